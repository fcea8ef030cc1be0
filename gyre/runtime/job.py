"""The training job on every rank (`--job train`): build the parts, then follow the controller.

    rank 0       the core's worker (main thread) + the controller (its own thread: proxy,
                 harness runner, scheduler) + its engine (its own thread)
    other ranks  a satellite's (or pool engine's) worker + its engine

The backends (engine, actor, weight transport) come from `gyre.backends.factory`; nothing here
names a concrete one. The per-rank loop is `serve`: wait for a command,
execute it. Every blocking wait of the job is one of: the barrier after `--train.prepare` (`prepare`,
called by gyre.run before the run directory exists), the engine secret's broadcast and the gather
of every rank's process identity (run.json), creating the weight transport (torch: its
gloo group), the barrier after snapshot 0, the cell's barrier before its actors are built
(`CellWorker.first_actor`: after position 0's engine started) and inside each hand-over,
`control.recv` for the next command, a collective inside a command (gradient reduction / parameter broadcast over a prefix group), or a one-sided
snapshot read (`weights.fetch*`, answered by the core's transport without its training thread).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from gyre.backends import factory
from gyre.backends.protocols import WeightTransport
from gyre.runtime.control import CONTROLLER, ControlPlane, SignedStore, default_store
from gyre.errors import EngineDied, RunStopped, WorkerFailed
from gyre.runtime.messages import Failed, Interrupted
from gyre.runtime.rundir import RunDir
from gyre.topology import Groups, Topology

if TYPE_CHECKING:
    from gyre.backends.engines.engine_host import EngineHost
    from gyre.config import GyreConfig
    from gyre.proxy.config import ProxyConfig
    from gyre.runtime.worker import CellWorker

logger = logging.getLogger(__name__)


def train(cfg: GyreConfig, topo: Topology, groups: Groups, run: RunDir, interrupts: Any = None) -> None:
    """`run`: rank 0's decision of the directory, the attempt and the resume point (`gyre.runtime.rundir`);
    `interrupts` (`gyre.runtime.control.Interrupts`): told how to reach the controller here."""
    from gyre.backends.engines.engine_host import share_secret

    factory.set_threads(cfg.train.torch_threads)  # once per process, before the engine or actor is built
    # blocking: rank 0 draws the run's secret and broadcasts it (over gloo, never the store); it
    # signs every store value (SignedStore) and authenticates the engines (engine_http)
    secret = share_secret(groups.control, src=0)
    _record_ranks(topo, groups, run)  # blocking: every rank's process, in run.json (who died, at the end)
    store = SignedStore(default_store(), secret)
    weights = factory.build_transport(cfg.transfer, groups, store)  # blocking (torch): every rank creates its group
    # blocking (gloo): every rank creates the KV-migration group
    kv = factory.build_kv_transport(cfg.proxy.migration, cfg.proxy.migration_transport, cfg.transfer, groups, store)
    try:
        _train(cfg, topo, groups, store, weights, secret, run, kv, interrupts)
    finally:
        weights.close()  # the torch transport's server thread stops here, on success and failure alike
        if kv is not None:
            kv.close()
        _write_transport_stats(Path(cfg.run_dir), topo.rank, weights)


def _chat_format_stop_ids(proxy: ProxyConfig, tokenizer: Any, model_cfg: Any) -> set[int]:
    """The ids of the run's chat format's stop tokens (gyre.config_checks.check_chat_format: the
    checkpoint's template, or --proxy.chat-format); a template no format knows is a ConfigError
    on every rank."""
    from gyre.config_checks import check_chat_format

    fmt = check_chat_format(proxy, tokenizer, model_cfg).format
    ids = (tokenizer.backend_tokenizer.token_to_id(t) for t in fmt.stop_tokens)
    return {i for i in ids if i is not None}


def _train(cfg: GyreConfig, topo: Topology, groups: Groups, store: Any, weights: WeightTransport, engine_secret: str,
           run: RunDir, kv: Any = None, interrupts: Any = None) -> None:
    from gyre.backends.models.vocab import VocabError, check_project_fallback, check_vocab, load_vocab
    from gyre.errors import ConfigError
    from gyre.runtime.controller import Controller
    from gyre.runtime.outputs import make_trackers
    from gyre.runtime.proxy_access import start_data_plane
    from gyre.runtime.plane_attach import attach_data_plane
    from gyre.backends.engines.engine_host import bind_address
    from gyre.runtime.worker import CellWorker

    control = ControlPlane(store, topo.rank)
    if interrupts is not None:  # a signal handler's own connection: the main thread may be mid-call on `store`
        notice = ControlPlane(store.clone(), topo.rank)
        interrupts.notify = lambda name: notice.send(CONTROLLER, Interrupted(cell=topo.cell, rank=topo.rank, signal=name))
    # The run's tokenizer (gyre.backends.models.vocab.load_vocab: the checkpoint's own when it has one),
    # resolved once the checkpoint is there (a prepared one too): its size bounds what the engines
    # sample, the checkpoint's eos ids end a turn. check_train_config compared an existing
    # checkpoint's embedding with it already; a prepared one is checked below.
    ckpt_dir = Path(cfg.run_dir) / "checkpoints"  # --train.prepare ran before the run directory (`prepare`)
    core_actor = None
    if topo.is_core:  # the authoritative weights and optimizer state live here (docs/design.md §1)
        vocab = load_vocab(cfg.model.checkpoint, cfg.proxy.tokenizer_path)
        core_actor, model_cfg = core_actor_offloaded(cfg, vocab.size, ckpt_dir, weights)
    # blocking: the starting snapshot is there, and every core position's actor has left its GPU
    # before position 0's engine measures the cell's free memory below
    dist.barrier(group=groups.control)
    if core_actor is None:
        vocab = load_vocab(cfg.model.checkpoint, cfg.proxy.tokenizer_path)
        model_cfg = factory.model_config_of(cfg.model, vocab.size)
    try:  # every rank, same point: a refusal is a ConfigError each rank leaves with (gyre/run.py)
        check_project_fallback(cfg.model.checkpoint, model_cfg.vocab_size, vocab)
        check_vocab(model_cfg.vocab_size, vocab.size, model=cfg.model.checkpoint or f"model preset {cfg.model.preset!r}",
                    tokenizer=f"the tokenizer at {vocab.path or 'gyre/assets/tokenizer'}")
    except VocabError as e:
        raise ConfigError(str(e)) from None
    # A turn ends at the checkpoint's eos ids and at the chat format's end-of-turn tokens (Llama 3.1:
    # <|eot_id|>, <|eom_id|>, <|end_of_text|>; a generation_config may name only one of them).
    stop_ids = sorted(set(vocab.stop_ids) | _chat_format_stop_ids(cfg.proxy, vocab.tokenizer, model_cfg))

    start_version = weights.latest()  # 0, or the resumed checkpoint's version
    engine_host = None
    if topo.position == 0:  # a cell's (or pool engine's) first rank serves its engine
        engine = factory.build_engine(cfg.model, cfg.engine, cfg.backend, model_cfg, weights.fetch(start_version),
                                      version=start_version, eos_token_ids=stop_ids, sampleable_vocab=vocab.size,
                                      name=f"rank{topo.rank}", transfer=cfg.transfer, sglang=cfg.sglang,
                                      cell_size=cfg.parallel.cell_size, run_dir=cfg.run_dir)
        # torchrun runs the same number of ranks on every node: one node iff local == world.
        single_node = int(os.environ.get("LOCAL_WORLD_SIZE", topo.world_size)) == topo.world_size
        bind, announce = bind_address(cfg.proxy.host, single_node=single_node, peer=os.environ.get("MASTER_ADDR"))
        if kv is not None and hasattr(engine, "attach_kv_transport"):
            engine.attach_kv_transport(kv, measure_prefill=True)  # --proxy.migration: this engine can move calls
        engine_host = host_engine(engine, host=bind, announce=announce, secret=engine_secret)
        store.set(f"engine/{topo.rank}", engine_host.url)

    def make_actor(is_core: bool):
        return factory.build_actor(cfg.model, cfg.backend, cfg.actor, cfg.loss, cfg.parallel, model_cfg, is_core=is_core)

    worker = CellWorker(topo, groups, control, weights, engine_host, make_actor, checkpoint_dir=str(ckpt_dir),
                        checkpoint_every=cfg.train.checkpoint_every, audit_dir=cfg.train.audit_dir,
                        offload_actor=cfg.backend.offload_actor)
    # A satellite's actor is built now, not at its first switch: the first model build in a
    # process costs seconds (library imports, 5-7 s measured under load), which used to keep
    # every satellite out of the first step it was switched in for. Blocking: after the engine
    # on position 0 measured the free memory of every GPU of the cell (the cell's barrier).
    worker.first_actor(core_actor)
    controller = None
    data_plane = attach_data_plane if cfg.executions.plane == "process" else start_data_plane
    if topo.is_controller:
        controller = Controller(
            topo, store, run, scheduler=cfg.scheduler, train=cfg.train, loss=cfg.loss, executions=cfg.executions,
            seed=cfg.seed, data_plane=functools.partial(data_plane, cfg.model, cfg.proxy, cfg.executions),
            trackers=make_trackers(cfg.tracking, str(run.path), name=Path(run.path).name, group=cfg.preset,
                                   config=dataclasses.asdict(cfg), fresh=not cfg.train.resume),
            start_version=start_version, engine_secret=engine_secret, interrupts=interrupts)
        controller.start()

    serve(worker, control, topo, controller)
    if controller is not None:
        controller.join()  # raises RunFailed when the run stopped early
    elif worker.stopped_by_failure:
        raise RunStopped(f"rank {topo.rank}: stopped early by the controller (rank 0 reports why)")
    logger.info("rank %d done", topo.rank)


def core_actor_offloaded(cfg: GyreConfig, vocab_size: int, ckpt_dir: Path, weights: WeightTransport) -> tuple[Any, Any]:
    """The core's actor and model config; its starting snapshot posted; then (--backend.offload-actor)
    its state moved to host memory, before the core cell's engine starts. SGLang sizes its KV pool
    once, at start, from the memory free on the cell's GPUs (kv_cache_configurator.py:2990-3060:
    free after its weights load less the slack pre × (1 − mem_fraction_static)): an actor still
    resident then (its bf16 weights and fp32 masters: ~49 GB for an 8B model) is memory the KV cache
    never gets back, and the longest prompt shrinks with it. The actor returns to the device at the
    cell's first switch to training, as after every rollout. With --backend.no-offload-actor it stays
    resident for the whole run, so the engine rightly sizes around it."""
    core_actor, model_cfg = factory.build_core_actor(cfg.model, cfg.backend, cfg.actor, cfg.loss, cfg.parallel,
                                                     cfg.train.resumed(), vocab=vocab_size, checkpoint_dir=ckpt_dir)
    weights.post(core_actor.version, core_actor.export_parameters(), published=True)
    if cfg.backend.offload_actor:
        t0 = time.perf_counter()
        nbytes = core_actor.offload()
        logger.info("core actor offloaded before the engine starts: %.1f MB in %.2fs", nbytes / 1e6,
                    time.perf_counter() - t0)
    return core_actor, model_cfg


def host_engine(engine: Any, *, host: str, announce: str, secret: str | None) -> EngineHost:
    """This rank's engine, started and served from its own thread (`EngineHost`), with the SIGQUIT
    watch on this (main) thread: an engine process that dies is this rank's diagnosed failure
    (`engine_host.SigquitWatch`), not a core dump."""
    from gyre.backends.engines.engine_host import EngineHost

    return EngineHost(engine, host=host, announce=announce, secret=secret, watch_sigquit=True)


def serve(worker: CellWorker, control: ControlPlane, topo: Topology, controller: Any = None, *,
          linger_s: float = 3.0) -> None:
    """The rank's loop: wait for the controller's next command, execute it, until a `Stop`.

    A handler that raises, or the engine dying (`EngineDied`, raised by the SIGQUIT watch wherever
    this thread waits, a command's engine call or the next command): its traceback is logged here,
    the controller is told (it stops the other ranks and states the root cause once) and given
    `linger_s` to do so before torchrun tears the job down; then WorkerFailed."""
    while True:
        msg = None
        try:
            msg = control.recv(what="the controller's next command (normal while the run is in rollout)")  # blocking: the controller's next command
            if not worker.handle(msg):
                return
        except Exception as e:
            if msg is None and not isinstance(e, EngineDied):
                raise  # the control plane itself failed (gyre.run logs it)
            logger.exception("rank %d failed %s", topo.rank,
                             f"while handling {msg!r}" if msg is not None else "while waiting for a command")
            command = type(msg).__name__ if msg is not None else "no command (it was waiting for one)"
            error = f"{type(e).__name__}: {e}"
            if e.__context__ is not None and e.__cause__ is None:  # raised while handling another (a
                # hand-over's barrier in `finally` after a failed release): that one is the root cause
                error += f" (while handling {type(e.__context__).__name__}: {e.__context__})"
            control.send(CONTROLLER, Failed(cell=topo.cell, rank=topo.rank, command=command, error=error))
            if controller is not None:
                controller.join()  # raises the RunFailed it built from the report
            time.sleep(linger_s)
            raise WorkerFailed(f"rank {topo.rank} failed") from e


def _record_ranks(topo: Topology, groups: Groups, run: RunDir) -> None:
    """Gather every rank's process identity on rank 0 (over the control group) and record it in
    this attempt's run.json entry (`gyre.runtime.peers`)."""
    from gyre.runtime import attempts, peers

    ranks: list[Any] = [None] * topo.world_size
    dist.all_gather_object(ranks, peers.identity(topo.rank), group=groups.control)
    if topo.rank == 0:
        attempts.record_ranks(run.path, run.attempt, ranks)


def _write_transport_stats(run_dir: Path, rank: int, weights: Any) -> None:
    """run_dir/transport/rank_<r>.json: what this rank's weight transport moved, by path."""
    try:
        out = run_dir / "transport"
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank_{rank:03d}.json").write_text(json.dumps(weights.stats.as_dict(), indent=1) + "\n")
    except OSError as e:  # an unwritable run dir must not hide the run's own outcome
        logger.warning("could not write transport stats: %r", e)


def prepare(cfg: GyreConfig, topo: Topology, groups: Groups) -> None:
    """`--train.prepare`, before the run directory is decided: rank 0 runs the hook, every rank
    waits for it, then checks what it wrote (`gyre.config_checks.check_prepared`), so a path the hook
    does not write is a refusal before run.json exists. Nothing to do without a hook."""
    from gyre.config_checks import check_prepared, prepared_later

    if not cfg.train.prepare:
        return
    checkpoint = prepared_later(cfg.model.checkpoint, cfg.train)
    dataset = not Path(cfg.executions.dataset.path).exists()
    if topo.is_controller:
        _prepare(cfg)  # the other ranks wait in the barrier below
    dist.barrier(group=groups.control)  # blocking: the prepared data (and warm start) are there
    check_prepared(cfg, checkpoint=checkpoint, dataset=dataset)


def _prepare(cfg: GyreConfig) -> None:
    """Run the config's preparation hook (e.g. the cpu_demo dataset and warm start)."""
    import importlib

    module, _, fn = cfg.train.prepare.partition(":")
    if not module or not fn:
        raise ValueError(f"train.prepare must be 'module:function', got {cfg.train.prepare!r}")
    kwargs: dict[str, Any] = {"seed": cfg.seed}
    if cfg.model.checkpoint and not _inside(cfg.model.checkpoint, cfg.train.prepare_dir):
        # The user's own checkpoint (--model.checkpoint outside the prepared directory): the hook
        # writes the data only, no starting checkpoint of the project model.
        kwargs["with_checkpoint"] = False
    logger.info("preparing with %s into %s (the other ranks wait)", cfg.train.prepare, cfg.train.prepare_dir)
    out = getattr(importlib.import_module(module), fn)(cfg.train.prepare_dir, **kwargs)
    logger.info("prepared: %s", out)


def _inside(path: str, root: str) -> bool:
    if not root:
        return False
    p, r = Path(path).resolve(), Path(root).resolve()
    return p == r or r in p.parents
