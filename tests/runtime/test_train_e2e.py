"""The whole run on 4 real gloo ranks (torchrun): harness subprocesses → proxy → engines on every
cell → TITO → trajectory → streaming training with satellites joining → publish.

One short run (module fixture), several properties checked on what it leaves behind:
  * no harness execution is aborted across role switches, while calls were rerouted;
  * measured staleness after the first burst equals φ + (μ−1)/2 (within 0.1), and over the
    whole run the finite-run value with the first burst's transient;
  * metrics.jsonl, summary.json and the role timeline PNG are well formed;
  * the default weight transport (torch) moved no parameter byte through torchrun's store;
  * `--train.resume` on a smaller world continues the versions, steps and metrics of the run
    (a resume already at --train.steps is refused in-process: tests/runtime/test_rundir.py).
The Colocate and Async baselines run in the same code (their own short runs, tests/jobs.py
RUNS["baselines"]: 3 ranks, 2 steps): every cell or the fixed split trains, and
calls wait through the switches instead of failing. Async's run moves its weights over the store
transport, whose counts are checked there (tests/runtime/test_transports_job.py `check_stats`).
"""

import json
import subprocess
from pathlib import Path

import pytest

from tests.jobs import RUNS, ROOT, env, nothing_aborted_but_the_cancelled_at_the_end, tiny_task, write_task_rows

PHI, MU, STEPS = 0.5, 2, 6

pytestmark = [pytest.mark.multirank, pytest.mark.jobs]


