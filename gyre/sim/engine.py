"""Discrete-event simulator: drives the *same* `ElasticScheduler` the runtime drives.

The simulator plays the world around the scheduler: harness executions, engine slots, cell
switches, micro-step compute and optimizer updates. Modelling assumptions (docs/theory.md §4):

- An execution holds one engine slot from start to end and runs at full speed; its duration is
  drawn at dispatch. Dispatched executions wait FIFO for a slot (d − p queued). With
  `wall_timeout_h` an execution ends at dispatch + that limit whatever it was doing (running,
  queued or paused), as the runner's wall clock would end it.
- Rollout capacity is C_R(t) = C_s + (cells in ROLLOUT)·C_e. A switching cell serves nothing.
  When capacity drops below the running count (colocate), the most recently started executions
  are *paused* (their harness waits for a model) and resume first, kv_recompute_s later than
  they would have (their KV cache is gone); nothing is ever aborted.
  Under the water-level rule (gyre) this never happens: w ≤ C_R − C_e before a cell leaves.
- A cell that leaves ROLLOUT reroutes its in-flight calls: its share of the running executions
  (running · C_e / C_R before the switch; the most recently started) each lose `reroute_s`
  (recompute of the prefix, or a KV migration: measured by benchmarks/reroute_bench.py).
- A group is ready eval_s after its last execution ends; it yields N micro-steps (one per
  execution), each taking (cell_hours_per_step·3600 / (B·N)) · duration/mean_duration seconds
  on one training cell (tokens grow with time).
- A step's update takes optimizer_s (+ param_send_s on a non-final step of a burst), on the
  core, after every micro-step of the step is done.
"""

from __future__ import annotations

import heapq
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from gyre.scheduler import (
    CellRole,
    Dispatch,
    ElasticScheduler,
    EventLog,
    OptimizerStep,
    Publish,
    SimClock,
    SwitchToRollout,
    SwitchToTrain,
    Work,
)
from gyre.sim.config import SimConfig
from gyre.sim.durations import DurationModel

logger = logging.getLogger(__name__)

_EXEC_DONE, _GROUP_READY, _SWITCH_DONE, _WORK_DONE, _STEP_DONE, _TICK, _DEADLINE = range(7)


class SimulationStalled(RuntimeError):
    pass


@dataclass
class SimResult:
    """Measured outcome of one simulated run (times in hours unless named _s)."""

    label: str
    step_end_h: list[float]
    staleness: list[int]
    train_busy_h: list[float]  # per cell: micro-step compute (+ optimizer on the core)
    role_intervals: list[list[tuple[float, float, str]]]  # per cell: (start_h, end_h, role)
    rollout_slot_hours: float  # ∫ running executions dt (execution-hours served)
    capacity_slot_hours: float  # ∫ C_R(t) dt
    paused_executions: int
    group_sojourn_h: list[float]  # dispatch → assignment to a step, per consumed group
    groups_in_system_area_h: float  # ∫ (groups dispatched, not yet assigned) dt
    num_cells: int
    cell_concurrency: int
    standalone_concurrency: int
    timed_out_executions: int = 0  # cut by wall_timeout_h
    rerouted_calls: int = 0  # in-flight calls moved off draining cells
    reroute_delay_h: float = 0.0  # summed delay they paid (ClusterConfig.reroute_s each)
    log: EventLog = field(repr=False, default_factory=EventLog)

    @property
    def total_h(self) -> float:
        return self.step_end_h[-1]

    @property
    def step_times_h(self) -> list[float]:
        return [b - a for a, b in zip([0.0] + self.step_end_h[:-1], self.step_end_h)]

    @property
    def mean_staleness(self) -> float:
        return float(np.mean(self.staleness))

    def role_fraction(self, cell: int, roles: tuple[str, ...] = ("to_train", "train", "to_rollout")) -> float:
        """Fraction of the run that `cell` spent outside ROLLOUT (paper Fig. 6b)."""
        return sum(b - a for a, b, r in self.role_intervals[cell] if r in roles) / self.total_h

    @property
    def idle_gpu_fraction(self) -> float:
        """1 − busy/total GPU time. Busy: training compute, plus rollout slots in use counted
        as cell-equivalents (running/C_e). Pool counted as C_s/C_e cells."""
        cells = self.num_cells + self.standalone_concurrency / self.cell_concurrency
        busy = sum(self.train_busy_h) + self.rollout_slot_hours / self.cell_concurrency
        return 1.0 - busy / (cells * self.total_h)

    @property
    def train_idle_fraction(self) -> float:
        """Of the cell-time spent outside ROLLOUT, the part not computing (waiting for data,
        for the update, or switching)."""
        role_h = sum(self.role_fraction(c) * self.total_h for c in range(self.num_cells))
        return 1.0 - sum(self.train_busy_h) / role_h if role_h > 0 else 0.0


