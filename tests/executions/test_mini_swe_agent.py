"""The real mini-swe-agent (litellm, its own agent loop and bash environment) as a black-box
harness against the proxy, one short task, scored by its evaluator. Slow: litellm's import alone
takes seconds."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from gyre.backends.models.tokenizer import byte_token_ids, load_tokenizer, token_bytes
from gyre.executions.config import EvaluatorConfig, RunnerConfig
from gyre.executions.evaluator import Evaluator, Outcome, RewardStatus
from gyre.executions.runner import HarnessRunner
from gyre.runtime.proxy_access import GyreProxyAccess
from gyre.executions.tasks import ExecutionSpec, Task
from gyre.proxy import MemorySink, Proxy, ProxyConfig, serve_proxy
from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.trajectory.record import Role

pytest.importorskip("minisweagent", reason="mini-swe-agent is not installed (the agents extra: pip install -e '.[test,agents]'; not next to sglang, setup.py)")

from examples.mini_swe_agent.task import make_tasks  # noqa: E402

RUN_MINI = Path(__file__).resolve().parents[2] / "examples" / "mini_swe_agent" / "run_mini.py"


def _call(command: str) -> str:
    return "I will run a command.\n<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"command": command}}) + "\n</tool_call>"


@pytest.mark.slow
def test_mini_swe_agent_solves_a_short_task_through_the_proxy(tmp_path):
    tok = load_tokenizer()
    table = token_bytes(tok)
    prompts = []

    def script(ids):
        prompt = b"".join(table[i] for i in ids).decode("utf-8", "replace")
        prompts.append(prompt)
        done = prompt.count("<tool_response>")
        if done == 0:
            return _call("echo apple > answer.txt")
        if done == 1:
            return _call("cat answer.txt")
        return _call("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")

    sink = MemorySink()
    proxy = Proxy(ProxyConfig(), sink=sink)
    proxy.router.add_engine(DeterministicEngine("det", script=script, byte_ids=byte_token_ids(tok)), kind="cell", index=0)
    handle = serve_proxy(proxy)
    try:
        task = Task.from_json(make_tasks(1)[0] | {"timeout_s": 240, "harness": [
            "{python}", str(RUN_MINI), "--step-limit", "6", "--max-tokens", "512"]})
        runner = HarnessRunner(RunnerConfig(run_dir=str(tmp_path / "runs"), timeout_s=240),
                               Evaluator(EvaluatorConfig()), GyreProxyAccess(proxy, handle.url))

        async def main():
            return await runner.dispatch(ExecutionSpec("mini-0", task, "g"))

        res = asyncio.run(main())
    finally:
        handle.stop()
    logs = (res.exec_dir / "stdout.log").read_text()[-2000:] + (res.exec_dir / "stderr.log").read_text()[-3000:]
    assert res.outcome is Outcome.COMPLETED, logs
    assert res.reward.status is RewardStatus.VALID and res.reward.reward == 1.0, logs
    recs = sink.for_execution("mini-0")
    assert len(recs) == 3 and all(r.role is Role.MAIN for r in recs)
    assert "answer.txt" in prompts[0] and "apple" in prompts[2].split("<tool_response>")[-1]  # the command output came back
    traj = json.loads((res.exec_dir / "mini.traj.json").read_text())
    assert traj["info"]["exit_status"] == "Submitted"
