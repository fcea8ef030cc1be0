"""Conformance fake of SGLang 0.5.23's tokenizer-manager / scheduler boundary, for CPU tests.
(Over 600 lines: one fake per SGLang boundary the adapter crosses — tokenizer manager, scheduler, engine, weight group — each behaviour next to the source lines it copies.)

`gyre.backends.engines.sglang_engine.SglangEngine` drives it exactly as it drives `sglang.Engine`
(`API = SglangApi(FakeEngine, io_struct, serialize, frozenset(SERVER_ARGS))`). It generates real tokens and log-probs
with Gyre's CPU decoder over the checkpoint at `model_path`, and holds the adapter to the
semantics read in the sglang 0.5.23 wheel (`pip download --no-deps sglang==0.5.23`; paths under
sglang/srt/, lines of that wheel):

  weight-update session   an update outside begin/end fails with SGLang's message; begin twice,
                          end without begin fail (scheduler_components/weight_updater.py:187-197,
                          232-239, 309-335)
  bucketed updates        any number of update_weights_from_tensor / _from_distributed calls in a
                          session, each loaded at once; weight_version None keeps the served
                          version (scheduler.py:5636-5638); the bytes an update holds are counted
                          (UPDATE_BYTES)
  unknown names           an update's name with no parameter is skipped with SGLang's warning
                          (Qwen3/Qwen2/Llama) or silently (Qwen3-MoE) (`_skip_unknown`)
  check_weights           snapshot / reset_tensors / compare / checksum over every parameter
                          (utils/weight_checker.py, `FakeWeightChecker`); compare raises "check
                          tensor equality failed:\n name=... max_abs_err=..." per differing
                          tensor, answered success=False with that message (weight_updater.py:
                          424-456); the TM answers (success, message, ranks, checksum)
                          (tokenizer_control_mixin.py:890-909)
  get_weights_by_name     Llama answers the first truncate_size rows as float32 lists; Qwen2/
                          Qwen3/Qwen3-MoE answer None (no such method in 0.5.23's classes)
  flush after an update   fails the update while requests run and the engine is not paused
                          (weight_updater.py:120-131, scheduler.py:5518-5545)
  release idle assertion  release_memory_occupation asserts `is_fully_idle(ignore_waiting=paused)`
                          (weight_updater.py:337-341, scheduler.py:5337-5370): last_batch still
                          holds a request that finished in the step before. A failed assert
                          kills the scheduler (`SchedulerCrash`, below)
  scheduler death         any exception in the scheduler's loop (run_scheduler_process,
                          scheduler.py:6370-6379): "Scheduler hit an exception: <traceback>" is
                          logged and SIGQUIT sent to its parent, the rank (scheduler.py:6343,
                          6373); nothing answers the TM again (its awaits and streams hang). The
                          fake's scheduler is a task in the rank, so the signal goes to this pid.
                          `FakeEngine.crash_on` names a control request whose handling kills it
                          (an OOM on resume, a kernel error)
  aborts                  rids match by prefix (scheduler.py:5675-5813); a waiting request is
                          dropped with an abort output, a running one gets `to_finish` and runs
                          one more decode step whose token is in its finishing chunk
                          (schedule_batch.py:2011-2013); the TM dedups `abort_sent` and drops a
                          request's state when its finishing output arrives
                          (tokenizer_manager.py:2241-2265, 2774)
  pause / continue        retract: running requests go back to the queue and recompute their KV
                          (scheduler.py:5817-5932); generate registers its rid_to_state
                          entry first, then waits while paused (tokenizer_manager.py:926,
                          938-939): an abort in between is sent unmatched and deduplicates
                          every later one (:2241-2265), so the request runs on after continue
                          (scheduler.py:5934); dispatch marks the state `dispatched` (:1790)
  context length          the TM refuses (ValueError, before dispatch) a prompt at or over
                          context_len and prompt + max_new_tokens over it (tokenizer_manager.py:
                          1332-1378); the scheduler caps max_new_tokens to context_len - 2 -
                          prompt and aborts prompts of context_len - 6 or more (scheduler.py:
                          2693-2716, 3244-3254; tp_worker.py:568-572)
  streaming               one chunk per wake-up, the newest (tokenizer_manager.py:1993);
                          meta_info['output_token_logprobs'] is the request's cumulative list of
                          (logprob, id, None) with 'output_token_logprobs_length'
                          (tokenizer_manager.py:2859-2870)
  weight_version          meta_info['weight_version'] is the TM's current version when the chunk
                          arrives (tokenizer_manager.py:2511); the finishing chunk has the exact
                          per-token spans (scheduler.py:5636-5652, utils/weight_versions.py,
                          output_streamer.py:541-549); an update's weight_version becomes current
                          (tokenizer_control_mixin.py:592-593)
  log-probs               with SGLANG_RETURN_ORIGINAL_LOGPROB=1, log-softmax of the logits after
                          penalizers (the min_new_tokens stop mask) and before temperature
                          (layers/sampler.py:82, 230-236; model_runner.py:2093)
  sampling_seed           honoured only with enable_deterministic_inference
                          (sampling/sampling_batch_info.py:157-170)
  Engine side effects     configure_logger's basicConfig(force=True) (engine.py:1152); the
                          scheduler inherits TORCHELASTIC_USE_AGENT_STORE and would hang
                          (raises here); shutdown() kills every child of the process
                          (engine.py:1491) and is registered with atexit (engine.py:326); with
                          `spawn_scheduler_process`, a child process stands for the scheduler and
                          the TM's subprocess watchdog SIGQUITs this process if it dies while the
                          watchdog runs (utils/watchdog.py:166-225), and multiprocessing's shared
                          resource tracker is started as spawn does; the first Engine() sets a
                          process-wide event-loop policy (`FakeUvloopPolicy`, engine.py:168)
  init_weights_update_group  joins as rank rank_offset with SGLang's `init_custom_process_group`
                          (utils/common.py:2859-2927, model_runner_components/weight_updater.py:
                          100-144; exec'd from GYRE_SGLANG_SRC when set, else rewritten): tcp://
                          rendezvous, PrefixStore(group_name), torch's _new_process_group_helper
                          (two more prefixes); receives one broadcast(src=0) per name
                          (weight_updater.py:260-298); gloo on CPU

  KV pool sizing           from the device's free memory before and after the weights load, at
                          mem_fraction_static (`size_kv_pool`: bootstrap.py:193-223,
                          kv_cache_configurator.py:2990-3060, pool_configurator.py:492-498,
                          637-647); max_total_num_tokens is reported as the scheduler's init info
                          (scheduler.py:1937-1948, engine.py:345) and bounds max_req_input_len
                          (tp_worker.py:568-572). The device is `FakeGpu`: a test puts what else
                          is resident there (an actor) and reads what the engine saw (`FakeEngine.kv`)

Request classes: sglang.srt.managers.io_struct cannot be imported on a CPU machine (it imports
schedule_batch, and sglang/__init__ imports srt.utils.common, which imports triton and CUDA
kernel packages), so the classes below copy the fields of io_struct.py:1927-2208, 2285
(`test_fake_request_fields_match_sglang_source` compares them with an unpacked wheel when
GYRE_SGLANG_SRC names one). Not modelled: TP > 1, the model_update_lock as a lock (an update
while not paused with requests running fails after 2 s instead of waiting), the mode="abort"
pause, ZMQ transit delays between the scheduler's two sockets (`chunk_delay_steps` delays
token outputs to model them), CUDA memory beyond the KV pool's sizing at start (release and resume
hand nothing back to `FakeGpu`; CUDA graphs and workspaces take nothing).
"""

from __future__ import annotations

import asyncio
import atexit
import glob
import logging
import math
import os
import pickle
import signal
import subprocess
import sys
import types
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from gyre.backends.engines.decoder import DecoderWeights, KVCache, extend
from gyre.backends.engines.sglang_engine import SglangApi
from gyre.backends.transfer.buckets import HeldBytes


# ----------------------------------------------------------------------------- io_struct copies
@dataclass(kw_only=True)
class PauseGenerationReqInput:
    mode: str = "abort"  # io_struct.py:1946: "abort" | "retract" | "in_place"


@dataclass(kw_only=True)
class ContinueGenerationReqInput:
    torch_empty_cache: bool = True  # io_struct.py:1955


@dataclass(kw_only=True)
class BeginWeightUpdateReqInput:
    selector: str = "all"  # io_struct.py:2200


@dataclass(kw_only=True)
class EndWeightUpdateReqInput:  # io_struct.py:2208
    pass


@dataclass(kw_only=True)
class UpdateWeightsFromTensorReqInput:  # io_struct.py:2027-2047
    serialized_named_tensors: list
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: str = "all"
    torch_empty_cache: bool = False


