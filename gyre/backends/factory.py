"""The one place that turns the config into a rank's backends (docs/design.md §1, §3).

`gyre/runtime/job.py` and the runtime never name a concrete engine, actor or transport; they call:

    check_backends(cfg)                       every rank, before anything starts (ConfigError)
    set_threads(cfg)                          once per process, before the engine or actor is built
    actor, model_config = build_core_actor(cfg, vocab, checkpoint_dir)   the core only
    transport = build_transport(cfg, groups, store)                      every rank, same point
    kv = build_kv_transport(cfg, groups, store)                          every rank, same point (None: off)
    engine = build_engine(cfg, model_config, params, version=, eos_token_ids=, name=)
    actor = build_actor(cfg, model_config, is_core=False)

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

from gyre.backends.config import SGLANG_API_ENV, BuildConfig
from gyre.backends.protocols import Actor, RolloutEngine, WeightTransport

if TYPE_CHECKING:
    from gyre.topology import Groups

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


def check_backends(cfg: BuildConfig) -> None:
    """Refuse a backend choice that cannot run, before anything starts (gyre.config.ConfigError,
    naming the flag)."""
    from gyre.errors import ConfigError

    cuda = torch.cuda.is_available()
    for flag, kinds, chosen in (("backend.engine", ENGINES, cfg.backend.engine),
                                ("backend.actor", ACTORS, cfg.backend.actor),
                                ("transfer.transport", TRANSPORTS, cfg.transfer.transport)):
        if chosen not in kinds:
            raise ConfigError(f"--{flag.replace('_', '-')} {chosen!r}: choose one of {sorted(kinds)}")
        why = why_not(kinds, chosen, cuda=cuda)
        if why is not None:
            raise ConfigError(f"--{flag.replace('_', '-')} {chosen}: {why}; use "
                              f"--{flag.replace('_', '-')} {runnable(kinds, cuda=cuda)[0]}")
    # Its architecture, before any rank builds; a checkpoint not there yet is one --train.prepare
    # writes (gyre.config refused any other), and `check_prepared` comes back here once it is.
    if cfg.model.checkpoint and os.path.isdir(cfg.model.checkpoint):
        check_model_checkpoint(cfg.model.checkpoint)
    if cfg.backend.device == "cuda" and not cuda:
        raise ConfigError("--backend.device cuda: CUDA is not available on this machine; "
                          "use --backend.device auto (cpu here)")
    if cfg.parallel.cell_size != 1 and cfg.backend.actor == "cpu":
        raise ConfigError(f"parallel.cell_size = {cfg.parallel.cell_size}: the built-in CPU actor "
                          f"(--backend.actor cpu) holds a whole model on one rank, so it needs "
                          f"parallel.cell_size = 1 (TP/PP/CP/EP are for --backend.actor megatron)")
    if cfg.backend.actor == "megatron":
        import importlib.util

        if importlib.util.find_spec("megatron") is None:  # find_spec: importing megatron costs seconds
            raise ConfigError("--backend.actor megatron: megatron-core is not installed; "
                              "pip install --no-build-isolation -e '.[gpu]' (or megatron-core==0.16.1)")
        if cfg.model.dtype == "float64":
            raise ConfigError("--model.dtype float64: --backend.actor megatron trains in float32 or bfloat16")
        if cfg.train.resume and not cfg.train.resume_weights_only:
            raise ConfigError("--train.resume: --backend.actor megatron does not save optimizer state yet "
                              "(its checkpoints are weights only); resume needs --backend.actor cpu, or "
                              "--train.resume-weights-only for a fresh optimizer")
    if cfg.transfer.transport == "mooncake":
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


def set_threads(cfg: BuildConfig) -> None:
    """torch intra-op threads for this process (`--train.torch-threads`; 0 leaves torch's)."""
    if cfg.train.torch_threads > 0:
        torch.set_num_threads(cfg.train.torch_threads)


# ----------------------------------------------------------------------------- models
def model_config_of(cfg: BuildConfig, vocab: int) -> Any:
    """The model architecture: the checkpoint's own config.json when `--model.checkpoint` is
    given (its family checked against `gyre.backends.models.arch`), else the preset's Qwen2 config."""
    if cfg.model.checkpoint:
        from transformers import AutoConfig

        from gyre.backends.models.arch import check_checkpoint

        check_checkpoint(cfg.model.checkpoint)
        return AutoConfig.from_pretrained(cfg.model.checkpoint)
    from gyre.backends.models.hf import model_config

    return model_config(cfg.model.preset, vocab)


def _initial_model(cfg: BuildConfig, vocab: int, checkpoint_dir: Path) -> tuple[Any, Path | None]:
    """The core's starting model: the newest checkpoint (resume), the given one, or a preset."""
    from gyre.backends.models.hf import build_model, dtype_of, load_model
    from gyre.logging_utils import ONCE

    mc, dtype = cfg.model, dtype_of(cfg.model.dtype)
    if cfg.train.resume:
        from gyre import checkpoint

        if cfg.train.resume_from:  # rank 0 chose it before anything started (gyre.runtime.rundir)
            path = Path(cfg.train.resume_from)
        else:
            path = checkpoint.select(checkpoint_dir, weights_only=cfg.train.resume_weights_only).path
        logger.info("resuming from %s", path, extra=ONCE)
        return load_model(str(path), dtype=dtype), path
    if mc.checkpoint:
        return load_model(mc.checkpoint, dtype=dtype), None
    return build_model(model_config_of(cfg, vocab), seed=mc.seed, dtype=dtype), None


# ----------------------------------------------------------------------------- actors and engines
def build_core_actor(cfg: BuildConfig, vocab: int, checkpoint_dir: Path) -> tuple[Actor, Any]:
    """The core's actor (authoritative weights and optimizer state, docs/design.md §1) and its
    model config: the newest checkpoint with optimizer state and version (`--train.resume`),
    `--model.checkpoint`, or the preset's seeded weights."""
    if cfg.backend.actor == "megatron":  # check_backends refused resume without --train.resume-weights-only
        return _megatron_core_actor(cfg, vocab, checkpoint_dir)
    model, resumed = _initial_model(cfg, vocab, checkpoint_dir)
    from gyre.backends.actors.cpu_actor import CpuActor

    actor = CpuActor(model, is_core=True, config=cfg.actor, loss=cfg.loss)
    if resumed is not None:
        actor.load_checkpoint(str(resumed), weights_only=cfg.train.resume_weights_only)  # weights, optimizer, version
        if actor.version >= cfg.train.steps:
            raise ValueError(f"--train.resume: {resumed} is already at version {actor.version} >= "
                             f"train.steps = {cfg.train.steps}; train.steps counts the whole run, raise it")
    return actor, model.config


def build_actor(cfg: BuildConfig, model_config: Any, *, is_core: bool) -> Actor:
    """A fresh actor of `--backend.actor` for `model_config` (its weights come from a snapshot:
    version -1 until the first import)."""
    if cfg.backend.actor == "megatron":  # shaped from the config alone: no HF-sized model is built
        from gyre.backends.actors.megatron_actor import MegatronActor

        actor = MegatronActor(model_config, None, is_core=is_core, config=megatron_config_of(cfg), optim=cfg.actor,
                              loss=cfg.loss, seed=cfg.model.seed)
    else:
        from gyre.backends.actors.cpu_actor import CpuActor
        from gyre.backends.models.hf import build_model, dtype_of

        actor = CpuActor(build_model(model_config, dtype=dtype_of(cfg.model.dtype)), is_core=is_core, config=cfg.actor,
                         loss=cfg.loss)
    actor.version = -1
    return actor


def megatron_config_of(cfg: BuildConfig) -> Any:
    """The Megatron layout of a cell: `--parallel.tp/pp/cp/ep` (one fact, one place), parameter
    dtype `--model.dtype`."""
    from gyre.backends.config import MegatronConfig

    p = cfg.parallel
    return MegatronConfig(tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
                          context_parallel_size=p.cp, expert_model_parallel_size=p.ep, params_dtype=cfg.model.dtype)


def _megatron_core_actor(cfg: BuildConfig, vocab: int, checkpoint_dir: Path) -> tuple[Actor, Any]:
    """The core's MegatronActor: a checkpoint (the resumed one, else `--model.checkpoint`) is read
    one tensor at a time into the rank's shards (`MegatronActor.from_checkpoint`), never as a whole
    HF model in host memory; a preset is small and built as before."""
    from gyre.backends.actors.megatron_actor import MegatronActor
    from gyre.logging_utils import ONCE

    path = None
    if cfg.train.resume:
        from gyre import checkpoint

        path = Path(cfg.train.resume_from) if cfg.train.resume_from else \
            checkpoint.select(checkpoint_dir, weights_only=cfg.train.resume_weights_only).path
        logger.info("resuming from %s", path, extra=ONCE)
    elif cfg.model.checkpoint:
        path = Path(cfg.model.checkpoint)
    if path is None:
        from gyre.backends.models.hf import build_model, dtype_of

        model = build_model(model_config_of(cfg, vocab), seed=cfg.model.seed, dtype=dtype_of(cfg.model.dtype))
        return _megatron_actor(cfg, model, is_core=True), model.config
    actor = MegatronActor.from_checkpoint(str(path), is_core=True, config=megatron_config_of(cfg), optim=cfg.actor,
                                          loss=cfg.loss, seed=cfg.model.seed)
    if cfg.train.resume:  # the weights are in; the version is the checkpoint's
        from gyre import checkpoint

        actor.version = checkpoint.version_of(path)
    return actor, actor.hf_config


def _megatron_actor(cfg: BuildConfig, model: Any, *, is_core: bool) -> Actor:
    """A MegatronActor (imported here: megatron is a GPU extra) holding `model`'s HF weights."""
    from gyre.backends.actors.megatron_actor import MegatronActor

    return MegatronActor(model.config, model.state_dict(), is_core=is_core, config=megatron_config_of(cfg),
                         optim=cfg.actor, loss=cfg.loss, seed=cfg.model.seed)


def build_engine(cfg: BuildConfig, model_config: Any, params: dict[str, torch.Tensor], *, version: int,
                 eos_token_ids: list[int], name: str, sampleable_vocab: int | None = None) -> RolloutEngine:
    """A rollout engine of `--backend.engine` serving `params` as `version` (not started).
    `sampleable_vocab`: ids >= it are never sampled (the tokenizer's size when the checkpoint
    pads its embedding, as real Qwen2.5 does); None: every embedding row."""
    if cfg.backend.engine == "sglang":
        engine = build_sglang_engine(cfg, model_config, params, version=version, eos_token_ids=eos_token_ids,
                                     name=name, sampleable_vocab=sampleable_vocab)
        engine.name = name
        return engine
    from gyre.backends.engines.cpu_engine import CpuEngine
    from gyre.backends.devices import this_engine_device

    engine = CpuEngine(model_config, params, version=version, config=cfg.engine, eos_token_ids=eos_token_ids,
                       device=this_engine_device(cfg.backend.device), sampleable_vocab=sampleable_vocab,
                       bucket_bytes=_bucket_bytes(cfg))
    engine.name = name
    return engine


def build_sglang_engine(cfg: BuildConfig, model_config: Any, params: dict[str, torch.Tensor], *, version: int,
                        eos_token_ids: list[int], name: str, sampleable_vocab: int | None = None) -> RolloutEngine:
    """The embedded SGLang engine of this cell (its first rank), from the run's config: the model
    directory above (under RUN_DIR/sglang/<name>/ when written), tp = the cell size, the first GPU
    this rank's, the dtype `--model.dtype` (auto resolved: bfloat16), `--sglang.*` options and
    pass-through. `build_engine` calls it for `--backend.engine sglang`."""
    import tempfile

    from gyre.backends.config import SglangConfig, SglangOptions, resolve_model_dtype
    from gyre.backends.engines.sglang_checkpoint import parse_size, sglang_model_dir
    from gyre.backends.engines.sglang_engine import SglangApi, SglangEngine

    dtype = resolve_model_dtype(cfg.model, cfg.backend)
    if cfg.run_dir:
        out = Path(cfg.run_dir) / "sglang" / name
    else:  # an engine built outside a run (tests, tools)
        out = Path(tempfile.mkdtemp(prefix=f"gyre-sglang-{name}-"))
    opts = getattr(cfg, "sglang", None) or SglangOptions()
    path, written = sglang_model_dir(checkpoint=cfg.model.checkpoint, version=version, out_dir=out,
                                     model_config=model_config, params=params, dtype=dtype,
                                     eos_token_ids=list(eos_token_ids), max_shard_bytes=parse_size(opts.max_shard_size))
    logger.info("sglang %s serves %s (%s, version %d, %s)", name, path, dtype, version,
                "written by Gyre" if written else "the checkpoint directory itself")
    sc = SglangConfig(model_path=path, tp_size=cfg.parallel.cell_size, mem_fraction_static=opts.mem_fraction_static,
                      base_gpu_id=torch.cuda.current_device() if torch.cuda.is_available() else 0, dtype=dtype,
                      enable_memory_saver=opts.enable_memory_saver, extra=dict(opts.extra))
    spec = os.environ.get(SGLANG_API_ENV)
    transfer = getattr(cfg, "transfer", None)
    coverage = transfer.coverage_check if transfer is not None else "auto"
    return SglangEngine(sc, version=version, api=SglangApi.from_spec(spec) if spec else None,
                        sampleable_vocab=sampleable_vocab, eos_token_ids=eos_token_ids, bucket_bytes=_bucket_bytes(cfg),
                        coverage_check=coverage, start_weights=params if coverage != "off" else None)


def _bucket_bytes(cfg: BuildConfig) -> int:
    from gyre.backends.transfer.buckets import bucket_bytes

    transfer = getattr(cfg, "transfer", None)
    return bucket_bytes(transfer.bucket_mb if transfer is not None else 512.0)


# ----------------------------------------------------------------------------- weight transport
def build_transport(cfg: BuildConfig, groups: Groups, store: Any) -> WeightTransport:
    """This rank's `--transfer.transport`. Collective for 'torch' (its gloo group is made by
    `groups.gloo_world('weights', ...)`): every rank calls it at the same point of start-up. The
    core's rank at this rank's position posts; with the CPU backends (cell_size 1) that is rank 0."""
    tc, topo = cfg.transfer, groups.topology
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


def build_kv_transport(cfg: BuildConfig, groups: Groups, store: Any) -> Any:
    """The engines' KV-migration transport (`--proxy.migration` auto|always over
    `--proxy.migration-transport`), or None when migration is off. Collective for 'gloo' (its gloo
    group is made by `groups.gloo_world('kv', ...)`): every rank calls it at the same point of start-up.
    Mooncake KV moves as the weight snapshots do: the same address, protocol and device."""
    if cfg.proxy.migration == "off":
        return None
    from gyre.backends.transfer.migration import build_kv_transport as build

    group = None
    if cfg.proxy.migration_transport == "gloo":
        group = groups.gloo_world("kv", KV_GROUP_TIMEOUT_S)
    tc = cfg.transfer
    return build(cfg.proxy.migration_transport, store.clone(), group, host=tc.host, protocol=tc.mooncake_protocol,
                 device=tc.mooncake_device)
