"""The one place that turns config sections into a rank's backends (docs/design.md §1, §3).

`gyre/runtime/job.py` and the runtime never name a concrete engine, actor or transport; each
builder takes the sections it reads (`check_backends`, `build_core_actor`, `build_actor`,
`build_engine`, `build_transport`, `build_kv_transport`).

`ENGINES` / `ACTORS` / `TRANSPORTS` map each `--backend.*` / `--transfer.transport` choice to
whether `gyre.run` can build it on this build; tests/contracts/ runs its contract tests over the
runnable ones (`runnable(...)`), so the GPU backends join when they are wired in.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gyre.backends.config import (SGLANG_API_ENV, BackendConfig, CpuEngineConfig, ModelConfig, OptimizerConfig, Resume,
                                  SglangOptions, TransferConfig)
from gyre.backends.protocols import Actor, RolloutEngine, WeightTransport

if TYPE_CHECKING:
    from gyre.loss.config import LossConfig
    from gyre.topology import Groups, ParallelConfig

logger = logging.getLogger(__name__)

# choice → None when gyre.run builds it, NEEDS_CUDA when it does so on a CUDA machine only,
# else why not (the ConfigError says so).
NEEDS_CUDA = "needs CUDA, and torch.cuda.is_available() is False on this machine"
# sglang: CUDA and the sglang package (docs/gpu-sglang.md), or a stand-in named by SGLANG_API_ENV
# (tests only; `gyre.backends.config`).
NEEDS_SGLANG = "needs CUDA and the sglang package (pip install 'sglang==0.5.23'; see docs/gpu-sglang.md)"
ENGINES: dict[str, str | None] = {"cpu": None, "sglang": NEEDS_SGLANG}
ACTORS: dict[str, str | None] = {"cpu": None, "megatron": NEEDS_CUDA}
TRANSPORTS: dict[str, str | None] = {"store": None, "torch": None, "mooncake": None}


def why_not(kinds: dict[str, str | None], chosen: str, *, cuda: bool) -> str | None:
    """Why `chosen` of `kinds` cannot run here (None: it can). A NEEDS_CUDA choice runs where
    `cuda` (torch.cuda.is_available(), asked by the caller, never at import time)."""
    why = kinds[chosen]
    if why is NEEDS_SGLANG:
        import importlib.util

        usable = os.environ.get(SGLANG_API_ENV) or (cuda and importlib.util.find_spec("sglang") is not None)
        return None if usable else why
    return None if why is NEEDS_CUDA and cuda else why


def runnable(kinds: dict[str, str | None], *, cuda: bool = False) -> list[str]:
    """The choices of `kinds` (ENGINES, ACTORS, TRANSPORTS) that gyre.run can build (on a CUDA
    machine too when `cuda`)."""
    return [k for k in kinds if why_not(kinds, k, cuda=cuda) is None]


def check_backends(backend: BackendConfig, transfer: TransferConfig, model: ModelConfig, parallel: ParallelConfig,
                   resume: Resume = Resume()) -> None:
    """Refuse a backend choice that cannot run, before anything starts (gyre.config.ConfigError,
    naming the flag)."""
    from gyre.errors import ConfigError

    cuda = torch.cuda.is_available()
    for flag, kinds, chosen in (("backend.engine", ENGINES, backend.engine),
                                ("backend.actor", ACTORS, backend.actor),
                                ("transfer.transport", TRANSPORTS, transfer.transport)):
        if chosen not in kinds:
            raise ConfigError(f"--{flag.replace('_', '-')} {chosen!r}: choose one of {sorted(kinds)}")
        why = why_not(kinds, chosen, cuda=cuda)
        if why is not None:
            raise ConfigError(f"--{flag.replace('_', '-')} {chosen}: {why}; use "
                              f"--{flag.replace('_', '-')} {runnable(kinds, cuda=cuda)[0]}")
    # Its architecture, before any rank builds; a checkpoint not there yet is one --train.prepare
    # writes (gyre.config refused any other), and `check_prepared` comes back here once it is.
    if model.checkpoint and os.path.isdir(model.checkpoint):
        check_model_checkpoint(model.checkpoint)
    if backend.device == "cuda" and not cuda:
        raise ConfigError("--backend.device cuda: CUDA is not available on this machine; "
                          "use --backend.device auto (cpu here)")
    if parallel.cell_size != 1 and backend.actor == "cpu":
        raise ConfigError(f"parallel.cell_size = {parallel.cell_size}: the built-in CPU actor "
                          f"(--backend.actor cpu) holds a whole model on one rank, so it needs "
                          f"parallel.cell_size = 1 (TP/PP/CP/EP are for --backend.actor megatron)")
    if backend.actor == "megatron":
        import importlib.util

        if importlib.util.find_spec("megatron") is None:  # find_spec: importing megatron costs seconds
            raise ConfigError("--backend.actor megatron: megatron-core is not installed; "
                              "pip install --no-build-isolation -e '.[gpu]' (or megatron-core==0.16.1)")
        if model.dtype == "float64":
            raise ConfigError("--model.dtype float64: --backend.actor megatron trains in float32 or bfloat16")
        if resume.on and not resume.weights_only:
            raise ConfigError("--train.resume: --backend.actor megatron does not save optimizer state yet "
                              "(its checkpoints are weights only); resume needs --backend.actor cpu, or "
                              "--train.resume-weights-only for a fresh optimizer")
    if transfer.transport == "mooncake":
        try:
            import mooncake.engine  # noqa: F401
        except Exception as e:  # noqa: BLE001 — any import failure means: not usable here
            raise ConfigError(f"--transfer.transport mooncake: the mooncake package is not importable ({e}); "
                              f"pip install mooncake-transfer-engine-non-cuda (CPU, plus libibverbs1) or "
                              f"mooncake-transfer-engine (CUDA), or use --transfer.transport torch") from None


def check_model_checkpoint(path: str) -> None:
    """Refuse `--model.checkpoint DIR` unless its config.json names a supported architecture
    (`gyre.backends.models.arch.SUPPORTED`) in a variant the backends implement (ConfigError naming
    the directory, the architecture and the supported list)."""
    from gyre.backends.models.arch import check_checkpoint
    from gyre.errors import ConfigError

    try:
        check_checkpoint(path)
    except (ValueError, OSError) as e:  # UnsupportedArchitecture is a ValueError
        raise ConfigError(f"--model.checkpoint {path}: {e}") from None


def set_threads(threads: int) -> None:
    """torch intra-op threads for this process (`--train.torch-threads`; 0 leaves torch's)."""
    if threads > 0:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- models
def model_config_of(model: ModelConfig, vocab: int) -> Any:
    """The model architecture: the checkpoint's own config.json when `--model.checkpoint` is
    given (its family checked against `gyre.backends.models.arch`), else the preset's Qwen2 config."""
    if model.checkpoint:
        from transformers import AutoConfig

        from gyre.backends.models.arch import check_checkpoint

        check_checkpoint(model.checkpoint)
        return AutoConfig.from_pretrained(model.checkpoint)
    from gyre.backends.models.hf import model_config

    return model_config(model.preset, vocab)


def _start_path(model: ModelConfig, resume: Resume, checkpoint_dir: Path) -> Path | None:
    """The checkpoint the core starts from: the resumed one, else `--model.checkpoint` (None: a preset)."""
    if resume.on:
        from gyre import checkpoint
        from gyre.logging_utils import ONCE

        # rank 0 chose it before anything started (gyre.runtime.rundir); the newest one otherwise
        path = Path(resume.path) if resume.path else checkpoint.select(checkpoint_dir, weights_only=resume.weights_only).path
        logger.info("resuming from %s", path, extra=ONCE)
        return path
    return Path(model.checkpoint) if model.checkpoint else None


# ----------------------------------------------------------------------------- actors and engines
def build_core_actor(model: ModelConfig, backend: BackendConfig, actor: OptimizerConfig, loss: LossConfig,
                     parallel: ParallelConfig, resume: Resume, *, vocab: int, checkpoint_dir: Path) -> tuple[Actor, Any]:
    """The core's actor (authoritative weights and optimizer state, docs/design.md §1) and its
    model config: the newest checkpoint with optimizer state and version (`resume`),
    `--model.checkpoint`, or the preset's seeded weights."""
    from gyre.backends.models.hf import build_model, dtype_of, load_model

    path = _start_path(model, resume, checkpoint_dir)
    if backend.actor == "megatron":  # check_backends refused resume without --train.resume-weights-only
        return _megatron_core_actor(model, actor, loss, parallel, resume, path, vocab)
    dtype = dtype_of(model.dtype)
    hf = build_model(model_config_of(model, vocab), seed=model.seed, dtype=dtype) if path is None else \
        load_model(str(path), dtype=dtype)
    from gyre.backends.actors.cpu_actor import CpuActor

    core = CpuActor(hf, is_core=True, config=actor, loss=loss)
    if resume.on:
        core.load_checkpoint(str(path), weights_only=resume.weights_only)  # weights, optimizer, version
        if core.version >= resume.steps:
            raise ValueError(f"--train.resume: {path} is already at version {core.version} >= "
                             f"train.steps = {resume.steps}; train.steps counts the whole run, raise it")
    return core, hf.config


def build_actor(model: ModelConfig, backend: BackendConfig, actor: OptimizerConfig, loss: LossConfig,
                parallel: ParallelConfig, model_config: Any, *, is_core: bool) -> Actor:
    """A fresh actor of `--backend.actor` for `model_config` (its weights come from a snapshot:
    version -1 until the first import)."""
    if backend.actor == "megatron":  # shaped from the config alone: no HF-sized model is built
        from gyre.backends.actors.megatron_actor import MegatronActor

        built = MegatronActor(model_config, None, is_core=is_core, config=megatron_config_of(parallel, model),
                              optim=actor, loss=loss, seed=model.seed)
    else:
        from gyre.backends.actors.cpu_actor import CpuActor
        from gyre.backends.models.hf import build_model, dtype_of

        built = CpuActor(build_model(model_config, dtype=dtype_of(model.dtype)), is_core=is_core, config=actor, loss=loss)
    built.version = -1
    return built


def megatron_config_of(parallel: ParallelConfig, model: ModelConfig) -> Any:
    """The Megatron layout of a cell: `--parallel.tp/pp/cp/ep` (one fact, one place), parameter
    dtype `--model.dtype`."""
    from gyre.backends.config import MegatronConfig

    p = parallel
    return MegatronConfig(tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
                          context_parallel_size=p.cp, expert_model_parallel_size=p.ep, params_dtype=model.dtype)


def _megatron_core_actor(model: ModelConfig, actor: OptimizerConfig, loss: LossConfig, parallel: ParallelConfig,
                         resume: Resume, path: Path | None, vocab: int) -> tuple[Actor, Any]:
    """The core's MegatronActor: a checkpoint (`path`) is read one tensor at a time into the rank's
    shards (`MegatronActor.from_checkpoint`), never as a whole HF model in host memory; a preset is
    small and built whole."""
    from gyre.backends.actors.megatron_actor import MegatronActor

    mcfg = megatron_config_of(parallel, model)
    if path is None:
        from gyre.backends.models.hf import build_model, dtype_of

        hf = build_model(model_config_of(model, vocab), seed=model.seed, dtype=dtype_of(model.dtype))
        return MegatronActor(hf.config, hf.state_dict(), is_core=True, config=mcfg, optim=actor, loss=loss,
                             seed=model.seed), hf.config
    core = MegatronActor.from_checkpoint(str(path), is_core=True, config=mcfg, optim=actor, loss=loss, seed=model.seed)
    if resume.on:  # the weights are in; the version is the checkpoint's
        from gyre import checkpoint

        core.version = checkpoint.version_of(path)
    return core, core.hf_config


def build_engine(model: ModelConfig, engine: CpuEngineConfig, backend: BackendConfig, model_config: Any,
                 params: dict[str, torch.Tensor], *, version: int, eos_token_ids: list[int], name: str,
                 sampleable_vocab: int | None = None, transfer: TransferConfig | None = None,
                 sglang: SglangOptions | None = None, cell_size: int = 1, run_dir: str = "") -> RolloutEngine:
    """A rollout engine of `--backend.engine` serving `params` as `version` (not started).
    `sampleable_vocab`: ids >= it are never sampled (the tokenizer's size when the checkpoint
    pads its embedding, as real Qwen2.5 does); None: every embedding row. `sglang`, `cell_size`
    and `run_dir` are the SGLang engine's (`build_sglang_engine`)."""
    transfer = transfer or TransferConfig()
    if backend.engine == "sglang":
        built = build_sglang_engine(model, backend, model_config, params, version=version, eos_token_ids=eos_token_ids,
                                    name=name, sampleable_vocab=sampleable_vocab, transfer=transfer, sglang=sglang,
                                    cell_size=cell_size, run_dir=run_dir)
        built.name = name
        return built
    from gyre.backends.engines.cpu_engine import CpuEngine
    from gyre.backends.devices import this_engine_device
    from gyre.backends.transfer.buckets import bucket_bytes

    built = CpuEngine(model_config, params, version=version, config=engine, eos_token_ids=eos_token_ids,
                      device=this_engine_device(backend.device), sampleable_vocab=sampleable_vocab,
                      bucket_bytes=bucket_bytes(transfer.bucket_mb))
    built.name = name
    return built


def build_sglang_engine(model: ModelConfig, backend: BackendConfig, model_config: Any, params: dict[str, torch.Tensor],
                        *, version: int, eos_token_ids: list[int], name: str, sampleable_vocab: int | None = None,
                        transfer: TransferConfig | None = None, sglang: SglangOptions | None = None,
                        cell_size: int = 1, run_dir: str = "") -> RolloutEngine:
    """The embedded SGLang engine of this cell (its first rank): the model directory above (under
    RUN_DIR/sglang/<name>/ when written), tp = the cell size, the first GPU this rank's, the dtype
    `--model.dtype` (auto resolved: bfloat16), `--sglang.*` options and pass-through."""
    import tempfile

    from gyre.backends.config import SglangConfig, resolve_model_dtype
    from gyre.backends.engines.sglang_checkpoint import parse_size, sglang_model_dir
    from gyre.backends.engines.sglang_engine import SglangApi, SglangEngine
    from gyre.backends.transfer.buckets import bucket_bytes

    transfer, opts = transfer or TransferConfig(), sglang or SglangOptions()
    dtype = resolve_model_dtype(model, backend)
    # an engine built outside a run (tests, tools) writes to a temporary directory
    out = Path(run_dir) / "sglang" / name if run_dir else Path(tempfile.mkdtemp(prefix=f"gyre-sglang-{name}-"))
    path, written = sglang_model_dir(checkpoint=model.checkpoint, version=version, out_dir=out,
                                     model_config=model_config, params=params, dtype=dtype,
                                     eos_token_ids=list(eos_token_ids), max_shard_bytes=parse_size(opts.max_shard_size))
    logger.info("sglang %s serves %s (%s, version %d, %s)", name, path, dtype, version,
                "written by Gyre" if written else "the checkpoint directory itself")
    sc = SglangConfig(model_path=path, tp_size=cell_size, mem_fraction_static=opts.mem_fraction_static,
                      base_gpu_id=torch.cuda.current_device() if torch.cuda.is_available() else 0, dtype=dtype,
                      enable_memory_saver=opts.enable_memory_saver, extra=dict(opts.extra))
    spec = os.environ.get(SGLANG_API_ENV)
    coverage = transfer.coverage_check
    return SglangEngine(sc, version=version, api=SglangApi.from_spec(spec) if spec else None,
                        sampleable_vocab=sampleable_vocab, eos_token_ids=eos_token_ids,
                        bucket_bytes=bucket_bytes(transfer.bucket_mb), coverage_check=coverage,
                        start_weights=params if coverage != "off" else None)


# ----------------------------------------------------------------------------- weight transport
def build_transport(transfer: TransferConfig, groups: Groups, store: Any) -> WeightTransport:
    """This rank's `--transfer.transport`. Collective for 'torch' (its gloo group is made by
    `groups.gloo_world('weights', ...)`): every rank calls it at the same point of start-up. The
    core's rank at this rank's position posts; with the CPU backends (cell_size 1) that is rank 0."""
    tc, topo = transfer, groups.topology
    owner = topo.cell_ranks(0)[topo.position]
    if tc.transport == "store":
        from gyre.backends.transfer.weights import SnapshotBoard

        return SnapshotBoard(store, keep=tc.keep, verify=tc.verify)
    if tc.transport == "torch":
        from gyre.backends.transfer.weights import TorchWeights

        group = groups.gloo_world("weights", tc.timeout_s)
        return TorchWeights(store, group, owner=owner, keep=tc.keep, verify=tc.verify)
    if tc.transport == "mooncake":
        from gyre.backends.transfer.weights import MooncakeWeights

        return MooncakeWeights(store, owner=owner, keep=tc.keep, verify=tc.verify, host=tc.host,
                               protocol=tc.mooncake_protocol, device=tc.mooncake_device)
    raise ValueError(f"transfer.transport: unknown {tc.transport!r}")  # check_backends refused it already


KV_GROUP_TIMEOUT_S = 600.0  # the KV-migration gloo group's collective timeout


def build_kv_transport(migration: str, over: str, transfer: TransferConfig, groups: Groups, store: Any) -> Any:
    """The engines' KV-migration transport (`--proxy.migration` auto|always over
    `--proxy.migration-transport`: `migration`, `over`), or None when migration is off. Collective for 'gloo' (its gloo
    group is made by `groups.gloo_world('kv', ...)`): every rank calls it at the same point of start-up.
    Mooncake KV moves as the weight snapshots do: the same address, protocol and device."""
    if migration == "off":
        return None
    from gyre.backends.transfer.migration import build_kv_transport as build

    group = groups.gloo_world("kv", KV_GROUP_TIMEOUT_S) if over == "gloo" else None
    tc = transfer
    return build(over, store.clone(), group, host=tc.host, protocol=tc.mooncake_protocol, device=tc.mooncake_device)