@dataclass(kw_only=True)
class UpdateWeightsFromDistributedReqInput:  # io_struct.py:2002-2019
    names: list
    dtypes: list
    shapes: list
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: str = "all"
    torch_empty_cache: bool = False


@dataclass(kw_only=True)
class InitWeightsUpdateGroupReqInput:  # io_struct.py:2126-2138
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


@dataclass(kw_only=True)
class GetWeightsByNameReqInput:  # io_struct.py:2166-2168
    name: str
    truncate_size: int = 100


@dataclass(kw_only=True)
class ReleaseMemoryOccupationReqInput:
    tags: list | None = None  # io_struct.py:2180


@dataclass(kw_only=True)
class ResumeMemoryOccupationReqInput:
    tags: list | None = None  # io_struct.py:2190


@dataclass(kw_only=True)
class CheckWeightsReqInput:  # io_struct.py:2217-2223
    action: str = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: list | None = None
    selector: str = "all"


@dataclass(kw_only=True)
class CheckWeightsReqOutput:  # io_struct.py:2249-2254 (payload: one ChecksumInfo per TP rank, or None)
    success: bool
    message: str
    payload: list | None = None


@dataclass(kw_only=True)
class AbortReq:  # io_struct.py:2285-2291 (rid from BaseReq, io_struct.py:89)
    rid: str | None = None
    abort_all: bool = False
    finished_reason: dict | None = None
    abort_message: str | None = None
    weight_versions: list | None = None


io_struct = types.SimpleNamespace(**{c.__name__: c for c in (
    PauseGenerationReqInput, ContinueGenerationReqInput, BeginWeightUpdateReqInput, EndWeightUpdateReqInput,
    UpdateWeightsFromTensorReqInput, UpdateWeightsFromDistributedReqInput, InitWeightsUpdateGroupReqInput,
    ReleaseMemoryOccupationReqInput, ResumeMemoryOccupationReqInput, AbortReq, GetWeightsByNameReqInput,
    CheckWeightsReqInput)})

# Update memory: the bytes of the tensors a weight update holds at once, and the peak since reset().
# Tensor path: what the adapter hands `serialize` stands for its copies on the rank's GPUs (the real
# MultiprocessingSerializer pickles CUDA IPC handles of them, and the scheduler maps that memory,
# tp_worker.py:193-201, weight_updater.py:444-447, no copy), held until the adapter drops them.
# Distributed path: the tensors a call receives (weight_updater.py:276-298 allocates one per name
# before loading any). Per GPU: divide by tp_size (every rank gets its own full copy).
UPDATE_BYTES = HeldBytes()


