"""Runner + real proxy: the cpu_demo harness (official openai SDK, real subprocess) produces a
branching call tree; keys isolate executions."""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
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
from gyre.trajectory.tree import build_tree

from examples.cpu_demo.policy import _NEXT, scripted_reply, tool_call
from examples.cpu_demo.task import harness_command, make_task


@pytest.fixture
def proxy_server():
    handles = []

    def make(script=None, **engine_kw):
        tok = load_tokenizer()
        sink = MemorySink()
        proxy = Proxy(ProxyConfig(), sink=sink)
        eng = DeterministicEngine("det", script=script, byte_ids=byte_token_ids(tok) if script else None, **engine_kw)
        proxy.router.add_engine(eng, kind="cell", index=0)
        h = serve_proxy(proxy)
        handles.append(h)
        return proxy, h, sink

    yield make
    for h in handles:
        h.stop()


def _next_word(prompt: str) -> str | None:
    """The file the harness says is next, in the last todo line of the prompt."""
    found = _NEXT.findall(prompt)
    return found[-1][0] if found else None


def _decoder():
    table = token_bytes(load_tokenizer())
    return lambda ids: b"".join(table[i] for i in ids).decode("utf-8", "replace")


def test_cpu_demo_harness_makes_compaction_subagent_and_retry_branches(tmp_path, proxy_server):
    import random

    task_json = make_task("words-t", random.Random(5))
    main_words = task_json["metadata"]["main"]
    decode = _decoder()
    forced = []

    def script(input_ids):
        prompt = decode(input_ids)
        reply = scripted_reply(prompt)  # a perfect policy ...
        # ... that once sends a call the harness must reject (content not a number), on the
        # main agent's second write: the harness discards it and asks again (retry).
        if _next_word(prompt) == main_words[1] and not forced:
            forced.append(prompt)
            return tool_call("write_next", {"content": "many"})
        return reply

    proxy, handle, sink = proxy_server(script)
    task = Task.from_json({**task_json, "harness": harness_command() + ["--compact-at", "650", "--max-tokens", "256"]})
    cfg = RunnerConfig(run_dir=str(tmp_path / "runs"), timeout_s=120)
    runner = HarnessRunner(cfg, Evaluator(EvaluatorConfig()), GyreProxyAccess(proxy, handle.url))
    spec = ExecutionSpec(execution_id="cpu-demo-0", task=task, group_id="g")

    async def main():
        return await runner.dispatch(spec)

    res = asyncio.run(main())
    stderr = (res.exec_dir / "stderr.log").read_text()
    assert res.outcome is Outcome.COMPLETED, stderr[-3000:]
    stats = json.loads((res.exec_dir / "stdout.log").read_text().strip().splitlines()[-1])
    assert stats["report"] == "done" and stats["retries"] == 1 and stats["sub_agents"] == 1 and stats["compactions"] >= 1
    # A perfect policy fills every file: reward 1.
    assert res.reward.status is RewardStatus.VALID and res.reward.reward == 1.0
    assert len(forced) == 1

    records = sink.for_execution("cpu-demo-0")
    assert len(records) == stats["calls"]
    roles = [r.role for r in records]
    assert Role.MAIN in roles and Role.MAIN_SUMMARY in roles and Role.SUB in roles
    # retry: two calls with the very same prompt tokens (the rejected one and its re-sample)
    by_input = {}
    for r in records:
        by_input.setdefault(r.input_ids.tobytes(), []).append(r)
    retried = [rs for rs in by_input.values() if len(rs) > 1]
    assert len(retried) == 1 and len(retried[0]) == 2
    a, b = retried[0]
    assert not np.array_equal(a.output_ids, b.output_ids)

    tree = build_tree(records)
    st = tree.stats
    by_role = {str(k).split(".")[-1].upper(): v for k, v in st.leaves_by_role.items()}
    # Compaction: the summary call is a leaf of its own, and the main conversation restarts
    # from the summary on another branch. Sub-agent: its own system prompt, its own branch.
    # Retry: the rejected output is a leaf next to its re-sample.
    assert by_role.get("MAIN_SUMMARY", 0) >= 1
    assert by_role.get("SUB", 0) >= 1
    assert by_role.get("MAIN", 0) >= 2  # the restarted main conversation + the rejected retry output
    assert st.leaves >= 4
    # The rejected output and its re-sample diverge right after their shared prompt.
    n = len(a.input_ids)
    leaf_seqs = [tree.leaf_tokens(k) for k in range(tree.num_leaves)]
    after_prompt = {tuple(s[n:n + 8]) for s in leaf_seqs if len(s) > n and np.array_equal(s[:n], a.input_ids)}
    assert tuple(a.output_ids[:8]) in after_prompt and tuple(b.output_ids[:8]) in after_prompt
    # Shared prefixes are stored once.
    assert st.duplicate_tokens_saved > 0 and st.unique_tokens < st.expanded_tokens


