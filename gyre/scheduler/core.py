"""The elastic scheduler's decision logic (docs/design.md §2–3): one object, driven by events, shared
by the simulator (`gyre.sim`) and the runtime controller. No IO, no threads, no sleeps.

Cell roles, as the scheduler sees them (the runtime's `gyre.runtime.cell` state machine refines them):

    ROLLOUT ──SwitchToTrain──► TO_TRAIN ──switch_done──► TRAIN
       ▲                          │                        │
       └──switch_done── TO_ROLLOUT ◄──── burst end ────────┘

Any other change raises `IllegalRole`. k(t) = cells not in ROLLOUT; C_R(t) = C_s + (K − k)·C_e.
"""

from __future__ import annotations

import enum
import heapq
import logging
from collections import deque
from dataclasses import dataclass, field

from gyre import dispatch as D
from gyre.scheduler.config import SchedulerConfig
from gyre.scheduler.events import (
    Clock,
    Decision,
    Dispatch,
    EventLog,
    OptimizerStep,
    Publish,
    SwitchToRollout,
    SwitchToTrain,
    Work,
)

logger = logging.getLogger(__name__)


class CellRole(enum.Enum):
    ROLLOUT = "rollout"
    TO_TRAIN = "to_train"
    TRAIN = "train"
    TO_ROLLOUT = "to_rollout"


_LEGAL = {
    CellRole.ROLLOUT: {CellRole.TO_TRAIN},
    CellRole.TO_TRAIN: {CellRole.TRAIN, CellRole.TO_ROLLOUT},
    CellRole.TRAIN: {CellRole.TO_ROLLOUT},
    CellRole.TO_ROLLOUT: {CellRole.ROLLOUT},
}


class IllegalRole(RuntimeError):
    pass


class SchedulerError(RuntimeError):
    """An event that contradicts the scheduler's state (unknown group, double finish, ...)."""


@dataclass
class _GroupProgress:
    """What the scheduler counts of one dispatched group (the run's record of it, with its
    executions and results, is the runtime's `gyre.runtime.ledger.GroupRecord`)."""

    version: int  # v_d: published version when dispatched
    finished: int = 0
    ready: bool = False
    step: int | None = None
    items: int = 0


@dataclass
class _Step:
    index: int
    assigned: list[int] = field(default_factory=list)
    queue: deque = field(default_factory=deque)  # (group, item) not yet claimed
    claimed: int = 0
    done: int = 0
    participants: set[int] = field(default_factory=set)  # cells that trained >= 1 item of it
    updating: bool = False