class Simulation:
    """One run. `Simulation(cfg, durations, label).run()` → SimResult. Deterministic per seed."""

    def __init__(self, cfg: SimConfig, durations: DurationModel, label: str = "") -> None:
        self.cfg = cfg
        self.durations = durations
        self.label = label or cfg.scheduler.mode
        sc, cl = cfg.scheduler, cfg.cluster
        self.clock = SimClock()
        self.log = EventLog(keep_ticks=False)
        self.sched = ElasticScheduler(
            sc, cl.num_cells, cl.standalone_concurrency, clock=self.clock, log=self.log
        )
        self.rng = np.random.default_rng(cfg.seed)
        norm = np.random.default_rng(cfg.seed + 1_000_003)
        sample = np.concatenate([durations.sample_group(norm, sc.n_per_group) for _ in range(512)])
        self.mean_duration = float(sample.mean())
        speed = (cl.nodes_per_cell / cfg.training.reference_nodes) ** cfg.training.scaling_exponent
        self.item_base_s = cfg.training.cell_hours_per_step * 3600.0 / (sc.batch_groups * sc.n_per_group * speed)
        self.heap: list = []
        self.seq = 0
        # executions
        self.ex_group: list[int] = []
        self.ex_left: list[float] = []
        self.ex_dur: list[float] = []
        self.ex_owed: list[float] = []  # prefix recompute still to run, part of ex_left
        self.ex_epoch: list[int] = []
        self.ex_started: list[bool] = []
        self.ex_done: list[bool] = []
        self.timed_out = 0
        self.queue: deque[int] = deque()
        self.running: OrderedDict[int, float] = OrderedDict()  # exec -> time its segment started
        self.group_left: dict[int, int] = {}
        self.group_execs: dict[int, list[int]] = {}
        self.paused = 0
        self.rerouted = 0  # in-flight calls moved off draining cells
        self.reroute_delay_s = 0.0  # their summed delay (reroute_s each)
        # cells
        self.busy: dict[int, Work | None] = {c: None for c in range(cl.num_cells)}
        self.train_busy = [0.0] * cl.num_cells
        self.step_end: list[float] = []
        # integrals
        self.last_t = 0.0
        self.area_running = 0.0
        self.area_capacity = 0.0
        self.area_groups = 0.0
        self.groups_in_system = 0

    # ------------------------------------------------------------------ plumbing
    def _push(self, t: float, kind: int, a=None, b=None) -> None:
        # never before now: an execution's time left (its duration minus the pieces it ran) can
        # round to a hair below zero, and its finish is then due now, not in the past
        heapq.heappush(self.heap, (max(t, self.clock()), self.seq, kind, a, b))
        self.seq += 1

    def _advance(self, t: float) -> None:
        dt = t - self.last_t
        if dt > 0:
            self.area_running += len(self.running) * dt
            self.area_capacity += self.sched.rollout_capacity * dt
            self.area_groups += self.groups_in_system * dt
            self.last_t = t
        self.clock.set(t)

    def _apply(self, decisions: list) -> None:
        tm = self.cfg.training
        now = self.clock()
        for dec in decisions:
            if isinstance(dec, Dispatch):
                for g in dec.groups:
                    self._new_group(g)
            elif isinstance(dec, SwitchToTrain):
                self._push(now + tm.switch_to_train_s, _SWITCH_DONE, dec.cell, "train")
                self._reroute_share()
                self._fit_capacity()
            elif isinstance(dec, SwitchToRollout):
                self._push(now + tm.switch_to_rollout_s, _SWITCH_DONE, dec.cell, "rollout")
            elif isinstance(dec, OptimizerStep):
                dt = tm.optimizer_s + (0.0 if dec.final_in_burst else tm.param_send_s)
                self.train_busy[0] += dt
                self._push(now + dt, _STEP_DONE, dec.step)
            elif isinstance(dec, Publish):
                pass  # weights reach the engines with the rollout switch; no cost modelled
        self._start_queued()

    def _new_group(self, g: int) -> None:
        n = self.cfg.scheduler.n_per_group
        durs = self.durations.sample_group(self.rng, n)
        ids = []
        for dur in durs:
            e = len(self.ex_group)
            self.ex_group.append(g)
            self.ex_left.append(float(dur))
            self.ex_dur.append(float(dur))
            self.ex_owed.append(0.0)
            self.ex_epoch.append(0)
            self.ex_started.append(False)
            self.ex_done.append(False)
            self.queue.append(e)
            if self.cfg.wall_timeout_h > 0:
                self._push(self.clock() + self.cfg.wall_timeout_h * 3600.0, _DEADLINE, e)
            ids.append(e)
        self.group_left[g] = n
        self.group_execs[g] = ids
        self.groups_in_system += 1

    def _fit_capacity(self) -> None:
        """Pause the most recently started executions that no longer have a slot."""
        cap, now = self.sched.rollout_capacity, self.clock()
        while len(self.running) > cap:
            e, seg_start = self.running.popitem(last=True)
            self._ran(e, now - seg_start)
            self.ex_left[e] += self.cfg.cluster.kv_recompute_s  # prefix recompute on resume
            self.ex_owed[e] += self.cfg.cluster.kv_recompute_s
            self.ex_epoch[e] += 1  # invalidates its pending finish event
            self.queue.appendleft(e)
            self.paused += 1

    def _reroute_share(self) -> None:
        """The draining cell's share of the running executions continue elsewhere, `reroute_s` later."""
        cl, now, c_e = self.cfg.cluster, self.clock(), self.cfg.scheduler.cell_concurrency
        before = self.sched.rollout_capacity + c_e
        n = min(c_e, round(len(self.running) * c_e / max(before, 1)))
        self.rerouted += n
        if cl.reroute_s <= 0 or n == 0:
            return
        for e in list(self.running)[-n:]:
            self._ran(e, now - self.running[e])
            self.running[e] = now
            self.ex_left[e] += cl.reroute_s
            self.ex_owed[e] += cl.reroute_s
            self.ex_epoch[e] += 1  # invalidates its pending finish event
            self._push(now + self.ex_left[e], _EXEC_DONE, e, self.ex_epoch[e])
        self.reroute_delay_s += n * cl.reroute_s

    def _ran(self, e: int, s: float) -> None:
        """Execution e ran for s: the prefix recompute it owes runs first, then its own work."""
        self.ex_owed[e] = max(self.ex_owed[e] - s, 0.0)
        self.ex_left[e] -= s

    def _mark_started(self, e: int) -> None:
        if not self.ex_started[e]:
            self.ex_started[e] = True
            g = self.ex_group[e]
            self.sched.on_execution_started(g, e - self.group_execs[g][0])  # never yields decisions

    def _start_queued(self) -> None:
        cap, now = self.sched.rollout_capacity, self.clock()
        while self.queue and len(self.running) < cap:
            e = self.queue.popleft()
            self.running[e] = now
            self._mark_started(e)
            self._push(now + self.ex_left[e], _EXEC_DONE, e, self.ex_epoch[e])

    def _finish(self, e: int) -> None:
        self.ex_done[e] = True
        g = self.ex_group[e]
        self._apply(self.sched.on_execution_finished(g, e - self.group_execs[g][0]))
        self.group_left[g] -= 1
        if self.group_left[g] == 0:
            self._push(self.clock() + self.cfg.training.eval_s, _GROUP_READY, g)
        self._start_queued()

    def _cut(self, e: int) -> None:
        """Wall-clock timeout: end the execution now, running, queued or paused."""
        now = self.clock()
        if e in self.running:
            self._ran(e, now - self.running.pop(e))
        else:
            self.queue.remove(e)
            self._mark_started(e)  # the real runner had started its harness at dispatch
        self.ex_epoch[e] += 1  # invalidates a pending finish
        self.ex_dur[e] -= max(self.ex_left[e] - self.ex_owed[e], 0.0)  # training work ∝ its own work done
        self.timed_out += 1
        self._finish(e)

    def _feed_cells(self) -> None:
        """Every idle training cell asks the scheduler for a micro-step."""
        progress = True
        while progress:
            progress = False
            for c in range(self.cfg.cluster.num_cells):
                if self.busy[c] is None and self.sched.roles[c] is CellRole.TRAIN:
                    w = self.sched.request_work(c)
                    if w is not None:
                        self.busy[c] = w
                        e = self.group_execs[w.group][w.item % self.cfg.scheduler.n_per_group]
                        scale = self.ex_dur[e] / self.mean_duration if self.cfg.training.tokens_scale else 1.0
                        dt = self.item_base_s * scale
                        self.train_busy[c] += dt
                        self._push(self.clock() + dt, _WORK_DONE, c, w)
                        progress = True

    # ------------------------------------------------------------------ main loop
    def run(self) -> SimResult:
        cfg = self.cfg
        self._apply(self.sched.start())
        self._push(cfg.scheduler.tick_s, _TICK)
        assigned_seen = 0
        limit_s = cfg.max_sim_hours * 3600.0
        while self.sched.version < cfg.steps:
            if not self.heap:
                raise SimulationStalled(f"{self.label}: nothing left to happen at step {self.sched.version}")
            t, _, kind, a, b = heapq.heappop(self.heap)
            if t > limit_s:
                raise SimulationStalled(f"{self.label}: simulated time passed {cfg.max_sim_hours} h at step {self.sched.version}")
            if kind == _EXEC_DONE and b != self.ex_epoch[a]:
                continue  # stale finish of a paused segment
            self._advance(t)
            if kind == _EXEC_DONE:
                del self.running[a]
                self._finish(a)
            elif kind == _DEADLINE:
                if not self.ex_done[a]:
                    self._cut(a)
            elif kind == _GROUP_READY:
                self._apply(self.sched.on_group_ready(a, cfg.scheduler.n_per_group))
            elif kind == _SWITCH_DONE:
                self._apply(self.sched.on_switch_done(a, b))
            elif kind == _WORK_DONE:
                self.busy[a] = None
                self._apply(self.sched.on_work_done(a, b))
            elif kind == _STEP_DONE:
                self.step_end.append(t)
                self._apply(self.sched.on_step_done(a))
            elif kind == _TICK:
                self._apply(self.sched.tick())
                self._push(t + cfg.scheduler.tick_s, _TICK)
            self._feed_cells()
            n_assigned = len(self.sched.staleness)
            self.groups_in_system -= n_assigned - assigned_seen
            assigned_seen = n_assigned
        return self._result()

    def _result(self) -> SimResult:
        H = 3600.0
        end = self.clock()
        intervals: list[list[tuple[float, float, str]]] = [[] for _ in range(self.cfg.cluster.num_cells)]
        state = ["rollout"] * self.cfg.cluster.num_cells
        since = [0.0] * self.cfg.cluster.num_cells
        dispatch_t: dict[int, float] = {}
        sojourn = []
        for ev in self.log:
            if ev.kind in ("switch_to_train", "switch_done", "switch_to_rollout"):
                c = ev["cell"]
                new = {"switch_to_train": "to_train", "switch_to_rollout": "to_rollout"}.get(ev.kind) or ev["role"]
                intervals[c].append((since[c] / H, ev.t / H, state[c]))
                state[c], since[c] = new, ev.t
            elif ev.kind == "dispatch":
                for g in range(ev["first_group"], ev["first_group"] + ev["n_groups"]):
                    dispatch_t[g] = ev.t
            elif ev.kind == "assign":
                sojourn.append((ev.t - dispatch_t[ev["group"]]) / H)
        for c in range(self.cfg.cluster.num_cells):
            intervals[c].append((since[c] / H, end / H, state[c]))
            intervals[c] = [iv for iv in intervals[c] if iv[1] > iv[0]]
        return SimResult(
            label=self.label,
            step_end_h=[t / H for t in self.step_end],
            staleness=list(self.sched.staleness),
            train_busy_h=[b / H for b in self.train_busy],
            role_intervals=intervals,
            rollout_slot_hours=self.area_running / H,
            capacity_slot_hours=self.area_capacity / H,
            paused_executions=self.paused,
            timed_out_executions=self.timed_out,
            rerouted_calls=self.rerouted,
            reroute_delay_h=self.reroute_delay_s / 3600.0,
            group_sojourn_h=sojourn,
            groups_in_system_area_h=self.area_groups / H,
            num_cells=self.cfg.cluster.num_cells,
            cell_concurrency=self.cfg.scheduler.cell_concurrency,
            standalone_concurrency=self.cfg.cluster.standalone_concurrency,
            log=self.log,
        )
