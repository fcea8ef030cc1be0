"""Elastic scheduler decision logic (docs/design.md §2–3), shared by the simulator and the runtime.

`ElasticScheduler` is a pure state machine: the driver (the simulator in `gyre.sim`, or the
runtime controller on the core's first rank) feeds it events and carries out the decisions it
returns, in order. It never blocks, sleeps, or touches the network; time comes from a `Clock`
(`SimClock` in the simulator and in tests, `WallClock` in the runtime). Every event and every
decision is appended to an `EventLog` (kinds listed in `gyre.scheduler.events.EventLog`).

Groups are integer indices here (0, 1, ... in dispatch order). A *group* is one query run N times
(docs/design.md §2); each part of Gyre holds its own view of one, under its own name: the spec
the runner launches is `gyre.executions.tasks.Group`, the scheduler counts its progress in a
private `_GroupProgress` (v_d, executions ended, ready, step, work items), the runtime's record
of it (executions, results, work, rewards) is `gyre.runtime.ledger.GroupRecord`, and the
trajectory processor's input is `gyre.trajectory.materialize.ScoredGroup`.

Protocol (each `on_*`/`tick`/`start` call returns a list of decisions to carry out in order)::

    sched = ElasticScheduler(cfg, num_cells=K, standalone_concurrency=C_s, clock=clock)  # C_e: cfg.cell_concurrency
    decisions = sched.start()                 # initial Dispatch((φ+μ)·B groups) [+ async split]
    # events, as they happen:
    sched.on_execution_started(group)         # p(t) += 1 (a harness began)
    sched.on_execution_finished(group)        # f(t) += 1 (success, timeout or crash)
    sched.on_group_ready(group, work_items)   # all N ended and scored; yields work_items micro-steps
    sched.on_switch_done(cell, to)            # a switch to "train" / "rollout" finished
    sched.on_work_done(cell, work)            # a micro-step's forward/backward finished
    sched.on_step_done(step)                  # optimizer update applied (+ params sent)
    sched.tick()                              # every cfg.tick_s: supply check, water-level moves
    # pull work, for every training cell that is idle, after any event:
    work = sched.request_work(cell)           # Work(step, group, item) or None

Decisions (gyre.scheduler.events):

    Dispatch(first_group, n_groups, version)  start N executions for each new group id
    SwitchToTrain(cell)                       drain/reroute the cell's calls, build the actor;
                                              a satellite pulls the core's current snapshot
    SwitchToRollout(cell)                     burst end: back to serving rollouts
    OptimizerStep(step, cells, final_in_burst) all work of the step is done: `cells` (= 0..k−1,
                                              the TRAIN prefix now) reduce over prefix group k,
                                              the core clips and steps
    Publish(version)                          the core publishes the new policy

Rules implemented (with the log entries that show them):

- Water level w = d − f, capacity C_R = C_s + (K − k)·C_e. In gyre mode the next cell in
  order (core first, a prefix always) moves to training when w ≤ C_R − C_e and the supply
  check (≥ ρ_min·B ready unassigned groups) has held for τ consecutive ticks (`switch_to_train`
  carries w, C_R, k, ready, supply_ticks). With `serial_join`, one cell switches at a time; no
  cell moves once the burst's last step has all its micro-steps claimed (it would train nothing).
- Ready groups are assigned to the step in progress oldest dispatch version first (`assign`
  carries d = v_t − v_d); streaming assigns one group whenever a training cell runs out of
  micro-steps, non-streaming assigns all B at once when B are ready.
- Only a cell inside the TRAIN prefix (cells 0..k−1 all in TRAIN, `train_prefix()`) gets work:
  with roles [TRAIN, TO_TRAIN, TRAIN] cell 2 waits until cell 1 has switched, since it could
  not take part in a reduce over prefix group 2. `all_claimed` marks the step's last claim (all
  B groups assigned, nothing left to hand out); a cell that arrives later finds no work in it.
- When all B groups are assigned and every micro-step is done: `OptimizerStep`, whose `cells`
  are the reduce membership, decided there and only there: the TRAIN prefix at that moment. It
  holds every cell that trained part of the step, and also a cell that switched in after the
  last claim (it reduces zero gradients and receives the new parameters). After μ steps
  the burst ends: training cells `SwitchToRollout` (not in async mode), `Publish(v)`, then
  boundary `Dispatch(μ·B)` at the new version.
- colocate: all cells switch at once when the burst's remaining μ·B groups are ready (training
  waits for the last execution of the batch; executions beyond it continue on the standalone
  pool if it has room, else wait for the cells to come back), or, with streaming, as soon as
  every outstanding execution fits in the pool (w ≤ C_s) and the supply check holds.
  async: cells 0..async_train_cells−1 train for the whole run.
"""

from gyre.scheduler.config import SchedulerConfig
from gyre.scheduler.core import CellRole, ElasticScheduler, IllegalRole, SchedulerError
from gyre.scheduler.events import (
    Clock,
    Decision,
    Dispatch,
    Event,
    EventLog,
    OptimizerStep,
    Publish,
    SimClock,
    SwitchToRollout,
    SwitchToTrain,
    WallClock,
    Work,
)

__all__ = [
    "SchedulerConfig",
    "ElasticScheduler",
    "CellRole",
    "IllegalRole",
    "SchedulerError",
    "Clock",
    "SimClock",
    "WallClock",
    "EventLog",
    "Event",
    "Decision",
    "Dispatch",
    "SwitchToTrain",
    "SwitchToRollout",
    "OptimizerStep",
    "Publish",
    "Work",
]