def serialize(named_tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """MultiprocessingSerializer.serialize stand-in (SGLang pickles CUDA IPC handles). Each tensor is
    counted in UPDATE_BYTES until the caller frees it (as its GPU memory would be)."""
    for _, v in named_tensors:
        n = v.numel() * v.element_size()
        UPDATE_BYTES.add(n)
        weakref.finalize(v, UPDATE_BYTES.sub, n)
    return pickle.dumps([(k, v.detach().cpu()) for k, v in named_tensors])


# ServerArgs fields the fake accepts: a subset of sglang 0.5.23's (a msgspec Struct assembled from
# the classes of arg_groups/fields/*.py, server_args.py:231; file:line of each below). Any other
# keyword is a TypeError, as for the real Struct (Engine(**kwargs) → ServerArgs(**kwargs),
# entrypoints/engine.py:295). `test_fake_server_args_are_sglangs` checks every name against the
# wheel when GYRE_SGLANG_SRC names one. (0.5.23 has no `cuda_graph_max_bs`: it is
# cuda_graph_max_bs_decode / _prefill, exec_.py:629-632.)
SERVER_ARGS = {
    "model_path",  # model.py:51
    "load_format",  # model.py:58
    "context_length",  # model.py:110
    "dtype",  # model.py:160
    "tp_size",  # parallel.py:45
    "mem_fraction_static", "max_running_requests", "chunked_prefill_size",  # schedule.py:27, 31, 52
    "base_gpu_id", "gpu_id_step", "random_seed",  # device.py:28, 32, 47
    "skip_tokenizer_init", "host", "weight_version",  # serving.py:58, 65, 172
    "log_level",  # observability.py:31
    "enable_memory_saver", "enable_custom_logit_processor", "attention_backend", "sampling_backend",  # exec_.py:58, 70, 207, 258
    "cuda_graph_max_bs_decode", "cuda_graph_max_bs_prefill", "disable_cuda_graph",  # exec_.py:629, 632, 670
    "enable_torch_compile", "enable_deterministic_inference",  # exec_.py:691, 1153
}

# The architectures the fake serves: sglang 0.5.23's ModelRegistry keys (EntryClass names) of the
# four families Gyre supports: models/qwen2.py:797, qwen3.py:808, qwen3_moe.py:1298, llama.py:968
# (LlamaForCausalLM is one entry of that list). SGLang resolves architectures[0] in its registry
# (models/registry.py:93-114) and falls back to its Transformers backend for an unknown name
# (model_loader/utils.py:219-220); the fake refuses unknown names instead (Gyre never relies on
# the fallback).
ARCHITECTURES = {"Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM"}

# Attention backends that take float16/bfloat16 only. With attention_backend unset SGLang picks fa3
# for MHA models on Hopper (arg_groups/model_override_base.py:305-311): the fake stands for an
# H200. triton / torch_native are accepted with float32 (tests/gpu/sglang_check.py --dtype float32
# --attention-backend triton); whether sgl-kernel's RMSNorm (layers/layernorm.py:628, 631: called whatever the
# dtype) accepts float32 there is for the GPU check to show.
HALF_ONLY_ATTENTION = {None, "fa3", "flashinfer", "trtllm_mha", "fa4"}

# configs/model_config.py:2274-2280
_STR_DTYPE_TO_TORCH_DTYPE = {"half": torch.float16, "float16": torch.float16, "float": torch.float32,
                             "float32": torch.float32, "bfloat16": torch.bfloat16}


def model_config_checks(config: Any, dtype: str, attention_backend: str | None) -> torch.dtype:
    """What sglang 0.5.23's ModelConfig and model loader check at Engine() (in its scheduler
    process; a failure there fails the start). Returns the served dtype.

    * `is_generation_model(architectures)` (configs/model_config.py:801-803, 2360-2366) evaluates
      `"LlamaEmbeddingModel" in architectures`: with no `architectures` in config.json that is
      `in None`, a TypeError (the same expression is evaluated here).
    * `_get_and_verify_dtype(hf_text_config, dtype)` (model_config.py:881, 2284-2340): the config's
      `dtype` (a str maps through _STR_DTYPE_TO_TORCH_DTYPE; missing → float32); "auto" serves it,
      except float32, which is served as float16 (gemma: bfloat16); another name not in the table
      is ValueError("Unknown dtype: ...").
    * the model class: architectures[0] in the registry (see ARCHITECTURES).
    * float32 with the Hopper default attention (see HALF_ONLY_ATTENTION) fails in the kernels."""
    archs = getattr(config, "architectures", None)
    "LlamaEmbeddingModel" in archs  # noqa: B015 — TypeError for None, as model_config.py:2366
    config_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = _STR_DTYPE_TO_TORCH_DTYPE.get(config_dtype)
    if config_dtype is None:
        config_dtype = torch.float32
    name = str(dtype).lower()
    if name == "auto":
        served = (torch.bfloat16 if str(getattr(config, "model_type", "")).startswith("gemma") else torch.float16) \
            if config_dtype == torch.float32 else config_dtype
    elif name in _STR_DTYPE_TO_TORCH_DTYPE:
        served = _STR_DTYPE_TO_TORCH_DTYPE[name]
    else:
        raise ValueError(f"Unknown dtype: {name}")
    if not archs or archs[0] not in ARCHITECTURES:
        raise ValueError(f"fake sglang: architecture {archs[0] if archs else None!r} is not one the fake serves "
                         f"({sorted(ARCHITECTURES)}); SGLang would try its Transformers backend")
    if served == torch.float32 and attention_backend in HALF_ONLY_ATTENTION:
        raise RuntimeError(f"fake sglang: float32 with attention backend {attention_backend or 'fa3 (the Hopper default)'}: "
                           f"its kernels take float16/bfloat16 only; the scheduler fails at start (SGLang: "
                           f"arg_groups/model_override_base.py:305-311; pass attention_backend='triton' to serve float32)")
    return served


class SchedulerCrash(AssertionError):
    """Raised inside the fake's scheduler: it dies as SGLang's does (`FakeScheduler._die`)."""


# ----------------------------------------------------------------------------- scheduler
@dataclass(eq=False)
class _SReq:
    rid: str
    input_ids: list[int]
    params: dict[str, Any]
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    cache: KVCache | None = None
    fed: int = 0
    to_finish: dict | None = None
    finished_reason: dict | None = None
    retraction_count: int = 0
    version_events: list[tuple[str, int]] = field(default_factory=list)  # (old version, #outputs then)


class FakeScheduler:
    """One decode step per loop iteration for every running request; control messages are
    handled at the top of an iteration (scheduler.py event_loop_normal: recv → process → batch)."""

    def __init__(self, engine: "FakeEngine"):
        self.engine = engine
        self.waiting: list[_SReq] = []
        self.running: list[_SReq] = []
        self.last_batch: list[_SReq] | None = None
        self.paused = False
        self.session: str | None = None
        self.released: set[str] = set()
        self.dead: BaseException | None = None
        self.groups: dict[str, Any] = {}
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.steps = 0
        self.pending_out: list[tuple[int, Any]] = []  # (deliver at step, output) for chunk_delay_steps

    # idle (scheduler.py:5337-5370)
    def is_fully_idle(self, ignore_waiting: bool = False) -> bool:
        idle = not self.running and not self.last_batch
        return idle and (ignore_waiting or not self.waiting)

    async def loop(self) -> None:
        while True:
            while not self.inbox.empty():
                self._process(*self.inbox.get_nowait())
            if self.dead is not None:
                return
            if not self.paused and (self.waiting or self.running) and "weights" not in self.released:
                self.last_batch = self._step()
                self.steps += 1
                await asyncio.sleep(self.engine.step_s)
            else:
                self.last_batch = None
                self._deliver(flush=True)
                msg = await self.inbox.get()
                self._process(*msg)

    def _process(self, msg: Any, fut: asyncio.Future | None) -> None:
        try:
            if type(msg).__name__ == self.engine.crash_on:
                raise SchedulerCrash(f"fake: the scheduler fails handling {type(msg).__name__} (FakeEngine.crash_on)")
            result = self._handle(msg)
        except SchedulerCrash as e:
            self._die(e)
            return
        except BaseException as e:  # noqa: BLE001 — handed to the caller
            if fut is not None and not fut.done():
                fut.set_exception(e)
            return
        if fut is not None and not fut.done():
            fut.set_result(result)

    def _die(self, e: SchedulerCrash) -> None:
        """run_scheduler_process's `except Exception` (sglang 0.5.23 managers/scheduler.py:6370-6379):
        log the traceback, SIGQUIT the parent process (`psutil.Process().parent()`, :6343; the
        send at :6373), and end. The scheduler's parent is the rank; this fake scheduler runs
        in the rank itself, so the signal goes to this pid. No reply ever reaches the TM: the
        awaiting coroutine, and every stream, hang (the loop returns on `dead`)."""
        import traceback

        self.dead = e
        logging.getLogger("sglang.srt.managers.scheduler").error(
            "Scheduler hit an exception: %s", "".join(traceback.format_exception(e)).rstrip())
        os.kill(os.getpid(), signal.SIGQUIT)

    def _handle(self, msg: Any) -> Any:
        if isinstance(msg, _SReq):
            self._admit(msg)
            return None
        handler = getattr(self, "_on_" + type(msg).__name__)
        return handler(msg)

    # -- requests
    def _admit(self, req: _SReq) -> None:
        """handle_generate_request: max_new_tokens capped to max_req_len - input - 1
        (init_req_max_new_tokens, scheduler.py:2693-2716), and a prompt of max_req_input_len tokens
        or more finished with an abort (validate_input_length, scheduler.py:3244-3254,
        managers/utils.py:259-287; no --allow-auto-truncate)."""
        eng, n = self.engine, len(req.input_ids)
        req.params["max_new_tokens"] = max(0, min(int(req.params.get("max_new_tokens", 1 << 30)), eng.max_req_len - n - 1))
        if n >= eng.max_req_input_len:
            req.finished_reason = {"type": "abort", "message": (
                f"Input length ({n} tokens) exceeds the maximum allowed length ({eng.max_req_input_len} tokens). "
                f"Use a shorter input or enable --allow-auto-truncate.")}
            self._emit(req, None)
            return
        self.waiting.append(req)

    def _on_AbortReq(self, m: AbortReq) -> None:  # scheduler.py:5675-5813
        for req in [r for r in self.waiting if m.abort_all or r.rid.startswith(m.rid)]:
            self.waiting.remove(req)
            req.finished_reason = {"type": "abort", "message": "Abort before prefill"}
            self._emit(req, None)
        for req in self.running + (self.last_batch or []):
            if req.finished_reason is None and (m.abort_all or req.rid.startswith(m.rid)):
                req.to_finish = {"type": "abort", "message": None}

    def _on_PauseGenerationReqInput(self, m: PauseGenerationReqInput) -> None:  # scheduler.py:5817-5932
        assert m.mode in ("in_place", "retract")
        self.paused = True
        if m.mode == "in_place":
            return
        retract = [r for r in self.running if r.finished_reason is None]
        self.last_batch = None
        for req in retract:  # KV freed; recomputed from input + output ids after continue
            req.cache, req.fed = None, 0
            req.retraction_count += 1
            self.waiting.append(req)
        self.running = []

    def _on_ContinueGenerationReqInput(self, m: ContinueGenerationReqInput) -> None:
        self.paused = False

    # -- weights (scheduler_components/weight_updater.py)
    def _on_BeginWeightUpdateReqInput(self, m: BeginWeightUpdateReqInput) -> tuple[bool, str]:
        if self.session is not None:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = m.selector
        return True, "Success"

    def _on_EndWeightUpdateReqInput(self, m: EndWeightUpdateReqInput) -> tuple[bool, str]:
        if self.session is None:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = None
        return True, "Success"

    def _load(self, named: list[tuple[str, torch.Tensor]], m: Any) -> tuple[bool, str]:
        eng = self.engine
        try:
            # SGLang keeps its parameters under checkpoint names (one tensor per MoE expert); the
            # fake's decoder holds transformers' in-memory (fused) ones, so compare in checkpoint form.
            held = _as_checkpoint(eng.weights.tensors, eng.model_config)
            state = {k: v.to(held[k].dtype) for k, v in named if k in held}
            _skip_unknown([k for k, _ in named if k not in held], eng.model_config)
            merged = {**held, **state}
            eng.weights = _weights(merged, eng.model_config)
        except (ValueError, KeyError) as e:
            return False, f"Failed to update weights: {e}"
        if m.weight_version is not None and m.weight_version != eng.weight_version:  # scheduler.py:5636-5652
            for req in self.running + self.waiting + (self.last_batch or []):
                if req.output_ids and req.finished_reason is None:
                    req.version_events.append((eng.weight_version, len(req.output_ids)))
            eng.weight_version = m.weight_version
        if m.flush_cache:
            if not self.is_fully_idle(ignore_waiting=self.paused):  # weight_updater.py:120-131
                return False, ("Weights were updated, but the cache was not flushed because requests are still "
                               "running or queued. Retract or finish them, then call /flush_cache.")
            for req in self.waiting:
                req.cache, req.fed = None, 0
        return True, "Success"

    def _on_UpdateWeightsFromTensorReqInput(self, m: UpdateWeightsFromTensorReqInput) -> tuple[bool, str]:
        if self.session is None:  # weight_updater.py:232-239
            return False, ("update_weights_from_tensor must run between begin_weight_update() and "
                           "end_weight_update()")
        if len(m.serialized_named_tensors) != self.engine.tp_size:
            return False, f"expected {self.engine.tp_size} serialized payloads (one per TP rank), got {len(m.serialized_named_tensors)}"
        return self._load(pickle.loads(m.serialized_named_tensors[0]), m)

    def _on_UpdateWeightsFromDistributedReqInput(self, m: UpdateWeightsFromDistributedReqInput) -> tuple[bool, str]:
        if self.session is None:  # weight_updater.py:187-197
            return False, ("update_weights_from_distributed must run between begin_weight_update() and "
                           "end_weight_update()")
        group = self.groups.get(m.group_name)
        if group is None:
            return False, f"Failed to receive weights: Group {m.group_name} not in {list(self.groups)}."
        named = []
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        got = 0
        try:
            for name, dtype, shape in zip(m.names, m.dtypes, m.shapes):  # weight_updater.py:280-298
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                UPDATE_BYTES.add(t.numel() * t.element_size())
                got += t.numel() * t.element_size()
                group.broadcast([t], opts).wait()
                named.append((name, t))
            return self._load(named, m)
        finally:
            UPDATE_BYTES.sub(got)  # the call's tensors go with it (loaded into the parameters)

    def _on_GetWeightsByNameReqInput(self, m: GetWeightsByNameReqInput) -> list | None:
        """weight_exporter.py:169-188 → the model class's get_weights_by_name. sglang 0.5.23 has
        one for LlamaForCausalLM (models/llama.py:819-890) and none for Qwen2/Qwen3/Qwen3-MoE: the
        AttributeError is caught and None answered (weight_exporter.py:186-188). Llama's: tied
        lm_head → embed_tokens (:828-837); a name it has no parameter for → KeyError, caught, None
        (:885-889); else `param.cpu().to(float32).numpy().tolist()[:truncate_size]` (:883), first
        rows of a 2-D parameter."""
        eng = self.engine
        if "LlamaForCausalLM" not in (getattr(eng.model_config, "architectures", None) or []):
            return None
        held = _as_checkpoint(eng.weights.tensors, eng.model_config)
        name = m.name
        if name == "lm_head.weight" and eng.model_config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        if name not in held:
            return None
        return held[name].cpu().to(torch.float32).numpy().tolist()[:m.truncate_size]

    def _on_CheckWeightsReqInput(self, m: CheckWeightsReqInput) -> CheckWeightsReqOutput:
        """weight_updater.py:424-456: the selected runners' WeightChecker.handle; any exception
        becomes success=False with str(e) as the message (:453-456), else "Success." and the
        checksum payload (None for the other actions). One TP rank, no draft runner."""
        try:
            roles = {"all": ["target"], "target": ["target"], "draft": []}.get(m.selector)
            if roles is None:  # _parse_runner_selector, weight_updater.py:71-78
                raise ValueError(f"invalid selector {m.selector!r}; expected 'target', 'draft', or 'all'")
            payloads = [self.engine.checker.handle(m.action, m.skip_tensor_list) for _ in roles]
            payload = [p for p in payloads if p is not None] or None
            return CheckWeightsReqOutput(success=True, message="Success.", payload=payload)
        except Exception as e:  # noqa: BLE001 — SGLang's own catch-all
            logging.getLogger("sglang.srt.managers.scheduler").warning(f"check_weights see error: {e}")
            return CheckWeightsReqOutput(success=False, message=f"{e}")

    def _on_InitWeightsUpdateGroupReqInput(self, m: InitWeightsUpdateGroupReqInput) -> tuple[bool, str]:
        raise AssertionError("handled in a thread by the tokenizer manager")

    def _on_ReleaseMemoryOccupationReqInput(self, m: ReleaseMemoryOccupationReqInput) -> None:
        if not self.is_fully_idle(ignore_waiting=self.paused):  # weight_updater.py:337-341
            raise SchedulerCrash(f"release_memory_occupation should be called only when server is idle. "
                                 f"(fake: running={[r.rid for r in self.running]}, "
                                 f"last_batch={[r.rid for r in self.last_batch or []]}, "
                                 f"waiting={[r.rid for r in self.waiting]}, paused={self.paused})")
        self.released = {"weights", "kv_cache", "cuda_graph"}
        for req in self.waiting:
            req.cache, req.fed = None, 0

    def _on_ResumeMemoryOccupationReqInput(self, m: ResumeMemoryOccupationReqInput) -> None:
        # Without enable_weights_cpu_backup the weights' memory comes back uninitialised.
        eng = self.engine
        g = torch.Generator().manual_seed(1234)
        eng.weights = _weights(
            {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in eng.weights.tensors.items()}, eng.model_config)
        self.released = set()

    # -- decode
    def _step(self) -> list[_SReq]:
        eng = self.engine
        self.running += self.waiting
        self.waiting = []
        batch = list(self.running)
        feeds = []
        if isinstance(eng.weights, _HfWeights):
            logits = [eng.weights.last_logits(req.input_ids + req.output_ids) for req in batch]
            feeds = [([], 0)] * len(batch)
        else:
            for req in batch:
                seq = req.input_ids + req.output_ids
                if req.cache is None:
                    req.cache, req.fed = KVCache.empty(eng.weights, len(seq) + req.params.get("max_new_tokens", 128) + 1), 0
                feeds.append((seq[req.fed:], req.fed))
            ids = torch.tensor([t for f, _ in feeds for t in f], dtype=torch.long)
            pos = torch.cat([torch.arange(s, s + len(f)) for f, s in feeds])
            with torch.no_grad():
                logits = extend(eng.weights, ids, pos, [len(f) for f, _ in feeds], [r.cache for r in batch])
        for req, (feed, _), row in zip(batch, feeds, logits):
            req.fed += len(feed)
            tok, lp, top = self._sample(req, row.float())
            req.output_ids.append(tok)
            self._check_finished(req, tok)
            self._emit(req, (tok, lp, top))
        self.running = [r for r in self.running if r.finished_reason is None]
        self._deliver()
        return batch

    def _sample(self, req: _SReq, logits: torch.Tensor) -> tuple[int, float, list | None]:
        p = req.params
        stop_ids = set(p.get("stop_token_ids") or []) | set(self.engine.eos_token_ids)
        if len(req.output_ids) < int(p.get("min_new_tokens") or 0):  # min_new_tokens penalizer
            logits = logits.clone()
            logits[list(stop_ids)] = float("-inf")
        bias = p.get("logit_bias")
        if bias:  # after the penalizers, before sampling and the reported log-probs
            # (sampling/sampling_batch_info.py:174-195, 440-441; model_runner.py:2085-2093)
            row = torch.zeros_like(logits)
            row[torch.tensor([int(k) for k in bias])] = torch.tensor([float(v) for v in bias.values()], dtype=row.dtype)
            logits = logits + row
        temperature, top_p = float(p.get("temperature", 1.0)), float(p.get("top_p", 1.0))
        original = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "0").lower() in ("1", "true")
        if temperature == 0:
            tok = int(torch.argmax(logits))
            dist = torch.log_softmax(logits, -1)
        else:
            probs = torch.softmax(logits / temperature, -1)
            sorted_p, order = probs.sort(descending=True)
            keep = (sorted_p.cumsum(0) - sorted_p) < top_p
            mask = torch.zeros_like(probs, dtype=torch.bool)
            mask[order[keep]] = True
            probs = torch.where(mask, probs, torch.zeros_like(probs))
            probs = probs / probs.sum()
            tok = int(torch.multinomial(probs, 1, generator=req.generator))
            dist = torch.log_softmax(logits, -1) if original else torch.log(probs)
        k = int(req.params.get("_top_logprobs_num") or 0)
        top = None
        if k:
            vals, idx = dist.topk(k)
            top = [(float(v), int(i), None) for v, i in zip(vals, idx)]
        return tok, float(dist[tok]), top

    def _check_finished(self, req: _SReq, tok: int) -> None:  # schedule_batch.py check_finished
        p = req.params
        if req.to_finish is not None:  # the aborted request's one extra decode step ends here
            req.finished_reason, req.to_finish = req.to_finish, None
        elif len(req.output_ids) >= int(p.get("min_new_tokens") or 0) and (
                tok in (p.get("stop_token_ids") or []) or tok in self.engine.eos_token_ids):
            req.finished_reason = {"type": "stop", "matched": tok}
        elif len(req.output_ids) >= int(p.get("max_new_tokens", 128)):
            req.finished_reason = {"type": "length", "length": len(req.output_ids)}

    def _emit(self, req: _SReq, token: tuple | None) -> None:
        spans = None
        if req.finished_reason is not None:  # utils/weight_versions.py compute_weight_version_spans
            spans = []
            for version, end in [*req.version_events, (self.engine.weight_version, len(req.output_ids))]:
                end = min(end, len(req.output_ids))
                if spans and end <= spans[-1]["end"]:
                    continue
                if spans and spans[-1]["version"] == version:
                    spans[-1]["end"] = end
                    continue
                spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
        out = (req.rid, token, req.finished_reason, len(req.output_ids), req.retraction_count, spans)
        self.pending_out.append((self.steps + self.engine.chunk_delay_steps, out))

    def _deliver(self, flush: bool = False) -> None:
        ready = [o for at, o in self.pending_out if flush or at <= self.steps]
        self.pending_out = [(at, o) for at, o in self.pending_out if not (flush or at <= self.steps)]
        for out in ready:
            self.engine.tokenizer_manager._handle_output(*out)


