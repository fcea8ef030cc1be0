"""What a run writes (gyre.runtime.records.RunRecords), on a real run directory with a stand-in
ledger: the step rows and their tracker copies, the end files, each written when another fails,
and the journal closed last."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

from gyre.runtime.attempts import write_manifest
from gyre.runtime.cell import CellState
from gyre.runtime.ledger import GroupPhase
from gyre.runtime.records import Phases, RunRecords
from gyre.runtime.rundir import RunDir
from gyre.runtime.summary import RunEnd
from gyre.scheduler.events import EventLog


@dataclasses.dataclass
class _Cfg:
    preset: str = "x"


class _Trackers:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def log(self, row, step):
        self.calls.append(("log", sorted(row), step))

    def image(self, name, png, step):
        self.calls.append(("image", name, step))


def _records(tmp_path, summarize, *, start_version=0, errors=None):
    write_manifest(tmp_path, _Cfg(), 2)
    ledger = SimpleNamespace(
        groups={0: SimpleNamespace(group_id="g0", phase=GroupPhase.CONSUMED),
                1: SimpleNamespace(group_id="g1", phase=GroupPhase.READY)},
        intervals=lambda end: {0: [(CellState.ROLLOUT, 0.0, 3.0), (CellState.TRAIN, 3.0, 4.0)], 1: []})
    events = EventLog()
    events.add(1.5, "publish", version=1)
    return RunRecords(RunDir(tmp_path, attempt=0, start_version=start_version), ledger=ledger, events=events,
                      summarize=summarize, trackers=_Trackers(),
                      on_error=lambda exc, what, path: errors.append(what) if errors is not None else None, fresh=True)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_steps_are_counted_on_from_the_resumed_version_and_copied_to_the_trackers(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')  # a fresh run replaces it
    records = _records(tmp_path, lambda how, fr: {}, start_version=3)
    assert records.steps == 3
    records.step({"step": 3, "loss": float("nan")})
    assert records.steps == 4
    assert _lines(tmp_path / "metrics.jsonl") == [{"step": 3, "loss": None}]
    assert records.trackers.calls == [("log", ["loss", "step"], 3)]


def test_finish_writes_the_end_files_and_closes_the_groups_a_clean_end_did_not_train(tmp_path):
    seen = []

    def summarize(how, fractions):
        seen.append((how.steps, fractions))
        return {"steps": how.steps, "error": how.error, "wall_s": 4.0}

    records = _records(tmp_path, summarize)
    phases = Phases()
    summary = records.finish(RunEnd(steps=2, end=4.0), phases)
    records.close(phases)
    assert phases.failed == [] and seen == [(2, {0: 0.25, 1: 0.0})]  # rollout 3 s, train 1 s
    assert json.loads((tmp_path / "summary.json").read_text()) == summary and summary["run"]["steps"] == 2
    assert json.loads((tmp_path / "run.json").read_text())["attempts"][0]["ended"]["steps"] == 2
    assert _lines(tmp_path / "events.jsonl") == [{"t": 1.5, "kind": "attempt", "attempt": 0, "version": 0},
                                                 {"t": 1.5, "kind": "publish", "version": 1}]
    assert (tmp_path / "role_timeline.png").stat().st_size > 0
    assert _lines(tmp_path / "groups.jsonl") == [{"kind": "closed", "group_id": "g1"}]  # g0 was trained
    assert records.trackers.calls == [("log", ["train_fraction"], 2), ("image", "role_timeline", 2)]


def test_a_failed_end_closes_no_group_and_a_failing_part_does_not_stop_the_others(tmp_path):
    def summarize(how, fractions):
        raise RuntimeError("a source broke")

    errors: list[str] = []
    records = _records(tmp_path, summarize, errors=errors)
    phases = Phases()
    records.finish(RunEnd(steps=0, end=4.0, error="rank 1 failed"), phases)
    records.close(phases)
    assert phases.failed == ["the summary"]
    assert json.loads((tmp_path / "summary.json").read_text())["run"]["attempts_not_ended"] == []  # still ended
    assert (tmp_path / "events.jsonl").exists() and (tmp_path / "role_timeline.png").exists()
    assert (tmp_path / "groups.jsonl").read_text() == ""  # a failed run's groups are lost to a resume, not closed
    phases.run("late", lambda: records.journal.trained(["g1"], 0))  # closed: nothing writes after it
    assert errors == ["groups.jsonl"] and phases.failed == ["the summary", "late"]
