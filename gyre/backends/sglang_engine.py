"""SGLang rollout engine embedded in a cell's process (GPU; `pip install gyre[gpu]`).

Wraps the offline `sglang.Engine` (sglang/srt/entrypoints/engine.py). Its synchronous helpers
call `loop.run_until_complete`, which cannot run inside Gyre's event loop, so the adapter awaits
the engine's `tokenizer_manager` coroutines directly with the same `io_struct` request objects
the helpers build:

    generate        Engine.async_generate(input_ids=..., sampling_params=..., return_logprob=True,
                    stream=True, rid=request_id) → chunks with meta_info['output_token_logprobs']
                    = [(logprob, token_id, text), ...] and meta_info['finish_reason']
    abort           tokenizer_manager.abort_request(rid=...)
    update_weights  pause_generation(mode='retract') → update_weights_from_tensor(
                    UpdateWeightsFromTensorReqInput(serialized_named_tensors=[one per TP rank],
                    flush_cache=True)) → continue_generation(): running requests are retracted,
                    their KV recomputed under the new weights (like the CPU engine's
                    `recompute_kv_on_update`), none dropped
    distributed     init_weights_update_group / update_weights_from_distributed (NCCL broadcast
                    from the core, the GPU form of `transfer.TorchDistTransport`)
    release/resume  release_memory_occupation / resume_memory_occupation (needs
                    `enable_memory_saver`)

Log-probs: with `logprobs='policy'` the adapter sets SGLANG_RETURN_ORIGINAL_LOGPROB=1 before
the engine starts, so SGLang reports log-softmax of the logits before temperature — the same
quantity as the CPU engine and the trainer. Token-id stop sequences (SGLang's `stop` takes
strings) are matched here: the request is aborted and its output cut right after the match.

Alternatives (`SamplingParams.top_logprobs` = k): `async_generate(..., top_logprobs_num=k)`;
meta_info['output_top_logprobs'] is, like 'output_token_logprobs', the request's cumulative list,
one entry per output token, each a list of (logprob, token_id, text or None) most likely first
(sglang tokenizer_manager `detokenize_top_logprobs_tokens`); `parse_top` maps the chunk's slice
to `TokenEvent.top`. They come from the same log-prob tensor as the sampled token's, so with
SGLANG_RETURN_ORIGINAL_LOGPROB they are policy log-probs too (read in SGLang's source, not run).

Checked against the sglang 0.5.23 wheel's source (Engine, tokenizer_manager, io_struct msgspec
request types, ServerArgs fields, SGLANG_RETURN_ORIGINAL_LOGPROB); not run here (no GPU).
Nothing here imports sglang at module import; the pure translation functions are CPU-tested.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import torch

from gyre.backends.config import SglangConfig
from gyre.backends.protocols import EngineHealth, SamplingParams, TokenEvent

logger = logging.getLogger(__name__)


def server_args(config: SglangConfig) -> dict[str, Any]:
    """`sglang.Engine(**kwargs)` from Gyre's config; `config.extra` (pass-through) wins."""
    if not config.model_path:
        raise ValueError("sglang.model_path: an HF checkpoint directory is required")
    if config.tp_size < 1:
        raise ValueError(f"sglang.tp_size must be ≥ 1, got {config.tp_size}")
    if not 0.0 < config.mem_fraction_static < 1.0:
        raise ValueError(f"sglang.mem_fraction_static must be in (0, 1), got {config.mem_fraction_static}")
    args: dict[str, Any] = {
        "model_path": config.model_path,
        "tp_size": config.tp_size,
        "mem_fraction_static": config.mem_fraction_static,
        "base_gpu_id": config.base_gpu_id,
        "dtype": config.dtype,
        "enable_memory_saver": config.enable_memory_saver,
        "skip_tokenizer_init": True,  # token ids in, token ids out (TITO, docs/design.md §4)
        "host": "127.0.0.1",
        "log_level": "error",
    }
    for key, value in config.extra.items():
        args[key.replace("-", "_")] = _coerce(value)
    return args


