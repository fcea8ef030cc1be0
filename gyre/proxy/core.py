"""The API-independent heart of the proxy: one model call from an authenticated, parsed request
to a stream of text / tool calls for the client and one TITO record (docs/design.md §4).
Over 600 lines: a call's whole life (render, route, stream, parse, record) reads as one sequence
here, so the exactness argument of TITO can be followed end to end.

    call = await proxy.aprepare(key, headers, req)   role, render with splicing, limits (errors are 4xx)
    async for item in call.events():                 str, ToolCall and Reasoning pieces, as generated
    (end of events)                                  record -> sink; the assistant turn kept for splicing

The OpenAI, Anthropic and Responses adapters translate formats around this. The chat format
(gyre/proxy/formats) decides the stop ids, the forced tool-call opening (docs/proxy_harnesses.md)
and how sampled text is parsed. Admission is gyre/proxy/admission.py, body parsing
gyre/proxy/bodies.py, an execution's records gyre/proxy/state.py; large requests are rendered on a
thread pool, one per execution at a time, and text that cannot fit the context is refused before
it is tokenized.

A call whose client goes away is aborted (`abort_on_disconnect`; the record says `abort`).
`close_execution` revokes the execution's keys, cancels its calls in flight and seals its record
(a later record is dropped and counted in `late_records`), so the `CallStats` it returns are
exactly what the record holds; `aclose_execution` first lets calls finish for `close_wait_s`. A
closed execution id is never issued again. Finish reasons: stop, length, tool_calls, abort, error
(the engine ended without a reason, or failed and no other engine could continue).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Iterable

from jinja2 import TemplateError

from gyre.backends.protocols import SamplingParams, TokenEvent, TokenIds, int32_ids
from gyre.backends.models.tokenizer import load_tokenizer
from gyre.backends.models.vocab import byte_table, stop_token_ids
from gyre.proxy.admission import Admission
from gyre.proxy.errors import ApiError  # noqa: F401  (re-exported: adapters import it from here)
from gyre.proxy.config import ProxyConfig
from gyre.proxy.formats import OutputParser, Reasoning
from gyre.proxy.formats.choice import chat_setup
from gyre.proxy.keys import KeyInfo, KeyRegistry
from gyre.proxy.limits import context_overflow_message
from gyre.proxy.pacing import frame_tokens
from gyre.proxy.roles import RoleClassifier
from gyre.proxy.render import UNMATCHED_KINDS, UNMATCHED_WHY, ChatRenderer, PromptTooLong, Rendered, StoredTurn, ids_digest, turn_fingerprint
from gyre.backends.transfer.migration_policy import MigrationPolicy
from gyre.proxy.router import NoEngineError, RouteInfo, Router
from gyre.proxy.sink import MemorySink, RecordSink
from gyre.proxy.resume import resumed_state, turn_ref
from gyre.proxy.state import CallStats, ExecutionState
from gyre.proxy.textstream import Detokenizer, StopMatcher, ToolCall
from gyre.trajectory.record import CallRecord, Role

logger = logging.getLogger(__name__)


def object_arguments(args: Any) -> dict:
    """Tool-call arguments as an object, as APIs that need one (Anthropic `tool_use.input`) return
    them: a non-object (`[1, 2]`, `null`, an unparsable string) is wrapped as {"value": ...}. The
    stored turn is keyed by this form too, so the re-sent turn splices (`Call._finish`)."""
    return args if isinstance(args, dict) else {"value": args}


class ClientGone(ConnectionResetError):
    """The client closed the connection while its call ran; the call was aborted."""


class abort_on_disconnect:
    """`with abort_on_disconnect(request): ...` cancels the current task when the client goes away
    (the connection's transport closes), polled after `poll_s`, the interval doubling to
    `max_poll_s` (thousands of long calls in flight must not keep the loop busy polling); the
    cancellation reaches the call (engine request aborted, record `abort`) and leaves as
    `ClientGone`. For non-streamed answers: a streamed one notices on its next write."""

    def __init__(self, request: Any, poll_s: float = 0.05, max_poll_s: float = 1.0) -> None:
        self.request = request
        self.poll_s = poll_s
        self.max_poll_s = max(poll_s, max_poll_s)
        self.fired = False

    def _gone(self) -> bool:
        t = self.request.transport
        return t is None or t.is_closing()

    def _check(self) -> None:
        if self._gone():
            self.fired = True
            self.task.cancel()
        else:
            self.poll_s = min(2 * self.poll_s, self.max_poll_s)
            self.handle = self.loop.call_later(self.poll_s, self._check)

    def __enter__(self) -> "abort_on_disconnect":
        self.task = asyncio.current_task()
        self.loop = asyncio.get_running_loop()
        self.handle = self.loop.call_later(self.poll_s, self._check)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.handle.cancel()
        if self.fired and exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            self.task.uncancel()
            raise ClientGone("client disconnected; call aborted") from None


@dataclass(frozen=True)
class ToolForce:
    """A forced tool call: `name` of the function, or None for any of the request's tools."""

    name: str | None = None


@dataclass
class ChatRequest:
    """A parsed request, API-independent. `messages` are normalized: role in system / user /
    assistant / tool, `content` a str, assistant `tool_calls` as [{name, arguments}]."""

    api: str
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    prompt_ids: list[int] | None = None  # /v1/completions
    prompt_text: str | None = None
    max_tokens: int | None = None
    min_tokens: int = 0  # OpenAI-compatible extension (SGLang, vLLM): no EOS before this many tokens
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False  # OpenAI stream_options.include_usage
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token (TokenEvent.top), returned with the log-probs
    parse_tools: bool = True
    force: ToolForce | None = None  # tool_choice required / named: see the module docstring
    media: list[str] = field(default_factory=list)  # fields of media parts rendered as text placeholders
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs (enable_thinking, ...)
    prefill: str = ""  # the answer's start, continued (Anthropic's trailing assistant message; render.ChatRenderer.render)


class Call:
    """One model call in flight. Iterate `events()` once; afterwards the fields below are final."""

    def __init__(self, proxy: "Proxy", state: ExecutionState, role: Role, req: ChatRequest, rendered: Rendered, sampling: SamplingParams, start: float,
                 forced_text: str = "", forced_ids: list[int] | None = None) -> None:
        self.proxy = proxy
        self.state = state
        self.role = role
        self.req = req
        self.rendered = rendered
        self.sampling = sampling
        self.start_time = start
        self.call_id = next(state.call_ids)
        self.tokens: list[TokenEvent] = []
        self.content_parts: list[str] = []
        self.reasoning_parts: list[str] = []  # the format's reasoning (thinking), apart from content
        self.tool_calls: list[ToolCall] = []
        self.stop_string: str | None = None
        self.finish: str = "error"  # stop | length | tool_calls | abort | error (set by _finish)
        self.first_token_time: float | None = None
        self.route = RouteInfo()
        self.record: CallRecord | None = None
        # The forced tool-call opening: the last len(forced_ids) ids of rendered.ids (input).
        self.forced_text = forced_text
        self.forced_ids = list(forced_ids or [])
        self.prompt_tokens = len(rendered.ids)

    @property
    def content(self) -> str:
        return "".join(self.content_parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)

    async def events(self) -> AsyncIterator[str | ToolCall]:
        p = self.proxy
        det = Detokenizer(p.token_table, p.eos_ids)
        stopper = StopMatcher(self.req.stop)
        parser = OutputParser(p.format, self.req.tools, parse_tools=self.req.parse_tools and p.config.tool_parser != "none",
                              reasoning=self.req.messages is not None)  # /v1/completions: raw text
        key = f"{self.state.execution_id}/{self.call_id}/{next(p._serial)}"
        gen = p.router.generate(key, self.state.execution_id, self.rendered.ids, self.sampling, self.route, p.eos_ids)
        completed = engine_failed = False
        # Text is needed token by token only to stream it or to catch a stop string; otherwise
        # the whole output is decoded once at the end (same result, a fraction of the work).
        per_token = self.req.stream or bool(stopper.stops)
        held: list[str] = []  # text not yet given to the parser (a stream's: until the last token of a delivery)
        turn = frame_tokens(self.req.top_logprobs, self.req.logprobs)  # a delivery can hold thousands of tokens
        try:
            # The generation prompt's reasoning text and the forced prefix are the start of the
            # turn's text: the parser begins in the state they leave (thinking closed or open,
            # inside a tool call); stop strings see only sampled text.
            for item in parser.push(self.rendered.gen_prefix + self.forced_text):
                yield self._keep(item)
            async for ev in gen:
                if self.first_token_time is None:
                    self.first_token_time = time.time()
                self.tokens.append(ev)
                if len(self.tokens) % turn == 0:
                    await asyncio.sleep(0)  # a turn for the other calls, and a frame ends here (gyre/proxy/pacing.py)
                if not per_token:
                    continue
                text = det.push(ev.token_id)
                if text:
                    held.append(stopper.push(text))
                    if stopper.matched is not None:
                        break
                if self.req.stream and held and (not ev.more or len(self.tokens) % turn == 0):  # a chunk per delivery (`stream_interval_s`)
                    for item in parser.push("".join(held)):
                        yield self._keep(item)
                    held.clear()
            if not per_token:
                hidden, table = p.eos_ids, p.token_table
                held.append(table.join(e.token_id for e in self.tokens if e.token_id not in hidden).decode("utf-8", "replace"))
            elif stopper.matched is None:
                tail = stopper.push(det.flush())
                held.append(tail + (stopper.flush() if stopper.matched is None else ""))
            for item in parser.push("".join(held)):
                yield self._keep(item)
            for item in parser.flush():
                yield self._keep(item)
            p.note_undecodable(self.tokens)
            completed = True
        except NoEngineError as e:
            engine_failed = True
            raise ApiError(503, "overloaded", f"no rollout engine: {e}") from None
        except ValueError as e:  # the engine refused the request (e.g. over its own length limit)
            raise ApiError(400, "invalid_request", f"the engine rejected the request: {e}") from None
        finally:
            try:
                await gen.aclose()  # a second cancellation (a close, then the client going) can land in here
            except RuntimeError as e:  # "aclose(): asynchronous generator is already running"
                logger.debug("proxy: %s: engine stream not closed here (%s)", key, e)
            finally:  # recorded (or counted late) however the cleanup ends: an aborted call is never lost
                self._finish(completed, stopper.matched, engine_error=engine_failed)

    def _unknown_forced_tools(self) -> list[str]:
        """Names of calls a forced `required` turn made that are not among the request's tools."""
        if self.req.force is None:
            return []
        names = {t["function"]["name"] for t in self.req.tools or ()}
        unknown = [tc.name for tc in self.tool_calls if tc.name not in names]
        if unknown:
            logger.warning("proxy: %s/%d: tool_choice required, and the model called %s, not one of the request's tools; "
                           "returned as written", self.state.execution_id, self.call_id, unknown)
        return unknown

    def _keep(self, item: str | ToolCall | Reasoning) -> str | ToolCall | Reasoning:
        if isinstance(item, ToolCall):
            self.tool_calls.append(item)
        elif isinstance(item, Reasoning):
            self.reasoning_parts.append(item.text)
        else:
            self.content_parts.append(item)
        return item

    def _ended_on_stop_sequence(self) -> bool:
        out = [e.token_id for e in self.tokens]
        return any(seq and out[-len(seq):] == list(seq) for seq in self.sampling.stop_sequences)

    def _finish(self, completed: bool, stop_string: str | None, engine_error: bool = False) -> None:
        p = self.proxy
        self.stop_string = stop_string
        last = self.tokens[-1] if self.tokens else None
        if engine_error:
            self.finish = "error"
        elif not completed:
            self.finish = "abort"
        elif stop_string is not None:
            self.finish = "stop"
        elif last is not None and (last.token_id in p.eos_ids or last.finish_reason == "stop"):
            self.finish = "stop"
        elif len(self.tokens) >= self.sampling.max_tokens or (last is not None and last.finish_reason == "length"):
            self.finish = "length"
        elif last is not None and last.finish_reason in ("abort", "error"):
            self.finish = last.finish_reason
        elif self._ended_on_stop_sequence():
            self.finish = "stop"
        else:  # the engine's stream ended early and said nothing: never pass that off as `stop`
            self.finish = "error"
            logger.warning("proxy: %s/%d: the engine's stream ended after %d tokens without a finish reason; recorded as 'error'",
                           self.state.execution_id, self.call_id, len(self.tokens))
        if self.finish == "stop" and self.tool_calls:
            self.finish = "tool_calls"
        st = self.state
        if st.closed:  # the execution was closed (and its record sealed) while this call ran
            p.late_records += 1
            logger.warning("proxy: %s/%d finished after its execution was closed; not recorded", st.execution_id, self.call_id)
            return
        st.stats = st.stats.with_call(self.rendered, self.role, self.route.reroutes, aborted=not completed)
        out_ids = [e.token_id for e in self.tokens]
        unknown = self._unknown_forced_tools()
        end = time.time()
        self.record = CallRecord(
            execution_id=st.execution_id,
            call_id=self.call_id,
            role=self.role,
            input_ids=int32_ids(self.rendered.ids),
            output_ids=out_ids,
            output_logprobs=[e.logprob for e in self.tokens],
            policy_version=self.tokens[0].version if self.tokens else p.policy_version,
            start_time=self.start_time,
            end_time=end,
            finish_reason="tool_calls" if self.finish == "tool_calls" else self.finish,
            output_versions=[e.version for e in self.tokens],
            message_starts=self.rendered.message_starts,
            payload_ref={
                "api": self.req.api,
                "spliced_turns": self.rendered.spliced,
                "unmatched_turns": self.rendered.unmatched,
                "unmatched_kinds": list(self.rendered.unmatched_kinds),
                "tolerated_turns": self.rendered.tolerated,
                "spliced_spans": [list(s) for s in self.rendered.spliced_spans],
                "spliced_calls": self.rendered.spliced_calls,
                "engines": self.route.engines,
                "reroutes": self.route.reroutes,
                "ttft_s": (self.first_token_time - self.start_time) if self.first_token_time else None,
                "stop_string": stop_string,
                "media_placeholders": list(self.req.media),  # injected text (context), see validate.media_text
                "forced_prefix": len(self.forced_ids),  # input_ids' last n ids: the forced tool-call opening (context)
                "forced_tool": None if self.req.force is None else (self.req.force.name or "*"),
                "forced_unknown_tool": unknown,
                "chat_format": p.format.name,
                "reasoning_prefix": self.rendered.gen_prefix_ids,  # input_ids' ids after the header (+ the prefill): the turn's start
                "prefill": self.rendered.prefill_ids,  # of those, the last n: the client's prefill, continued by output_ids
                "stripped_turns": self.rendered.stripped,  # turns rendered without their reasoning (past_reasoning=strip)
                "aborted": not completed,
            },
        )
        if completed and self.req.messages is not None:
            # Keyed by the arguments as the client got them (Anthropic: always an object).
            wrap = object_arguments if self.req.api == "anthropic" else (lambda a: a)
            calls = [{"name": tc.name, "arguments": wrap(tc.arguments)} for tc in self.tool_calls]
            fp = turn_fingerprint(self.content, calls)
            # A forced / reasoning-prefixed turn is prefix + sampled ids, in the context before the
            # prefix: re-sent, it splices back to exactly the tokens the model saw (the prefix
            # stays input there).
            n_ctx = len(self.rendered.ids) - len(self.forced_ids) - self.rendered.gen_prefix_ids
            ids = self.rendered.ids
            turn_ids = array("i", ids[n_ctx:])
            turn_ids.extend(out_ids)
            digest = self.rendered.ctx_digest or ids_digest(ids[:n_ctx])
            st.turns.add(fp, StoredTurn(self.call_id, n_ctx, digest, turn_ids, self.content, calls))
            self.record.payload_ref["turn"] = turn_ref(n_ctx, digest, self.content, calls)  # kept again after a restart
        try:
            p.sink.on_record(self.record)
        except Exception as e:  # a failing sink must be loud, but the client already has its answer
            if not getattr(e, "reported", False):  # a sink that stated its error itself sets `reported`
                logger.exception("proxy: sink failed on %s/%d", st.execution_id, self.call_id)
            p.sink_errors += 1
            st.stats = replace(st.stats, sink_errors=st.stats.sink_errors + 1)


class Proxy:
    """Keys, executions, rendering, routing and records. Serve it with `gyre.proxy.server`."""

    def __init__(self, config: ProxyConfig | None = None, *, router: Router | None = None, sink: RecordSink | None = None, tokenizer=None,
                 stop_ids: Iterable[int] | None = None, model_config: Any = None) -> None:
        """`tokenizer`: the run's (`gyre.backends.models.vocab.load_vocab`; default `--proxy.tokenizer-path`,
        else the project's); `stop_ids`: the ids that end a turn (default: from the tokenizer's
        directory, `gyre.backends.models.vocab.stop_token_ids`), beside the chat format's own;
        `model_config`: the checkpoint's HF config (helps choose the chat format)."""
        self.config = config or ProxyConfig()
        c = self.config
        self.tokenizer = tokenizer or load_tokenizer(c.tokenizer_path)
        # The chat format and who renders tools (gyre/proxy/formats/choice.py): from the checkpoint's
        # template, --proxy.chat-format and --proxy.tool-format; model_config: config.json, a cross-check.
        self.chat = chat_setup(self.tokenizer, model_config, chat_format=c.chat_format, tool_format=c.tool_format, tool_parser=c.tool_parser)
        self.format = self.chat.format
        self.renderer = ChatRenderer(self.tokenizer, cache_chars=c.encode_cache_chars, splice=c.splice, fmt=self.format,
                                     past_reasoning=c.past_reasoning, tools=self.chat.tools)
        # Every id's bytes, built once; ids past the tokenizer's (padding rows) and holes read b"".
        self.token_table = byte_table(self.tokenizer)
        if stop_ids is None:  # the checkpoint's own (generation_config.json, config.json, tokenizer eos)
            stop_ids = stop_token_ids(self.tokenizer, getattr(self.tokenizer, "name_or_path", None) or None)
        fmt_stops = (self.tokenizer.backend_tokenizer.token_to_id(t) for t in self.format.stop_tokens)
        self.eos_ids = frozenset(stop_ids) | frozenset(i for i in fmt_stops if i is not None)
        self.router = router or Router(affinity_slack=c.affinity_slack, max_reroutes=c.max_reroutes, engine_wait_s=c.engine_wait_s,
                                       progress_timeout_s=c.engine_progress_timeout_s,
                                       migration=MigrationPolicy(mode=c.migration, bandwidth_Bps=c.migration_bandwidth_gbps * 1e9,
                                                                 prefill_tok_s=c.migration_prefill_tok_s))
        # Well inside the progress limit, which a held engine must not look like it broke.
        cap = c.engine_progress_timeout_s / 4 if c.engine_progress_timeout_s > 0 else math.inf
        self.hold_s, self.stream_hold_s = min(c.engine_hold_s, cap), min(c.stream_interval_s, cap)
        self.sink = sink if sink is not None else MemorySink()
        self.keys = KeyRegistry()
        self.classifier = RoleClassifier(c.roles)
        self.executions: dict[str, ExecutionState] = {}
        self.policy_version = 0  # reported for calls that produced no token
        self.sink_errors = 0
        self.undecodable_tokens = 0  # sampled ids with no token (note_undecodable)
        self.late_records = 0  # calls that ended after their execution was closed (not recorded)
        # Ids being closed: refused by `issue_key` until the sink knows them itself (`is_closed`).
        self.closed_executions: set[str] = set()
        self._pool: ThreadPoolExecutor | None = None
        self.admission = Admission(c, lambda eid: self._state(eid).allowance)
        self.unmatched_executions: dict[str, dict[str, Any]] = {}  # closed executions with unmatched turns (worst kept)
        self._serial = itertools.count()

    def note_undecodable(self, tokens: list[TokenEvent]) -> None:
        """Count sampled ids the tokenizer has no bytes for (padding rows, holes): shown as
        nothing, kept in the record; warned about once. An engine that masks to the tokenizer's
        size (`sampleable_vocab`) never samples one."""
        table = self.token_table
        n, bad_ids = len(table), table.undecodable
        bad = sum(1 for e in tokens if not 0 <= e.token_id < n or e.token_id in bad_ids)
        if bad:
            if not self.undecodable_tokens:
                logger.warning("proxy: the engine sampled %d id(s) the tokenizer has no token for (e.g. %d, tokenizer "
                               "ids: %d); they show as nothing. Its vocabulary should be masked to the tokenizer's "
                               "(sampleable_vocab)", bad, next(e.token_id for e in tokens if not 0 <= e.token_id < n
                                                               or e.token_id in bad_ids), n)
            self.undecodable_tokens += bad

    # ---- executions -------------------------------------------------------------------------
    def issue_key(self, execution_id: str, role_hint: Role | str | None = None, key: str | None = None) -> str:
        """A key for `execution_id`. A closed execution's id is refused (ValueError): its record is
        sealed, and a second life would restart its call ids."""
        if execution_id in self.closed_executions or self.sink.is_closed(execution_id):
            raise ValueError(f"issue: execution {execution_id!r} was closed and its record sealed; use a new execution id")
        return self.keys.issue(execution_id, role_hint, key)

    def revoke_execution(self, execution_id: str) -> int:
        return self.keys.revoke_execution(execution_id)

    def execution_stats(self, execution_id: str) -> CallStats:
        st = self.executions.get(execution_id)
        return CallStats() if st is None else replace(st.stats, inflight=len(st.allowance.tasks))

    def close_execution(self, execution_id: str) -> CallStats:
        """Revoke the execution's keys, abort its calls in flight (their records are not written:
        `inflight` counts them), drop its splice state and seal its store file. Callable from any
        thread."""
        self.keys.revoke_execution(execution_id)
        self.closed_executions.add(execution_id)
        st = self.executions.get(execution_id)
        if st is not None:
            st.closed = True  # from here on its calls are not recorded
            for task in list(st.allowance.tasks):
                task.get_loop().call_soon_threadsafe(task.cancel)
        stats = self.execution_stats(execution_id)
        self.executions.pop(execution_id, None)
        if stats.unmatched_turns:
            self._note_unmatched(execution_id, stats)
        self.router.forget(execution_id)
        self.sink.close_execution(execution_id)
        self.closed_executions.discard(execution_id)  # the sink knows it from now on
        return stats

    async def aclose_execution(self, execution_id: str, wait_s: float | None = None) -> CallStats:
        """`close_execution`, but first lets in-flight calls finish for `wait_s` (default
        `close_wait_s`), then aborts the rest and waits for their `abort` records."""
        self.keys.revoke_execution(execution_id)  # no new calls while we wait
        st = self.executions.get(execution_id)
        if st is not None and st.allowance.tasks:
            wait_s = self.config.close_wait_s if wait_s is None else wait_s
            _, rest = await asyncio.wait(list(st.allowance.tasks), timeout=wait_s)
            st.closing = True
            for task in rest:
                task.cancel()
            if rest:
                await asyncio.wait(rest, timeout=5.0)
        return self.close_execution(execution_id)

    KEEP_WORST = 100

    def _note_unmatched(self, execution_id: str, stats: CallStats) -> None:
        self.unmatched_executions[execution_id] = {"unmatched_turns": stats.unmatched_turns, "calls": stats.calls,
                                                   "unmatched_kinds": dict(stats.unmatched_kinds)}
        if len(self.unmatched_executions) > 10 * self.KEEP_WORST:  # bounded over a long run
            self.unmatched_executions = {e: v for e, v in self.worst_unmatched(self.KEEP_WORST, pairs=True)}

    def worst_unmatched(self, n: int = 10, pairs: bool = False) -> list:
        """Closed executions with the most unmatched turns: [{execution_id, unmatched_turns, calls,
        unmatched_kinds}], worst first (for the run's summary.json)."""
        top = sorted(self.unmatched_executions.items(), key=lambda kv: (-kv[1]["unmatched_turns"], kv[0]))[:n]
        return top if pairs else [{"execution_id": e, **v} for e, v in top]

    def _warn_unmatched(self, state: ExecutionState, rendered: Rendered) -> None:
        if state.warned_unmatched:
            return
        state.warned_unmatched = True
        kind = min(rendered.unmatched_kinds, key=UNMATCHED_KINDS.index)
        hint = " (--proxy.splice tolerant splices this pattern)" if kind in ("split", "text_dropped") else ""
        logger.warning("proxy: execution %s re-sent %d assistant turn(s) that match no turn the policy sampled (%s); they are "
                       "tokenized from text, so their sampled ids are lost and the trajectory branches there. Likely: %s%s. "
                       "Warned once per execution; counts in the execution's stats and summary.json.",
                       state.execution_id, len(rendered.unmatched_kinds), ", ".join(sorted(set(rendered.unmatched_kinds))),
                       UNMATCHED_WHY[kind], hint)

    # ---- admission ----------------------------------------------------------------------------
    def _state(self, execution_id: str) -> ExecutionState:
        state = self.executions.get(execution_id)
        if state is None:
            state = self.executions[execution_id] = resumed_state(execution_id, self.sink)  # its records, if any
        return state

    def admit(self, key: KeyInfo, body_bytes: int = 0):
        """`with proxy.admit(key, content_length):` (gyre/proxy/admission.py)."""
        return self.admission.admit(key.execution_id, body_bytes)

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(1, self.config.render_threads), thread_name_prefix="gyre-render")
        return self._pool

    def text_chars(self, req: ChatRequest) -> int:
        """Characters of the request's message text (a cheap lower bound on what it renders to)."""
        if req.messages is not None:
            return sum(len(m["content"]) for m in req.messages if isinstance(m.get("content"), str))
        return len(req.prompt_text or "") + len(req.prompt_ids or ())

    def _check_size(self, chars: int) -> None:
        """400 at once when the text alone cannot fit in the context (before any tokenizing)."""
        c = self.config
        if chars > c.max_context_tokens * self.renderer.max_token_chars:
            self._too_long(-(-chars // self.renderer.max_token_chars), at_least=True)

    def _too_long(self, n: int, at_least: bool = False) -> None:
        c = self.config
        raise ApiError(400, "invalid_request", context_overflow_message(n, c.max_context_tokens, at_least), param="messages",
                       code="context_length_exceeded")

    async def aprepare(self, key: KeyInfo, headers, req: ChatRequest) -> Call:
        """`prepare` for the server: the size check first, then rendering and tokenizing on the
        thread pool (one request per execution at a time) unless the request is small."""
        chars = self.text_chars(req)
        self._check_size(chars)
        if chars + len(req.tools or ()) * 512 < self.config.inline_render_chars:
            return self.prepare(key, headers, req)
        start = time.time()
        state, role = self._classify(key, headers, req)
        async with self.admission.render_lock(key.execution_id):
            t0 = time.perf_counter()
            built = await asyncio.get_running_loop().run_in_executor(self.pool, self._build, req, state)
            self.admission.charge_render(key.execution_id, time.perf_counter() - t0)
        return self._call(state, role, req, start, built)

    # ---- calls ------------------------------------------------------------------------------
    def authenticate(self, key: str | None) -> KeyInfo:
        info = self.keys.lookup(key)
        if info is None:
            if not self.config.require_auth:
                return KeyInfo(key="", execution_id="anonymous")
            raise ApiError(401, "authentication", "invalid or revoked API key" if key else "missing API key")
        return info

    def prepare(self, key: KeyInfo, headers, req: ChatRequest) -> Call:
        """Role, render with splicing, limits; all on the calling thread (see `aprepare`)."""
        start = time.time()
        self._check_size(self.text_chars(req))
        state, role = self._classify(key, headers, req)
        return self._call(state, role, req, start, self._build(req, state))

    def _classify(self, key: KeyInfo, headers, req: ChatRequest) -> tuple[ExecutionState, Role]:
        c = self.config
        if req.media and c.media == "reject":
            raise ApiError(400, "invalid_request", f"{req.media[0]}: this model reads text only; image, audio and file "
                           "content is refused (proxy.media=reject; 'placeholder' turns it into a line of text)", param=req.media[0])
        state = self._state(key.execution_id)
        system, last_user = "", ""
        if req.messages:
            if req.messages[0]["role"] == "system":
                system = req.messages[0]["content"]
            for m in reversed(req.messages):
                if m["role"] == "user":
                    last_user = m["content"]
                    break
        try:
            role, state.main_system = self.classifier.classify(system, last_user, headers.get(c.roles.header), key.role_hint,
                                                               state.main_system, req.max_tokens, bool(req.tools))
        except ValueError as e:
            raise ApiError(400, "invalid_request", f"header {c.roles.header}: {e}", param=c.roles.header) from None
        return state, role

    def _call(self, state: ExecutionState, role: Role, req: ChatRequest, start: float, built: tuple) -> Call:
        rendered, sampling, forced_text, forced_ids = built
        if rendered.unmatched_kinds:
            self._warn_unmatched(state, rendered)
        return Call(self, state, role, req, rendered, sampling, start, forced_text, forced_ids)

    def _build(self, req: ChatRequest, state: ExecutionState) -> tuple[Rendered, SamplingParams, str, list[int]]:
        """Render + tokenize + sampling parameters: no shared state but the renderer's (locked)
        cache and reads of the execution's stored turns, so it may run on the thread pool."""
        c = self.config
        if req.messages is not None:
            try:
                rendered = self.renderer.render(req.messages, req.tools, state.turns, max_tokens=c.max_context_tokens,
                                                template_kwargs=req.template_kwargs, prefill=req.prefill, packed=True)
            except PromptTooLong as e:
                self._too_long(e.min_tokens, at_least=True)
            except TemplateError as e:  # the chat template itself refuses (e.g. Llama 3.1: one tool call per turn)
                raise ApiError(400, "invalid_request", f"the model's chat template refused this conversation: {e}", param="messages") from None
        elif req.prompt_ids is not None:
            rendered = Rendered(ids=array("i", req.prompt_ids))
        else:
            rendered = Rendered(ids=self.renderer.encode(req.prompt_text or "", packed=True))
        forced_text, forced_ids = self._forced_prefix(req)
        if forced_ids:
            rendered.ids.extend(forced_ids)
        # Packed and hashed here (a render thread for a long prompt), never a list of Python ints:
        # not built and freed per call, and nothing the garbage collector walks.
        n = len(rendered.ids)
        rendered.ids = TokenIds.from_array(rendered.ids)
        if req.messages is not None:
            rendered.ctx_digest = ids_digest(rendered.ids.packed[: n - len(forced_ids) - rendered.gen_prefix_ids])
        if n == 0:
            raise ApiError(400, "invalid_request", "the prompt is empty", param="prompt")
        if n >= c.max_context_tokens:
            self._too_long(n)
        max_tokens = req.max_tokens if req.max_tokens is not None else c.default_max_tokens
        max_tokens = min(max_tokens, c.max_context_tokens - n)
        stop_seqs = [ids for ids in (self.renderer.backend.encode(s, add_special_tokens=False).ids for s in req.stop) if ids]
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            stop_token_ids=sorted(self.eos_ids),
            stop_sequences=stop_seqs,
            seed=req.seed,
            min_tokens=min(req.min_tokens, max_tokens),
            top_logprobs=req.top_logprobs,
            hold_s=self.stream_hold_s if req.stream or any(req.stop) else self.hold_s,  # text token by token: `Call.events`
        )
        return rendered, sampling, forced_text, forced_ids

    def _forced_prefix(self, req: ChatRequest) -> tuple[str, list[int]]:
        """(text, ids) of the forced tool-call opening to append to the prompt; ("", []) if none."""
        if req.force is None or req.messages is None:
            return "", []
        names = [t["function"]["name"] for t in req.tools or ()]
        if not names:
            raise ApiError(400, "invalid_request", "tool_choice forces a tool call, but the request has no tools", param="tool_choice")
        name = req.force.name
        if name is None and len(names) == 1:
            name = names[0]  # `required` with one tool: that tool, by name (fully enforced)
        if name is not None and name not in names:
            raise ApiError(400, "invalid_request", f"tool_choice names {name!r}, which is not one of the request's tools {names}", param="tool_choice")
        if self.config.tool_parser == "none":
            raise ApiError(400, "invalid_request", "tool_choice: forcing a tool call needs tool parsing (proxy.tool_parser auto)", param="tool_choice")
        opening = self.format.tool_call_opening
        text = opening(name)
        return text, self.renderer.encode(opening(self.renderer.escape(name)) if name else text)

    def count_tokens(self, key: KeyInfo, req: ChatRequest) -> int:
        self._check_size(self.text_chars(req))
        state = self.executions.get(key.execution_id)
        try:
            return len(self.renderer.render(req.messages or [], req.tools, state.turns if state else None, max_tokens=self.config.max_context_tokens, prefill=req.prefill,
                                            template_kwargs=req.template_kwargs).ids)
        except PromptTooLong as e:
            self._too_long(e.min_tokens, at_least=True)
        except TemplateError as e:
            raise ApiError(400, "invalid_request", f"the model's chat template refused this conversation: {e}", param="messages") from None
