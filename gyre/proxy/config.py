"""Proxy configuration: `ProxyConfig` is the `--proxy.*` section of `gyre.config.GyreConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

DEFAULT_SUMMARY_MARKERS = (
    "Your task is to create a detailed summary of the conversation so far",
    "summarize the conversation so far",
    "<gyre:summary>",
)

# A harness's background calls, recorded as Role.HELPER and never trained. Best known from
# published captures of Claude Code's prompts (2025-2026; they change between versions, so these
# are substrings of the stable opening sentences). Codex CLI makes no such calls that we know of
# (its compaction is a summary call, matched by the summary markers); add a rule when one shows
# up, see gyre/proxy/roles.py.
DEFAULT_HELPER_SYSTEM_MARKERS = (
    "Analyze if this message indicates a new conversation topic",  # Claude Code: topic / title detection
    "Your task is to process Bash commands that an AI coding agent wants to run",  # Claude Code: bash prefix check
    "Summarize this coding conversation in under 50 characters",  # Claude Code: terminal title (older versions)
    "<gyre:helper>",
)
# Per-request metadata some harnesses send as a system-prompt line: not the prompt's identity.
DEFAULT_VOLATILE_SYSTEM_LINES = ("x-anthropic-billing-header:",)  # Claude Code 2.1.x: cc_version, cch hash
DEFAULT_HELPER_USER_MARKERS = (
    "Bash command prefix detection",  # Claude Code: the <policy_spec> of the bash prefix check
    "word title for the following conversation",  # Claude Code: "Please write a 5-10 word title for ..."
    "<gyre:helper>",
)


@dataclass(kw_only=True)
class RoleRulesConfig:
    """How a call's role (main, main summary, sub-agent, sub-agent summary, helper) is decided.

    Order: the request header, then the helper rules (a helper marker in the system prompt or the
    last user turn, or `max_tokens` at most `helper_max_tokens`), then the key's role hint, then
    the rules: the first main call of an execution fixes its main system prompt; a later call
    whose system prompt does not match it is a sub-agent call; a summary marker in the last user
    turn makes it the summary variant. Helper calls are recorded but never trained.
    """

    header: str = "x-gyre-role"
    """Request header that names the role outright: main, main_summary, sub, sub_summary."""
    use_key_hint: bool = True
    """Honour a role hint attached to the execution's key when it was issued."""
    system_prompt_match: Literal["exact", "prefix"] = "prefix"
    """Compare system prompts whole, or only their first `system_prompt_prefix_chars` characters."""
    system_prompt_prefix_chars: int = 256
    """Characters compared in `prefix` mode (harnesses often append dates or paths at the end)."""
    summary_markers: tuple[str, ...] = DEFAULT_SUMMARY_MARKERS
    """Substrings (case-insensitive) of the last user turn that mark a context-compaction call."""
    sub_agent_markers: tuple[str, ...] = ()
    """Substrings (case-insensitive) of the last user turn that mark a sub-agent call."""
    helper_system_markers: tuple[str, ...] = DEFAULT_HELPER_SYSTEM_MARKERS
    """Substrings (case-insensitive) of the system prompt that mark a harness's background helper
    call (title, topic, bash-prefix check): recorded as role helper, never trained."""
    helper_user_markers: tuple[str, ...] = DEFAULT_HELPER_USER_MARKERS
    """Substrings (case-insensitive) of the last user turn that mark a helper call."""
    helper_max_tokens: int = 1
    """A call asking for at most this many tokens is a helper (Claude Code's start-up quota probe
    sends max_tokens=1); 0 turns the rule off."""
    volatile_system_lines: tuple[str, ...] = DEFAULT_VOLATILE_SYSTEM_LINES
    """System-prompt lines starting with one of these are ignored when system prompts are compared
    (and left out of the rendered prompt by the Anthropic adapter): per-request metadata a harness
    puts there, such as Claude Code's `x-anthropic-billing-header:` line, which changes at
    compaction and would make the main agent's later calls look like a sub-agent's."""


