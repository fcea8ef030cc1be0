"""A harness cannot steer the evaluator (issue 36, item 3).

Before: a harness that replaced its `workspace` by a symbolic link (to a sibling execution's
workspace, or to any host directory) had the evaluator, running as the controller's user, run
and write in that directory and score what it found there: the sibling's reward, writes outside
the run. Now the workspace is refused (not evaluated; the execution is excluded and
`result.json` says why) and nothing is written where the link points.

The runner cases run in-process (harness processes, no model); one real job runs both links
under the default sandbox and checks the run directory: results, metrics, the host directory.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from gyre.executions import sandbox
from gyre.executions.config import EvaluatorConfig, RunnerConfig
from gyre.executions.evaluator import Evaluator
from gyre.executions.runner import HarnessRunner
from gyre.executions.tasks import EvaluatorSpec, ExecutionSpec, Task

from tests.jobs import FAULTS, RUNS, reap, rows, start, write_task_rows

STEER = FAULTS / "steer_harness.py"
# Marks the directory it runs in with the execution it scores, and rewards `right` in answer.txt.
MARKING = ["sh", "-c", 'touch "evaluated-$(basename "$(dirname "$GYRE_WORKSPACE")")"; '
           'if grep -q right answer.txt 2>/dev/null; then echo 1; else echo 0; fi']


def _host_dir(tmp_path: Path) -> Path:
    host = tmp_path / "host"
    host.mkdir()
    (host / "answer.txt").write_text("right\n")
    return host


def _check_group(execs: Path, group: str, host: Path | None) -> None:
    """The linking execution `.0` refused and excluded, its sibling `.1` scored 1 in its own
    workspace only, the host directory untouched."""
    steered = json.loads((execs / f"{group}.0" / "result.json").read_text())
    assert (execs / f"{group}.0" / "workspace").is_symlink()  # the harness did make the link
    assert steered["reward"]["status"] == "excluded" and steered["reward"]["reward"] is None, steered
    assert "symbolic link" in steered["reward"]["detail"]["refused"]
    sibling = json.loads((execs / f"{group}.1" / "result.json").read_text())
    assert sibling["reward"]["status"] == "valid" and sibling["reward"]["reward"] == 1.0, sibling
    assert sorted(p.name for p in (execs / f"{group}.1" / "workspace").iterdir()) == ["answer.txt", f"evaluated-{group}.1"]
    if host is not None:
        assert sorted(p.name for p in host.iterdir()) == ["answer.txt"]


@pytest.mark.parametrize("backend", ["none", pytest.param("bwrap", marks=pytest.mark.skipif(
    not sandbox.bwrap_works(), reason="bubblewrap not usable here"))])
def test_a_linked_workspace_is_not_scored_from_there_nor_written_there(tmp_path, backend):
    host = _host_dir(tmp_path)
    runner_cfg = RunnerConfig(run_dir=str(tmp_path / "runs"), sandbox=backend, kill_grace_s=0.5)
    runner = HarnessRunner(runner_cfg, Evaluator(EvaluatorConfig(retry_backoff_s=0.0, timeout_s=30), runner_cfg))
    specs = []
    for gid, target in (("sib", "../{group}.1/workspace"), ("host", str(host))):
        task = Task(task_id=gid, instruction="x", harness=[sys.executable, str(STEER), target],
                    evaluator=EvaluatorSpec("command", MARKING))
        specs += [ExecutionSpec(f"{gid}.{i}", task, gid, i) for i in range(2)]

    async def main():
        return await asyncio.gather(*[runner.dispatch(s) for s in specs])

    results = asyncio.run(main())
    assert [r.outcome.value for r in results] == ["completed"] * 4, [r.error for r in results]
    _check_group(runner.run_dir, "sib", None)
    _check_group(runner.run_dir, "host", host)


@pytest.mark.jobs
@pytest.mark.multirank
def test_a_real_run_excludes_steered_executions_and_writes_nothing_where_they_point(tmp_path):
    """Default sandbox (bwrap here, else none): step 0 links to the sibling, step 1 to a host directory."""
    host = _host_dir(tmp_path)
    tasks = write_task_rows(tmp_path / "tasks.jsonl", [
        {"harness": [sys.executable, str(STEER), "../{group}.1/workspace", "1"], "evaluator": {"command": MARKING}},
        {"harness": [sys.executable, str(STEER), str(host), "1"], "evaluator": {"command": MARKING}},
    ])
    run = tmp_path / "run"
    # Each group's steering execution is excluded by design; a health window of every execution (4)
    # keeps two such in a row (their order against their siblings' is timing) from stopping the run.
    proc = start(RUNS["evaluator_escape"].command(tasks, run), tmp_path, tmp_path / "log.txt")
    try:
        rc = proc.wait(300)
    finally:
        reap(proc, "steer_harness")
    log = (tmp_path / "log.txt").read_text()
    assert rc == 0, log[-6000:]
    execs = run / "executions"
    _check_group(execs, "t0.a0.g0", None)
    _check_group(execs, "t1.a0.g1", host)
    # Every execution that linked its workspace away (later groups too) was refused, none scored.
    for d in execs.iterdir():
        if (d / "workspace").is_symlink() and (d / "result.json").exists():
            reward = json.loads((d / "result.json").read_text())["reward"]
            assert reward is None or reward["status"] == "excluded", (d.name, reward)
    metrics = rows(run / "metrics.jsonl")
    assert [m["executions_valid"] for m in metrics] == [1, 1], metrics
    assert "workspace not evaluated" in log
    expected = "evaluators run in sandbox bwrap" if sandbox.bwrap_works() else "evaluators not sandboxed"
    assert expected in log
