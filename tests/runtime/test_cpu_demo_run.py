"""The README's first command, for real: `torchrun --nproc-per-node 4 -m gyre.run --preset cpu-demo`.

Slow (about 6-7 min on 2 cores, plus about a minute for the warm start unless GYRE_CPU_DEMO_DATA
points at a prepared data directory): the reward must rise by a margin whose 95 % confidence
interval excludes zero, and the metrics, summary and role timeline must be well formed.

The margin is `fitted_rise`: the least-squares line of group-mean reward on step, its value at
the last step minus at the first, with a bootstrap over whole groups. Five seeds of the preset
(32 steps of 16 executions, lr 1e-3 decaying linearly to 0.1x) are measured side by side by
`benchmarks/demo_learning.py` (results/demo_learning.json; the README has the table).
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.jobs import RUNS

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.multirank, pytest.mark.jobs]


@pytest.mark.timeout(1900)  # prepares its data (the warm start too) and trains 32 steps: ~12 min alone
def test_cpu_demo_reward_rises(tmp_path):
    data = os.environ.get("GYRE_CPU_DEMO_DATA") or str(tmp_path / "data")
    run_dir = tmp_path / "run"
    cmd = RUNS["cpu_demo"].command(f"{data}/tasks.jsonl", run_dir, "--train.prepare-dir", data,
                                   "--model.checkpoint", f"{data}/warm_start")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [r["step"] for r in rows] == list(range(summary["steps"]))
    assert all(len(r["group_rewards"]) == r["groups"] for r in rows)
    trend = summary["reward_trend"]
    assert trend["unit"] == "group" and trend["fitted_rise_ci95_low"] > 0, trend
    assert trend["last_mean"] > trend["first_mean"], trend
    assert summary["aborted_calls"] == 0 and set(summary["execution_outcomes"]) == {"completed"}
    assert (run_dir / "role_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(summary["train_fraction"]) == {"0", "1", "2", "3"} and summary["train_fraction"]["0"] > 0