def test_wrong_or_revoked_key_is_rejected(tmp_path, proxy_server):
    """A harness can use only its own key: a forged key and another execution's revoked key get
    401, and its own calls are recorded under its own execution only."""
    proxy, handle, sink = proxy_server(eos_prob=0.3)
    script = tmp_path / "keys.py"
    script.write_text(
        "import json, os, sys, openai\n"
        "out = {}\n"
        "c = openai.OpenAI(max_retries=0)\n"
        "r = c.chat.completions.create(model='m', messages=[{'role': 'user', 'content': 'hi'}], max_tokens=4)\n"
        "out['own'] = r.choices[0].finish_reason\n"
        "for name, key in (('forged', 'gyre-forged-key'), ('other', sys.argv[1])):\n"
        "    try:\n"
        "        openai.OpenAI(api_key=key, max_retries=0).chat.completions.create(model='m', messages=[{'role': 'user', 'content': 'x'}], max_tokens=4)\n"
        "        out[name] = 'accepted'\n"
        "    except openai.AuthenticationError as e:\n"
        "        out[name] = e.status_code\n"
        "json.dump(out, open('keys.json', 'w'))\n"
    )
    access = GyreProxyAccess(proxy, handle.url)
    runner = HarnessRunner(RunnerConfig(run_dir=str(tmp_path / "runs")), Evaluator(EvaluatorConfig()), access)

    async def main():
        return await runner.dispatch(ExecutionSpec("k0", _task("k0", script, "none"), "g"))

    issued = {}
    orig_open = access.open_execution

    def spy_open(eid, gid):
        issued[eid] = orig_open(eid, gid)
        return issued[eid]

    access.open_execution = spy_open
    first = asyncio.run(main())  # k0's key is revoked when it ends; k1 then tries it
    assert first.outcome is Outcome.COMPLETED, (first.exec_dir / "stderr.log").read_text()[-2000:]

    async def second():
        return await runner.dispatch(ExecutionSpec("k1", _task("k1", script, issued["k0"]), "g"))

    res = asyncio.run(second())
    assert res.outcome is Outcome.COMPLETED, (res.exec_dir / "stderr.log").read_text()[-2000:]
    out = json.loads((res.workspace / "keys.json").read_text())
    assert out["own"] in ("stop", "length")
    assert out["forged"] == 401 and out["other"] == 401
    assert issued["k0"] != issued["k1"]
    assert {r.execution_id for r in sink.records} == {"k0", "k1"}
    assert len(sink.for_execution("k0")) == 1 and len(sink.for_execution("k1")) == 1


def _task(tid, script, arg):
    from gyre.executions.tasks import EvaluatorSpec

    return Task(task_id=tid, instruction="x", harness=[sys.executable, str(script), arg],
                evaluator=EvaluatorSpec("python", lambda ws, t: 1.0))