def _write_tasks(tasks: Path) -> Path:
    # Long-tailed executions: (turns, max tokens per answer); long answers keep calls in
    # flight on engines when cells leave rollout, so the run exercises rerouting.
    return write_task_rows(tasks, [tiny_task(turns, tokens) for turns, tokens in [(1, 40), (6, 200), (6, 200), (6, 200)]])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    tasks = _write_tasks(tmp / "tasks.jsonl")
    run_dir = tmp / "run"
    proc = subprocess.run(_command(run_dir, tasks, nproc=4, steps=STEPS), cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=env())
    (tmp / "log.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"dir": run_dir, "rows": rows, "summary": summary, "tasks": tasks}


def _command(run_dir: Path, tasks: Path, *, nproc: int, steps: int, phi: float = PHI, mu: int = MU,
             extra: tuple[str, ...] = ()) -> list[str]:
    # tests/jobs.py RUNS["e2e"]: rerouting needs calls in flight on a cell when it leaves rollout.
    # Two settings make that the rule rather than luck: a decode-step floor (10 ms) so a call lasts
    # about as long as the harness's gap between calls is short, and τ = 30 ticks (3 s) so a
    # burst's first switch waits until the freshly dispatched harnesses have started calling (with
    # τ = 1 the core left rollout before their first call, and only burst 0 ever rerouted anything).
    # The drain at the end is the builder's 5 s: executions still running then are cancelled (the
    # default 60 s waited for executions no step would train).
    return RUNS["e2e"].command(tasks, run_dir, *extra, nproc=nproc, steps=steps, phi=phi, mu=mu)


def test_outputs_are_well_formed(run):
    rows = run["rows"]
    assert [r["step"] for r in rows] == list(range(STEPS))
    for r in rows:
        for key in ("reward_mean", "loss", "clip_frac", "staleness_mean", "tokens_trained", "cell_time_s"):
            assert key in r
        assert 0.0 <= r["clip_frac"] <= 1.0
        # a step trains tokens unless every group of it had equal rewards (no micro-step at all)
        assert r["tokens_trained"] > 0 or r["zero_advantage_groups"] == r["groups"], r
    png = (run["dir"] / "role_timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(run["summary"]["train_fraction"]) == {"0", "1", "2", "3"}
    assert run["summary"]["steps"] == STEPS


def test_no_execution_aborted_while_calls_were_rerouted(run):
    s = run["summary"]
    nothing_aborted_but_the_cancelled_at_the_end(s)
    assert s["reroutes"] > 0, "no call was in flight on a cell when it left rollout; the run proves nothing"


def test_staleness_matches_closed_form_after_the_first_burst(run):
    by_step = run["summary"]["staleness_by_step"]
    d = [x for step, xs in by_step.items() if int(step) >= MU for x in xs]
    assert d, by_step
    assert abs(sum(d) / len(d) - (PHI + (MU - 1) / 2)) <= 0.1, by_step


def test_staleness_over_the_whole_run_matches_its_finite_run_value(run):
    """Over all steps the mean also includes the first burst's transient. By hand, φ 0.5, μ 2,
    B 2, 6 steps, groups consumed in dispatch order: groups 0-4 are dispatched at version 0
    ((φ+μ)·B), 5-8 at version 2 and 9-12 at version 4 (μ·B per publish); step s consumes groups
    2s, 2s+1, so d = 0 0 | 1 1 | 2 0 | 1 1 | 2 0 | 1 1, mean 10/12 (1.0 in the limit). The
    completion order moves single d's, not their mean (docs/theory.md)."""
    assert abs(run["summary"]["measured_staleness_mean"] - 10 / 12) <= 0.1, run["summary"]


def test_the_default_torch_transport_moved_no_parameter_byte_through_the_store(run):
    """The weight transport every job uses unless told (`--transfer.transport torch`): the
    satellites read the core's snapshots one-sidedly from its server, and a broadcast over a
    prefix group happened (tests/runtime/test_transports_job.py checks store and mooncake)."""
    from tests.runtime.test_transports_job import check_stats

    stats = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in (run["dir"] / "transport").glob("rank_*.json")}
    assert sorted(stats) == [0, 1, 2, 3], stats
    check_stats(stats, "torch", steps=STEPS)


def test_resume_continues_versions_on_a_smaller_world(run):
    """Resume the finished 6-step run on 2 ranks to 8 steps: the checkpoint's weights, optimizer
    state and version carry over, so steps 6..7 are appended and the last checkpoint is version 8.
    Without the run's decode floor (there to make reroutes, which this test does not look at)."""
    from safetensors.torch import load_file

    ckpts = sorted((run["dir"] / "checkpoints").glob("step_*"))
    assert [c.name for c in ckpts] == [f"step_{STEPS:06d}"]
    before = load_file(str(ckpts[-1] / "model.safetensors"))
    cmd = _command(run["dir"], run["tasks"], nproc=2, steps=STEPS + MU,
                   extra=("--train.resume", "--engine.min-decode-step-s", "0"))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    rows = [json.loads(line) for line in (run["dir"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS + MU))  # appended, not restarted at 0
    assert [r["version"] for r in rows[STEPS:]] == [STEPS + 1, STEPS + 2]
    # Groups trained after resuming were dispatched at the resumed version or later.
    assert all(d >= 0 for r in rows[STEPS:] for d in r["staleness"]), rows[STEPS:]
    last = run["dir"] / "checkpoints" / f"step_{STEPS + MU:06d}"
    assert json.loads((last / "gyre_actor.json").read_text())["version"] == STEPS + MU
    after = load_file(str(last / "model.safetensors"))
    assert any(not (after[k] == before[k]).all() for k in before), "resumed run did not train"


@pytest.mark.parametrize("mode", ["colocate", "async"])
def test_baselines_run_in_the_same_code(tmp_path, mode):
    """Colocate (C0) and Async (A0, 2 training cells), φ = 1, μ = 1, no streaming, 2 steps on 3
    ranks: in Colocate every cell trains every step and calls wait out the switches (no engine is
    left to reroute to); in Async cells 0, 1 train every step and cell 2 never does. Either way
    nothing is aborted and every step trains B groups. (The run above's long-tailed executions,
    without its decode floor, which is there to make reroutes, which a baseline never makes.)
    Async's run is also the store transport's job: cells 0 and 1 share every step, so the new
    parameters are broadcast to cell 1 and cell 2 reads published versions through the store."""
    from tests.runtime.test_transports_job import check_stats

    run_dir = tmp_path / "run"
    transport = ("--transfer.transport", "store") if mode == "async" else ()
    cmd = RUNS["baselines"].command(_write_tasks(tmp_path / "tasks.jsonl"), run_dir, "--scheduler.mode", mode, *transport)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    s = json.loads((run_dir / "summary.json").read_text())
    assert [r["step"] for r in rows] == [0, 1] and s["mode"] == mode
    nothing_aborted_but_the_cancelled_at_the_end(s)
    training = {"colocate": {"0", "1", "2"}, "async": {"0", "1"}}[mode]
    assert all(set(r["claims_by_cell"]) <= training and r["cells_in_step"] == len(training) for r in rows), \
        [(r["step"], r["claims_by_cell"], r["cells_in_step"], r["tokens_trained"]) for r in rows]
    assert {c for c, f in s["train_fraction"].items() if f > 0} == training, s["train_fraction"]
    # Without streaming a step takes whichever B groups are ready first, so the staleness is
    # E[d] = φ only on average; what must hold is that each step trains B groups, none from a
    # version newer than the policy it updates.
    assert all(r["groups"] == 2 and len(r["staleness"]) == 2 and min(r["staleness"]) >= 0 for r in rows), rows
    if transport:
        stats = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in (run_dir / "transport").glob("rank_*.json")}
        assert sorted(stats) == [0, 1, 2], stats
        check_stats(stats, "store")