# ----------------------------------------------------------------------------- tokenizer manager
@dataclass(eq=False)
class _State:
    rid: str
    event: asyncio.Event
    top: bool
    out_list: list = field(default_factory=list)
    finished: bool = False
    dispatched: bool = False  # tokenizer_manager.py:281, set once sent (_mark_state_dispatched, :1790, 1802-1810)
    abort_sent: bool = False
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)


class FakeTokenizerManager:
    """The part of sglang's TokenizerManager (managers/tokenizer_manager.py,
    tokenizer_control_mixin.py) the adapter calls, over `FakeScheduler` in the same loop."""

    def __init__(self, engine: "FakeEngine"):
        self.engine = engine
        self.rid_to_state: dict[str, _State] = {}
        self.context_len = engine.context_len  # tokenizer_manager.py:600
        self.max_req_input_len = engine.max_req_input_len  # set from the scheduler's info (engine.py:1399)
        # compute_num_reserved_tokens() (tokenizer_manager.py:605): 0 unless speculative decoding
        # reserves draft slots; a test sets FakeEngine.num_reserved_tokens to model it.
        self.num_reserved_tokens = getattr(engine, "num_reserved_tokens", 0)
        self.is_pause = False
        self.scheduler: FakeScheduler | None = None
        self._task: asyncio.Task | None = None
        self._unpaused: asyncio.Event | None = None
        self.calls: list[str] = []  # control calls in order, for tests
        self._subprocess_watchdog: _Watchdog | None = None  # tokenizer_manager.py:726

    def auto_create_handle_loop(self) -> None:
        if self._task is None:
            self.scheduler = FakeScheduler(self.engine)
            self._unpaused = asyncio.Event()
            self._unpaused.set()
            self._task = asyncio.get_running_loop().create_task(self.scheduler.loop(), name="fake-sglang-scheduler")
        # A dead scheduler answers nothing: requests sent now wait forever (real SGLang: the ZMQ
        # send succeeds, no reply comes), unless the rank's SIGQUIT handler ends the wait.

    async def _call(self, msg: Any) -> Any:
        self.auto_create_handle_loop()
        self.calls.append(type(msg).__name__)
        fut = asyncio.get_running_loop().create_future()
        self.scheduler.inbox.put_nowait((msg, fut))
        try:
            result = await fut
        except BaseException as e:
            self._trace(msg, repr(e))
            raise
        self._trace(msg, result)
        return result

    def _trace(self, msg: Any, result: Any) -> None:
        """GYRE_FAKE_SGLANG_TRACE=file: one JSON line per control call (for the multi-rank test)."""
        path = os.environ.get("GYRE_FAKE_SGLANG_TRACE")
        if path:
            import json

            line = {"pid": os.getpid(), "engine": id(self.engine), "call": type(msg).__name__,
                    "weight_version": self.engine.weight_version, "result": result if result is None else str(result),
                    "released": sorted(self.scheduler.released), "paused": self.scheduler.paused}
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")

    def _send(self, msg: Any) -> None:
        self.auto_create_handle_loop()
        self.scheduler.inbox.put_nowait((msg, None))

    # -- generation (tokenizer_manager.py:890-967, 1096-1271, 1769-1810, 1936-2030)
    async def generate_request(self, input_ids: list[int], sampling_params: dict, rid: str, top_logprobs_num: int):
        """The state is registered *before* the pause is waited on (`_init_req_state`, :926, 3798-3848,
        then :938-939): an abort during a pause finds it, sends an AbortReq the scheduler cannot match
        (nothing queued has that rid, scheduler.py:5675-5813) and sets `abort_sent`, so the request,
        dispatched after `continue`, runs on and every later abort of it is deduplicated (:2249-2250).
        Validation (logit_bias, the context length) runs after the pause, before dispatch (:1271);
        any failure, or the consumer closing the stream, releases the state as :955-967 /
        3850-3868 do: undispatched → deleted, dispatched → abort_request."""
        self.auto_create_handle_loop()
        if rid in self.rid_to_state:  # tokenizer_manager.py:3834-3837
            raise ValueError(f"Duplicate request ID detected: {rid}")
        state = self.rid_to_state[rid] = _State(rid, asyncio.Event(), top=top_logprobs_num > 0)
        try:
            await self._unpaused.wait()  # tokenizer_manager.py:938-939
            eng = self.engine
            self._validate_one_request(input_ids, sampling_params)
            for token_id in sampling_params.get("logit_bias") or {}:  # SamplingParams.verify (tokenizer_manager.py:1567,
                if not 0 <= int(token_id) < eng.vocab_size:             # sampling/sampling_params.py:295-301)
                    raise ValueError(f"logit_bias must has keys in [0, {eng.vocab_size - 1}], got {token_id}.")
            min_new, max_new = int(sampling_params.get("min_new_tokens") or 0), sampling_params.get("max_new_tokens")
            if max_new is not None and not 0 <= min_new <= max_new:  # sampling_params.py:280-293
                raise ValueError(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.")
            gen = torch.Generator()
            seed = sampling_params.get("sampling_seed")
            if seed is not None and eng.enable_deterministic_inference:  # sampling_batch_info.py:157-170
                gen.manual_seed(int(seed))
            else:
                gen.seed()
            params = dict(sampling_params, _top_logprobs_num=top_logprobs_num)
            self.scheduler.inbox.put_nowait((_SReq(rid, list(input_ids), params, gen), None))
            state.dispatched = True  # _send_one_request → _mark_state_dispatched (:1789-1791)
            while True:
                await state.event.wait()
                out_list, state.out_list = state.out_list, []
                state.event.clear()
                if isinstance(out_list[-1], BaseException):
                    raise out_list[-1]
                yield out_list[-1]  # the newest chunk only (tokenizer_manager.py:1993)
                if state.finished:
                    return
        except BaseException:
            self._release_req_state_on_failure(rid, state)
            raise

    def _validate_one_request(self, input_ids: list[int], sampling_params: dict) -> None:
        """tokenizer_manager.py:1332-1378 with SGLang's defaults (allow_auto_truncate False,
        fields/serving.py:254-257; validate_total_tokens True, :606); the input counts the
        speculative reserve (:1335)."""
        n, max_new = len(input_ids) + self.num_reserved_tokens, sampling_params.get("max_new_tokens")
        if n >= self.context_len:
            raise ValueError(f"The input ({n} tokens) is longer than the model's context length ({self.context_len} tokens).")
        if max_new is not None and max_new + n > self.context_len:
            raise ValueError(f"Requested token count exceeds the model's maximum context length of {self.context_len} "
                             f"tokens. You requested a total of {max_new + n} tokens: {n} tokens from the input "
                             f"messages and {max_new} tokens for the completion. Please reduce the number of tokens "
                             f"in the input messages or the completion to fit within the limit.")

    def _release_req_state_on_failure(self, rid: str, state: _State) -> None:  # tokenizer_manager.py:3850-3868
        if self.rid_to_state.get(rid) is not state:
            return
        if state.dispatched:
            try:
                self.abort_request(rid)
            except Exception:  # noqa: BLE001 — logged and dropped there (:3863-3868)
                pass
        else:
            del self.rid_to_state[rid]

    def _handle_output(self, rid, token, finished_reason, completion_tokens, retractions, spans) -> None:
        state = self.rid_to_state.get(rid)
        if state is None:
            return  # "Received output for rid but the state was deleted"
        if token is not None:
            tok, lp, top = token
            state.output_token_logprobs.append((lp, tok, None))
            if state.top:
                state.output_top_logprobs.append(top)
        meta = {"id": rid, "finish_reason": finished_reason, "weight_version": self.engine.weight_version,
                "completion_tokens": completion_tokens, "num_retractions": retractions,
                "output_token_logprobs": state.output_token_logprobs,
                "output_token_logprobs_length": len(state.output_token_logprobs)}
        if state.top:
            meta["output_top_logprobs"] = state.output_top_logprobs
        if spans is not None:  # utils/weight_versions.py add_weight_versions_to_meta_info
            meta["weight_versions"] = spans
            meta["weight_version"] = spans[-1]["version"]
        state.finished = finished_reason is not None
        state.out_list.append({"meta_info": meta, "output_ids": None})
        state.event.set()
        if state.finished:
            del self.rid_to_state[rid]  # tokenizer_manager.py:2774

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:  # tokenizer_manager.py:2241-2265
        """Sent whether or not the request was dispatched yet (an undispatched one is not in the
        scheduler, which drops the AbortReq unmatched); `abort_sent` then silences every later abort."""
        if not abort_all and not rid:
            return
        state = None if abort_all else self.rid_to_state.get(rid)
        if not abort_all:
            if state is None:  # tokenizer_worker_num == 1 (:2252-2253)
                return
            if state.abort_sent:
                return
            state.abort_sent = True
        self.calls.append("AbortReq")
        self._send(AbortReq(rid=rid, abort_all=abort_all))

    # -- control (tokenizer_manager.py:2267-2290, tokenizer_control_mixin.py)
    async def pause_generation(self, obj: PauseGenerationReqInput) -> None:
        if obj.mode == "abort":
            raise NotImplementedError("the fake does not model pause_generation(mode='abort')")
        self.auto_create_handle_loop()
        self.is_pause = True
        self._unpaused.clear()
        await self._call(obj)

    async def continue_generation(self, obj: ContinueGenerationReqInput) -> None:
        self.auto_create_handle_loop()
        self.is_pause = False
        await self._call(obj)
        self._unpaused.set()

    async def _session_call(self, obj: Any) -> tuple[bool, str]:
        if not self.is_pause:  # takes the model_update_lock writer lock: waits for in-flight requests
            await self._wait_no_requests(type(obj).__name__)
        return await self._call(obj)

    async def _wait_no_requests(self, what: str) -> None:
        for _ in range(200):
            if not self.rid_to_state:
                return
            await asyncio.sleep(0.01)
        raise TimeoutError(f"fake sglang: {what} while not paused waits for the writer lock, i.e. for "
                           f"{len(self.rid_to_state)} in-flight requests to finish (tokenizer_control_mixin.py:503-525)")

    async def begin_weight_update(self, obj: BeginWeightUpdateReqInput, request=None) -> tuple[bool, str]:
        return await self._session_call(obj)

    async def end_weight_update(self, obj: EndWeightUpdateReqInput, request=None) -> tuple[bool, str]:
        return await self._session_call(obj)

    async def update_weights_from_tensor(self, obj: UpdateWeightsFromTensorReqInput, request=None) -> tuple[bool, str]:
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        return await self._session_call(obj)

    async def update_weights_from_distributed(self, obj: UpdateWeightsFromDistributedReqInput, request=None):
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        if not self.is_pause:
            await self._wait_no_requests("update_weights_from_distributed")
        self.auto_create_handle_loop()
        self.calls.append(type(obj).__name__)
        # The broadcast blocks the scheduler until the sender sends: run it off the loop.
        sched = self.scheduler
        fut = asyncio.get_running_loop().create_future()
        await asyncio.to_thread(sched._process, obj, _ThreadFuture(fut))
        return await fut

    async def init_weights_update_group(self, obj: InitWeightsUpdateGroupReqInput, request=None) -> tuple[bool, str]:
        self.auto_create_handle_loop()
        self.calls.append(type(obj).__name__)
        try:
            group = await asyncio.to_thread(_join_group, obj)
        except Exception as e:  # noqa: BLE001 — SGLang answers (False, message)
            return False, f"Failed to initialize custom process group: {e}."
        self.scheduler.groups[obj.group_name] = group
        return True, "Succeeded to initialize custom process group."

    async def get_weights_by_name(self, obj: GetWeightsByNameReqInput, request=None):
        # tokenizer_control_mixin.py:861-870: one DP rank → its answer itself
        return await self._call(obj)

    async def check_weights(self, obj: CheckWeightsReqInput, request=None) -> tuple:
        """tokenizer_control_mixin.py:890-909: (success, message, ranks, per_engine_checksum); the
        rank answers merged by FanOutCommunicator.merge_results (communicator.py:106-110: all
        successes, messages joined by " | "); ranks/checksum only when a payload came back."""
        import hashlib

        results = [await self._call(obj)]
        success, message = all(r.success for r in results), " | ".join(r.message for r in results)
        infos = [info for r in results if r.payload is not None for info in r.payload]
        if not infos:
            return success, message, None, None
        h = hashlib.sha256()
        for info in infos:
            h.update(info["per_gpu_checksum"].encode())
        return success, message, infos, h.hexdigest()

    async def release_memory_occupation(self, obj: ReleaseMemoryOccupationReqInput, request=None) -> None:
        await self._call(obj)

    async def resume_memory_occupation(self, obj: ResumeMemoryOccupationReqInput, request=None) -> None:
        await self._call(obj)


class _ThreadFuture:
    """Hands a result computed in a worker thread to an asyncio future."""

    def __init__(self, fut: asyncio.Future):
        self.fut, self.loop = fut, fut.get_loop()

    def done(self) -> bool:
        return False

    def set_result(self, r: Any) -> None:
        self.loop.call_soon_threadsafe(self.fut.set_result, r)

    def set_exception(self, e: BaseException) -> None:
        self.loop.call_soon_threadsafe(self.fut.set_exception, e)


JOIN_TIMEOUT_S = 60.0  # SGLang passes none (weight_updater.py:133-139): default_pg_timeout, 30 min; tests fail faster
JOINED_WITH: str | None = None  # how the last join ran: "sglang" (its own function) or "rewrite"
_JOINED: dict[str, Any] = {}  # groups fake engines of this process joined, by name


def _join_group(m: InitWeightsUpdateGroupReqInput) -> Any:
    """`init_weights_update_group` of the model runner (model_executor/model_runner_components/
    weight_updater.py:100-144) for TP rank 0: rank rank_offset of `init_custom_process_group`
    (utils/common.py:2859) over tcp://master_address:master_port. SGLang's own function when
    GYRE_SGLANG_SRC names an unpacked wheel, else `_init_custom_process_group`; gloo (CPU)."""
    global JOINED_WITH
    import torch.distributed as dist

    if m.backend != "gloo":
        raise ValueError(f"fake sglang runs on CPU: backend {m.backend!r} unsupported, use gloo")
    assert m.group_name != "", "Group name cannot be empty"  # weight_updater.py:122
    # Every real engine's scheduler is a process of its own; fake engines share this one, so the
    # group an earlier engine joined under this name goes first (torch refuses a registered name,
    # distributed_c10d.py:2008). Not modelled: one engine joining twice (SGLang: that error).
    if m.group_name in _JOINED:
        dist.destroy_process_group(_JOINED.pop(m.group_name))
    init = _sglang_init_custom_process_group()
    JOINED_WITH = "rewrite" if init is None else "sglang"
    host = m.master_address.strip("[]")
    host = f"[{host}]" if ":" in host else host  # NetworkAddress.to_tcp (utils/network.py:526-565)
    pg = (init or _init_custom_process_group)(backend=m.backend, init_method=f"tcp://{host}:{m.master_port}",
                                              world_size=m.world_size, rank=m.rank_offset + 0, group_name=m.group_name,
                                              timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    _JOINED[m.group_name] = pg
    return pg


def _init_custom_process_group(*, backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                               timeout: timedelta) -> Any:
    """utils/common.py:2859-2927 for the arguments weight_updater.py:133-139 passes. The layout
    the trainer must match: a TCPStore client (rank 0 hosts it), PrefixStore(group_name) around
    it, then torch's `_new_process_group_helper` adds PrefixStore(f"{group_name}/") and
    PrefixStore(f"{device}/") (torch 2.13 distributed_c10d.py:2060, 2101) and registers the group
    (so `dist.broadcast(group=pg)` works, weight_updater.py:283)."""
    from torch.distributed import distributed_c10d as c10d

    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))  # :2899-2901
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)  # :2905
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store, group_name=group_name,
                                           backend_options=None, timeout=timeout, device_id=None)  # :2913-2923
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # :2925
    return pg


