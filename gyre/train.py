"""The training job on every rank (`--job train`): build the parts, then follow the controller.

    rank 0       the core's worker (main thread) + the controller (its own thread: proxy,
                 harness runner, scheduler) + its engine (its own thread)
    other ranks  a satellite's (or pool engine's) worker + its engine

The per-rank loop is the last few lines of `train`: wait for a command, execute it. Every
blocking wait of the job is one of: the barrier after snapshot 0, `control.recv` for the next
command, or a collective inside a command (gradient reduction / parameter broadcast over a
prefix group).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gyre.backends.config import ModelConfig
from gyre.control import CONTROLLER, ControlPlane, SnapshotBoard, default_store
from gyre.errors import RunStopped, WorkerFailed
from gyre.logging_utils import ONCE
from gyre.runtime.messages import Failed
from gyre.topology import Groups, Topology

logger = logging.getLogger(__name__)


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}[name]


def _initial_model(mc: ModelConfig, vocab: int, checkpoint_dir: Path, resume: bool) -> Any:
    """The core's starting model: the newest checkpoint (resume), the given one, or a preset."""
    from gyre.backends.models import build_model, load_model, model_config

    if resume:
        found = sorted(checkpoint_dir.glob("step_*"))
        if not found:
            raise FileNotFoundError(f"--train.resume: no checkpoint under {checkpoint_dir}")
        logger.info("resuming from %s", found[-1], extra=ONCE)
        return load_model(str(found[-1]), dtype=_dtype(mc.dtype)), found[-1]
    if mc.checkpoint:
        return load_model(mc.checkpoint, dtype=_dtype(mc.dtype)), None
    return build_model(model_config(mc.preset, vocab), seed=mc.seed, dtype=_dtype(mc.dtype)), None


def train(cfg: Any, topo: Topology, groups: Groups) -> None:
    from gyre.backends.cpu_actor import CpuActor
    from gyre.backends.cpu_engine import CpuEngine
    from gyre.backends.models import build_model
    from gyre.backends.tokenizer import ENDOFTEXT, IM_END, load_tokenizer
    from gyre.runtime.controller import Controller
    from gyre.runtime.engine_host import EngineHost
    from gyre.runtime.worker import CellWorker

    if topo.cell_size != 1:
        raise ValueError(f"parallel.cell_size = {topo.cell_size}: the built-in CPU engine and actor hold a whole "
                         f"model on one rank, so CPU runs use parallel.cell_size = 1 (TP/PP/CP/EP are for the GPU backends)")
    torch.set_num_threads(cfg.train.torch_threads)
    store = default_store()
    board = SnapshotBoard(store)
    control = ControlPlane(store, topo.rank)
    tokenizer = load_tokenizer(cfg.proxy.tokenizer_path)
    ckpt_dir = Path(cfg.run_dir) / "checkpoints"

    if topo.is_controller and cfg.train.prepare:
        _prepare(cfg)  # the other ranks wait in the barrier below
    core_actor = None
    if topo.is_core:  # the authoritative weights and optimizer state live here (docs/design.md §1)
        model, resumed = _initial_model(cfg.model, len(tokenizer), ckpt_dir, cfg.train.resume)
        core_actor = CpuActor(model, is_core=True, config=cfg.actor, loss=cfg.loss)
        if resumed is not None:
            core_actor.load_checkpoint(str(resumed))  # weights, optimizer state and version
            if core_actor.version >= cfg.train.steps:
                raise ValueError(f"--train.resume: {resumed} is already at version {core_actor.version} >= "
                                 f"train.steps = {cfg.train.steps}; train.steps counts the whole run, raise it")
        board.put(core_actor.version, core_actor.export_parameters(), published=True)
    dist.barrier(group=groups.control)  # blocking: the starting snapshot is on the board for every rank

    start_version = board.latest()  # 0, or the resumed checkpoint's version
    params = board.get(start_version)
    model_cfg = core_actor.model.config if core_actor is not None else _config_of(cfg.model, len(tokenizer))
    engine_host = None
    if topo.position == 0:  # a cell's (or pool engine's) first rank serves its engine
        eos = tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])
        engine = CpuEngine(model_cfg, params, version=start_version, config=cfg.engine, eos_token_ids=eos)
        engine.name = f"rank{topo.rank}"
        engine_host = EngineHost(engine, host=cfg.proxy.host)
        store.set(f"engine/{topo.rank}", engine_host.url)

    def make_actor(is_core: bool) -> Any:
        actor = CpuActor(build_model(model_cfg, dtype=_dtype(cfg.model.dtype)), is_core=is_core, config=cfg.actor,
                         loss=cfg.loss)
        actor.version = -1  # nothing yet: the first work pulls the core's current snapshot
        return actor

    worker = CellWorker(topo, groups, control, board, engine_host, make_actor, checkpoint_dir=str(ckpt_dir),
                        checkpoint_every=cfg.train.checkpoint_every, audit_dir=cfg.train.audit_dir)
    # A satellite's actor is built now, not at its first switch: the first model build in a
    # process costs seconds (library imports, 5-7 s measured under load), which used to keep
    # every satellite out of the first step it was switched in for.
    worker.actor = core_actor if core_actor is not None else make_actor(False)
    controller = None
    if topo.is_controller:
        controller = Controller(cfg, topo, store, start_version=start_version)
        controller.start()

    while True:
        msg = control.recv(what="a command from the controller")  # blocking: the controller's next command
        try:
            if not worker.handle(msg):
                break
        except Exception as e:
            # Log the traceback here, tell the controller (it stops the other ranks and states the
            # root cause once), give it a moment to do so before torchrun tears the job down.
            logger.exception("rank %d failed while handling %r", topo.rank, msg)
            control.send(CONTROLLER, Failed(cell=topo.cell, rank=topo.rank, command=type(msg).__name__,
                                            error=f"{type(e).__name__}: {e}"))
            if controller is not None:
                controller.join()  # raises the RunFailed it built from the report
            time.sleep(3.0)
            raise WorkerFailed(f"rank {topo.rank} failed") from e
    if controller is not None:
        controller.join()  # raises RunFailed when the run stopped early
    elif worker.stopped_by_failure:
        raise RunStopped(f"rank {topo.rank}: stopped early by the controller (rank 0 reports why)")
    logger.info("rank %d done", topo.rank)


def _prepare(cfg: Any) -> None:
    """Run the config's preparation hook (e.g. the cpu_demo dataset and warm start)."""
    import importlib

    module, _, fn = cfg.train.prepare.partition(":")
    if not module or not fn:
        raise ValueError(f"train.prepare must be 'module:function', got {cfg.train.prepare!r}")
    logger.info("preparing with %s into %s (the other ranks wait)", cfg.train.prepare, cfg.train.prepare_dir)
    out = getattr(importlib.import_module(module), fn)(cfg.train.prepare_dir, seed=cfg.seed)
    logger.info("prepared: %s", out)


def _config_of(mc: ModelConfig, vocab: int) -> Any:
    """The model architecture config: from the checkpoint when one is given, else the preset."""
    if mc.checkpoint:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(mc.checkpoint)
    from gyre.backends.models import model_config

    return model_config(mc.preset, vocab)
