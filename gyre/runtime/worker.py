"""The cell worker: what every rank does with the controller's commands (docs/design.md §1, §3).

A worker owns its cell's state machine (`gyre.runtime.cell`), the rollout engine it serves (first rank
of a cell or pool engine) and, once the cell has trained, its training actor (kept across
bursts; only the core's holds optimizer state), all typed by `gyre.backends.protocols`. Commands (`gyre.runtime.messages`, where the
whole protocol is drawn) arrive in the rank's mailbox and go to one handler each (`HANDLERS`);
every transition is reported to the controller, which keeps the run's timeline.

    ToTrain             ROLLOUT → DRAINING (engine releases memory; the proxy has already
                        rerouted its calls) → JOINING (actor state back on the device; a satellite
                        pulls the core's current snapshot) ; then asks for work. Every hand-over
                        waits for the whole cell between its two halves (`cell_barrier`)
    TrainWork           train one bundle of micro-steps (JOINING → TRAIN on the first); ask again
    Reduce(k, final,    sum gradients over the prefix group of cells 0..k−1; the core scales
      grad_scale,       them by grad_scale (|E| = valid, docs/design.md §6), clips, steps (no
      trained)          update when grad_scale is None: no valid execution; no reduce either
                        when not trained: every group all-equal, no micro-step) and posts the new
                        snapshot (`WeightTransport.post`); on a non-final step the new
                        parameters are broadcast over the same group (`WeightTransport.broadcast`)
    ToRollout(v)        → RESUMING (actor state to host memory, device cache freed —
                        --backend.offload-actor —; engine resumes, loads published version v)
                        → ROLLOUT. Joined / RolledBack carry the switch's parts in seconds.
    Load(v)             a rollout engine loads published version v between decode steps
    Stop(failed,        report the timeline, save the core's checkpoint (not after a failure,
      checkpoint)       unless `checkpoint`: an interrupt), stop the engine
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from gyre.backends.protocols import Actor, WeightTransport
from gyre import checkpoint
from gyre.runtime.cell import CellState, CellStateMachine
from gyre.runtime.control import CONTROLLER, ControlPlane
from gyre.runtime.messages import (Command, Joined, Load, Loaded, Reduce, Report, RequestWork, RolledBack, StepDone,
                                   Stop, Stopped, ToRollout, ToTrain, TrainWork, Transition, WorkDone, handler_for)
from gyre.runtime.samples import train_bundle
from gyre.topology import Groups, Topology

if TYPE_CHECKING:
    from gyre.backends.engines.engine_host import EngineHost

logger = logging.getLogger(__name__)


class CellWorker:
    def __init__(
        self,
        topo: Topology,
        groups: Groups,
        control: ControlPlane,
        weights: WeightTransport,
        engine_host: EngineHost | None,
        make_actor: Callable[[bool], Actor],
        *,
        checkpoint_dir: str | None = None,
        checkpoint_every: int = 0,
        audit_dir: str = "",
        offload_actor: bool = True,
        cell_wait_s: float = 1200.0,
    ) -> None:
        self.cell_wait_s = cell_wait_s  # `cell_barrier`'s deadline: longer than an engine's start (EngineHost, 600 s)
        self.audit_dir = audit_dir
        self.offload_actor = offload_actor  # --backend.offload-actor: the actor leaves the device in rollout
        self.checkpoint_every = checkpoint_every
        self.topo, self.groups, self.plane, self.weights = topo, groups, control, weights
        self.engine = engine_host
        self.make_actor = make_actor
        self._actor: Actor | None = None
        self.checkpoint_dir = checkpoint_dir
        self._checkpointed: int | None = None  # the version of the last checkpoint written
        self.cell = topo.cell  # None on a standalone-pool rank
        self.sm = CellStateMachine(self.cell if self.cell is not None else -1, clock=time.time)
        self.version = 0  # policy version of the weights this rank holds (engine or actor)
        self.stopped_by_failure = False  # the controller stopped the run early (it reports why)

    # ------------------------------------------------------------------ the actor and its memory
    @property
    def actor(self) -> Actor | None:
        return self._actor

    @actor.setter
    def actor(self, actor: Actor | None) -> None:
        """An actor handed over while the cell serves rollouts (the job builds them at start-up)
        leaves the device at once, as it would entering rollout."""
        self._actor = actor
        if actor is not None and self.sm.state is CellState.ROLLOUT:
            self._offload()

    def first_actor(self, core_actor: Actor | None) -> None:
        """Start-up: this rank's actor, the core's (built before the engine on every position, and
        offloaded before it starts: `job.core_actor_offloaded`) or a satellite's, built now, once
        position 0's engine has started: SGLang sizes its KV cache
        from the memory free on every GPU of the cell at its start and refuses a > 10 % imbalance
        between them (sglang/srt/distributed/bootstrap.py:441-452), so no position loads an actor
        onto its GPU while the engine measures."""
        self.cell_barrier("start-up: position 0's engine started")
        self.actor = core_actor if core_actor is not None else self.make_actor(False)

    def cell_barrier(self, what: str = "the cell's hand-over") -> None:
        """Wait for every rank of this cell (or pool engine): a CPU all-reduce on the cell's own
        group, over gloo whatever the backend string. Position 0's engine spans every GPU of the
        cell (SGLang's TP ranks) while each position holds its own actor, so the memory changes
        hands on all of them together. A cell of one rank has nothing to wait for.

        Polled, not blocking in gloo: the wait is logged every `progress_every` s (the control
        plane's), a signal handler (`engine_host.SigquitWatch`) can raise meanwhile, and past
        `cell_wait_s` it is a TimeoutError naming the cell (a frozen rank would otherwise hold this
        one for gloo's own timeout)."""
        t = self.topo
        if self.groups is None or t.cell_size == 1:
            return
        import torch
        import torch.distributed as dist

        group = (self.groups.cells[t.cell] if t.cell is not None
                 else self.groups.pool[(t.rank - t.num_cells * t.cell_size) // t.cell_size])
        work = dist.all_reduce(torch.zeros(1), group=group, async_op=True)
        start = last = time.monotonic()
        pause = 0.001
        while not work.is_completed():
            now = time.monotonic()
            if now - start > self.cell_wait_s:
                raise TimeoutError(f"rank {t.rank}: cell {t.cell}'s ranks did not all reach {what} within "
                                   f"{self.cell_wait_s:.0f} s")
            if now - last > getattr(self.plane, "progress_every", 30.0):
                logger.info("rank %d: waiting %.0f s for the ranks of cell %s (%s)", t.rank, now - start, t.cell, what)
                last = now
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        work.wait()  # raises what the collective failed with (a peer gone)

    def _offload(self) -> float:
        """Actor state to host memory (`Actor.offload`), unless --backend.no-offload-actor; seconds."""
        if not self.offload_actor:
            return 0.0
        t0 = time.perf_counter()
        nbytes = self._actor.offload()
        dt = time.perf_counter() - t0
        logger.debug("rank %d: actor offloaded, %.1f MB in %.3fs", self.topo.rank, nbytes / 1e6, dt)
        return dt

    def _restore(self) -> float:
        """Actor state back on its device (`Actor.restore`); seconds (0 when it never left)."""
        t0 = time.perf_counter()
        self._actor.restore()
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ helpers
    def _to(self, state: CellState, note: str = "") -> None:
        t = self.sm.to(state, note)
        self._report(Transition(cell=self.cell, rank=self.topo.rank, src=t.src.value, dst=t.dst.value, t=t.time))

    def _report(self, report: Report) -> None:
        """Cell-level reports come from the cell's first rank only (one per cell)."""
        if self.topo.position == 0:
            self.plane.send(CONTROLLER, report)

    def _ensure_version(self, version: int) -> None:
        """A satellite trains at the step's version: fetch it from the core's snapshots when behind.
        (The core cannot step past a version while a cell of the step still has work, so it is held.)"""
        if self.actor.version != version:
            if self.topo.is_core:
                raise RuntimeError(f"core actor is at version {self.actor.version}, step needs {version}")
            self._pull(version, self.weights.fetch(version))

    def _pull(self, version: int, params: dict[str, Any]) -> None:
        """A satellite's actor takes the core's parameters of `version` (read one-sidedly)."""
        self.actor.import_parameters(params)
        self.actor.version = version

    def _audit(self, name: str) -> None:
        """Debug (train.audit_dir): the core's parameters, reduced gradients and optimizer state
        (`Actor.debug_state`; the CPU actor has it, a sharded GPU actor raises)."""
        if not self.audit_dir:
            return
        import os

        import torch

        os.makedirs(self.audit_dir, exist_ok=True)
        torch.save(self.actor.debug_state(), f"{self.audit_dir}/{name}.pt")

    # ------------------------------------------------------------------ commands
    def handle(self, msg: Command) -> bool:
        """Execute one command; False when the worker should exit. UnknownMessage for a type
        `HANDLERS` does not hold."""
        handler = handler_for(self.HANDLERS, msg, f"rank {self.topo.rank}'s worker")
        return handler(self, msg) is not False

    def _on_to_train(self, msg: ToTrain) -> None:
        """Memory hand-over, rollout → train: the engine frees its memory first, on every GPU of
        the cell (the cell's barrier: no position restores before position 0's release has
        ended), then the actor's state comes back to the device (docs/design.md §3); each part is
        timed and reported (position 0's engine_release includes the wait for the cell)."""
        self._to(CellState.DRAINING)
        t = [time.perf_counter()]
        try:
            if self.engine is not None:
                self.engine.release()
        finally:  # a failed release too: the other positions must not wait here forever
            self.cell_barrier("the engine's release")
        t.append(time.perf_counter())
        if self.actor is None:
            self._actor = self.make_actor(self.topo.is_core)  # on the device: the cell trains now
        restore_s = self._restore()
        t.append(time.perf_counter())
        if not self.topo.is_core and self.actor.version != self.weights.latest():
            self._pull(*self.weights.fetch_latest())  # the core's *current* parameters (docs/design.md §3)
        t.append(time.perf_counter())
        parts = {"engine_release": t[1] - t[0], "actor_restore": restore_s, "snapshot": t[3] - t[2]}
        if t[-1] - t[0] > 2.0:
            logger.info("rank %d: switching to train took %.1fs (engine release %.1fs, actor %.1fs, of which "
                        "restore %.1fs; snapshot %.1fs)", self.topo.rank, t[-1] - t[0], t[1] - t[0], t[2] - t[1],
                        restore_s, t[3] - t[2])
        self._to(CellState.JOINING)
        self._report(Joined(cell=self.cell, rank=self.topo.rank, version=self.actor.version, handover_s=parts))
        self._report(RequestWork(cell=self.cell, rank=self.topo.rank))

    def _on_work(self, msg: TrainWork) -> None:
        self._ensure_version(msg.version)
        bundle = self.plane.take_blob(msg.key)
        if self.sm.state is CellState.JOINING:
            self._to(CellState.TRAIN, f"step {msg.step}")
        t0 = time.perf_counter()
        metrics = train_bundle(self.actor, bundle)
        metrics["compute_s"] = time.perf_counter() - t0
        self._report(WorkDone(cell=self.cell, rank=self.topo.rank, step=msg.step, group=msg.group, item=msg.item,
                              metrics=metrics))
        self._report(RequestWork(cell=self.cell, rank=self.topo.rank))

    def _on_reduce(self, msg: Reduce) -> None:
        step, k, final = msg.step, msg.k, msg.final
        stay = msg.stay  # async mode: training cells keep training after a publish
        if self.sm.state is CellState.JOINING:  # joined, trained nothing: still in the step's group
            self._to(CellState.TRAIN, f"step {step} (no work)")
        group = self.groups.prefix(k)
        if msg.trained:  # every cell of the step got the same `trained`: all reduce, or none
            self.actor.reduce_gradients(group)  # blocking: cells 0..k−1 at this position
        stats: dict[str, float] = {}
        if self.topo.is_core:
            self._audit(f"before_{step:06d}")
            stats = self._update(step, msg.grad_scale, msg.trained)
            self._audit(f"after_{step:06d}")
            self.weights.post(self.actor.version, self.actor.export_parameters(), published=final)
        else:
            self.actor.zero_grad()
        keeps_training = not final or stay
        if keeps_training and k > 1:
            # New parameters to the satellites of the step (docs/design.md §3), over the same group.
            params = self.weights.broadcast(group, self.topo.cell_ranks(0)[self.topo.position],
                                            self.actor.export_parameters() if self.topo.is_core else None)
            if not self.topo.is_core:
                self.actor.import_parameters(params)
        if self.topo.is_core or keeps_training:
            self.actor.version = step + 1  # a satellite going back to rollout keeps its old version,
            # so the next time it joins it pulls the core's current snapshot
        if self.topo.is_core and self.checkpoint_every and (step + 1) % self.checkpoint_every == 0:
            took = self._checkpoint()
            if took is not None:  # in the step's metrics row: the stop budget is checked against it
                stats["checkpoint_s"] = took
        if self.topo.is_core:
            if final:
                self._to(CellState.PUBLISHING, f"version {step + 1}")
            self._report(StepDone(cell=self.cell, rank=self.topo.rank, step=step, stats=stats))
            if final and stay:
                self._to(CellState.TRAIN, "publish done, training on")
        if keeps_training:
            self._report(RequestWork(cell=self.cell, rank=self.topo.rank))

    def _update(self, step: int, grad_scale: float | None, trained: bool = True) -> dict[str, float]:
        """The core's optimizer step. grad_scale turns the gradient packed with |E| = B·N into the
        one with the loss's |E| (`gyre.loss.LossConfig.grad_scale`); the actor applies it before
        clipping. None: no execution of the step has a valid reward, so there is no loss; not
        `trained`: every group's rewards were all equal, so no micro-step was made and the
        gradient is zero. Either way the parameters stay as they are (an AdamW step on zero
        gradients would still move them: momentum, weight decay) and the version advances like
        any step's, so the schedule is unchanged."""
        if grad_scale is None or not trained:
            if grad_scale is None:
                logger.warning("step %d: no execution has a valid reward (all excluded after failed evaluations); "
                               "no update, version %d keeps the parameters of version %d", step, step + 1, step)
            else:
                logger.info("step %d: every group's rewards were all equal (zero advantage): no forward/backward, "
                            "no update, version %d keeps the parameters of version %d", step, step + 1, step)
            self.actor.zero_grad()
            self.actor.version += 1  # what optimizer_step would do: the core posts version step + 1
            return {"update_skipped": 1.0}
        return self.actor.optimizer_step(grad_scale=grad_scale)

    def _on_to_rollout(self, msg: ToRollout) -> None:
        """Memory hand-over, train → rollout: the actor's state leaves the device and its cache is
        freed, on every position (the cell's barrier), before the engine takes memory again on
        every GPU of the cell (docs/design.md §3); each part is timed."""
        self._to(CellState.RESUMING)
        try:
            offload_s = self._offload() if self.actor is not None else 0.0
        finally:
            self.cell_barrier("every position's offload")
        t0 = time.perf_counter()
        if self.engine is not None:
            self.engine.resume()
        t1 = time.perf_counter()
        self._load_published(msg.version)
        parts = {"actor_offload": offload_s, "engine_resume": t1 - t0, "engine_load": time.perf_counter() - t1}
        self._to(CellState.ROLLOUT)
        self._report(RolledBack(cell=self.cell, rank=self.topo.rank, version=self.version, handover_s=parts))

    def _on_load(self, msg: Load) -> bool | None:
        """Load the newest published version queued. A rank that fell behind (frozen, swapped
        out) finds several `Load`s in its mailbox: it loads only the newest (the older ones may
        have left the board), and none when a `Stop` is queued behind them (the job is over and
        the core's snapshots with it). Each `Load` taken is answered with a `Loaded`."""
        loads, after = [msg], None
        while (nxt := self.plane.try_recv()) is not None:
            if not isinstance(nxt, Load):
                after = nxt
                break
            loads.append(nxt)
        newest = max(m.version for m in loads)
        if isinstance(after, Stop):
            logger.info("rank %d: %d queued loads (up to version %d) skipped: a Stop follows them",
                        self.topo.rank, len(loads), newest)
        else:
            if len(loads) > 1:
                logger.info("rank %d: %d queued loads coalesced to version %d", self.topo.rank, len(loads), newest)
            self._load_published(newest)
        for _ in loads:
            self._report(Loaded(cell=self.cell, rank=self.topo.rank, version=self.version))
        return self.handle(after) if after is not None else None

    def _load_published(self, version: int) -> None:
        """The engine loads published `version`, or a newer published one if this rank fell so far
        behind that `version` was evicted (its later `Load` commands name that one anyway)."""
        if self.engine is not None:
            version, params = self.weights.fetch_published(version)
            self.engine.update(params, version)
            first, read_back = not getattr(self, "_read_back", False), getattr(self.engine, "read_back", None)
            if read_back is not None and (first or getattr(self.weights, "verify", True)):  # --transfer.verify
                read_back(params, version, full=first)  # gyre.backends.transfer.readback: stops on a mismatch
                self._read_back = True
        self.version = version

    def _checkpoint(self) -> float | None:
        """The core's checkpoint of its current version, written atomically (`gyre.checkpoint`:
        a crash leaves the previous checkpoints intact and no half-written one to resume from).
        A version already written (the end right after a periodic checkpoint) is not written twice,
        and version 0 not at all (the starting weights: a run stopped before its first step used to
        leave a step_000000 behind). Returns the seconds the write took (None: nothing written)."""
        if not self.checkpoint_dir or self.actor.version in (0, self._checkpointed):
            return None
        t0 = time.monotonic()
        path = checkpoint.write(self.checkpoint_dir, self.actor.version, self.actor.save_checkpoint,
                                finalize=self.topo.position == 0)  # a sharded cell's first rank writes the files
        self._checkpointed = self.actor.version
        took = time.monotonic() - t0
        logger.info("checkpoint written to %s (%.1fs)", path, took)
        return took

    def _on_stop(self, msg: Stop) -> bool:
        # A later Stop(failed) behind this one: the controller found this rank silent (frozen) after
        # it had ended the run well; the run failed, and this rank leaves as a stopped one.
        while (later := self.plane.try_recv()) is not None:
            if isinstance(later, Stop) and later.failed:
                msg = later
        self.stopped_by_failure = msg.failed
        if self.topo.is_core and self.actor is not None and (not msg.failed or msg.checkpoint):
            self._checkpoint()  # between commands: the weights and optimizer state of actor.version
        if self.engine is not None:
            self.engine.stop()
        self.plane.send(CONTROLLER, Stopped(cell=self.cell, rank=self.topo.rank))  # every rank, not only the first
        return False

    # One handler per command type (tests/runtime/test_messages.py checks the table is complete).
    HANDLERS: dict[type[Command], Callable[[CellWorker, Any], bool | None]] = {
        ToTrain: _on_to_train,
        TrainWork: _on_work,
        Reduce: _on_reduce,
        ToRollout: _on_to_rollout,
        Load: _on_load,
        Stop: _on_stop,
    }
