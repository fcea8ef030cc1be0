"""Built-in CPU rollout engine (docs/design.md §1): continuous batching over per-request KV caches.

An asyncio front (`generate` streams TokenEvents) over one decode loop task. Each loop step:

    apply a pending weight update (between steps, never inside one)
    admit waiting requests (≤ max_batch running, ≤ max_prefill_tokens of prompt per step)
    one fused forward in a worker thread: new requests feed their prompt, running ones their
        last token (`decoder.extend`, token-wise work batched over all of them)
    sample one token per request, emit it, retire finished requests

so requests join and leave the running batch between decode steps. Each TokenEvent's log-prob is
log-softmax of the raw logits at the sampled token (`logprobs='policy'`): exactly the trainer's ℓ_t
for the same weights and tokens, whatever temperature / top-p sampled it. `update_weights` copies
the new weights in place bucket by bucket (`--transfer.bucket-mb`) and, with
`recompute_kv_on_update`, re-prefills running requests: every later token's log-prob is the new
weights' and carries the new version; no request is dropped. Sampling, stops, abort, the emulated
accelerator of the benchmarks (`min_decode_step_s`): docs/backends.md, "CPU engine".

Lifecycle (`EngineState`):
    CREATED → RUNNING (start) | STOPPED
    RUNNING → RELEASED (release_memory; nothing running or queued) | STOPPED (stop)
    RELEASED → RUNNING (resume) | STOPPED
    STOPPED is final. Anything else raises RuntimeError.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import torch

from gyre.backends.config import CpuEngineConfig
from gyre.backends.engines.decoder import DecoderWeights, KVCache, extend, validated
from gyre.backends.transfer.buckets import MIB, HeldBytes, nbytes, plan_tensors
from gyre.backends.transfer.migration import KvTransport, MigrationRefused, RequestState, Tickets, pack_state, unpack_state
from gyre.backends.protocols import EngineHealth, EngineState, SamplingParams, TokenEvent
from gyre.backends.engines.sampling import sample_token, sampling_logprobs, top_logprobs

logger = logging.getLogger(__name__)




@dataclass(eq=False)
class _Request:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    generator: torch.Generator
    queue: asyncio.Queue
    out: list[TokenEvent] = field(default_factory=list)
    cache: KVCache | None = None
    fed: int = 0  # tokens of prompt + out already in the cache
    finish: str | None = None  # 'stop' | 'length' | 'abort' | 'error'

    def sequence(self) -> list[int]:
        return self.prompt + [e.token_id for e in self.out]


class CpuEngine:
    """The built-in RolloutEngine. `model_config` is the HF config of a supported family
    (`gyre.backends.models.arch`), `state_dict` its HF weights.
    `device`: where weights, KV caches and the forward live (`--backend.device`, resolved by
    `gyre.backends.devices.engine_device`: cpu, or the rank's GPU); sampling reads the step's
    logits on CPU, so seeded requests sample alike on either.
    `sampleable_vocab`: ids >= it are never sampled nor listed in top log-probs (real Qwen2.5
    pads its embedding past the tokenizer's last id; those rows decode to nothing). None: every
    row. The reported policy log-prob stays log-softmax over every row, the trainer's ℓ_t."""

    name = "cpu"

    def __init__(self, model_config, state_dict: dict[str, torch.Tensor], *, version: int = 0,
                 config: CpuEngineConfig | None = None, eos_token_ids: list[int] | None = None,
                 device: torch.device | str = "cpu", sampleable_vocab: int | None = None,
                 bucket_bytes: int = 512 * MIB):
        self.config = config or CpuEngineConfig()
        self.bucket_bytes = int(bucket_bytes)  # `update_weights` stages at most this much at once (+ one tensor)
        self.held = HeldBytes()  # bytes an update holds staged, and the peak (tests bound it)
        self._torn: int | None = None  # the version an update was copying in when it failed (`update_weights`)
        self.model_config = model_config
        self.device = torch.device(device)
        self._weights = DecoderWeights.from_state_dict(state_dict, model_config, device=self.device)
        rows = self._weights.shape.vocab_size
        if sampleable_vocab is not None and not 0 < sampleable_vocab <= rows:
            raise ValueError(f"CpuEngine: sampleable_vocab {sampleable_vocab} must be in 1..{rows} "
                             f"(the model's embedding rows)")
        self.sampleable_vocab = rows if sampleable_vocab is None else int(sampleable_vocab)
        self._padded_ids = list(range(self.sampleable_vocab, rows))  # never sampled
        self.version = version
        self.eos_token_ids = list(eos_token_ids or [])
        self.state = EngineState.CREATED
        self._requests: dict[str, _Request] = {}  # every request whose stream is still open
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._step_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.steps = 0
        self.tokens_generated = 0
        self.paced_s = 0.0  # seconds slept to hold decode steps at min_decode_step_s
        self.slow_steps = 0  # steps whose compute alone exceeded min_decode_step_s
        # KV migration (`gyre.backends.transfer.migration`): off until a transport is attached
        self._tickets: Tickets | None = None
        self._parked: dict[str, tuple[RequestState, KVCache, torch.Generator, float]] = {}

    @classmethod
    def from_model(cls, model, **kwargs) -> "CpuEngine":
        """An engine serving an HF model's current weights (copied)."""
        return cls(model.config, model.state_dict(), **kwargs)

    @classmethod
    def from_checkpoint(cls, path: str, **kwargs) -> "CpuEngine":
        """An engine serving an HF checkpoint directory (config.json + *.safetensors)."""
        import glob
        import os

        from safetensors.torch import load_file
        from transformers import AutoConfig

        from gyre.backends.models.arch import check_checkpoint

        check_checkpoint(path)  # an unsupported architecture is refused by name, before reading weights
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"CpuEngine.from_checkpoint: no *.safetensors under {path}")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(f))
        config = AutoConfig.from_pretrained(path)
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        if "eos_token_ids" not in kwargs and config.eos_token_id is not None:
            eos = config.eos_token_id
            kwargs["eos_token_ids"] = list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
        return cls(config, state, **kwargs)

    # ---------------------------------------------------------------- lifecycle
    def _move(self, to: EngineState, *, require: EngineState | None = None) -> None:
        logger.debug("engine %s → %s", self.state.value, to.value)
        self.state = self.state.move(to, require=require, who="CpuEngine")

    async def start(self) -> None:
        self._move(EngineState.RUNNING, require=EngineState.CREATED)
        self._loop_task = asyncio.create_task(self._loop(), name="gyre-cpu-engine")

    async def stop(self) -> None:
        self._move(EngineState.STOPPED)
        if self.config.min_decode_step_s > 0:
            logger.info("engine paced: %d of %d decode steps overran min_decode_step_s %.3fs; %.1fs slept",
                        self.slow_steps, self.steps, self.config.min_decode_step_s, self.paced_s)
        for req in list(self._running) + list(self._waiting):
            self._finish(req, "abort")
        self._running.clear()
        self._waiting.clear()
        self._wake.set()
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass

    async def release_memory(self) -> None:
        """Free every KV cache (the cell is switching to training). Nothing may be in flight. On
        CUDA the weights also wait in pinned host memory and the cached blocks are freed, so the
        actor has the GPU; `resume` brings them back."""
        if self._running or self._waiting:
            raise RuntimeError(f"CpuEngine.release_memory: {len(self._running)} running and "
                               f"{len(self._waiting)} waiting requests; drain first")
        async with self._step_lock:
            self._move(EngineState.RELEASED)
            if self.device.type == "cuda":  # the cell trains: weights to pinned host memory, blocks to the driver
                self._weights = self._weights.to("cpu", pin=True)
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()

    async def resume(self) -> None:
        async with self._step_lock:
            self._move(EngineState.RUNNING, require=EngineState.RELEASED)
            if self._weights.device != self.device:  # released on CUDA (unless an update came meanwhile)
                self._weights = self._weights.to(self.device)
        self._wake.set()

    async def health(self) -> EngineHealth:
        alive = self._loop_task is not None and not self._loop_task.done()
        return EngineHealth(
            ok=alive and self.state in (EngineState.RUNNING, EngineState.RELEASED),
            version=self.version, running=len(self._running), waiting=len(self._waiting),
            released=self.state is EngineState.RELEASED,
            detail={"state": self.state.value, "steps": self.steps, "tokens": self.tokens_generated,
                    "kv_bytes": sum(r.cache.nbytes() for r in self._running if r.cache is not None),
                    "paced_s": self.paced_s, "slow_steps": self.slow_steps},
        )

    def load(self) -> int:
        return len(self._running) + len(self._waiting)

    # ---------------------------------------------------------------- weights
    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Copy new weights in, in buckets of at most `bucket_bytes` (gyre.backends.transfer.buckets):
        names and shapes are checked first (a bad update changes nothing); then, with no decode step
        between buckets (the step lock is held), each bucket is staged on the engine's device and
        copied into the served tensors. The version changes after the last bucket. A failure between
        buckets leaves the weights torn: the engine stops stepping and refuses requests until a
        complete update lands (`_torn`), so nothing is ever sampled from a mix of versions."""
        if self.state is EngineState.STOPPED:
            raise RuntimeError("CpuEngine.update_weights: engine is stopped")
        _, named, _ = validated(state_dict, self.model_config)
        dst = self._weights.tensors
        lost = [k for k in dst if k not in named and not (k == "lm_head.weight" and self._weights.tied)]
        if lost:
            raise ValueError(f"CpuEngine.update_weights(version {version}): no tensor for {lost[:3]}")
        buckets = plan_tensors([(k, t) for k, t in named.items() if k in dst], self.bucket_bytes)
        async with self._step_lock:
            self._torn = int(version)
            for bucket in buckets:
                await asyncio.to_thread(self._copy_bucket, bucket)
            self._torn = None
            self.version = int(version)
            if self.config.recompute_kv_on_update:
                for req in self._running:
                    req.cache, req.fed = None, 0
        self._wake.set()
        logger.info("engine weights updated to version %d in %d buckets (%d running requests kept)", version,
                    len(buckets), len(self._running))

    def _copy_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Stage one bucket on the weights' device and dtype (`held` counts it), copy it in, free it
        (on CPU the staging could be skipped; kept so a CPU run holds what a GPU run does)."""
        dst = self._weights.tensors
        staged: list[tuple[str, torch.Tensor]] = []
        try:
            for name, t in bucket:
                s = t.detach().to(dst[name].device, dst[name].dtype, copy=True)
                self.held.add(nbytes(s))
                staged.append((name, s))
            for name, s in staged:
                dst[name].copy_(s)
        finally:
            for _, s in staged:
                self.held.sub(nbytes(s))

    async def read_weights(self, names: list[str], rows: int) -> dict[str, torch.Tensor | None]:
        """The first `rows` rows (1-D: elements) of each named served tensor, as float32 on CPU,
        like SGLang's get_weights_by_name (`gyre.backends.transfer.readback`); None for a name the
        engine does not hold."""
        async with self._step_lock:
            out: dict[str, torch.Tensor | None] = {}
            tensors = self._weights.tensors
            for name in names:
                key = "model.embed_tokens.weight" if name == "lm_head.weight" and self._weights.tied else name
                t = tensors.get(key)
                out[name] = None if t is None else t.detach()[:rows].to("cpu", torch.float32).clone()
            return out

    @property
    def weights_dtype(self) -> torch.dtype:
        return self._weights.dtype

    # ---------------------------------------------------------------- requests
    def _validate(self, request_id: str, input_ids: list[int], sampling: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        if not input_ids:
            raise ValueError(f"generate({request_id}): input_ids is empty")
        bad = [t for t in input_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"generate({request_id}): input_ids has ids outside [0, {vocab}): {bad[:5]}")
        if sampling.max_tokens < 1:
            raise ValueError(f"generate({request_id}): max_tokens must be ≥ 1, got {sampling.max_tokens}")
        if sampling.temperature < 0 or not 0 < sampling.top_p <= 1:
            raise ValueError(f"generate({request_id}): temperature {sampling.temperature} / top_p {sampling.top_p} out of range")
        if any(not s for s in sampling.stop_sequences):
            raise ValueError(f"generate({request_id}): empty stop sequence")
        if len(input_ids) >= self.config.max_model_len:
            raise ValueError(f"generate({request_id}): prompt of {len(input_ids)} tokens reaches max_model_len {self.config.max_model_len}")
        if request_id in self._requests:
            raise ValueError(f"generate: request id {request_id!r} is already in flight")

    async def generate(self, request_id: str, input_ids: list[int], sampling: SamplingParams) -> AsyncIterator[TokenEvent]:
        """Stream the sampled tokens of one request (see module docstring for the log-probs)."""
        if self.state is not EngineState.RUNNING:
            raise RuntimeError(f"CpuEngine.generate({request_id}): engine is {self.state.value}")
        if self._torn is not None and not self._step_lock.locked():
            raise RuntimeError(f"CpuEngine.generate({request_id}): the update to version {self._torn} failed between "
                               f"buckets; the weights are torn until a complete update lands")
        self._validate(request_id, input_ids, sampling)
        req = self._adopt(request_id, input_ids, sampling)  # a migrated-in request continues
        if req is None:
            gen = torch.Generator()
            if sampling.seed is None:
                gen.seed()
            else:
                gen.manual_seed(int(sampling.seed))
            req = _Request(request_id, [int(t) for t in input_ids], sampling, gen, asyncio.Queue())
        self._requests[request_id] = req
        self._waiting.append(req)
        self._wake.set()
        try:
            while True:
                item = await req.queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if req.finish is None:  # the consumer went away: stop computing for it
                self._finish(req, "abort")
            self._requests.pop(request_id, None)

    async def abort(self, request_id: str) -> list[TokenEvent]:
        """Stop the request now; return every token it produced (yielded or still queued).

        Runs on the event loop between the loop's result applications, so a step in flight for
        this request has its token discarded, never half-applied."""
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"abort: no request {request_id!r} in flight")
        if req.finish is None:
            self._finish(req, "abort")
        return list(req.out)

    def _finish(self, req: _Request, reason: str) -> None:
        req.finish = reason
        if req in self._running:
            self._running.remove(req)
        if req in self._waiting:
            self._waiting.remove(req)
        req.cache = None
        req.queue.put_nowait(None)

    # ---------------------------------------------------------------- the loop
    def _admit(self) -> None:
        budget = self.config.max_prefill_tokens
        while self._waiting and len(self._running) < self.config.max_batch:
            req = self._waiting[0]
            if len(req.prompt) > budget and budget < self.config.max_prefill_tokens:
                break  # admit at least one per step, however long its prompt
            budget -= len(req.prompt)
            self._running.append(self._waiting.pop(0))

    async def _loop(self) -> None:
        try:
            await self._steps()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # never leave streams hanging on a dead loop
            logger.exception("engine loop died")
            for req in list(self._running) + list(self._waiting):
                req.queue.put_nowait(RuntimeError(f"engine loop died: {exc!r}"))
                self._finish(req, "error")
            raise

    async def _steps(self) -> None:
        while True:
            if self.state is not EngineState.RUNNING or self._torn is not None or not (self._running or self._waiting):
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._step_lock:
                if self.state is not EngineState.RUNNING or self._torn is not None:
                    continue
                self._admit()
                batch = list(self._running)
                if not batch:  # everything was aborted while we waited for the lock
                    continue
                weights, version = self._weights, self.version
                feeds = []
                for req in batch:
                    seq = req.sequence()
                    if req.cache is None:
                        req.cache = KVCache.empty(weights, len(seq) + min(req.sampling.max_tokens, 256))
                    feeds.append((seq[req.fed:], req.fed))
                try:
                    caches = [req.cache for req in batch]  # captured here: an abort clears req.cache
                    t0 = time.perf_counter()
                    results = await asyncio.to_thread(self._compute, weights, batch, caches, feeds)
                    await self._pace(time.perf_counter() - t0)
                except Exception as exc:  # a failed step fails its requests, not the engine
                    logger.exception("engine step failed for %d requests", len(batch))
                    for req in batch:
                        if req.finish is None:
                            req.queue.put_nowait(RuntimeError(f"engine step failed: {exc!r}"))
                            self._finish(req, "error")
                    continue
                self.steps += 1
                for req, (feed, _), (tok, lp, top) in zip(batch, feeds, results):
                    if req.finish is not None:  # aborted while the step ran: discard
                        continue
                    req.fed += len(feed)
                    self._emit(req, TokenEvent(tok, lp, version, top=top))
            await asyncio.sleep(0)  # let aborts / updates / new requests in between steps

    async def _pace(self, compute_s: float) -> None:
        """Emulated accelerator: hold the step to min_decode_step_s (nothing when it is 0)."""
        floor = self.config.min_decode_step_s
        if floor <= 0:
            return
        rest = floor - compute_s
        if rest <= 0:
            self.slow_steps += 1
            if self.slow_steps == 1 or self.slow_steps % 100 == 0:
                logger.warning("engine step computed in %.3fs, over min_decode_step_s %.3fs (%d such steps): "
                               "the emulated accelerator is slower than asked", compute_s, floor, self.slow_steps)
            return
        self.paced_s += rest
        await asyncio.sleep(rest)

    def _compute(self, weights: DecoderWeights, batch: list[_Request], caches: list[KVCache], feeds) -> list[tuple[int, float, list | None]]:
        """Worker thread: one fused forward, then one sample (and top-k, if asked) per request."""
        ids = torch.tensor([t for f, _ in feeds for t in f], dtype=torch.long)
        pos = torch.cat([torch.arange(start, start + len(f)) for f, start in feeds])
        with torch.no_grad():
            logits = extend(weights, ids, pos, [len(f) for f, _ in feeds], caches).cpu()  # [B, V]: sampled on CPU
        out = []
        for req, row in zip(batch, logits):
            sp = req.sampling
            early = [*sp.stop_token_ids, *self.eos_token_ids] if len(req.out) < sp.min_tokens else []
            banned = [*early, *self._padded_ids] or None  # padded rows: out of the sampled distribution only
            tok, policy_lp, sampling_lp = sample_token(row, temperature=sp.temperature, top_p=sp.top_p, generator=req.generator,
                                                       banned=banned)
            top = None
            if sp.top_logprobs > 0:  # the same distribution the reported log-prob comes from
                if self.config.logprobs == "policy":
                    dist = torch.log_softmax(row.float(), dim=-1)
                    dist[self.sampleable_vocab:] = float("-inf")  # a padded row is no candidate
                else:
                    dist = sampling_logprobs(row, temperature=sp.temperature, top_p=sp.top_p, banned=banned)
                top = top_logprobs(dist, sp.top_logprobs)
            out.append((tok, policy_lp if self.config.logprobs == "policy" else sampling_lp, top))
        return out

    def _emit(self, req: _Request, ev: TokenEvent) -> None:
        req.out.append(ev)
        self.tokens_generated += 1
        sp = req.sampling
        ids = [e.token_id for e in req.out]
        reason = None
        if ev.token_id in sp.stop_token_ids or ev.token_id in self.eos_token_ids:
            reason = "stop"
        elif any(len(s) <= len(ids) and ids[-len(s):] == list(s) for s in sp.stop_sequences):
            reason = "stop"
        elif len(ids) >= sp.max_tokens or len(req.prompt) + len(ids) >= self.config.max_model_len:
            reason = "length"
        if reason is not None:
            ev.finish_reason = reason
        req.queue.put_nowait(ev)
        if reason is not None:
            self._finish(req, reason)

    # ---------------------------------------------------------------- KV migration (gyre.backends.transfer.migration)
    def attach_kv_transport(self, transport: KvTransport, *, measure_prefill: bool = False) -> None:
        """Enable migration: held exports are served over `transport`, imports pulled with it.
        `measure_prefill`: time a 512-token prefill now (the cost rule's recompute rate)."""
        self._tickets = Tickets(transport)
        if measure_prefill:
            self.prefill_tok_s = self._prefill_rate(512)
            logger.info("engine %s: prefill %.0f tokens/s (for the migration cost rule)", self.name, self.prefill_tok_s)

    @property
    def supports_migration(self) -> bool:
        return self._tickets is not None

    def _model_signature(self) -> dict:
        w = self._weights
        return {"num_layers": w.num_layers, "num_kv_heads": w.num_kv_heads, "head_dim": w.head_dim,
                "dtype": str(w.dtype).removeprefix("torch.")}

    def kv_bytes_per_token(self) -> int:
        w = self._weights
        return 2 * w.num_layers * w.num_kv_heads * w.head_dim * w.tensors["model.embed_tokens.weight"].element_size()

    async def migration_info(self) -> dict:
        return {"kv_bytes_per_token": self.kv_bytes_per_token(), "prefill_tok_s": getattr(self, "prefill_tok_s", None),
                "transport": self._tickets.transport.name if self._tickets is not None else None}

    async def export_request(self, request_id: str) -> RequestState:
        """Stop a running request between decode steps and return its state; its stream ends
        as on abort. The KV tensors in the state are views of the request's cache (on the cache's
        own device), kept alive by the state alone. Refuses (MigrationRefused, request untouched)
        a request that has no complete cache yet (waiting, or caches dropped by a weight update).

        Exactness: the importer continues bit for bit what this engine would have computed, as
        long as the batch it decodes in has the same composition (row results of a batched matmul
        depend on the batch size, on any engine)."""
        async with self._step_lock:  # no step in flight: fed / out / cache agree
            req = self._requests.get(request_id)
            if req is None:
                raise KeyError(f"export_request: no request {request_id!r} in flight")
            cache = req.cache
            if (req.finish is not None or req not in self._running or cache is None or not req.out
                    or cache.length != len(req.prompt) + len(req.out) - 1):
                raise MigrationRefused(f"export_request({request_id}): nothing to move yet (waiting, finished, "
                                       f"or its cache was dropped)")
            n = cache.length
            state = RequestState(prompt=list(req.prompt), events=list(req.out), sampling=req.sampling,
                                 kv_k=[k[:, :n] for k in cache.k], kv_v=[v[:, :n] for v in cache.v], kv_length=n,
                                 kv_version=self.version, rng_state=req.generator.get_state(),
                                 rng_device=str(req.generator.device), model=self._model_signature())
            self._finish(req, "abort")
        return state

    def import_request(self, request_id: str, state: RequestState) -> None:
        """Park `state` under `request_id`; the next `generate(request_id, state.sequence(), ...)`
        continues it instead of prefilling. Raises MigrationRefused when it cannot continue here."""
        if self.state is not EngineState.RUNNING:
            raise MigrationRefused(f"import_request({request_id}): engine is {self.state.value}")
        if state.model != self._model_signature():
            raise MigrationRefused(f"import_request({request_id}): KV of model {state.model}, this engine serves {self._model_signature()}")
        if state.kv_version != self.version and self.config.recompute_kv_on_update:
            raise MigrationRefused(f"import_request({request_id}): KV of version {state.kv_version}, engine at {self.version}")
        total = len(state.prompt) + len(state.events)
        if state.kv_length != total - 1 or total >= self.config.max_model_len:
            raise MigrationRefused(f"import_request({request_id}): {state.kv_length} cached of {total} tokens "
                                   f"(max_model_len {self.config.max_model_len})")
        if request_id in self._requests or request_id in self._parked:
            raise MigrationRefused(f"import_request: request id {request_id!r} already here")
        now = time.monotonic()
        for rid in [r for r, p in self._parked.items() if now - p[3] > 600]:  # never adopted: the router went away
            logger.warning("engine: dropping migrated request %s never continued", rid)
            del self._parked[rid]
        left = max(1, state.sampling.max_tokens - len(state.events))
        cache = KVCache.empty(self._weights, total + min(left, 256))
        for dst, src in zip(cache.k + cache.v, state.kv_k + state.kv_v):
            dst[:, : state.kv_length].copy_(src)  # to the cache's own device
        cache.length = state.kv_length
        gen = torch.Generator(device=state.rng_device)
        gen.set_state(state.rng_state.to("cpu"))
        self._parked[request_id] = (state, cache, gen, now)

    def _adopt(self, request_id: str, input_ids: list[int], sampling: SamplingParams) -> _Request | None:
        parked = self._parked.pop(request_id, None)
        if parked is None:
            return None
        state, cache, gen, _ = parked
        if [int(t) for t in input_ids] != state.sequence():
            logger.warning("generate(%s): input differs from the migrated request's tokens; recomputing", request_id)
            return None
        return _Request(request_id, state.sequence(), sampling, gen, asyncio.Queue(), cache=cache, fed=cache.length)

    async def migrate_out(self, request_id: str) -> tuple[list[TokenEvent], dict | None]:
        """Two-phase, source side: stop the request, hold its packed state on the KV transport.
        Returns (every event generated, handle for the target; None when packing failed, then the
        caller recomputes). Raises MigrationRefused/KeyError with the request untouched."""
        if self._tickets is None:
            raise MigrationRefused(f"engine {self.name}: no KV transport attached")
        state = await self.export_request(request_id)
        try:
            buf = await asyncio.to_thread(pack_state, state)
            return state.events, self._tickets.hold(request_id, buf)
        except Exception as e:  # the request is already stopped: hand back its tokens anyway
            logger.warning("engine %s: packing %s for migration failed: %r", self.name, request_id, e)
            return state.events, None

    async def migrate_in(self, request_id: str, handle: dict) -> int:
        """Two-phase, target side: pull the held state, park it under `request_id`; the ack is
        this returning (bytes moved). Raises on refusal or transport failure."""
        if self._tickets is None:
            raise MigrationRefused(f"engine {self.name}: no KV transport attached")
        if handle.get("transport") != self._tickets.transport.name:
            raise MigrationRefused(f"engine {self.name}: handle for transport {handle.get('transport')!r}, "
                                   f"this engine uses {self._tickets.transport.name!r}")
        buf = await asyncio.to_thread(self._tickets.transport.pull, handle)
        state = await asyncio.to_thread(unpack_state, buf)
        self.import_request(request_id, state)
        return int(buf.numel())

    async def migrate_release(self, key: str) -> bool:
        """Two-phase, source side: drop a held state (after the target's ack, or a failure)."""
        return self._tickets.release(key) if self._tickets is not None else False

    def held_migrations(self) -> int:
        return len(self._tickets.tickets) if self._tickets is not None else 0

    def _prefill_rate(self, tokens: int) -> float:
        """Prefill throughput (tokens/s) of one `tokens`-long prompt on the current weights."""
        w = self._weights
        ids = torch.randint(0, self.model_config.vocab_size, (tokens,))
        cache = KVCache.empty(w, tokens)
        t0 = time.perf_counter()
        with torch.no_grad():
            extend(w, ids, torch.arange(tokens), [tokens], [cache])
        return tokens / max(time.perf_counter() - t0, 1e-9)
