"""The controller's side of a step's reduce, through the real `Controller` (state built by its
__init__) and the real scheduler, with a recording control plane in place of torchrun's store:
the controller sends `Reduce(k = len(cells))` to exactly the scheduler's `OptimizerStep.cells`,
including a cell that switched in after the step's last micro-step was claimed (it reduces zero
gradients and receives the new parameters), and the step's metrics row comes from the ledger."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

from gyre.config import GyreConfig, ParallelConfig
from gyre.runtime.controller import Controller
from gyre.runtime.rundir import RunDir
from gyre.runtime.messages import Reduce, StepDone, TrainWork, WorkDone
from gyre.runtime.samples import GroupWork
from gyre.scheduler import SchedulerConfig, SwitchToTrain
from gyre.topology import Topology


class _Store:  # Controller.__init__ clones the store for its thread; nothing else is read from it
    def clone(self) -> "_Store":
        return self


class _RecordingPlane:
    def __init__(self) -> None:
        self.sent: list[tuple[int, object]] = []
        self.blobs: dict[str, object] = {}

    def send(self, dst: int, msg: object) -> None:
        self.sent.append((dst, msg))

    def put_blob(self, key: str, value: object) -> None:
        self.blobs[key] = value

    def try_recv(self) -> None:
        return None


def _controller(tmp_path, num_cells: int = 3) -> Controller:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"task_id": f"t{i}", "instruction": "x", "harness": ["true"],
                                         "evaluator": {"command": ["true"]}}) + "\n" for i in range(4)))
    cfg = GyreConfig(run_dir=str(tmp_path / "run"))
    cfg.executions.dataset.path = str(tasks)
    cfg.scheduler = SchedulerConfig(n_per_group=2, batch_groups=1, phi=0, mu=2, tau=0, rho_min=0.0)
    cfg.scheduler.cell_concurrency = 8
    topo = Topology.from_config(ParallelConfig(cell_size=1), num_cells, 0)
    run = RunDir(Path(cfg.run_dir), attempt=0, start_version=0)
    ctl = Controller(topo, _Store(), run, scheduler=cfg.scheduler, train=cfg.train, loss=cfg.loss,
                     executions=cfg.executions, seed=cfg.seed, data_plane=None)  # the loop is not started here
    ctl.plane = _RecordingPlane()
    ctl.data = SimpleNamespace(dispatch_group=lambda group: [], executions_dir=Path("unused"),  # none started here
                               reroutes=lambda: 0, take_reroutes=lambda: [], take_unmatched=lambda: 0,
                               sink_errors=lambda: 0)
    ctl.ledger.begin(time.time())
    ctl.last_step_t = ctl.ledger.t_start
    return ctl


def _ready(ctl: Controller, g: int, items: int) -> None:
    """Group g's executions end and its work is made (what _on_exec_event/_make_work do)."""
    rec = ctl.ledger.groups[g]
    for spec in rec.spec.executions:
        ctl._apply(ctl.sched.on_execution_finished(g, spec.index))
    ctl.ledger.set_work(g, GroupWork([[f"bundle{g}.{i}"] for i in range(items)], [1.0, 0.0]))
    ctl._apply(ctl.sched.on_group_ready(g, items))


def _switch_in(ctl: Controller, cell: int) -> None:
    """A tick moves `cell` to training (the drain needs the loop: done by hand) and it joins."""
    assert ctl.sched.tick() == [SwitchToTrain(cell)]
    ctl._apply(ctl.sched.on_switch_done(cell, "train"))


def test_the_reduce_goes_to_the_schedulers_cells_including_one_that_came_after_the_last_claim(tmp_path):
    ctl = _controller(tmp_path)
    ctl._apply(ctl.sched.start())  # Dispatch: μ·B = 2 groups into the ledger
    assert sorted(ctl.ledger.groups) == [0, 1]
    _ready(ctl, 0, items=1)
    _switch_in(ctl, 0)
    ctl.pending.add(0)
    ctl._serve_pending()  # the core claims step 0's only micro-step
    (dst, work), = [(d, m) for d, m in ctl.plane.sent if isinstance(m, TrainWork)]
    assert dst == 0 and (work.step, work.group, work.item) == (0, 0, 0)
    assert ctl.plane.blobs[work.key] == ["bundle0.0"]
    _switch_in(ctl, 1)  # after the last claim: no work for it in step 0, but it is in the reduce
    ctl.pending.add(1)
    ctl._serve_pending()
    assert [d for d, m in ctl.plane.sent if isinstance(m, TrainWork)] == [0]

    ctl._on_message(WorkDone(cell=0, rank=0, step=0, group=0, item=0, metrics={"micro_steps": 1.0}))
    (ev,) = ctl.sched.log.of("optimizer_step")
    assert ev["cells"] == [0, 1] and ev["participants"] == [0]  # the scheduler's decision
    reduces = [(d, m) for d, m in ctl.plane.sent if isinstance(m, Reduce)]
    assert [d for d, _ in reduces] == [0, 1]  # ranks of cells 0 and 1 (cell_size 1); not cell 2
    assert all(m.k == 2 and m.step == 0 and not m.final for _, m in reduces)
    assert all(m.grad_scale == 1.0 for _, m in reduces) and ctl.ledger.steps[0].valid == 2
    assert ctl.pending == set()  # both are in the reduce: they ask again after it

    ctl._on_message(StepDone(cell=0, rank=0, step=0, stats={"grad_norm": 0.5}))
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["cells_in_step"] == 2 and row["claim_order"] == [0] and row["claims_by_cell"] == {"0": 1}
    assert row["staleness"] == [0] and row["rewards"] == [1.0, 0.0] and row["grad_norm"] == 0.5
    assert set(row["cell_time_s"]) == {"0", "1", "2"}


def test_work_done_metrics_reach_the_step_row_through_the_ledger(tmp_path):
    ctl = _controller(tmp_path, num_cells=2)
    ctl._apply(ctl.sched.start())
    _ready(ctl, 0, items=2)
    _switch_in(ctl, 0)
    for _ in range(2):
        ctl.pending.add(0)
        ctl._serve_pending()
    works = [m for _, m in ctl.plane.sent if isinstance(m, TrainWork)]
    assert [(w.group, w.item) for w in works] == [(0, 0), (0, 1)]
    for w, loss in zip(works, (0.25, 0.5)):
        ctl._on_message(WorkDone(cell=0, rank=0, step=0, group=w.group, item=w.item,
                                 metrics={"loss": loss, "micro_steps": 1.0, "num_executions": 1.0}))
    reduces = [(d, m) for d, m in ctl.plane.sent if isinstance(m, Reduce)]
    assert [(d, m.k) for d, m in reduces] == [(0, 1)]
    ctl._on_message(StepDone(cell=0, rank=0, step=0, stats={}))
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["loss"] == 0.75 and row["micro_steps"] == 2.0 and row["cells_in_step"] == 1
