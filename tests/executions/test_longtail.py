"""The longtail workload: its duration law matches the paper's numbers (checked against the
log-normal's closed forms and by sampling), and it runs for real through the runner with
timeouts and partial-progress rewards."""

from __future__ import annotations

import asyncio
import math

import pytest

from gyre.executions.config import EvaluatorConfig, RunnerConfig
from gyre.executions.evaluator import Evaluator, Outcome, RewardStatus
from gyre.executions.runner import HarnessRunner
from gyre.executions.tasks import Dataset, Task

from examples.longtail.harness import HOUR, draw_plan
from examples.longtail.task import make_tasks


def _phi(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def test_default_law_is_the_papers_workload():
    # closed forms of LogNormal(ln 1.62 h, 0.588): mean 1.93 h, P(T > 4 h) = 6.25 %
    mu, s = math.log(1.62), 0.588
    assert abs(math.exp(mu + s * s / 2) - 1.93) < 0.01
    assert abs((1 - _phi((math.log(4.0) - mu) / s)) - 0.0625) < 0.002
    plans = [draw_plan(7, f"e{i}") for i in range(4000)]
    totals = [p.total_s / HOUR for p in plans]
    assert abs(sum(totals) / len(totals) - 1.93) < 0.06
    assert abs(sum(t > 4.0 for t in totals) / len(totals) - 0.0625) < 0.012
    for p in plans[:200]:
        assert p.turns == len(p.think_s) == len(p.tool_s) >= 1
        assert math.isclose(sum(p.think_s) + sum(p.tool_s), p.total_s, rel_tol=1e-9)
    assert abs(sum(p.turns for p in plans) / len(plans) - 40.0) < 0.6
    # seeded: same id, same plan; other id or seed, another plan
    assert draw_plan(7, "e1") == plans[1]
    assert draw_plan(8, "e1") != plans[1] and draw_plan(7, "e2") != plans[1]


@pytest.mark.jobs  # harnesses run to their timeout: whole executions end to end
def test_runs_through_runner_with_timeout_tail(tmp_path):
    """Scaled so 4 h lasts 4 s: the executions whose plan exceeds 4 h time out, and all get a
    reward equal to their finished share of turns."""
    scale = 4.0 / (4 * HOUR)
    raw = make_tasks(16, seed=0, time_scale=scale, no_model=True, extra_args=["--turns-mean", "8"])
    ds = Dataset([Task.from_json(t) for t in raw])
    runner = HarnessRunner(RunnerConfig(run_dir=str(tmp_path / "runs"), max_concurrency=16, kill_grace_s=0.2),
                           Evaluator(EvaluatorConfig()))

    async def main():
        return await asyncio.gather(*[runner.dispatch(g.executions[0]) for g in ds.iter_groups(1, shuffle=False, epochs=1)])

    results = asyncio.run(main())
    plans = {r.execution_id: draw_plan(0, r.execution_id, turns_mean=8) for r in results}
    for r in results:
        plan = plans[r.execution_id]
        assert r.reward.status is RewardStatus.VALID
        # Margins absorb start-up time and scheduling delay on a loaded machine (1.5 s for the
        # completed ones: 16 interpreters starting at once under a load of 10 took over 0.75 s).
        if plan.total_s > 6.0 * HOUR:  # killed with a third of the work or more left
            assert r.outcome is Outcome.TIMED_OUT and r.reward.reward < 1.0
        if plan.total_s < 2.5 * HOUR:
            assert r.outcome is Outcome.COMPLETED and r.reward.reward == 1.0
    assert any(p.total_s > 6.0 * HOUR for p in plans.values()), "seed 0 should include a timeout tail"
    for r in results:  # the reward is the harness's own progress record
        done = (r.workspace / "progress.json").read_text()
        assert r.reward.detail["turns_done"] == __import__("json").loads(done)["turns_done"]