def _sglang_init_custom_process_group() -> Any:
    """SGLang's own `init_custom_process_group` from $GYRE_SGLANG_SRC/sglang/srt/utils/common.py,
    or None when it is unset. That module imports triton and CUDA kernel packages, so only the
    function is compiled (its line numbers kept), with the one global it reads, `torch_release`
    (common.py:120)."""
    root = os.environ.get("GYRE_SGLANG_SRC")
    if not root:
        return None
    import ast

    from packaging import version

    path = os.path.join(root, "sglang", "srt", "utils", "common.py")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "init_custom_process_group"]
    if not fns:
        raise RuntimeError(f"{path} has no init_custom_process_group (GYRE_SGLANG_SRC is not sglang 0.5.23?)")
    namespace = {"torch": torch, "torch_release": version.parse(torch.__version__).release}
    exec(compile(ast.Module(body=fns, type_ignores=[]), path, "exec"), namespace)
    return namespace["init_custom_process_group"]


# ----------------------------------------------------------------------------- engine
class FakeEngine:
    """`sglang.Engine(**server_args)` over Gyre's CPU decoder (see the module docstring)."""

    # Knobs for tests (class attributes, so the factory hook needs no extra arguments).
    step_s = 0.002                  # sleep after each decode step (lets control messages in)
    chunk_delay_steps = 0           # token outputs reach the TM this many steps late
    spawn_scheduler_process = False  # start a child process standing for the scheduler
    crash_on: str | None = None     # a control request's class name: its handling kills the scheduler
    gpu: "FakeGpu | None" = None     # the device the KV pool is sized on; None: an empty one per engine
    instances: list["FakeEngine"] = []

    def __init__(self, **kwargs: Any):
        _import_engine_module()
        unknown = set(kwargs) - SERVER_ARGS
        if unknown:
            raise TypeError(f"ServerArgs.__init__() got unexpected keyword arguments {sorted(unknown)}")
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE"):
            raise RuntimeError("fake sglang: the scheduler would inherit TORCHELASTIC_USE_AGENT_STORE and wait "
                               "30 min for a TCPStore nobody hosts (torch/distributed/rendezvous.py:188-194)")
        logging.basicConfig(level=getattr(logging, str(kwargs.get("log_level", "error")).upper()), force=True,
                            format="[sglang-fake] %(message)s")  # configure_logger, engine.py:1152
        self.server_args = kwargs
        self.step_s = float(os.environ.get("GYRE_FAKE_SGLANG_STEP_S", type(self).step_s))
        self.tp_size = int(kwargs.get("tp_size", 1))
        self.weight_version = str(kwargs.get("weight_version", "default"))  # fields/serving.py:172
        self.enable_deterministic_inference = bool(kwargs.get("enable_deterministic_inference", False))
        self.model_config, self.weights, self.eos_token_ids, self.dtype = _load(
            kwargs["model_path"], kwargs.get("load_format"), kwargs.get("dtype", "auto"), kwargs.get("attention_backend"))
        self.vocab_size = int(self.model_config.vocab_size)
        self.context_len = _context_len(self.model_config, kwargs.get("context_length"))
        # the KV pool, sized from the device's free memory as the model runner does (`size_kv_pool`)
        self.kv = size_kv_pool(self.gpu if self.gpu is not None else FakeGpu(), self.model_config, self.dtype,
                               kwargs.get("mem_fraction_static"), self.tp_size, owner=f"engine{id(self)}")
        # tp_worker.py:568-572: what the scheduler admits, bounded by the context and the KV pool
        self.max_req_len = min(self.context_len - 1, self.kv.max_total_num_tokens - 1)
        self.max_req_input_len = self.max_req_len - 5
        # Scheduler.get_init_info (scheduler.py:1937-1948), kept by Engine (engine.py:345) and
        # reported by get_server_info (engine.py:1570-1585)
        self._scheduler_init_result = types.SimpleNamespace(scheduler_infos=[{
            "status": "ready", "max_total_num_tokens": self.kv.max_total_num_tokens,
            "max_req_input_len": self.max_req_input_len}])
        self.tokenizer_manager = FakeTokenizerManager(self)
        self.checker = FakeWeightChecker(self)
        self.process: subprocess.Popen | None = None
        if self.spawn_scheduler_process:
            # SGLang launches its schedulers with mp.Process under the spawn method (engine.py:956-974,
            # 1995), and spawn's Popen starts multiprocessing's shared resource tracker, a child of
            # this process kept for its whole life (multiprocessing/popen_spawn_posix.py:
            # resource_tracker.getfd() → ensure_running()).
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()
            self.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
            self.tokenizer_manager._subprocess_watchdog = _Watchdog(self.process)
        self.shutdown_called = False
        atexit.register(self.shutdown)  # engine.py:326
        FakeEngine.instances.append(self)

    async def async_generate(self, *, input_ids: list[int], sampling_params: dict, return_logprob: bool = False,
                             stream: bool = False, rid: str | None = None, top_logprobs_num: int = 0, **_: Any):
        if not (return_logprob and stream):
            raise NotImplementedError("the fake serves return_logprob=True, stream=True only")
        return self.tokenizer_manager.generate_request(input_ids, sampling_params, rid, top_logprobs_num)

    def shutdown(self) -> None:
        """kill_process_tree(os.getpid(), include_parent=False) (engine.py:1491): every child of
        this process, whoever started it."""
        self.shutdown_called = True
        for pid in _children(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class FakeWeightChecker:
    """utils/weight_checker.py's WeightChecker (model_runner.py:2227-2240 hands it check_weights)
    over the fake's parameters. Its parameters are checkpoint names (SGLang's own fuse q/k/v
    into qkv_proj, gate/up into gate_up_proj, experts into w13/w2) and it has no buffers, so no
    non-persistent one to skip (weight_checker.py:60-82) and no quantized weight (raw, bitwise
    compares only, weight_checker_comparator.py:123-171)."""

    def __init__(self, engine: "FakeEngine"):
        self.engine = engine
        self.snapshot: dict[str, torch.Tensor] | None = None
        self.snapshot_bytes = 0  # host memory the snapshot holds (one arena, weight_checker.py:97-116)

    def _state(self) -> dict[str, torch.Tensor]:  # _model_state: named_parameters + named_buffers (:248-251)
        return _as_checkpoint(self.engine.weights.tensors, self.engine.model_config)

    def handle(self, action: str, skip_tensor_list: list[str] | None = None) -> dict | None:  # :126-149
        if action == "snapshot":  # :151-176: published only once every copy is made
            snap = {k: v.detach().clone() for k, v in self._state().items()}
            self.snapshot, self.snapshot_bytes = snap, sum(v.numel() * v.element_size() for v in snap.values())
            return None
        if action == "reset_tensors":  # :178-183, random values as _random_like (:314-335)
            state = {k: v if _skipped(k, skip_tensor_list) else _random_like(v) for k, v in self._state().items()}
            self.engine.weights = _weights(state, self.engine.model_config)
            return None
        if action == "compare":  # :185-204
            assert self.snapshot is not None  # an AssertionError: str() is "", so message ""
            errors = []
            for name, actual in self._state().items():  # zip(strict=True), names asserted equal (:270-283)
                expect = self.snapshot[name]
                if _skipped(name, skip_tensor_list):
                    continue
                diff = (actual.float() - expect.float()).abs()
                if bool((diff == 0).all()):
                    continue
                # compare_weights (weight_checker_comparator.py:141-171): raw tensors have no tolerance
                errors.append(f"name={name} max_abs_err={diff.max().item()} mean_abs_err={diff.mean().item()} "
                              f"num_exceed={int((~(diff <= 0.0)).sum())} "
                              f"expect=raw(shape={tuple(expect.shape)} dtype={expect.dtype}) "
                              f"actual=raw(shape={tuple(actual.shape)} dtype={actual.dtype}) ")
            if errors:  # _check_tensors (:305-311); the snapshot stays (cleared only after success)
                raise Exception("check tensor equality failed:\n" + "\n".join(errors))
            self.snapshot, self.snapshot_bytes = None, 0
            return None
        if action == "checksum":  # :206-246; the hash is not SGLang's tensor_hash (mm_utils), only its shape
            import hashlib

            sums = {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
                    for k, v in self._state().items() if not _skipped(k, skip_tensor_list)}
            h = hashlib.sha256()
            for k in sorted(sums):
                h.update(k.encode())
                h.update(sums[k].encode())
            return {"checksums": sums, "per_gpu_checksum": h.hexdigest(), "parallelism_info": dict(
                role="target", tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1, rank=0, size=1)}
        raise Exception(f"Unsupported {action=}")


def _skipped(name: str, skip_tensor_list: list[str] | None) -> bool:  # _is_skip_weight_check, :74-80
    return any(pat in name for pat in (skip_tensor_list or ()))


def _random_like(t: torch.Tensor) -> torch.Tensor:  # weight_checker.py:314-335
    if t.dtype.is_floating_point:
        return torch.rand(t.shape, dtype=torch.float32).to(t.dtype)
    if t.dtype == torch.bool:
        return torch.rand(t.shape) > 0.5
    info = torch.iinfo(t.dtype)
    return torch.randint(int(info.min), int(info.max), t.shape, dtype=t.dtype)


# ----------------------------------------------------------------------------- device memory (KV sizing)
class FakeGpu:
    """One GPU's memory as `torch.cuda.mem_get_info` reports it: `total` bytes less what is resident
    now. Each resident is a number of bytes or a callable giving them at the moment asked (an actor
    that offloads returns 0 then)."""

    def __init__(self, total: int = 80 * 2**30):
        self.total = int(total)
        self.residents: dict[str, Any] = {}

    def hold(self, name: str, nbytes: Any) -> None:
        self.residents[name] = nbytes

    def used(self) -> int:
        return sum(int(v() if callable(v) else v) for v in self.residents.values())

    def free(self) -> int:
        return self.total - self.used()


@dataclass
class KvSizing:
    """What the fake's model runner saw and got (bytes; tokens)."""
    pre_model_load_free: int  # bootstrap.measure_pre_model_load_memory: free before the weights load
    weights_bytes: int
    available: int  # free when the pool is sized, after the weights (kv_cache_configurator.py:3000)
    mem_fraction_static: float
    cell_size: int  # KV bytes per token (pool_configurator.py:492-498)
    max_total_num_tokens: int


# SGLang derives a default from the GPU's size when the server arg is None (server_args); Gyre
# always passes one (sglang_engine.server_args), so the fake only needs a stand-in.
DEFAULT_MEM_FRACTION_STATIC = 0.88


def kv_cell_size(config: Any, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes per token of an MHA/GQA model's KV pool (pool_configurator.py:492-498): the KV heads
    per GPU (model_config.py:1700-1711: max(1, heads // tp)) × (head_dim + v_head_dim) × layers ×
    the KV dtype's size (the served dtype: kv_cache_dtype "auto")."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return max(1, heads // tp_size) * 2 * head_dim * config.num_hidden_layers * torch.empty((), dtype=dtype).element_size()


def weights_bytes(config: Any, dtype: torch.dtype, tp_size: int = 1) -> int:
    """The served model's bytes per GPU: every parameter (tied ones once) in the served dtype,
    split evenly over TP (an approximation: norms are replicated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters())
    return n * torch.empty((), dtype=dtype).element_size() // tp_size


def size_kv_pool(gpu: FakeGpu, config: Any, dtype: torch.dtype, mem_fraction_static: float | None, tp_size: int = 1,
                 *, owner: str = "engine", page_size: int = 1) -> KvSizing:
    """The model runner's start, in bytes (SGLang keeps GB floats):
    free before the weights load = pre (model_runner.py:1262, bootstrap.py:193-223); the weights
    load; free again = available (kv_cache_configurator.py:2999-3005); rest = available − pre ×
    (1 − mem_fraction_static) (:3007, :3038), a ValueError naming --mem-fraction-static when ≤ 0
    (:3043-3058); tokens = rest // cell size, rounded down to the page (pool_configurator.py:
    637-647); the pool is then allocated (it stays resident on `gpu`)."""
    f = DEFAULT_MEM_FRACTION_STATIC if mem_fraction_static is None else float(mem_fraction_static)
    pre = gpu.free()
    wbytes = weights_bytes(config, dtype, tp_size)
    gpu.hold(f"{owner} weights", wbytes)
    available = gpu.free()
    rest = available - pre * (1 - f)
    if rest <= 0:
        minimum = 1 - available / pre
        raise ValueError(f"Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static={f}. "
                         f"Raise --mem-fraction-static above {math.ceil(minimum * 1000) / 1000:.3f}")
    cell = kv_cell_size(config, dtype, tp_size)
    tokens = int(rest) // cell // page_size * page_size
    gpu.hold(f"{owner} kv", tokens * cell)
    return KvSizing(pre, wbytes, available, f, cell, tokens)


class FakeUvloopPolicy(asyncio.DefaultEventLoopPolicy):
    """Stands for uvloop.EventLoopPolicy (its loops are asyncio's own here)."""


ENGINE_MODULE_IMPORTED = False


def _import_engine_module() -> None:
    """`sglang.Engine` is a LazyImport (sglang/__init__.py:68, utils.py:364-384): the first
    Engine(...) imports sglang.srt.entrypoints.engine, whose module body sets a process-wide
    policy, `asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())` (engine.py:168), once per
    process, before anything is checked."""
    global ENGINE_MODULE_IMPORTED
    if not ENGINE_MODULE_IMPORTED:
        ENGINE_MODULE_IMPORTED = True
        asyncio.set_event_loop_policy(FakeUvloopPolicy())


class _Watchdog:
    """SubprocessWatchdog (utils/watchdog.py:166-225): polls the engine's processes from a daemon
    thread and sends SIGQUIT to this process when one died, unless stopped first (Engine.shutdown
    stops it, engine.py:1473-1476)."""

    def __init__(self, process: subprocess.Popen):
        import threading

        self.process, self.stopped = process, threading.Event()
        threading.Thread(target=self._loop, daemon=True, name="fake-subprocess-watchdog").start()

    def _loop(self) -> None:
        while not self.stopped.wait(0.05):
            if self.process.poll() is not None:
                os.kill(os.getpid(), signal.SIGQUIT)
                return

    def stop(self) -> None:
        self.stopped.set()


def _context_len(config: Any, context_length: int | None) -> int:
    """ModelConfig.context_len: get_context_length (utils/hf_transformers/common.py:668-694: the
    first of CONTEXT_LENGTH_KEYS, times a rope scaling factor) or the context_length server arg,
    which may not exceed it without SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN
    (configs/model_config.py:1291-1326)."""
    rope = getattr(config, "rope_scaling", None)
    factor = 1
    if rope:
        factor = rope.get("factor", 1)
        if "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3":
            factor = 1
    derived = 2048
    for key in ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings"):
        if getattr(config, key, None) is not None:
            derived = int(factor * getattr(config, key))
            break
    if context_length is None:
        return derived
    if int(context_length) > derived and not os.environ.get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"):
        raise ValueError(f"User-specified context_length ({context_length}) is greater than the derived "
                         f"context_length ({derived}). To allow overriding this maximum, set the env var "
                         f"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1")
    return int(context_length)


def _children(pid: int) -> set[int]:
    from gyre.executions.procs import child_pids

    return child_pids(pid)


def _load(model_path: str, load_format: str | None, dtype: str, attention_backend: str | None):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)  # SGLang's get_config reads it with AutoConfig too
    served = model_config_checks(config, dtype, attention_backend)
    state: dict[str, torch.Tensor] = {}
    if load_format == "dummy":
        from gyre.backends.models.hf import build_model

        state = build_model(config, seed=0).state_dict()
    for f in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))) if load_format != "dummy" else []:
        state.update(load_file(f))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    eos = config.eos_token_id
    eos_ids = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
    state = {k: v.to(served) for k, v in state.items()}  # the weights are loaded in the served dtype
    return config, _weights(state, config), eos_ids, served


