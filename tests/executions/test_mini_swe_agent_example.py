"""examples/mini_swe_agent as a newcomer runs it: the two commands of its README, read from the
README itself (so the documentation and this test cannot drift), run from a fresh working
directory with 2 ranks instead of 4 and 2 steps; then the run directory is checked. Plus the
evaluator's partial credit against values worked out by hand."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from examples.mini_swe_agent.task import evaluate, make_tasks
from tests.executions.helpers import assert_trained
from tests.jobs import RUNS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "examples" / "mini_swe_agent" / "README.md"


def readme_commands(readme: Path) -> list[list[str]]:
    """The argv of each command in the README's first ```bash block that runs torchrun: lines
    joined at a trailing backslash, split as a shell would (quotes removed, `$PWD` kept)."""
    blocks = re.findall(r"```bash\n(.*?)```", readme.read_text(), flags=re.S)
    block = next(b for b in blocks if "torchrun" in b)
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with the single value after `flag` replaced (the flag must be there)."""
    i = argv.index(flag)
    return argv[:i + 1] + [value] + argv[i + 2:]


def test_evaluate_gives_half_for_the_file_plus_closeness_and_reads_the_trajectory_otherwise(tmp_path):
    ws = tmp_path / "exec" / "workspace"
    ws.mkdir(parents=True)
    assert evaluate(ws, None, expected="apple")["reward"] == 0.0  # no file, no trajectory
    # No answer.txt: 0.3 × the best closeness of a word of the model's last reply. A format error
    # keeps the reply only in extra.response. "appel" vs "apple": 3 in place, 5 shared, same
    # length: 0.6·3/5 + 0.2·5/5 + 0.2 = 0.76, times 0.3 = 0.228.
    reply = {"choices": [{"message": {"content": "<x> appel zz!"}}]}
    traj = {"messages": [{"role": "user", "content": "apple"}, {"role": "assistant", "content": "nothing"},
                         {"role": "user", "content": "format error", "extra": {"response": reply}}]}
    (ws.parent / "mini.traj.json").write_text(json.dumps(traj))
    got = evaluate(ws, None, expected="apple")
    assert got["reward"] == pytest.approx(0.228) and got["closest_word"] == "appel"
    # answer.txt counts 0.5 + 0.5 × closeness, and wins over the trajectory.
    (ws / "answer.txt").write_text(" appel\n")
    assert evaluate(ws, None, expected="apple") == {"reward": pytest.approx(0.5 + 0.5 * 0.76), "answer": "appel"}
    (ws / "answer.txt").write_text("apple\n")
    assert evaluate(ws, None, expected="apple")["reward"] == 1.0


def test_tasks_are_loadable_and_name_the_evaluator():
    from gyre.executions.tasks import Task

    tasks = [Task.from_json(t) for t in make_tasks()]
    assert len({t.task_id for t in tasks}) == len(tasks) == 16
    for t in tasks:
        assert t.evaluator.target == "examples.mini_swe_agent.task:evaluate"
        assert t.evaluator.kwargs["expected"] in t.instruction


@pytest.mark.jobs
@pytest.mark.slow
@pytest.mark.multirank
def test_the_readme_command_trains_two_steps_through_mini_swe_agent(tmp_path):
    pytest.importorskip("minisweagent", reason="mini-swe-agent is not installed (the agents extra: pip install -e '.[test,agents]'; not next to sglang, setup.py)")
    make, train = readme_commands(README)
    assert make[:3] == ["python", "-m", "examples.mini_swe_agent.task"] and train[0] == "torchrun", (make, train)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, *make[1:]], cwd=tmp_path, env=env, check=True, capture_output=True)

    # As documented, from a fresh directory: 2 ranks and 2 steps instead of 4 and 6.
    train = [a.replace("$PWD", str(ROOT)) for a in train]
    train = with_flag(with_flag(train, "--nproc-per-node", "2"), "--train.steps", "2")
    cmd = RUNS["mini_swe_agent_example"].documented(
        [sys.executable, "-m", "torch.distributed.run", *train[1:], "--train.drain-at-end-s", "5"])
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]

    run = tmp_path / train[train.index("--run-dir") + 1]
    summary = assert_trained(run, steps=2)
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1]

    # Every completed execution ran mini-swe-agent, which called the model (recorded in tito/),
    # and got a valid reward.
    results = [json.loads(p.read_text()) for p in (run / "executions").glob("*/result.json")]
    completed = [r for r in results if r["outcome"] == "completed"]
    assert completed
    for r in completed:
        d = run / "executions" / r["execution_id"]
        traj = json.loads((d / "mini.traj.json").read_text())
        assert traj["info"]["model_stats"]["api_calls"] >= 1, (d / "stderr.log").read_text()[-2000:]
        assert r["reward"]["status"] == "valid" and 0.0 <= r["reward"]["reward"] <= 1.0
        assert (run / "tito" / f"{r['execution_id']}.tito").stat().st_size > 0
    assert summary["calls"] >= len(completed)