class ElasticScheduler:
    """Decision logic for modes gyre / colocate / async. See `gyre.scheduler` for the protocol.

    Args:
        cfg: the scheduler config (validated here); `cfg.cell_concurrency` is C_e, executions
            one rollout cell serves at once.
        num_cells: K.
        standalone_concurrency: C_s, the standalone pool's concurrency (0 = no pool).
        clock: a `SimClock` or `WallClock`; every log entry carries clock time.
        log: event log to append to (a new one by default).
        start_version: the version the run starts at (a resumed run's checkpoint); step indices,
            dispatch versions and publishes count on from it.
    """

    def __init__(
        self,
        cfg: SchedulerConfig,
        num_cells: int,
        standalone_concurrency: int = 0,
        *,
        clock: Clock,
        log: EventLog | None = None,
        start_version: int = 0,
    ) -> None:
        cfg.validate(num_cells)
        if start_version < 0:
            raise ValueError(f"start_version must be >= 0, got {start_version}")
        if standalone_concurrency < 0:
            raise ValueError(f"standalone_concurrency (C_s) must be >= 0, got {standalone_concurrency}")
        self.cfg = cfg
        self.K, self.C_e, self.C_s = num_cells, cfg.cell_concurrency, standalone_concurrency
        self.clock = clock
        self.log = log if log is not None else EventLog()
        self.roles = [CellRole.ROLLOUT] * num_cells  # read-only for drivers
        self._k = 0  # cells not in ROLLOUT, kept in step with roles by _set_role
        self.dispatched = self.started = self.finished = 0  # d(t), p(t), f(t) in executions
        self.groups: dict[int, _GroupProgress] = {}
        self._ready: list[tuple[int, int, int]] = []  # heap (v_d, ready seq, group)
        self._ready_seq = 0
        self.version = start_version  # optimizer steps done (a resumed run counts on from its checkpoint)
        self.published = start_version
        self.step = _Step(start_version)
        self.supply_ticks = 0
        self.started_run = False
        self.staleness: list[int] = []  # d of every assigned group, in assignment order

    # ------------------------------------------------------------------ derived quantities
    @property
    def water_level(self) -> int:
        """w(t) = d(t) − f(t): executions dispatched and not yet ended."""
        return self.dispatched - self.finished

    @property
    def cells_in_training(self) -> int:
        """k(t): cells not in ROLLOUT (switching either way counts: they serve no rollouts)."""
        return self._k

    @property
    def rollout_capacity(self) -> int:
        """C_R(t) = C_s + (K − k(t))·C_e."""
        return self.C_s + (self.K - self.cells_in_training) * self.C_e

    @property
    def ready_unassigned(self) -> int:
        return len(self._ready)

    @property
    def burst_pos(self) -> int:
        """Steps already done in the current burst (0..μ−1)."""
        return self.version - self.published

    def train_prefix(self) -> int:
        """k such that cells 0..k−1 are in TRAIN and cell k is not: the cells that can take part in
        a reduce over prefix group k (docs/design.md §1). Cells enter in order, but their switches
        finish in any order: [TRAIN, TO_TRAIN, TRAIN] has prefix 1."""
        k = 0
        while k < self.K and self.roles[k] is CellRole.TRAIN:
            k += 1
        return k

    def _all_claimed(self) -> bool:
        """The step in progress has all B groups assigned and every micro-step claimed."""
        return len(self.step.assigned) == self.cfg.batch_groups and not self.step.queue

    def _snapshot(self) -> dict:
        return dict(
            w=self.water_level,
            C_R=self.rollout_capacity,
            k=self.cells_in_training,
            ready=self.ready_unassigned,
            supply_ticks=self.supply_ticks,
        )

    def _set_role(self, cell: int, role: CellRole) -> None:
        cur = self.roles[cell]
        if role not in _LEGAL[cur]:
            raise IllegalRole(f"cell {cell}: {cur.value} -> {role.value} is not a legal role change")
        self._k += (cur is CellRole.ROLLOUT) - (role is CellRole.ROLLOUT)
        self.roles[cell] = role

    # ------------------------------------------------------------------ start and dispatch
    def start(self) -> list[Decision]:
        """Initial boundary dispatch (φ+μ)·B groups; async mode also fixes its training cells."""
        if self.started_run:
            raise SchedulerError("start() called twice")
        self.started_run = True
        out: list[Decision] = []
        if self.cfg.mode == "async":
            for c in range(self.cfg.async_train_cells):
                out.append(self._switch_to_train(c))
        if self.cfg.dispatch == "boundary":
            first = D.phi_groups(self.cfg.phi, self.cfg.batch_groups) + self.cfg.mu * self.cfg.batch_groups
        else:
            first = D.continuous_matched_inflight(self.cfg.phi, self.cfg.mu, self.cfg.batch_groups)
        out.append(self._dispatch(first))
        return out

    def _dispatch(self, n_groups: int) -> Dispatch:
        first = len(self.groups)
        for g in range(first, first + n_groups):
            self.groups[g] = _GroupProgress(version=self.published)
        self.dispatched += n_groups * self.cfg.n_per_group
        self.log.add(self.clock(), "dispatch", first_group=first, n_groups=n_groups, version=self.published, w=self.water_level)
        return Dispatch(first, n_groups, self.published)

    # ------------------------------------------------------------------ execution events
    def _group(self, g: int) -> _GroupProgress:
        if g not in self.groups:
            raise SchedulerError(f"unknown group {g}")
        return self.groups[g]

    def on_execution_started(self, group: int, execution: int | None = None) -> list[Decision]:
        """A harness began; `execution` (index within the group) is optional, logged so that a
        run's event log yields measured durations (gyre.sim.durations.EmpiricalDurations)."""
        self._group(group)
        self.started += 1
        if self.started > self.dispatched:
            raise SchedulerError("more executions started than dispatched")
        self.log.add(self.clock(), "exec_start", group=group, execution=execution)
        return []

    def on_execution_finished(self, group: int, execution: int | None = None) -> list[Decision]:
        """An execution ended (success, harness timeout or crash)."""
        grp = self._group(group)
        if grp.finished >= self.cfg.n_per_group:
            raise SchedulerError(f"group {group}: more than N={self.cfg.n_per_group} executions finished")
        grp.finished += 1
        self.finished += 1
        self.log.add(self.clock(), "exec_finish", group=group, execution=execution)
        return self._poll()

    def on_group_ready(self, group: int, work_items: int = 1) -> list[Decision]:
        """All N executions of `group` ended and were scored; it yields `work_items` micro-steps."""
        grp = self._group(group)
        if grp.ready:
            raise SchedulerError(f"group {group} reported ready twice")
        if grp.finished != self.cfg.n_per_group:
            raise SchedulerError(f"group {group} ready with {grp.finished}/{self.cfg.n_per_group} executions ended")
        if work_items < 1:
            raise ValueError(f"work_items must be >= 1, got {work_items}")
        grp.ready, grp.items = True, work_items
        heapq.heappush(self._ready, (grp.version, self._ready_seq, group))
        self._ready_seq += 1
        self.log.add(self.clock(), "group_ready", group=group, version=grp.version)
        return self._poll()

    # ------------------------------------------------------------------ cells
    def _switch_to_train(self, cell: int) -> SwitchToTrain:
        self._set_role(cell, CellRole.TO_TRAIN)
        self.log.add(self.clock(), "switch_to_train", cell=cell, **self._snapshot())
        return SwitchToTrain(cell)

    def _switch_to_rollout(self, cell: int) -> SwitchToRollout:
        self._set_role(cell, CellRole.TO_ROLLOUT)
        self.log.add(self.clock(), "switch_to_rollout", cell=cell)
        return SwitchToRollout(cell)

    def on_switch_done(self, cell: int, to: str) -> list[Decision]:
        """A switch of `cell` towards `to` ("train" or "rollout") finished. A switch to train
        that completes after the burst already sent the cell back is ignored (logged)."""
        role = self.roles[cell]
        if to == "train" and role is CellRole.TO_TRAIN:
            self._set_role(cell, CellRole.TRAIN)
        elif to == "rollout" and role is CellRole.TO_ROLLOUT:
            self._set_role(cell, CellRole.ROLLOUT)
        elif to == "train" and role is CellRole.TO_ROLLOUT:
            self.log.add(self.clock(), "switch_superseded", cell=cell)
            return []
        else:
            raise IllegalRole(f"cell {cell}: switch to {to!r} done while {role.value}")
        self.log.add(self.clock(), "switch_done", cell=cell, role=self.roles[cell].value)
        return self._poll()

    # ------------------------------------------------------------------ training work
    def _assign(self, g: int) -> None:
        grp = self.groups[g]
        grp.step = self.step.index
        self.step.assigned.append(g)
        self.step.queue.extend((g, i) for i in range(grp.items))
        d = D.staleness(self.step.index, grp.version)
        self.staleness.append(d)
        self.log.add(self.clock(), "assign", group=g, step=self.step.index, version=grp.version, d=d)

    def request_work(self, cell: int) -> Work | None:
        """A training cell asks for its next micro-step; None = nothing for it now (ask again
        after the next event). Only a cell inside the TRAIN prefix (`train_prefix`) gets work:
        any other could not take part in the step's reduce. Assigns ready groups to the step,
        oldest dispatch version first: one at a time when streaming, all B at once otherwise."""
        if cell >= self.train_prefix():  # not TRAIN, the core not TRAIN, or a gap below it
            return None
        if self.cfg.mode == "colocate" and self.train_prefix() < self.K:
            return None  # Colocate trains on every cell: no step starts before the last one switched in
        st, B = self.step, self.cfg.batch_groups
        if st.updating:
            return None
        if not st.queue and len(st.assigned) < B:
            if self.cfg.streaming:
                if self._ready:
                    self._assign(heapq.heappop(self._ready)[2])
            elif not st.assigned and len(self._ready) >= B:
                for _ in range(B):
                    self._assign(heapq.heappop(self._ready)[2])
        if not st.queue:
            return None
        g, i = st.queue.popleft()
        st.claimed += 1
        st.participants.add(cell)
        self.log.add(self.clock(), "claim", cell=cell, step=st.index, group=g, item=i)
        if self._all_claimed():
            self.log.add(self.clock(), "all_claimed", step=st.index, cells=sorted(st.participants))
        return Work(st.index, g, i)

    def on_work_done(self, cell: int, work: Work) -> list[Decision]:
        st = self.step
        if work.step != st.index:
            raise SchedulerError(f"work for step {work.step} reported during step {st.index}")
        st.done += 1
        if st.done > st.claimed:
            raise SchedulerError("more micro-steps done than claimed")
        self.log.add(self.clock(), "item_done", cell=cell, step=st.index)
        return self._poll()

    def on_step_done(self, step: int) -> list[Decision]:
        """The core applied the optimizer update of `step` (and sent parameters on a non-final
        step). Ends the burst after μ steps: cells back to rollout, publish, dispatch μ·B."""
        if step != self.step.index or not self.step.updating:
            raise SchedulerError(f"step_done({step}) but step {self.step.index} is not updating")
        self.version += 1
        self.log.add(self.clock(), "step_done", step=step)
        out: list[Decision] = []
        self.step = _Step(self.version)
        if self.burst_pos == self.cfg.mu:
            if self.cfg.mode != "async":
                for c in range(self.K):
                    if self.roles[c] in (CellRole.TRAIN, CellRole.TO_TRAIN):
                        out.append(self._switch_to_rollout(c))
            self.published = self.version
            self.log.add(self.clock(), "publish", version=self.version)
            out.append(Publish(self.version))
            if self.cfg.dispatch == "boundary":
                out.append(self._dispatch(self.cfg.mu * self.cfg.batch_groups))
            self.supply_ticks = 0
        if self.cfg.dispatch == "continuous":
            out.append(self._dispatch(self.cfg.batch_groups))
        return out + self._poll()

    # ------------------------------------------------------------------ control
    def _poll(self) -> list[Decision]:
        """Decisions that follow from the state right now (not tick-gated)."""
        out: list[Decision] = []
        st = self.step
        if (
            not st.updating
            and len(st.assigned) == self.cfg.batch_groups
            and not st.queue
            and st.done == st.claimed
        ):
            st.updating = True
            # The reduce membership, decided here and nowhere else: the TRAIN prefix now. A cell
            # that switched in after the last claim is in it: it reduces zero gradients and gets
            # the new parameters (docs/design.md §3).
            cells = tuple(range(self.train_prefix()))
            if not cells or not st.participants <= set(cells):
                raise SchedulerError(f"step {st.index}: cells {sorted(st.participants)} trained it but the TRAIN "
                                     f"prefix is {list(cells)}")
            final = self.burst_pos == self.cfg.mu - 1
            self.log.add(self.clock(), "optimizer_step", step=st.index, cells=list(cells),
                         participants=sorted(st.participants), final=final)
            out.append(OptimizerStep(st.index, cells, final, tuple(st.assigned)))
        if (
            self.cfg.mode == "colocate"
            and all(r is CellRole.ROLLOUT for r in self.roles)
            and self.ready_unassigned >= (self.cfg.mu - self.burst_pos) * self.cfg.batch_groups
        ):
            # training waits for the last execution of the burst's batch; executions beyond it
            # keep running on the standalone pool if it has room, else they wait (paused)
            out.extend(self._switch_to_train(c) for c in range(self.K))
        return out

    def tick(self) -> list[Decision]:
        """Control tick (every cfg.tick_s): supply check bookkeeping and water-level moves."""
        if self.ready_unassigned >= self.cfg.rho_min * self.cfg.batch_groups and self.ready_unassigned > 0:
            self.supply_ticks += 1
        else:
            self.supply_ticks = 0
        self.log.add(self.clock(), "tick", **self._snapshot())
        out = self._poll()
        supply_ok = self.supply_ticks >= self.cfg.tau
        if self.cfg.mode == "gyre" and supply_ok:
            out.extend(self._gyre_move())
        elif self.cfg.mode == "colocate" and supply_ok and self.cfg.streaming:
            if all(r is CellRole.ROLLOUT for r in self.roles) and self.water_level <= self.C_s:
                out.extend(self._switch_to_train(c) for c in range(self.K))
        return out

    def _gyre_move(self) -> list[Decision]:
        """Core-first order: the next cell j = k(t) moves when w ≤ C_R − C_e."""
        if self.cfg.serial_join and any(r is CellRole.TO_TRAIN for r in self.roles):
            return []
        if any(r is CellRole.TO_ROLLOUT for r in self.roles):
            return []  # burst end still in progress
        if self._all_claimed() and self.burst_pos == self.cfg.mu - 1:
            return []  # the burst's last micro-step is claimed: a new cell would train nothing before burst end
        k = self.cells_in_training
        if k >= self.K:
            return []
        if self.roles[k] is not CellRole.ROLLOUT:
            raise SchedulerError(f"training cells are not a prefix: {[r.value for r in self.roles]}")
        if self.water_level <= self.rollout_capacity - self.C_e:
            return [self._switch_to_train(k)]
        return []