def _weights(state: dict[str, torch.Tensor], config: Any):
    """Gyre's CPU decoder over `state` where it knows the family, else HF transformers' own model
    (`_HfWeights`): the fake's tokens and log-probs are the family's real forward either way."""
    _check_names(state, config)
    try:
        return DecoderWeights.from_state_dict(state, config)
    except (ValueError, KeyError, NotImplementedError):
        return _HfWeights(state, config)


def _as_checkpoint(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """`state` under HF checkpoint names (transformers' own save-time reversal, on a meta model)."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return dict(revert_weight_conversion(model, dict(state)))


def _skip_unknown(names: list[str], config: Any) -> None:
    """What SGLang's load_weights does with a name it has no parameter for: Qwen3 / Qwen2 / Llama
    log a warning and go on (models/qwen3.py:752-760, qwen2.py:711-719, llama.py:771-779:
    `logger.warning(f"Parameter {name} not found in params_dict")`), Qwen3-MoE skips it without a
    word (qwen3_moe.py:1224-1225, 1244-1246, 1266-1267). The load succeeds either way: the
    parameter keeps its old value. (A name that matches a stacked mapping, q/k/v or gate/up, then
    misses params_dict is a KeyError there instead, fatal to the scheduler; not modelled.)"""
    if not names:
        return
    log = logging.getLogger("sglang.srt.models")
    if "Qwen3MoeForCausalLM" in (getattr(config, "architectures", None) or []):
        return
    for name in names:
        log.warning(f"Parameter {name} not found in params_dict")


def _check_names(state: dict[str, torch.Tensor], config: Any) -> None:
    """SGLang's load_weights takes the names of an HF checkpoint on disk: one tensor per MoE expert
    (models/qwen3_moe.py:1157-1175), not transformers 5's fused in-memory `experts.gate_up_proj`;
    lm_head.weight is skipped when embeddings are tied (models/qwen2.py load_weights). Checked at
    start (the served checkpoint directory is Gyre's); an update skips unknown names as SGLang does
    (`_skip_unknown`)."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    expected = set(revert_weight_conversion(model, model.state_dict())) - ({"lm_head.weight"} if tied else set())
    got = set(state) - ({"lm_head.weight"} if tied else set())
    if got != expected:
        raise ValueError(f"weights: names SGLang's load_weights does not know {sorted(got - expected)[:3]}, "
                         f"missing {sorted(expected - got)[:3]} (checkpoint names expected)")


class _HfWeights:
    """A family the decoder does not know (yet): the HF model, whole sequence per decode step (no KV
    cache; the adapter always retracts and flushes, so the KV would be recomputed anyway). `state`
    has checkpoint names (SGLang's load_weights reads those: per-expert MoE tensors), so it is
    loaded the way a checkpoint is, through from_pretrained, which strictly reports missing and
    unexpected names."""

    def __init__(self, state: dict[str, torch.Tensor], config: Any):
        import tempfile

        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.tensors = {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}
        dtype = next(iter(state.values())).dtype
        with tempfile.TemporaryDirectory() as d:
            config.to_json_file(os.path.join(d, "config.json"))
            save_file({k: v.contiguous() for k, v in self.tensors.items()}, os.path.join(d, "model.safetensors"))
            model, info = AutoModelForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation="eager",
                                                               output_loading_info=True)
        bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if bad:
            raise ValueError(f"weights: {bad}")
        self.model = model.eval()

    @torch.no_grad()
    def last_logits(self, seq: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([seq])).logits[0, -1]


API = SglangApi(FakeEngine, io_struct, serialize, frozenset(SERVER_ARGS))
