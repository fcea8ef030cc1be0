"""examples/tool_agent/harness.py as Gyre runs it: a real subprocess (official openai SDK) started
by the runner against a real Gyre proxy whose engine is scripted, then scored by the example's
evaluator. A policy that calls get_price with the asked item and then repeats the price gets
reward 1; a policy writing garbage tool calls gets error strings back as tool results, and the
harness still exits 0 within its bounded number of calls (reward 0)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from examples.tool_agent.harness import MAX_CALLS
from examples.tool_agent.make_tasks import make_split
from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.models.tokenizer import byte_token_ids, load_tokenizer
from gyre.executions.config import EvaluatorConfig, RunnerConfig
from gyre.executions.evaluator import Evaluator, Outcome, RewardStatus
from gyre.executions.runner import HarnessRunner
from gyre.executions.tasks import ExecutionSpec, Task
from gyre.proxy import MemorySink, Proxy, ProxyConfig, serve_proxy
from gyre.proxy.textstream import tool_call_opening
from gyre.runtime.proxy_access import GyreProxyAccess

from examples.cpu_demo.task import HARNESS as _CPU_DEMO_HARNESS

HARNESS = _CPU_DEMO_HARNESS.parents[1] / "tool_agent" / "harness.py"
TOK = load_tokenizer()
OPENING = tool_call_opening("get_price")


def good_policy(prompt: str) -> str:
    """Continues the forced opening with the asked item; after a tool result, repeats its price.
    (The scripted engine spells one token per byte: the harness runs with --max-tokens 512.)"""
    if prompt.endswith(OPENING):
        item = re.search(r"(?:an? )(\w+)[?.]", prompt.rsplit("<|im_start|>user\n", 1)[1]).group(1)
        return " " + json.dumps({"item": item}) + "}\n</tool_call>"
    price = re.findall(r"costs (\d+) dollars", prompt)[-1]
    return f"That costs {price} dollars."


def garbage_policy(prompt: str) -> str:
    """Arguments that are a list, then a call to a tool that does not exist, then text without a price."""
    if prompt.endswith(OPENING):
        return ' [1, {"colour": 2}]}\n</tool_call>'
    if prompt.count("<tool_response>") == 1:
        return 'Hmm.\n<tool_call>\n{"name": "rm_rf", "arguments": "{not json"}\n</tool_call>' \
               '\n<tool_call>\n{"name": "buy", "arguments": {"item": 7}}\n</tool_call>'
    return "I do not know <tool_call>{broken"


def run_one(tmp_path, policy, eid: str):
    seen: list[str] = []

    def script(input_ids):
        prompt = TOK.decode(list(input_ids))
        seen.append(prompt)
        return policy(prompt)

    sink = MemorySink()
    proxy = Proxy(ProxyConfig(), sink=sink)
    proxy.router.add_engine(DeterministicEngine("det", script=script, byte_ids=byte_token_ids(TOK)), kind="cell", index=0)
    handle = serve_proxy(proxy)
    try:
        task_json = make_split("heldout", 1, seed=3)[0]
        task = Task.from_json({**task_json, "harness": ["{python}", str(HARNESS), "--max-tokens", "512"]})
        runner = HarnessRunner(RunnerConfig(run_dir=str(tmp_path / "runs"), timeout_s=120, sandbox="none"),
                               Evaluator(EvaluatorConfig()), GyreProxyAccess(proxy, handle.url))
        spec = ExecutionSpec(execution_id=eid, task=task, group_id="g", index=0)

        async def main():
            return await runner.dispatch(spec)

        res = asyncio.run(main())
    finally:
        handle.stop()
    return res, task_json, seen, sink.for_execution(eid)


def test_a_lookup_then_an_answer_earns_reward_one(tmp_path):
    res, task, seen, records = run_one(tmp_path, good_policy, "tool-good")
    stderr = (res.exec_dir / "stderr.log").read_text()
    assert res.outcome is Outcome.COMPLETED, stderr[-3000:]
    stats = json.loads((res.exec_dir / "stdout.log").read_text().strip().splitlines()[-1])
    price = task["metadata"]["price"]
    assert stats == {"calls": 2, "tool_calls": 1, "tool_errors": 0, "answer": f"That costs {price} dollars."}
    assert res.reward.status is RewardStatus.VALID and res.reward.reward == 1.0
    # The model saw the tool declared, the forced opening on call 1, the price only in call 2's tool result.
    assert len(seen) == 2 and len(records) == 2
    assert '"name": "get_price"' in seen[0].split("<|im_end|>")[0] and seen[0].endswith(OPENING)
    assert f"costs {price} dollars" not in seen[0] and f"costs {price} dollars" in seen[1]
    assert seen[1].endswith("<|im_start|>assistant\n")


def test_garbage_tool_calls_get_errors_back_and_the_harness_still_exits_zero(tmp_path):
    res, task, seen, records = run_one(tmp_path, garbage_policy, "tool-garbage")
    stderr = (res.exec_dir / "stderr.log").read_text()
    assert res.outcome is Outcome.COMPLETED, stderr[-3000:]
    stats = json.loads((res.exec_dir / "stdout.log").read_text().strip().splitlines()[-1])
    # Call 2's first block is not JSON: the proxy keeps it as text, so only `buy` reaches the harness.
    assert stats["calls"] == MAX_CALLS == len(seen) and stats["tool_calls"] == stats["tool_errors"] == 2
    assert "name one item of the shop" in seen[1] and "unknown tool 'buy'" in seen[2]
    assert stats["answer"] == "I do not know <tool_call>{broken"
    assert (res.exec_dir / "workspace" / "answer.txt").read_text() == "I do not know <tool_call>{broken\n"
    assert res.reward.status is RewardStatus.VALID and res.reward.reward == 0.0
