"""SGLang rollout engine embedded in a cell's first rank (GPU; `pip install gyre[gpu]`).
(Over 600 lines: each engine state below is a request/answer pair with SGLang, documented where it is awaited.)

Wraps the offline `sglang.Engine` (sglang 0.5.23). Its synchronous helpers call
`loop.run_until_complete`, which cannot run inside Gyre's event loop, so the adapter awaits the
engine's tokenizer-manager coroutines directly. Only the tokenizer manager lives in this process;
the scheduler (weights, KV cache) is a subprocess, so every state change (generate, abort, update,
release, resume) is a request to it, and the adapter waits for the answer that proves the state was
reached.

Each SGLang behaviour (with its file:line in the wheel) and what the adapter does about it:
docs/gpu-sglang.md, "How the adapter follows SGLang 0.5.23". What goes over the wire, pure:
sglang_wire.py; the core's side of the weight-update group: weight_group.py. Nothing here
imports sglang at module import; `SglangApi.real()` does when the engine starts.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import torch

from gyre.backends.config import SglangConfig
from gyre.backends.engines.sglang_wire import (match_stop, parse_chunk, parse_top, prefix_free_rid, sampling_params,
                                              server_args, span_versions, tp_devices, unsampleable_bias)
from gyre.backends.protocols import EngineHealth, EngineState, SamplingParams, TokenEvent
from gyre.backends.transfer.buckets import MIB, plan, plan_tensors
from gyre.executions.procs import child_pids, descendant_pids, terminate_pids

logger = logging.getLogger(__name__)


def _resource_tracker_pids() -> set[int]:
    """multiprocessing's shared resource tracker: the spawn of SGLang's schedulers starts it as a
    child of this process (popen_spawn_posix: resource_tracker.getfd()), and it serves the whole
    process, so it is never one of the engine's processes (it ignores SIGTERM, too)."""
    from multiprocessing import resource_tracker

    pid = getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None)
    return {pid} if pid else set()


@dataclass
class SglangApi:
    """What the adapter takes from the sglang package: the Engine class, the `io_struct` module
    and the tensor serializer. `real()` imports sglang (GPU machines); the conformance fake
    (tests/backends/sglang_fake.py) provides the same three names, and `from_spec` loads either
    from "module:attribute" (the factory's test-only GYRE_SGLANG_API hook)."""

    Engine: Callable[..., Any]
    io_struct: Any
    serialize: Callable[[Any], Any]
    server_arg_names: frozenset[str] | None = None
    """ServerArgs' field names, to check `--sglang.*` pass-through names before Engine() (None: unchecked)."""

    @classmethod
    def real(cls) -> "SglangApi":
        import sglang  # lazy: a GPU extra
        from sglang.srt.managers import io_struct
        from sglang.srt.server_args import ServerArgs
        from sglang.srt.utils import MultiprocessingSerializer

        # ServerArgs is a msgspec Struct assembled from arg_groups/fields/*.py (server_args.py:231);
        # Engine(**kwargs) builds it from the keywords (entrypoints/engine.py:278-297).
        names = _fields(ServerArgs)
        return cls(sglang.Engine, io_struct, MultiprocessingSerializer.serialize, frozenset(names) or None)

    @classmethod
    def from_spec(cls, spec: str) -> "SglangApi":
        module, _, attr = spec.partition(":")
        api = getattr(importlib.import_module(module), attr or "API")
        return api() if callable(api) and not isinstance(api, SglangApi) else api



@dataclass(eq=False)
class _Req:
    request_id: str
    rid: str
    out: list[TokenEvent] = field(default_factory=list)
    aborted: bool = False
    abort_unsent: bool = False  # aborted here before SGLang dispatched it: sent once it is (`_send_abort`)


def kv_capacity(engine: Any) -> int | None:
    """The KV pool's size in tokens an `sglang.Engine` got: `max_total_num_tokens` of the scheduler's
    init info (scheduler.py:1937-1948, sized in kv_cache_configurator.py:2990-3060 from the memory
    free at the model runner's start), which the Engine keeps (engine.py:345) and `get_server_info`
    reports (engine.py:1570-1585; that one drives the TM's loop, so it is not called from here).
    None when the engine does not say."""
    infos = getattr(getattr(engine, "_scheduler_init_result", None), "scheduler_infos", None) or [{}]
    tokens = infos[0].get("max_total_num_tokens") if isinstance(infos[0], dict) else None
    return int(tokens) if tokens is not None else None


