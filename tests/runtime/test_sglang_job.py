"""The whole job with `--backend.engine sglang` on 3 real gloo ranks (torchrun): every cell's
engine is the SGLang adapter (`gyre.backends.engines.sglang_engine`) over the conformance fake of SGLang
0.5.23 (tests/backends/sglang_fake.py, named by the factory's test-only GYRE_SGLANG_API hook),
the actors are CPU actors. Cells flip between rollout and training, so the adapter is driven
through start under torchrun, generation for harness subprocesses, drains with calls in flight,
release, resume and published weight updates. Checked on what the run leaves behind:
  * the run completes its steps, no harness call was aborted by a switch, and calls were rerouted;
  * every control call the fake saw (its trace) succeeded: each weight update inside a
    pause → begin → update → end → continue session, no release refused by the scheduler's
    idle assertion (the fake stays dead after one, and the run would fail);
  * every engine's weight version ends at a published version.
"""

import json
import subprocess
from pathlib import Path

import pytest

from tests.jobs import RUNS, nothing_aborted_but_the_cancelled_at_the_end, tiny_task, write_task_rows
from tests.jobs import env as jobs_env

STEPS = 4
SESSION = ["PauseGenerationReqInput", "BeginWeightUpdateReqInput", "UpdateWeightsFromTensorReqInput",
           "EndWeightUpdateReqInput", "ContinueGenerationReqInput"]

pytestmark = [pytest.mark.multirank, pytest.mark.jobs]


def _tasks(path: Path) -> Path:
    return write_task_rows(path, [tiny_task(turns, tokens) for turns, tokens in [(1, 40), (4, 120), (4, 120), (4, 120)]])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sglang_job")
    run_dir, trace = tmp / "run", tmp / "trace.jsonl"
    cmd = RUNS["sglang"].command(_tasks(tmp / "tasks.jsonl"), run_dir, steps=STEPS)
    env = {**jobs_env(), "GYRE_SGLANG_API": "tests.backends.sglang_fake:API", "GYRE_FAKE_SGLANG_TRACE": str(trace),
           "GYRE_FAKE_SGLANG_STEP_S": "0.01"}  # a decode-step floor keeps calls in flight at switches
    proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=900, env=env)
    (tmp / "log.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    calls = [json.loads(line) for line in trace.read_text().splitlines()]
    return {"rows": rows, "summary": summary, "calls": calls, "log": proc.stdout + proc.stderr}


def test_the_job_runs_through_the_sglang_adapter_without_aborting_a_call(run):
    assert [r["step"] for r in run["rows"]] == list(range(STEPS))
    s = run["summary"]
    nothing_aborted_but_the_cancelled_at_the_end(s)
    assert s["reroutes"] > 0, "no call was in flight on a cell when it left rollout; the run proves nothing"


def test_every_sglang_control_call_succeeded_in_order(run):
    by_engine: dict[int, list[dict]] = {}
    for c in run["calls"]:
        by_engine.setdefault(c["engine"], []).append(c)
    assert len(by_engine) == 3  # one engine per cell (cell size 1)
    releases = 0
    for calls in by_engine.values():
        names = [c["call"] for c in calls]
        assert all("Crash" not in str(c["result"]) and "False" not in str(c["result"]) for c in calls), calls
        for i, name in enumerate(names):
            if name == "UpdateWeightsFromTensorReqInput":
                assert names[i - 2 : i + 3] == SESSION, names[i - 2 : i + 3]
            if name == "ReleaseMemoryOccupationReqInput":
                releases += 1
                assert names[i - 1] == "PauseGenerationReqInput" and calls[i - 1]["paused"]
                assert names[i + 1 : i + 2] in ([], ["ResumeMemoryOccupationReqInput"]), names[i : i + 2]
        updates = [c for c in calls if c["call"] == "UpdateWeightsFromTensorReqInput"]
        assert updates and int(updates[-1]["weight_version"]) >= 1
    assert releases >= 1  # cells left rollout to train
