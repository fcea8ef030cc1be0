"""The cpu_demo end to end on the real data path: the warm-started tiny model served by the
built-in CPU engine behind the real proxy, four concurrent harness executions under the runner.
Slow: it needs a warm-started checkpoint (GYRE_CPU_DEMO_CKPT, or one trained here, minutes)."""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from gyre.backends.models.tokenizer import ENDOFTEXT, IM_END, load_tokenizer
from gyre.executions.config import EvaluatorConfig, RunnerConfig
from gyre.executions.evaluator import Evaluator, Outcome, RewardStatus
from gyre.executions.runner import HarnessRunner
from gyre.runtime.proxy_access import GyreProxyAccess
from gyre.executions.tasks import ExecutionSpec, Task
from gyre.proxy import MemorySink, Proxy, ProxyConfig, serve_proxy
from gyre.trajectory.record import Role
from gyre.trajectory.tree import build_tree

from examples.cpu_demo.task import harness_command, make_task


@pytest.mark.slow
def test_warm_started_model_drives_the_harness_through_proxy_and_cpu_engine(tmp_path):
    from gyre.backends.engines.cpu_engine import CpuEngine
    from gyre.backends.models.hf import load_model

    ckpt = os.environ.get("GYRE_CPU_DEMO_CKPT")
    if not ckpt:
        from examples.cpu_demo.warm_start import warm_start

        ckpt = str(tmp_path / "warm_start")
        warm_start(ckpt, eval_episodes=1)
    tok = load_tokenizer()
    engine = CpuEngine.from_model(load_model(ckpt), eos_token_ids=tok.convert_tokens_to_ids([IM_END, ENDOFTEXT]))
    sink = MemorySink()
    proxy = Proxy(ProxyConfig(), sink=sink)
    proxy.router.add_engine(engine, kind="cell", index=0)
    handle = serve_proxy(proxy)
    try:
        handle.call(engine.start())
        rng = random.Random(7)
        # The model's main prompts climb ~410 -> ~650 tokens, then it delegates and finishes: at
        # the harness's default --compact-at (650) compaction is a coin flip. e0 and e1 compact
        # by the harness's rule (550); e2 and e3 keep the default and delegate.
        specs = [ExecutionSpec(f"e{i}", Task.from_json({**make_task(f"w{i}", rng),
                                                        "harness": harness_command() + (["--compact-at", "550"] if i < 2 else [])}), "g", i)
                 for i in range(4)]
        runner = HarnessRunner(RunnerConfig(run_dir=str(tmp_path / "runs"), max_concurrency=4, timeout_s=300),
                               Evaluator(EvaluatorConfig()), GyreProxyAccess(proxy, handle.url))

        async def main():
            return await asyncio.gather(*[runner.dispatch(s) for s in specs])

        results = asyncio.run(main())
    finally:
        handle.stop()
    seen: set[Role] = set()
    for r in results:
        assert r.outcome is Outcome.COMPLETED, (r.exec_dir / "stderr.log").read_text()[-2000:]
        assert r.reward.status is RewardStatus.VALID and 0.0 <= r.reward.reward <= 1.0
        recs = sink.for_execution(r.execution_id)
        assert recs and all(len(x.output_ids) > 0 for x in recs)
        roles = {x.role for x in recs}
        seen |= roles
        if roles & {Role.MAIN_SUMMARY, Role.SUB}:  # a summary or a sub-agent starts a new branch
            assert build_tree(recs).stats.leaves >= 2, (r.execution_id, sorted(x.name for x in roles))
    # The warm-started model follows the format well enough to compact (by the harness's rule)
    # and to delegate (its own choice).
    assert {Role.MAIN, Role.MAIN_SUMMARY, Role.SUB} <= seen