@pytest.mark.jobs  # a real harness runs to its timeout against the built-in engine: a whole execution end to end
def test_timed_out_cpu_demo_execution_gets_partial_reward(tmp_path, proxy_server):
    """Acceptance: the cpu_demo harness writes three of its six files, then the model stalls
    (endless text, never a tool call) until the runner's timeout kills the harness. The
    preserved workspace scores 3/6: strictly between an empty and a complete workspace."""
    import random

    from examples.cpu_demo.task import evaluate

    task_json = make_task("words-p", random.Random(11))
    main_words = task_json["metadata"]["main"]
    decode = _decoder()

    def script(input_ids):
        prompt = decode(input_ids)
        if _next_word(prompt) == main_words[3]:
            return "Let me think about this. " * 400  # cut at max_tokens, no tool call
        return scripted_reply(prompt)

    proxy, handle, _ = proxy_server(script, token_delay=0.002)
    task = Task.from_json({**task_json, "harness": harness_command() + ["--max-tokens", "256"], "timeout_s": 15})
    runner = HarnessRunner(RunnerConfig(run_dir=str(tmp_path / "runs"), kill_grace_s=0.5), Evaluator(EvaluatorConfig()),
                           GyreProxyAccess(proxy, handle.url))

    async def main():
        return await runner.dispatch(ExecutionSpec("partial-0", task, "g"))

    res = asyncio.run(main())
    assert res.outcome is Outcome.TIMED_OUT, (res.exec_dir / "stderr.log").read_text()[-2000:]
    words = task_json["evaluator"]["kwargs"]["words"]
    empty, full = tmp_path / "empty", tmp_path / "full"
    empty.mkdir()
    full.mkdir()
    for w in words:
        (full / f"{w}.txt").write_text(str(len(w)))
    r_empty, r_full = evaluate(empty, None, words)["reward"], evaluate(full, None, words)["reward"]
    assert (r_empty, r_full) == (0.0, 1.0)
    assert res.reward.status is RewardStatus.VALID
    assert r_empty < res.reward.reward < r_full
    assert res.reward.reward == 3 / 6  # exactly the three files written before the stall


def test_a_call_in_flight_at_the_timeout_ends_with_its_execution_not_as_an_abort(tmp_path, proxy_server):
    """A harness whose time is up while a model call runs: the runner closes the execution at the
    proxy before it kills the harness, so the call ends with the execution (not recorded, counted
    `inflight`) and is not counted as an aborted call. This harness drops its connection on SIGTERM
    and then lingers until the SIGKILL: were the kill sent first, the proxy would see a client that
    vanished mid-answer (`aborted_calls` 1) long before the close."""
    proxy, handle, sink = proxy_server(token_delay=0.05)  # never EOS: the call outlives the timeout
    script = tmp_path / "linger.py"
    script.write_text(
        "import json, os, signal, socket, time, urllib.parse\n"
        "u = urllib.parse.urlparse(os.environ['OPENAI_BASE_URL'])\n"
        "body = json.dumps({'model': 'm', 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 5000}).encode()\n"
        "s = socket.create_connection((u.hostname, u.port))\n"
        "def term(*_):  # the runner signals the leader and its group: this can run twice\n"
        "    try:\n"
        "        s.shutdown(socket.SHUT_RDWR)\n"
        "        s.close()\n"
        "    except OSError:\n"
        "        pass\n"
        "    time.sleep(60)\n"
        "signal.signal(signal.SIGTERM, term)\n"
        "s.sendall(f'POST {u.path}/chat/completions HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\n'\n"
        "          f'Authorization: Bearer {os.environ[\"OPENAI_API_KEY\"]}\\r\\nContent-Length: {len(body)}\\r\\n\\r\\n'.encode() + body)\n"
        "print(s.recv(65536)[:200])\n"
    )
    access = GyreProxyAccess(proxy, handle.url)
    task = _task("linger", script, "x")
    task = Task(task_id=task.task_id, instruction=task.instruction, harness=task.harness, evaluator=task.evaluator, timeout_s=5.0)
    runner = HarnessRunner(RunnerConfig(run_dir=str(tmp_path / "runs"), kill_grace_s=2.0), Evaluator(EvaluatorConfig()), access)

    async def main():
        return await runner.dispatch(ExecutionSpec("linger-0", task, "g"))

    res = asyncio.run(main())
    assert res.outcome is Outcome.TIMED_OUT, (res.exec_dir / "stderr.log").read_text()[-2000:]
    assert access.totals["aborted_calls"] == 0, access.totals
    # the call ended after its execution closed: not recorded (counted `inflight` when the close
    # found it running, else a late record)
    assert proxy.late_records == 1 and access.totals["calls"] == 0, (proxy.late_records, access.totals)
    assert sink.for_execution("linger-0") == []