@dataclass(kw_only=True)
class ProxyConfig:
    """The black-box proxy (docs/design.md §4): OpenAI / Anthropic endpoints, TITO recording, routing."""

    host: str = "127.0.0.1"
    """Bind address (loopback by default)."""
    port: int = 0
    """Bind port; 0 picks a free one (the handle reports it)."""
    model_name: str = "gyre-policy"
    """Model id reported by /v1/models and echoed in responses (requests may name any model)."""
    max_context_tokens: int = 32768
    """Model context limit: prompts at or over it get a 400; max_tokens is clamped to fit."""
    default_max_tokens: int = 1024
    """OpenAI calls without max_tokens (Anthropic requires it)."""
    max_body_bytes: int = 16 << 20
    """Request bodies over this get a 413 in the API's error format."""
    tool_parser: Literal["auto", "hermes", "none"] = "auto"
    """How tool calls are read out of the model's text: `auto` with the chat format's own parser
    (gyre/proxy/formats), `hermes` the same but refused at start unless the format writes Hermes
    `<tool_call>` JSON, `none` not at all."""
    chat_format: str = "auto"
    """The chat format (turns, tool calls, reasoning; gyre/proxy/formats): `auto` reads it from the
    tokenizer's chat template and refuses a template it does not know; or one of qwen2.5, qwen3,
    qwen3-coder, qwen3.5, llama3.1, chatml (plain ChatML turns, no tools: SmolLM2)
    (docs/proxy_harnesses.md)."""
    tool_format: Literal["auto", "hermes", "none"] = "auto"
    """How a request's `tools` reach the model (gyre/proxy/formats/choice.py): `auto` through the chat
    template when it renders tools, else a request with tools gets a 400 naming `tools` (never
    dropped: the model would not know them); `hermes` the same for a template that renders tools,
    and for one that cannot (plain ChatML, SmolLM2) the tool list is declared in the system turn
    the Hermes / Qwen2.5 way, calls and results rendered as `<tool_call>` / `<tool_response>` text
    and the model's `<tool_call>` JSON parsed: how a model without native tool calls is taught to
    call tools; `none` a 400 for every request with tools."""
    past_reasoning: Literal["keep", "strip"] = "keep"
    """For templates that drop the reasoning of turns before the last user query (Qwen3): `keep`
    splices the sampled thinking back (one prefix-shared trajectory: the context the model really
    saw); `strip` renders those turns as the template does (each such call its own branch, still
    exact; what the model sees at inference). docs/proxy_harnesses.md compares them."""
    require_auth: bool = True
    """Reject calls without a known, unrevoked execution key (401)."""
    affinity_slack: int = 2
    """Prefix affinity: keep an execution on its engine unless that engine has this many more
    in-flight calls than the least-loaded one."""
    max_reroutes: int = 16
    """Reroutes (drain or engine failure) allowed per call before it fails with an error."""
    engine_wait_s: float = 600.0
    """How long a call waits for any engine to be in rollout before failing with 503/529."""
    migration: Literal["off", "auto", "always"] = "off"
    """A drained cell's in-flight calls (docs/design.md §3): `off` recomputes each call's prefix
    (prompt + generated) on its new engine; `always` moves its KV cache, sampling state and
    tokens there instead (two-phase: the source frees it only after the target's ack; any failure
    falls back to recompute); `auto` moves it where that is cheaper: KV bytes / transport bandwidth
    < prefill tokens / the engine's prefill throughput (gyre/backends/transfer/migration.py)."""
    migration_transport: Literal["gloo", "mooncake"] = "gloo"
    """How migrated KV moves between engine ranks: gloo point-to-point on a group of its own, or
    the Mooncake Transfer Engine (TCP here, RDMA on clusters). Never through the proxy."""
    migration_bandwidth_gbps: float = 0.0
    """The `auto` rule's transport bandwidth in GB/s; 0 = learned from the migrations themselves."""
    migration_prefill_tok_s: float = 0.0
    """The `auto` rule's prefill throughput; 0 = each engine's measurement at start-up."""
    tokenizer_path: str | None = None
    """Tokenizer directory (any `tokenizers`-backed tokenizer: tokenizer.json or tekken.json),
    overriding --model.checkpoint's own; None = the checkpoint's tokenizer when it has one, else
    the project's (gyre/assets/tokenizer, the built-in presets)."""
    admin_token: str | None = None
    """Enables the /admin API (keys, engines, drain/resume) for callers presenting this bearer
    token; None disables it (in-process users call the Proxy object directly)."""
    encode_cache_chars: int = 64 << 20
    """Characters of rendered chat turns whose token ids are cached (long histories re-send them)."""
    splice: Literal["exact", "tolerant"] = "tolerant"
    """Re-sent assistant turns: `exact` splices the sampled ids only for a turn re-sent whole (text
    and tool calls, re-serialized); `tolerant` also for a turn whose text the harness dropped or
    whose text and tool calls it sent as separate messages, when its tool calls (and text, if
    sent) match a stored turn exactly; it puts in that turn's sampled ids, never other tokens.
    Unmatched turns are counted per execution and warned about once (gyre/proxy/render.py)."""
    media: Literal["placeholder", "reject"] = "placeholder"
    """Image, audio and file content for this text-only policy: `placeholder` renders each part as
    a line of text (`[image: image/png, 48213 bytes]`, URLs by scheme and host, never fetched),
    context and never a training target; `reject` answers 400 naming the field."""
    max_calls_per_key: int = 32
    """Calls one execution (all its keys) may have in flight at once; more get a 429 at once
    (a harness with many parallel sub-agents stays far below it). 0 = unlimited."""
    calls_per_second_per_key: float = 50.0
    """Sustained calls per second one execution may start (a token bucket holding
    `2 x` this many, so bursts pass); more get a 429 with Retry-After. No harness reaches it
    against a real model; it bounds what a looping harness costs everyone else. 0 = unlimited."""
    body_bytes_per_call: int = 131072
    """A call costs one unit of the per-execution rate budget (`calls_per_second_per_key`) plus one
    per whole multiple of this many bytes in its body (capped at the bucket, so any body under the size limit can
    pass when the bucket is full): reading and parsing a huge body costs the event loop time every
    execution shares, so an execution sending them is slowed, not the others. At the defaults a
    200k-token prompt (~1 MB) costs 8 units; 16 MB bodies pass at most one per two seconds.
    0 = bytes are free."""
    body_values_per_call: int = 4096
    """Work charging: a call also costs one unit per whole multiple of this many JSON values in
    its body (counted as `,` `{` `[` bytes: parse and validation work grows with them, not with
    bytes), debited after the body is read, uncapped: an execution sending 300k tiny items waits
    for them itself (gyre/proxy/admission.py). 0 = values are free."""
    render_ms_per_unit: float = 20.0
    """Work charging: a request rendered and tokenized on the thread pool also costs one unit per
    this many milliseconds its render took (debited after it, uncapped), so an execution sending
    huge prompts back to back is slowed to about one core's worth of rendering at the default
    rate, not the others. 0 = renders are free."""
    inline_parse_values: int = 8192
    """Bodies with fewer JSON values than this are parsed on the event loop (about a millisecond);
    larger ones are parsed and validated in a worker process (`parse_processes`), so the GIL-bound
    `json.loads` and field checks of a huge body never stall other executions' calls."""
    parse_processes: int = 1
    """Worker processes that parse and validate large bodies (shared by all executions; each
    execution has one large body in work at a time)."""
    max_body_items: int = 20000
    """Messages (or Responses input items) plus their content blocks one request may hold; more is
    a 400 naming the limit. A 1M-token conversation of real turns holds a few thousand."""
    max_tools: int = 1024
    """Tools one request may declare; more is a 400 naming the limit."""
    max_json_depth: int = 64
    """How deeply a body's JSON may nest (tool schemas included); deeper is a 400 naming the limit."""
    render_threads: int = 4
    """Threads that render the template and tokenize (the tokenizer releases the GIL), off the
    event loop, so a huge prompt from one execution never stalls the calls of the others. Each
    execution renders one request at a time (its others queue without holding a thread)."""
    gil_switch_ms: float = 0.5
    """The interpreter's GIL switch interval in the proxy's process (`sys.setswitchinterval`),
    lowered to this at serve time, never raised: a render thread busy with a long prompt hands the
    GIL back to the event loop within it. At Python's default 5 ms each wait of the loop for the
    GIL adds up to 5 ms to every other execution's call (3-5x their p99 beside a 783k-token
    prompt, benchmarks/proxy_stalls.py). 0 = leave it as it is."""
    gc_freeze: bool = True
    """At serve time, once per process, collect and then move every object alive
    (`gc.freeze`: imported libraries, the tokenizer, the byte table) out of the garbage collector's
    reach. Otherwise each full collection walks them all: 30-80 ms in which every execution's
    call waits (benchmarks/proxy_stalls.py). They are still freed when nothing refers to them;
    only a reference cycle among them is kept. False = leave the collector as it is."""
    gc_young_objects: int = 10000
    """The collector's first threshold in the proxy's process (net new container objects between
    young collections), raised to this at serve time, never lowered. At Python's 700 a proxy
    holding 4,096 open executions collected ~60 times a second, promoting in-flight calls' objects
    to the old generations, so full collections (~290 ms, every call waiting) came every 2 s and
    the collector took ~0.5 of the proxy's ~2 ms of CPU a call; at 10,000: 0.1-0.2 ms a call, no
    full collection, longest pause ~110 ms (`benchmarks/scale_bench.py --only proxy
    --open-executions 4096 --engines 8 [--proxy-gc-young 0]`). 0 = leave it as it is. Only
    with `gc_every_s` 0: otherwise there are no automatic collections."""
    gc_every_s: float = 600.0
    """While the proxy serves, automatic collection is off in its process and one full collection
    runs every this many seconds, or sooner once `gc_every_objects` more containers are alive
    (gyre/proxy/collector.py). The proxy makes no cyclic garbage at steady state, yet each young
    collection stopped every call for the ~35k objects of the calls in flight: at 4,096 open the
    proxy's added p99 was 13-20 ms with them, 7-9 without (`benchmarks/proxy_gc_bench.py`, the
    two alternated). The clocked collection costs ~110 ms at 4,096 open (`--full-every-s 5`).
    Process-wide, as torchtitan's `gc_freq`: a trainer sharing the rank has its cycles collected
    on this clock too. 0 = Python's automatic collector (with `gc_young_objects`)."""
    gc_every_objects: int = 500_000
    """See `gc_every_s`: the growth in live containers that brings the next full collection
    forward, bounding both the cyclic garbage kept and the pause (a full collection walks what is
    alive and not frozen, ~0.3 us an object)."""
    inline_render_chars: int = 16384
    """Requests with less text than this are rendered on the event loop (sub-millisecond work;
    a thread hand-off would cost more than it saves)."""
    responses_store_bytes: int = 16 << 20
    """Stored `/v1/responses` kept per execution (JSON bytes of their messages and bodies), least
    recently used evicted first; `previous_response_id` naming an evicted one is a 400
    `previous_response_not_found` (the client re-sends the full input). 0 = unbounded."""
    close_wait_s: float = 2.0
    """`aclose_execution` (the admin DELETE) lets in-flight calls finish this long, then aborts
    them (recorded `abort`) before sealing the execution's record."""
    client_stall_s: float = 30.0
    """A streamed call whose client takes none of its stream for this long (the proxy's send
    buffer stays full) is ended: engine request aborted, recorded `abort`, connection dropped
    (gyre/proxy/pacing.py). 0 = wait as long as the execution lives."""
    engine_progress_timeout_s: float = 300.0
    """A call whose engine sends no token for this long (a frozen rank, a hung driver) continues on
    another engine from the tokens it has, as after a drain, and the silent engine gets no new
    calls until it answers a health check; 0 waits forever. Longer than the slowest honest first
    token (a long prompt's prefill on a busy engine, a weight load)."""
    engine_hold_s: float = 1.0
    """A call that neither streams nor has stop strings needs its text only at the end, so the
    engine's server may hold its tokens after the first (which comes at once: time to first token
    stays exact) up to this long and send them together, over the websocket transport: two
    frames for a short answer instead of one per token, and for the proxy one wake-up instead of
    two per token (benchmarks/scale_bench.py). A drain loses nothing (the engine's abort returns
    every token). At most a quarter of engine_progress_timeout_s. 0 = each token at once."""
    stream_interval_s: float = 0.05
    """A call that streams, or has stop strings, needs its text token by token; the engine's
    server holds its tokens after the first (which comes at once: the recorded time to first token
    stays exact) up to this long and sends them as one frame, over the websocket transport, and
    the proxy streams each frame as one chunk (one SSE event per API) instead of one per token.
    Measured (`benchmarks/stream_bench.py`: 256 streaming harnesses, 200 tokens a call at 50
    tokens/s): the proxy's CPU a call 23.6 ms at 0, 13.2 at 0.05 (0.56x), 9.6 at 0.1 (0.41x).
    The cost: text arrives in bursts, and the first visible text can come one interval later
    when the first token's text is held back (part of a character, a possible tool-call tag); a
    stop string is caught up to this late (the tokens past it are dropped, as always). Agent
    harnesses read whole turns. 0 = a frame and a chunk per token, as OpenAI streams. At most a
    quarter of engine_progress_timeout_s. (SGLang's --stream-interval, counted in time.)"""
    roles: RoleRulesConfig = field(default_factory=RoleRulesConfig)