class SglangEngine:
    """RolloutEngine over an embedded `sglang.Engine` (see the module docstring)."""

    name = "sglang"

    def __init__(self, config: SglangConfig, *, version: int = 0, logprobs: str = "policy",
                 api: SglangApi | None = None, land_timeout_s: float = 120.0, sampleable_vocab: int | None = None,
                 eos_token_ids: list[int] | tuple[int, ...] = (), bucket_bytes: int = 512 * MIB,
                 coverage_check: str = "off", start_weights: dict[str, torch.Tensor] | None = None):
        """`sampleable_vocab`: ids >= it (padded embedding rows the tokenizer cannot decode) are never
        sampled (`unsampleable_bias`, checked against the served model's vocab_size at start); None:
        every row is sampleable. `eos_token_ids`: the run's end ids, added to every request's
        stop_token_ids (the checkpoint's own config may name other ones). `coverage_check`
        (--transfer.coverage-check) with `start_weights` (the values the checkpoint holds, in the
        actor's names): `_check_coverage` at start; dropped after it."""
        self.config = config
        self.coverage_check, self._start_weights = coverage_check, start_weights
        self._checking = False  # `_check_coverage` runs: the weights are not the served ones
        self.bucket_bytes = int(bucket_bytes)  # an update's bucket (`update_weights`; --transfer.bucket-mb)
        self._torn: int | None = None  # the version an update failed part-way to (`_in_session`)
        self._warned_readback = False
        self.sampleable_vocab = sampleable_vocab
        self.eos_token_ids = [int(i) for i in eos_token_ids]
        self._bias: dict[str, float] = {}
        self._hf_config = None  # the served model's, read at the first update
        self.version = version
        self.logprobs = logprobs
        self.land_timeout_s = land_timeout_s
        self.state = EngineState.CREATED
        self._api = api
        self._engine = None
        self._engine_pids: set[int] = set()
        self._requests: dict[str, _Req] = {}  # live: streams open, not aborted
        self._aborting: dict[str, _Req] = {}  # rid → aborted here, not yet landed in SGLang
        self._serial = 0
        self._weights_lock = asyncio.Lock()  # one weight update / release / resume at a time
        self.version_mismatches = 0
        self._warned_min_tokens = False
        self.context_len: int | None = None  # the served model's (TM.context_len), read at start
        self.max_prompt_len: int | None = None  # prompts at or over it are refused (`_fit_context`)
        self.reserved = 0  # tokens SGLang reserves per request (speculative decoding), read at start
        self.kv_tokens: int | None = None  # the KV pool's capacity in tokens SGLang got (`kv_capacity`), at start

    # ---------------------------------------------------------------- lifecycle
    def _move(self, to: EngineState, *, require: EngineState | None = None) -> None:
        self.state = self.state.move(to, require=require, who="SglangEngine")

    async def start(self) -> None:
        self._move(EngineState.RUNNING, require=EngineState.CREATED)
        policy = asyncio.get_event_loop_policy()  # sglang's engine module sets uvloop's (engine.py:168)
        try:
            api = self._api = self._api or SglangApi.real()
            args = server_args(self.config, set(api.server_arg_names) if api.server_arg_names else None)
            if self.sampleable_vocab is not None:
                self._bias = unsampleable_bias(self.sampleable_vocab, _vocab_size(self.config.model_path))
        except BaseException:
            self.state = EngineState.STOPPED
            asyncio.set_event_loop_policy(policy)
            raise
        args["weight_version"] = str(self.version)  # chunks carry numbers, not "default"
        if self.logprobs == "policy":
            os.environ.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")  # read by the scheduler at import
        if torch.cuda.is_available():  # SGLang sizes its KV cache from the memory free right now
            free, total = torch.cuda.mem_get_info(self.config.base_gpu_id)
            if free < self.config.mem_fraction_static * total:
                logger.warning("sglang start: %.1f GiB free on cuda:%d, less than mem_fraction_static %.2f of %.1f GiB "
                               "(an actor resident: --backend.no-offload-actor, or another process): the KV cache "
                               "will be smaller, or the start fails (--sglang.mem-fraction-static; docs/gpu-sglang.md)",
                               free / 2**30, self.config.base_gpu_id, self.config.mem_fraction_static, total / 2**30)
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        before = child_pids(os.getpid())
        agent_store = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # the scheduler inherits os.environ
        try:
            self._engine = await asyncio.to_thread(lambda: api.Engine(**args))
        except BaseException:
            self.state = EngineState.STOPPED
            raise
        finally:
            asyncio.set_event_loop_policy(policy)  # the first Engine() imported sglang's engine module
            if agent_store is not None:
                os.environ["TORCHELASTIC_USE_AGENT_STORE"] = agent_store
            root.handlers[:] = handlers  # SGLang's configure_logger: basicConfig(force=True)
            root.setLevel(level)
        # Only what the engine started; a harness is never one of them (its processes predate this
        # call, or are launched by the controller after the engine is up).
        self._engine_pids = child_pids(os.getpid()) - before - _resource_tracker_pids()
        tm = self._engine.tokenizer_manager
        self.context_len = getattr(tm, "context_len", None)  # tokenizer_manager.py:600
        limits = [v for v in (self.context_len, getattr(tm, "max_req_input_len", None)) if v]  # engine.py:1399
        self.max_prompt_len = min(limits) if limits else None
        self.reserved = int(getattr(tm, "num_reserved_tokens", 0) or 0)  # speculative draft slots (:605, :1335)
        atexit.unregister(getattr(self._engine, "shutdown", lambda: None))
        self.kv_tokens = kv_capacity(self._engine)
        logger.info("sglang engine up (tp=%d, model=%s, version %d, %d engine processes): KV cache %s tokens at "
                    "mem_fraction_static %.2f, prompts under %s tokens", self.config.tp_size, self.config.model_path,
                    self.version, len(self._engine_pids), self.kv_tokens if self.kv_tokens is not None else "(unknown)",
                    self.config.mem_fraction_static, self.max_prompt_len)
        await self._check_coverage()

    async def stop(self) -> None:
        """End the engine's own processes (SIGTERM, then SIGKILL after 30 s). Never
        `Engine.shutdown`, which kills every child of this rank (engine.py:1491)."""
        if self.state is EngineState.STOPPED:
            return
        self._move(EngineState.STOPPED)
        # The tokenizer manager's watchdog SIGQUITs this rank when an engine process dies; stop it
        # first, as Engine.shutdown does (engine.py:1473-1476; utils/watchdog.py:166-225).
        watchdog = getattr(getattr(self._engine, "tokenizer_manager", None), "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()
        pids = descendant_pids(self._engine_pids)
        self._engine, self._engine_pids = None, set()
        await asyncio.to_thread(terminate_pids, pids, 30.0)
        self._requests.clear()
        self._aborting.clear()

    @property
    def _tm(self):
        if self._engine is None:
            raise RuntimeError(f"SglangEngine: engine is {self.state.value}")
        return self._engine.tokenizer_manager

    @property
    def _io(self):
        return self._api.io_struct

    # ---------------------------------------------------------------- requests
    async def generate(self, request_id: str, input_ids: list[int], sampling: SamplingParams) -> AsyncIterator[TokenEvent]:
        if self.state is not EngineState.RUNNING:
            raise RuntimeError(f"SglangEngine.generate({request_id}): engine is {self.state.value}")
        if self._checking:
            raise RuntimeError(f"SglangEngine.generate({request_id}): the engine checks its weight updates; not serving yet")
        if self._torn is not None and not self._weights_lock.locked():
            raise RuntimeError(f"SglangEngine.generate({request_id}): the update to version {self._torn} failed "
                               f"part-way; the weights are torn until a complete update lands")
        if request_id in self._requests:
            raise ValueError(f"generate: request id {request_id!r} is already in flight")
        max_new = self._fit_context(request_id, len(input_ids), sampling.max_tokens)
        if sampling.min_tokens and self.logprobs == "policy" and not self._warned_min_tokens:
            self._warned_min_tokens = True
            logger.warning("min_tokens > 0: SGLang reports the log-probs of the first min_tokens tokens with the "
                           "stop ids masked (penalizers run before SGLANG_RETURN_ORIGINAL_LOGPROB's log-softmax), "
                           "not the trainer's unmasked ones; see docs/gpu-sglang.md")
        self._serial += 1
        req = self._requests[request_id] = _Req(request_id, prefix_free_rid(request_id, self._serial))
        seen, done, labels = 0, False, []
        try:
            extra = {"top_logprobs_num": sampling.top_logprobs} if sampling.top_logprobs > 0 else {}
            params = sampling_params(sampling)
            params["max_new_tokens"] = max_new
            if "min_new_tokens" in params:  # SGLang refuses min > max (sampling/sampling_params.py:290-294)
                params["min_new_tokens"] = min(params["min_new_tokens"], max_new)
            if self.eos_token_ids:
                params["stop_token_ids"] = sorted(set(params["stop_token_ids"]) | set(self.eos_token_ids))
            if self._bias:
                params["logit_bias"] = self._bias
            stream = await self._engine.async_generate(input_ids=list(input_ids), sampling_params=params,
                                                       return_logprob=True, stream=True, rid=req.rid, **extra)
            async for chunk in stream:
                if req.aborted:  # abort() already returned the tokens; yield nothing past them
                    self._send_abort(req)  # dispatched now: an abort held back during a pause goes out
                    return
                pairs, finish, chunk_version = parse_chunk(chunk, seen)
                tops = parse_top(chunk, seen, len(pairs)) if extra else [None] * len(pairs)
                seen += len(pairs)
                version = int(chunk_version) if chunk_version is not None and chunk_version.isdigit() else self.version
                labels += [str(version)] * len(pairs)
                if finish is not None:
                    self._check_versions(req, labels, chunk)
                if finish not in (None, "stop", "length"):  # SGLang ended it itself (scheduler.py:5802)
                    self._log_own_finish(req, chunk, len(req.out) + len(pairs))
                for i, (tok, lp) in enumerate(pairs):
                    ev = TokenEvent(tok, lp, version, top=tops[i])
                    req.out.append(ev)
                    if match_stop([e.token_id for e in req.out], sampling.stop_sequences) is not None:
                        ev.finish_reason = "stop"  # SGLang does not know token-id stop sequences
                        if finish is None:
                            self._abort_in_sglang(req)
                        done = True
                        yield ev
                        return
                    if i == len(pairs) - 1 and finish is not None:
                        ev.finish_reason = finish if finish in ("stop", "length") else "abort"
                    yield ev
                    if req.aborted:
                        return
                if finish is not None:
                    done = True
                    return
        finally:
            if not done and not req.aborted and self._engine is not None:
                self._abort_in_sglang(req)  # the consumer went away mid-stream
            if self._requests.get(request_id) is req:
                del self._requests[request_id]

    def _log_own_finish(self, req: _Req, chunk: dict[str, Any], tokens: int) -> None:
        """A finish SGLang decided (an abort Gyre did not ask for: OOM past its retract limit, a
        watchdog, an abort of all requests): the stream's last token says `abort` (the proxy
        records the call as aborted); SGLang's reason is logged here, once, since no field of the
        token carries it. With no token at all the proxy records `error` and says so."""
        fr = chunk.get("meta_info", {}).get("finish_reason")
        message = fr.get("message") if isinstance(fr, dict) else None
        logger.warning("sglang engine %s: SGLang ended %s itself after %d tokens (%s)%s", self.name, req.request_id,
                       tokens, fr.get("type") if isinstance(fr, dict) else fr, f": {message}" if message else "")

    def _fit_context(self, request_id: str, n: int, max_tokens: int) -> int:
        """max_new_tokens for a prompt of n tokens, as the CPU engine ends it: a prompt at or over
        the limit is a ValueError; one whose prompt + max_tokens runs over the context ends with
        'length'. SGLang's tokenizer manager refuses both with a ValueError (tokenizer_manager.py:
        1338-1378, no --allow-auto-truncate), so max_new_tokens is cut to context_len - n; its
        scheduler then ends the request at max_req_len - n - 1 tokens, 'length' (scheduler.py:2714;
        max_req_len = context_len - 1, tp_worker.py:568), and aborts a prompt of max_req_input_len
        (context_len - 6) tokens or more without a token (scheduler.py:3244-3254): refused here."""
        if self.max_prompt_len is not None and n >= self.max_prompt_len:
            raise ValueError(f"generate({request_id}): prompt of {n} tokens reaches the SGLang engine's limit "
                             f"{self.max_prompt_len} (context length {self.context_len}; SGLang's scheduler takes "
                             f"prompts under max_req_input_len)")
        if self.context_len is None:
            return max_tokens
        if self.reserved and n + self.reserved >= self.context_len:  # tokenizer_manager.py:1335-1351
            raise ValueError(f"generate({request_id}): prompt of {n} tokens plus the {self.reserved} tokens SGLang's "
                             f"speculative decoding reserves reaches the context length {self.context_len}")
        return min(max_tokens, self.context_len - n - self.reserved)

    def _abort_in_sglang(self, req: _Req) -> None:
        req.aborted = True
        req.abort_unsent = True
        self._aborting[req.rid] = req
        self._send_abort(req)

    def _send_abort(self, req: _Req) -> None:
        """TM.abort_request once SGLang has dispatched the request. Its state exists from the
        moment generate starts, before the wait on a pause (tokenizer_manager.py:926, 938-939); an
        abort before dispatch reaches a scheduler that cannot match it (scheduler.py:5675-5813) and
        sets `abort_sent`, which drops every later abort (:2249-2250): the request would run to
        max_new_tokens after `continue`. So it is held (`abort_unsent`) and sent from the stream's
        next chunk or `_unlanded`, whichever sees the state dispatched first (:1790)."""
        if not req.abort_unsent or self._engine is None:
            return
        state = self._tm.rid_to_state.get(req.rid)
        if state is not None and not getattr(state, "dispatched", True):
            return
        req.abort_unsent = False
        if state is not None:
            self._tm.abort_request(rid=req.rid)

    def _check_versions(self, req: _Req, labels: list[str], chunk: dict[str, Any]) -> None:
        """Compare the versions the tokens were given with the scheduler's spans (finishing chunk)."""
        exact = span_versions(chunk.get("meta_info", {}).get("weight_versions"), len(labels))
        wrong = sum(1 for got, want in zip(labels, exact) if want is not None and got != want)
        if wrong:
            self.version_mismatches += wrong
            logger.warning("request %s: %d tokens were labelled with a version other than the scheduler's spans %s",
                           req.request_id, wrong, chunk["meta_info"]["weight_versions"])

    async def abort(self, request_id: str) -> list[TokenEvent]:
        """Stop `request_id`; return the tokens its stream yielded (it yields nothing more). SGLang
        finishes it one decode step later; `release_memory` waits for that."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise KeyError(f"abort: no request {request_id!r} in flight")
        self._abort_in_sglang(req)
        return list(req.out)

    def _unlanded(self) -> list[str]:
        """rids aborted here whose SGLang request state still exists (tokenizer_manager.py:2774
        deletes it when the scheduler's finishing output arrives; :3850-3868 an undispatched one
        whose stream ended); a held-back abort is sent once its request is dispatched."""
        alive = self._tm.rid_to_state
        for rid in [r for r in self._aborting if r not in alive]:
            del self._aborting[rid]
        for req in list(self._aborting.values()):
            self._send_abort(req)
        return list(self._aborting)

    async def _wait_landed(self) -> None:
        t0 = last_log = time.monotonic()
        while unlanded := self._unlanded():
            now = time.monotonic()
            if now - t0 > self.land_timeout_s:
                raise RuntimeError(f"SglangEngine: {len(unlanded)} aborted requests did not finish in SGLang within "
                                   f"{self.land_timeout_s:.0f}s: {unlanded[:5]}")
            if now - last_log > 5.0:
                last_log = now
                logger.info("waiting for %d aborted SGLang requests to finish (%s...)", len(unlanded), unlanded[:3])
            await asyncio.sleep(0.005)

    # ---------------------------------------------------------------- weights
    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """In-cell update from this rank's tensors, in one weight-update session, bucket by bucket
        (`gyre.backends.transfer.buckets`): one `update_weights_from_tensor` call per bucket, each
        with one payload per TP rank whose tensors sit on that rank's GPU (`tp_devices`; each rank
        opens only its own, deserialize_own_rank, managers/tp_worker.py:193-201). SGLang loads
        each call at once (model_runner_components/weight_updater.py:343-381: `load_weights` over
        the call's tensors; each TP rank gets the full tensors and its weight_loader narrows out its
        shard, so a bucket costs its full size on every GPU of the cell) and the session allows any
        number of calls (scheduler_components/weight_updater.py:232-262 only checks the session is
        open). Only the last call carries `weight_version` (None leaves the served version as it
        is, scheduler.py:5636-5638) and `flush_cache` (weight_updater.py:120-133), so the version
        changes once, with the last bucket. A bucket's copies are freed before the next is made:
        at most one bucket per GPU at a time (+ one tensor larger than the bucket)."""
        if self.state is not EngineState.RUNNING:
            raise RuntimeError(f"SglangEngine.update_weights(version {version}): engine is {self.state.value}"
                               + (" (resume first: SGLang keeps no copy of released weights)"
                                  if self.state is EngineState.RELEASED else ""))
        io = self._io
        buckets = plan_tensors(list(self._checkpoint_names(state_dict).items()), self.bucket_bytes)

        async def load() -> Any:
            result: Any = (True, "no tensors")
            for i, bucket in enumerate(buckets):
                last = i == len(buckets) - 1
                result = await self._send_bucket(bucket, str(version) if last else None, last)
                _check(result, f"update_weights_from_tensor (bucket {i + 1} of {len(buckets)})")
            return result

        await self._in_session(load, "update_weights_from_tensor", version)
        self.version = int(version)

    async def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], weight_version: str | None,
                           flush: bool) -> Any:
        # `copies` keeps each rank's tensors alive while SGLang maps them (CUDA IPC); they go when
        # this returns, so the next bucket reuses their blocks.
        copies = [[(k, v.detach().to(device, copy=True)) for k, v in bucket] for device in self._rank_devices()]
        payload = [self._api.serialize(c) for c in copies]  # one per TP rank (engine.py:1743)
        obj = self._io.UpdateWeightsFromTensorReqInput(serialized_named_tensors=payload, load_format=None,
                                                       flush_cache=flush, weight_version=weight_version)
        try:
            return await self._tm.update_weights_from_tensor(obj, None)
        finally:
            del copies, payload

    def _rank_devices(self) -> list[torch.device]:
        if torch.cuda.is_available():
            return tp_devices(self.config)
        return [torch.device("cpu")] * self.config.tp_size

    def _checkpoint_names(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """SGLang's load_weights reads checkpoint names (per-expert MoE tensors), not transformers
        5's fused in-memory ones (sglang_checkpoint.checkpoint_names)."""
        from gyre.backends.engines.sglang_checkpoint import checkpoint_names

        if self._hf_config is None:
            from transformers import AutoConfig

            self._hf_config = AutoConfig.from_pretrained(self.config.model_path)
        return checkpoint_names(self._hf_config, state_dict)

    async def _in_session(self, load: Callable[[], Any], what: str, version: int) -> None:
        """pause(retract) → begin_weight_update → load() → end_weight_update → continue_generation
        (weight_updater.py:232-239, 309-335); end runs whatever happened. A load that failed may
        have loaded some buckets (SGLang has no rollback): the engine is then *torn*, stays paused
        (its version label still the old one, but nothing is generated from the mix) and refuses
        requests until a complete update lands (`_torn`). (A load_weights exception inside SGLang
        kills its scheduler instead, weight_updater.py:343-381 has no try: the rank's SIGQUIT watch.)"""
        io, tm = self._io, self._tm
        async with self._weights_lock:
            await tm.pause_generation(io.PauseGenerationReqInput(mode="retract"))
            started = landed = False
            try:
                _check(await tm.begin_weight_update(io.BeginWeightUpdateReqInput(), None), "begin_weight_update")
                try:
                    started = True
                    _check(await load(), what)
                    landed = True
                finally:
                    _check(await tm.end_weight_update(io.EndWeightUpdateReqInput(), None), "end_weight_update")
            finally:
                if landed:
                    self._torn = None
                elif started:
                    self._torn = int(version)
                if self._torn is None:
                    await tm.continue_generation(io.ContinueGenerationReqInput())
                else:
                    logger.error("SGLang weight update to version %d failed part-way: the engine stays paused and "
                                 "refuses requests until a complete update lands", self._torn)

    async def _check_coverage(self) -> None:
        """Once at start, before anything is served (`gyre.backends.transfer.coverage.at_start`):
        the start weights through `update_weights` at the start version (the version does not
        move) between SGLang's check_weights snapshot/reset and compare. A failure stops the
        engine (its weights may be random) and raises."""
        from gyre.backends.transfer import coverage

        params, self._start_weights = self._start_weights, None
        if params is None:
            return
        names = sorted(self._checkpoint_names(params))

        async def push() -> int:
            await self.update_weights(params, self.version)
            return len(names)

        self._checking = True
        try:
            await coverage.at_start(self._tm, self._io, self.coverage_check, names, push,
                                    engine=f"sglang {self.config.model_path}",
                                    prime=any(k.replace("-", "_") == "load_format" and str(v) == "dummy"
                                              for k, v in self.config.extra.items()))
        except BaseException:
            await self.stop()
            raise
        finally:
            self._checking = False

    async def read_weights(self, names: list[str], rows: int) -> dict[str, Any]:
        """`gyre.backends.transfer.readback`'s read: TM.get_weights_by_name(name, truncate_size=rows)
        per name (tokenizer_control_mixin.py:861-870, io_struct.py:2166-2168), the first `rows` rows
        as float32 lists (models/llama.py:819-890; with TP, rank 0's part: see readback). SGLang
        0.5.23 implements it for Llama-style classes only: Qwen2/Qwen3/Qwen3-MoE have no
        `get_weights_by_name`, the exporter catches the AttributeError and answers None
        (model_executor/model_runner_components/weight_exporter.py:181-188). So: every answer None →
        UNREADABLE (the class cannot export; warned once), otherwise None means SGLang has no such
        parameter. Transformers' fused MoE expert tensors have no SGLang name: UNREADABLE."""
        from gyre.backends.transfer.readback import UNREADABLE

        io, out = self._io, {}
        for name in names:
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                out[name] = UNREADABLE
                continue
            got = await self._tm.get_weights_by_name(io.GetWeightsByNameReqInput(name=name, truncate_size=rows), None)
            out[name] = None if got is None else torch.tensor(got, dtype=torch.float32)
        answered = [n for n in names if out[n] is not UNREADABLE]
        if answered and all(out[n] is None for n in answered):
            if not self._warned_readback:
                self._warned_readback = True
                logger.warning("SGLang cannot read weights back for this model class (get_weights_by_name answers "
                               "None for every parameter: sglang 0.5.23 implements it for Llama-style classes, not "
                               "Qwen2/Qwen3/Qwen3-MoE); the weight read-back is skipped for %s (the coverage check at start, "
                               "--transfer.coverage-check, covers these classes)", self.config.model_path)
            out.update({n: UNREADABLE for n in answered})
        return out

    @property
    def weights_dtype(self) -> torch.dtype | None:
        return _STR_DTYPES.get(self.config.dtype)  # auto: the sent tensors' own

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "gyre_weights", backend: str = "nccl") -> None:
        """Join the group the core's `WeightBroadcaster` hosts (rank 0 there; this engine's TP ranks
        are rank_offset..rank_offset+tp-1). Blocks until every member joined: run the core's side
        at the same time."""
        obj = self._io.InitWeightsUpdateGroupReqInput(master_address=master_address, master_port=master_port,
                                                      rank_offset=rank_offset, world_size=world_size,
                                                      group_name=group_name, backend=backend)
        _check(await self._tm.init_weights_update_group(obj, None), "init_weights_update_group")

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              version: int, group_name: str = "gyre_weights") -> None:
        """Receive one broadcast from the core (its `WeightBroadcaster.send`, same order), in a
        weight-update session."""
        if self.state is not EngineState.RUNNING:
            raise RuntimeError(f"SglangEngine.update_weights_from_distributed: engine is {self.state.value}")
        sizes = [(i, _numel(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size())
                 for i, (dtype, shape) in enumerate(zip(dtypes, shapes))]
        buckets = plan(sizes, self.bucket_bytes)

        async def load() -> Any:
            # SGLang receives every tensor of a call before loading it (weight_updater.py:260-298: one
            # torch.empty per name, then the broadcasts), so a call holds its bucket; the core's
            # broadcasts are one per tensor in `names` order, so bucket boundaries need no agreement.
            result: Any = (True, "no tensors")
            for b, idx in enumerate(buckets):
                last = b == len(buckets) - 1
                obj = self._io.UpdateWeightsFromDistributedReqInput(
                    names=[names[i] for i in idx], dtypes=[dtypes[i] for i in idx], shapes=[shapes[i] for i in idx],
                    group_name=group_name, flush_cache=last, weight_version=str(version) if last else None)
                result = await self._tm.update_weights_from_distributed(obj, None)
                _check(result, f"update_weights_from_distributed (bucket {b + 1} of {len(buckets)})")
            return result

        await self._in_session(load, "update_weights_from_distributed", version)
        self.version = int(version)

    # ---------------------------------------------------------------- memory
    async def release_memory(self) -> None:
        """Free weights, KV cache and CUDA graphs (the cell trains). Refused while a request is live
        here (the proxy drains the cell first); waits for aborted requests to finish in SGLang, and
        pauses it, so the scheduler's idle assertion holds (weight_updater.py:337-341)."""
        if self._requests:
            raise RuntimeError(f"SglangEngine.release_memory refused: {len(self._requests)} requests still running "
                               f"here ({sorted(self._requests)[:5]}); drain the cell (abort or finish them) first")
        io = self._io
        async with self._weights_lock:
            self._move(EngineState.RELEASED, require=EngineState.RUNNING)
            try:
                await self._wait_landed()
                await self._tm.pause_generation(io.PauseGenerationReqInput(mode="retract"))
                await self._tm.release_memory_occupation(io.ReleaseMemoryOccupationReqInput(tags=None), None)
            except BaseException:
                self.state = EngineState.RUNNING
                raise

    async def resume(self) -> None:
        """Take the memory back: this process's cached CUDA blocks are returned first (SGLang needs
        the physical memory free; the actor's own offload is the worker's). Weights must be loaded
        after this (SGLang keeps no copy)."""
        io = self._io
        async with self._weights_lock:
            if self.state is not EngineState.RELEASED:
                raise RuntimeError(f"SglangEngine.resume: engine is {self.state.value}, not released")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                free, total = torch.cuda.mem_get_info(self.config.base_gpu_id)
                logger.info("sglang resume: %.1f of %.1f GiB free on cuda:%d", free / 2**30, total / 2**30,
                            self.config.base_gpu_id)
            await self._tm.resume_memory_occupation(io.ResumeMemoryOccupationReqInput(tags=None), None)
            await self._tm.continue_generation(io.ContinueGenerationReqInput())
            self._move(EngineState.RUNNING)

    async def health(self) -> EngineHealth:
        return EngineHealth(ok=self.state in (EngineState.RUNNING, EngineState.RELEASED), version=self.version,
                            running=len(self._requests), waiting=0, released=self.state is EngineState.RELEASED,
                            detail={"state": self.state.value, "aborting": len(self._aborting),
                                    "version_mismatches": self.version_mismatches})

    # KV migration (`protocols.MigratableEngine`): not yet. `supports_migration` is False, so the
    # router recomputes; a direct call says why. Design note - which SGLang mechanism would carry it:
    # PD disaggregation's KV transfer, not HiCache. Its sender/receiver pair
    # (python/sglang/srt/disaggregation/base/conn.py: BaseKVSender.init/send(kv_indices),
    # BaseKVReceiver.send_metadata(kv_indices), KVPoll) with the Mooncake backend
    # (disaggregation/mooncake/conn.py: MooncakeKVManager, RDMA writes into pages the receiver
    # preallocated, decode.py's DecodePreallocQueue) is already a two-phase, point-to-point page move
    # with a completion poll before the sender frees - our handshake. What it lacks: it runs only
    # prefill → decode at the end of a prefill (one server is either mode), so the source would
    # need a "send a running request's pages" path (its req_to_token row, prompt + generated) and
    # the target a decode-side entry that adopts them with the request's output ids, and the
    # sampler's per-request RNG position would have to travel in the aux/metadata buffer.
    # HiCache (mem_cache/hiradix_cache.py + an L3 storage backend such as Mooncake store) shares
    # prefix pages by token hash: a target could load a prefix the source wrote through instead of
    # recomputing it, but with no handshake (the source may evict first) and without the sampling
    # state, so not token-exact.
    supports_migration = False

    async def migrate_out(self, request_id: str):
        raise NotImplementedError("SGLang engine: KV migration is not wired (see the note above "
                                  "SglangEngine.supports_migration); the router recomputes instead")

    def load(self) -> int:
        return len(self._requests)


def _vocab_size(model_path: str) -> int:
    """The served model's embedding rows, from its config.json (what SGLang's ModelConfig reads;
    a multimodal config nests it in text_config)."""
    import json

    with open(os.path.join(model_path, "config.json")) as f:
        config = json.load(f)
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not vocab:
        raise ValueError(f"{model_path}/config.json has no vocab_size")
    return int(vocab)


_STR_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16, "float32": torch.float32,
               "float": torch.float32}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _fields(cls) -> set[str]:
    """Field names of an io_struct request: msgspec Structs (sglang ≥ 0.5.2x) or dataclasses."""
    return set(getattr(cls, "__struct_fields__", ())) | set(getattr(cls, "__dataclass_fields__", {}))


def _check(result: Any, what: str) -> None:
    """SGLang returns (success, message) tuples or objects with .success; raise on failure."""
    success, message = True, ""
    if isinstance(result, tuple) and result:
        success, message = bool(result[0]), str(result[1]) if len(result) > 1 else ""
    elif hasattr(result, "success"):
        success, message = bool(result.success), str(getattr(result, "message", ""))
    if not success:
        raise RuntimeError(f"sglang {what} failed: {message}")