def _coerce(value: str) -> Any:
    """Pass-through CLI strings → bool / int / float where they parse, else the string."""
    if not isinstance(value, str):
        return value
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def sampling_params(sp: SamplingParams) -> dict[str, Any]:
    """SGLang sampling_params dict for one request (stop sequences are matched by the adapter)."""
    out: dict[str, Any] = {
        "max_new_tokens": sp.max_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "stop_token_ids": list(sp.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,  # keep the stop token in the output: it was sampled and is trained
    }
    if sp.seed is not None:
        out["sampling_seed"] = int(sp.seed)
    if sp.min_tokens:
        out["min_new_tokens"] = int(sp.min_tokens)
    return out


def parse_chunk(chunk: dict[str, Any], seen: int) -> tuple[list[tuple[int, float]], str | None, str | None]:
    """New (token_id, logprob) pairs of a streamed chunk, its finish type, its weight version.

    SGLang's meta_info['output_token_logprobs'] is the request's cumulative list — the same list
    object, which keeps growing after the chunk was sent — so the chunk's own
    'output_token_logprobs_length' bounds what belongs to it (sglang 0.5.23 tokenizer_manager)."""
    meta = chunk.get("meta_info", {})
    entries = meta.get("output_token_logprobs") or []
    end = int(meta.get("output_token_logprobs_length", len(entries)))
    pairs = [(int(e[1]), float(e[0])) for e in entries[seen:end]]
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    version = meta.get("weight_version")
    return pairs, kind, None if version is None else str(version)


def parse_top(chunk: dict[str, Any], seen: int, n: int) -> list[list[tuple[int, float]] | None]:
    """TokenEvent.top for the chunk's n new tokens (positions seen .. seen+n-1): SGLang's
    (logprob, token_id, text) triples as (token_id, logprob); None where SGLang sent none."""
    rows = chunk.get("meta_info", {}).get("output_top_logprobs") or []
    out: list[list[tuple[int, float]] | None] = []
    for i in range(seen, seen + n):
        row = rows[i] if i < len(rows) else None
        out.append(None if row is None else [(int(e[1]), float(e[0])) for e in row])
    return out


def match_stop(ids: list[int], stop_sequences: list[list[int]]) -> int | None:
    """Length of the output to keep if some stop sequence ends inside `ids`, else None."""
    best = None
    for s in stop_sequences:
        for end in range(len(s), len(ids) + 1):
            if ids[end - len(s) : end] == list(s):
                best = end if best is None else min(best, end)
                break
    return best


@dataclass(eq=False)
class _Req:
    rid: str
    out: list[TokenEvent] = field(default_factory=list)
    aborted: bool = False


class SglangEngine:
    """RolloutEngine over an embedded `sglang.Engine`."""

    name = "sglang"

    def __init__(self, config: SglangConfig, *, version: int = 0, logprobs: str = "policy"):
        self.config = config
        self.version = version
        self.logprobs = logprobs
        self._engine = None
        self._requests: dict[str, _Req] = {}
        self._released = False

    async def start(self) -> None:
        args = server_args(self.config)
        if self.logprobs == "policy":
            os.environ.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
        import sglang  # lazy: GPU only

        self._engine = await asyncio.to_thread(lambda: sglang.Engine(**args))
        logger.info("sglang engine up (tp=%d, model=%s)", self.config.tp_size, self.config.model_path)

    async def stop(self) -> None:
        if self._engine is not None:
            await asyncio.to_thread(self._engine.shutdown)
            self._engine = None

    @property
    def _tm(self):
        if self._engine is None:
            raise RuntimeError("SglangEngine: not started")
        return self._engine.tokenizer_manager

    async def generate(self, request_id: str, input_ids: list[int], sampling: SamplingParams) -> AsyncIterator[TokenEvent]:
        engine = self._engine
        if engine is None:
            raise RuntimeError(f"SglangEngine.generate({request_id}): not started")
        if self._released:
            raise RuntimeError(f"SglangEngine.generate({request_id}): memory is released")
        if request_id in self._requests:
            raise ValueError(f"generate: request id {request_id!r} is already in flight")
        req = self._requests[request_id] = _Req(request_id)
        seen, done = 0, False
        try:
            extra = {"top_logprobs_num": sampling.top_logprobs} if sampling.top_logprobs > 0 else {}
            stream = await engine.async_generate(input_ids=list(input_ids), sampling_params=sampling_params(sampling),
                                                 return_logprob=True, stream=True, rid=request_id, **extra)
            async for chunk in stream:
                pairs, finish, chunk_version = parse_chunk(chunk, seen)
                tops = parse_top(chunk, seen, len(pairs)) if extra else [None] * len(pairs)
                seen += len(pairs)
                version = int(chunk_version) if chunk_version is not None and chunk_version.isdigit() else self.version
                for i, (tok, lp) in enumerate(pairs):
                    if req.aborted:  # abort() already returned the tokens; yield nothing past them
                        return
                    ev = TokenEvent(tok, lp, version, top=tops[i])
                    req.out.append(ev)
                    if match_stop([e.token_id for e in req.out], sampling.stop_sequences) is not None:
                        ev.finish_reason = "stop"  # SGLang does not know token-id stop sequences
                        self._tm.abort_request(rid=request_id)
                        done = True
                        yield ev
                        return
                    if i == len(pairs) - 1 and finish in ("stop", "length"):
                        ev.finish_reason = finish
                    yield ev
                if finish is not None:
                    done = True
                    return
        finally:
            if not done and not req.aborted and self._engine is not None:
                self._tm.abort_request(rid=request_id)  # the consumer went away mid-stream
            self._requests.pop(request_id, None)

    async def abort(self, request_id: str) -> list[TokenEvent]:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"abort: no request {request_id!r} in flight")
        req.aborted = True  # the stream yields nothing past what is returned here
        self._tm.abort_request(rid=request_id)
        return list(req.out)

    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        from sglang.srt.managers.io_struct import (ContinueGenerationReqInput, PauseGenerationReqInput,
                                                   UpdateWeightsFromTensorReqInput)
        from sglang.srt.utils import MultiprocessingSerializer

        named = [(k, v.detach().cuda() if torch.cuda.is_available() else v) for k, v in state_dict.items()]
        payload = [MultiprocessingSerializer.serialize(named) for _ in range(self.config.tp_size)]
        kwargs: dict[str, Any] = dict(serialized_named_tensors=payload, load_format=None, flush_cache=True)
        if "weight_version" in _fields(UpdateWeightsFromTensorReqInput):
            kwargs["weight_version"] = str(version)
        await self._tm.pause_generation(PauseGenerationReqInput(mode="retract"))
        try:
            result = await self._tm.update_weights_from_tensor(UpdateWeightsFromTensorReqInput(**kwargs), None)
        finally:
            await self._tm.continue_generation(ContinueGenerationReqInput())
        _check(result, "update_weights_from_tensor")
        self.version = int(version)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "gyre_weights", backend: str = "nccl") -> None:
        from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput

        obj = InitWeightsUpdateGroupReqInput(master_address=master_address, master_port=master_port, rank_offset=rank_offset,
                                             world_size=world_size, group_name=group_name, backend=backend)
        _check(await self._tm.init_weights_update_group(obj, None), "init_weights_update_group")

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              version: int, group_name: str = "gyre_weights") -> None:
        """Receive a broadcast from the core over the group made by `init_weights_update_group`."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

        obj = UpdateWeightsFromDistributedReqInput(names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, flush_cache=True)
        _check(await self._tm.update_weights_from_distributed(obj, None), "update_weights_from_distributed")
        self.version = int(version)

    async def release_memory(self) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        if self._requests:
            raise RuntimeError(f"SglangEngine.release_memory: {len(self._requests)} requests in flight; drain first")
        await self._tm.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=None), None)
        self._released = True

    async def resume(self) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        await self._tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=None), None)
        self._released = False

    async def health(self) -> EngineHealth:
        return EngineHealth(ok=self._engine is not None, version=self.version, running=len(self._requests), waiting=0,
                            released=self._released)

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
