"""Entry point: `torchrun --standalone --nproc-per-node 4 -m gyre.run [--preset NAME] [overrides]`.

Every rank runs this same program (SPMD, docs/design.md §1): parse the config, initialize
torch.distributed, build the topology and every process group up front, then run the job.
Every blocking collective of the top level is visible here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gyre.config import ConfigError, GyreConfig, parse_config
from gyre.config_checks import check_job, check_train_config
from gyre.errors import RunFailed, RunStopped
from gyre.logging_utils import ONCE, setup_logging
from gyre.topology import Groups, Topology, TopologyError

if TYPE_CHECKING:
    from gyre.runtime.rundir import RunDir

logger = logging.getLogger("gyre.run")


def device_and_backend(cuda_available: bool, device_count: int, local_rank: int, requested: str) -> tuple[torch.device, str]:
    """This rank's device and the torch.distributed backend string (pure: no CUDA call).

    With CUDA every rank binds the GPU of its LOCAL_RANK (NCCL will not put two ranks on one
    GPU), and the default backend is torch's multi-backend string "cpu:gloo,cuda:nccl": CPU
    tensors (control, smoke check, CPU snapshots, the CPU actor's gradients) go over gloo, CUDA
    tensors (Megatron's gradients and TP/PP traffic) over NCCL, on the same groups. Plain
    "nccl" would fail on the first CPU tensor ("No backend type associated with device type cpu").

        requested   no CUDA               CUDA
        auto        cpu,  "gloo"          cuda:LOCAL_RANK, "cpu:gloo,cuda:nccl"
        gloo        cpu,  "gloo"          cuda:LOCAL_RANK, "gloo" (a control run: NCCL off)
        nccl        refused               cuda:LOCAL_RANK, "cpu:gloo,cuda:nccl"

    >>> device_and_backend(True, 8, 3, "auto")
    (device(type='cuda', index=3), 'cpu:gloo,cuda:nccl')
    """
    if requested not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"--parallel.backend {requested!r}: choose one of auto, gloo, nccl")
    if not cuda_available:
        if requested == "nccl":
            raise ConfigError("--parallel.backend nccl: CUDA is not available on this machine; "
                              "use --parallel.backend auto (gloo here)")
        return torch.device("cpu"), "gloo"
    if not 0 <= local_rank < device_count:
        raise ConfigError(f"LOCAL_RANK {local_rank}: only {device_count} CUDA devices are visible and each rank "
                          f"needs its own GPU; start at most {device_count} ranks per node (--nproc-per-node)")
    return torch.device("cuda", local_rank), "gloo" if requested == "gloo" else "cpu:gloo,cuda:nccl"


def bind_device(requested: str) -> str:
    """Choose this rank's device and backend (`device_and_backend`), bind the GPU, return the
    backend string for `init_process_group`."""
    device, backend = device_and_backend(torch.cuda.is_available(), torch.cuda.device_count(),
                                         int(os.environ.get("LOCAL_RANK", "0")), requested)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work: the caching allocator, NCCL, Megatron
    return backend


def smoke_check(topo: Topology, groups: Groups) -> None:
    """All-reduce over every prefix group this rank belongs to and check the sum.

    Rank r contributes (cell(r) + 1); over the prefix group of cells 0..k−1 the sum must be
    k(k+1)/2. Ranks outside a prefix never call its collective, so they are never blocked.
    """
    if topo.is_pool:
        logger.info("standalone pool rank: in no prefix group")
        return
    for k in range(2, topo.num_cells + 1):
        if topo.cell >= k:
            continue
        t = torch.tensor([float(topo.cell + 1)])
        dist.all_reduce(t, group=groups.prefix(k))  # blocking: members of cells 0..k−1 only
        expected = k * (k + 1) / 2
        if t.item() != expected:
            raise RuntimeError(f"prefix k={k} all-reduce gave {t.item()}, expected {expected}")
    logger.info("prefix all-reduce ok for k=2..%d", topo.num_cells)


def _leave_together(rank: int, world: int, timeout: float = 20.0) -> None:
    """After a failure every rank has been told to stop; rank 0 (whose exit code carries the
    failure) leaves last, so torchrun does not SIGTERM ranks that were exiting cleanly and list
    them as failures beside the root cause."""
    from gyre.runtime.control import default_store

    store = default_store()
    if rank != 0:
        store.add("leaving", 1)
        return
    deadline = time.monotonic() + timeout
    while store.add("leaving", 0) < world - 1 and time.monotonic() < deadline:
        time.sleep(0.05)


def init_distributed(backend: str) -> tuple[int, object | None]:
    """`init_process_group` that also works when torchrun restarts the job (`--max-restarts`).

    Two stores, as torchrun gives them. Its agent's store (TORCHELASTIC_USE_AGENT_STORE; one node,
    or static rendezvous) is kept for the whole job, and its workers' env:// store has no
    per-restart prefix: the new ranks would read the dead ranks' gloo addresses under the same
    keys ("Gloo connectFullMesh failed ... Connection refused"). So every attempt gets its own
    prefix there (`gyre/attempt_<TORCHELASTIC_RESTART_COUNT>/`), under which every Gyre key
    (`default_store()`) lives, and the unprefixed store outlives the attempt (where rank 0 records
    the run directory for the next one; `gyre.runtime.rundir`). With several nodes the restart
    counts differ between nodes (a torchrun whose ranks were restarted because another node's
    died does not count it), so a prefix from them splits the world: launch.sh then runs c10d
    rendezvous with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, where rank 0 hosts a fresh store each
    round, and the prefix is fixed. Returns the restart count (the largest of any rank's,
    plus Slurm's requeues) and the store that outlives the attempt (None without one).
    """
    from torch.distributed import PrefixStore, TCPStore

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # else rank 0 hosts it, as env:// does
    if agent and rank == 0 and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1 \
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        logger.warning("torchrun --max-restarts across %s nodes with its agent's store (static rendezvous, or "
                       "c10d without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): a restart will not meet again; use "
                       "launch.sh, or --rdzv-backend c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/cluster.md)",
                       os.environ["GROUP_WORLD_SIZE"])
    raw = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=not agent and rank == 0,
                   timeout=dist.default_pg_timeout, multi_tenant=not agent)
    prefix = f"gyre/attempt_{attempt}/" if agent else "gyre/attempt/"
    dist.init_process_group(backend, store=PrefixStore(prefix, raw), rank=rank, world_size=world)
    # blocking: every rank's restart count, for rank 0's decision (resume in the same directory)
    counts = torch.tensor([attempt])
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    os.environ["GYRE_TORCHRUN_RESTARTS"] = str(int(counts.item()))  # the agreed count (plane_attach.restarts_left)
    # A restart is torchrun's (this job's store outlives it) or Slurm's (a requeued job: a new
    # torchrun; launch.sh gives it the same --run-dir).
    return int(counts.item()) + int(os.environ.get("SLURM_RESTART_COUNT", "0")), raw if agent else None


_RUN: list = []  # this job's RunDir once rank 0 decided it (for a forced exit's records)


def _force_exit(code: int) -> None:
    """The graceful stop ran out of time (or a second signal came): never cut a checkpoint
    silently — name the one being written —, record the attempt's end if the controller could
    not (rank 0: summary, events line, `ended`), then exit at once."""
    from gyre import checkpoint

    if (note := checkpoint.cut_note()) is not None:
        logger.error("%s", note)
    if _RUN and int(os.environ.get("RANK", "0")) == 0:
        name = signal.Signals(code - 128).name if 128 < code < 128 + 65 else "a signal"
        _end_interrupted(0, _RUN[0], name, "(the graceful stop did not finish within --train.shutdown-timeout-s: a "
                                            "rank that did not answer, or a start-up that took the budget)")
    for h in logging.getLogger().handlers:
        h.flush()
    os._exit(code)


def _end_interrupted(rank: int, run: object | None, name: str, why: str | None = None) -> None:
    """Rank 0, a signal while the job was starting (before the controller could run its stop):
    the attempt, once it exists, still ends with its summary, events line and `ended` record."""
    if rank != 0 or run is None:
        return
    from gyre.runtime.stop import early_end

    try:
        early_end(run, name, *(() if why is None else (why,)))
    except (OSError, ValueError, LookupError) as err:
        logger.error("interrupted by %s while starting; its summary could not be written: %s", name, err)


def _parse_once(argv: list[str] | None) -> GyreConfig:
    """`parse_config`, with what it prints (`--help`, a refused flag) said by rank 0 alone: every
    rank parses the same command line, and torchrun would show the same message once per rank."""
    if os.environ.get("RANK", "0") == "0":
        try:
            return parse_config(argv)
        except SystemExit as e:
            if e.code not in (0, None):
                why = e.code if isinstance(e.code, str) else "the message above"
                tell_torchrun(f"gyre: the command line was refused ({why}); `python -m gyre.run --help` lists the flags")
            raise
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            return parse_config(argv)
        except SystemExit as e:  # rank 0 says it and fails the job; the other ranks leave quietly
            raise SystemExit(0 if e.code not in (0, None) else e.code) from None


def tell_torchrun(message: str) -> None:
    """Name the failure in torchrun's end-of-job report ("Root Cause ... traceback: <message>")
    instead of "To enable traceback see ...": its error file, when torchrun gave one
    (TORCHELASTIC_ERROR_FILE, torch.distributed.elastic.multiprocessing.errors)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json

    try:
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)
    except OSError:
        pass


def load_note(load1: float, cores: int, ranks_here: int) -> str | None:
    """What the machine's load does to this run's times, for the log at start (None: quiet).

    With `load1` other runnable processes on `cores` cores, the node's `ranks_here` ranks get
    cores / (load1 + ranks) of a core each instead of min(1, cores / ranks): times stretch by up to
    the ratio.

    >>> load_note(30.0, 2, 4)
    'machine load 30.0 on 2 cores (15.0 a core) before start: this run's 4 ranks get a smaller share, so steps may take up to 8.5x as long as on a quiet machine'
    >>> load_note(0.5, 2, 4) is None
    True
    """
    if cores <= 0 or load1 <= 0.5 * cores:
        return None
    slow = min(1.0, cores / ranks_here) / (cores / (load1 + ranks_here))
    return (f"machine load {load1:.1f} on {cores} cores ({load1 / cores:.1f} a core) before start: this run's "
            f"{ranks_here} ranks get a smaller share, so steps may take up to {slow:.1f}x as long as on a quiet machine")


def resolve_run_dir(cfg: GyreConfig, rank: int, world: int, store: Any, **kw: Any) -> RunDir:
    """`gyre.runtime.rundir.resolve` on the sections it reads; its decision (the directory, the
    checkpoint resumed from) written back into `cfg` for the job."""
    from gyre.runtime import rundir

    run = rundir.resolve(cfg.run_dir, cfg.preset, cfg.train.resumed(), rank, world, store, overwrite=cfg.overwrite,
                         config=dataclasses.asdict(cfg), **kw)
    cfg.run_dir, cfg.train.resume, cfg.train.resume_from = str(run.path), bool(run.checkpoint), run.checkpoint
    return run


def main(argv: list[str] | None = None) -> int:
    """Run the job; 0 when it succeeded. A failure is stated once: by the controller for a run
    that stopped early (RunFailed), else by the rank that raised, with its traceback."""
    cfg: GyreConfig = _parse_once(argv)
    setup_logging(cfg.log_level)
    if cfg.job == "train" and os.environ.get("LOCAL_RANK", "0") == "0" and hasattr(os, "getloadavg"):
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if note := load_note(os.getloadavg()[0], os.cpu_count() or 1, ranks_here):
            logger.warning("%s", note)
    from gyre.sized_defaults import apply_checkpoint_defaults

    given = list(sys.argv[1:] if argv is None else argv)
    for note in apply_checkpoint_defaults(given, cfg.preset, cfg.model, cfg.backend, cfg.actor, cfg.train):
        logger.info("default for the checkpoint: %s", note, extra=ONCE)
    alone = "RANK" not in os.environ
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a SIGKILLed torchrun takes its ranks (and harnesses) with it
        from gyre.executions.procs import watch_parent
        watch_parent("torchrun")
    if alone:
        # Plain `python -m gyre.run`: a world of one, as torchrun would set it up.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    try:
        check_job(cfg, list(sys.argv[1:] if argv is None else argv))  # training flags without --job train
        backend = bind_device(cfg.parallel.backend)
    except ConfigError as e:  # before the rendezvous: every rank has it, rank 0 says it
        logger.error("%s", e, extra=ONCE)
        if os.environ["RANK"] == "0":
            tell_torchrun(f"gyre: {e}")
        return 2 if os.environ["RANK"] == "0" else 0
    if alone:
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        restart, elastic = 0, None
    else:
        restart, elastic = init_distributed(backend)  # blocking: rendezvous
    rank, world = dist.get_rank(), dist.get_world_size()
    from gyre.runtime.rundir import RunDirError, RunFinished

    rc = 0
    run = None  # rank 0's decision of the run directory, once made
    # SIGINT/SIGTERM (Ctrl-C, scancel, Slurm preemption, torchrun forwarding either) stop a train
    # job gracefully: the controller runs its failure path and the run exits non-zero.
    from gyre.runtime.control import Interrupts

    interrupts = Interrupts(rank, cfg.train.shutdown_timeout_s, force=_force_exit)
    if cfg.job == "train":
        interrupts.install()  # job.train hands it to the controller: the stop budget runs from its signal
    try:
        topo = Topology.from_config(cfg.parallel, world, rank)
        logger.info("topology (%s backend):\n%s", dist.get_backend(), topo.describe(), extra=ONCE)
        t0 = time.perf_counter()
        groups = topo.create_groups()  # blocking: every rank creates every group, same order
        logger.info("created all process groups in %.2fs", time.perf_counter() - t0, extra=ONCE)
        if cfg.job == "train":
            check_train_config(cfg, topo.num_cells)
            from gyre.runtime.job import prepare

            prepare(cfg, topo, groups)  # blocking: rank 0 writes --train.prepare's files; every rank checks them
            if cfg.backend.actor == "megatron":
                from gyre.backends.factory import megatron_config_of
                from gyre.backends.actors.megatron_config import initialize_parallel_state

                # blocking: Megatron's groups are world-collective: every rank, pool ranks too
                initialize_parallel_state(megatron_config_of(cfg.parallel, cfg.model), seed=cfg.model.seed)
        if cfg.job == "smoke":
            smoke_check(topo, groups)
        else:
            from gyre.executions import scratch
            from gyre.runtime.control import default_store
            from gyre.runtime.job import train  # the full RL loop (scheduler, cells, proxy, actors)

            if os.environ.get("LOCAL_RANK", "0") == "0":  # one sweep a node
                scratch.sweep()  # temporary directories of processes killed before they could clean up (a crashed attempt's)
            # blocking: rank 0 decides the directory, the attempt and the checkpoint to resume from
            run = resolve_run_dir(cfg, rank, world, default_store(), restart=restart, elastic=elastic)
            _RUN[:] = [run]
            logger.info("run directory: %s (attempt %d%s)", run.path, run.attempt,
                        f", resuming version {run.start_version} from {run.checkpoint}" if run.checkpoint else "",
                        extra=ONCE)
            train(cfg, topo, groups, run, interrupts)
        dist.barrier(group=groups.control)  # blocking: everyone done
    except RunFinished as e:  # a restart after the last step: every rank has it, the job succeeded
        logger.warning("%s", e, extra=ONCE)
        _leave_together(rank, world)
    except (ConfigError, RunDirError, TopologyError) as e:  # a refused config: every rank has it, rank 0 says it
        logger.error("%s", e, extra=ONCE)
        rc = 2 if rank == 0 else 0  # one failure for torchrun to report: rank 0's
        if rank == 0:
            tell_torchrun(f"gyre: {e}")
        _leave_together(rank, world)
    except RunFailed as e:
        if isinstance(e, RunStopped):  # the run failed elsewhere and the controller said why
            logger.info("%s", e)
            rc = 0
        else:  # the controller already logged the diagnosis; after a signal, 128 + it, as a shell says
            rc = interrupts.code if interrupts.first is not None else 1
        # After a signal, within the shutdown bound: a rank that died (the cause) never reports leaving.
        _leave_together(rank, world, timeout=3.0 if interrupts.first is not None else 20.0)
    except KeyboardInterrupt as e:  # a signal before the controller could take it (Interrupts.handle)
        name = e.args[0] if e.args and e.args[0] in signal.Signals.__members__ else "SIGINT"
        rc = 128 + signal.Signals[name].value
        _end_interrupted(rank, run, name)
    except Exception:
        logger.exception("rank %d failed", rank)
        rc = 1
        if interrupts.first is not None:  # start-up broke off by the signal (a peer that left): still recorded
            _end_interrupted(rank, run, interrupts.first[0])
    finally:
        dist.destroy_process_group()
    if rc == 0:
        logger.info("done", extra=ONCE)
    return rc


if __name__ == "__main__":
    sys.exit(main())
