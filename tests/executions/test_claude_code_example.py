"""examples/claude_code: the evaluator's partial credit by hand; the README's CPU smoke command
(the stand-in harness), read from the README itself and run for its 2 steps from a fresh
directory (slow); and the real `claude` CLI through run_claude.py against the proxy with a
scripted model, skipped unless a binary is found (GYRE_CLAUDE_BIN, `claude` on PATH, or the one
the claude-agent-sdk wheel bundles): one task, and (slow) a run past a full context."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from examples.claude_code.run_claude import find_claude
from examples.claude_code.task import evaluate, make_tasks
from tests.executions.helpers import assert_trained
from tests.jobs import RUNS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "claude_code"
CLAUDE = find_claude()  # GYRE_CLAUDE_BIN, `claude` on PATH, or the one claude-agent-sdk bundles
NO_CLI = "no claude binary (pip install claude-agent-sdk, or set GYRE_CLAUDE_BIN)"


def readme_commands(readme: Path, marker: str) -> list[list[str]]:
    """The argv of each command in the README's ```bash block that contains `marker`: lines
    joined at a trailing backslash, split as a shell would (quotes removed, `$PWD` kept)."""
    blocks = re.findall(r"```bash\n(.*?)```", readme.read_text(), flags=re.S)
    block = next(b for b in blocks if marker in b)
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_evaluate_gives_half_for_the_file_plus_closeness_and_reads_the_final_answer_otherwise(tmp_path):
    ws = tmp_path / "exec" / "workspace"
    ws.mkdir(parents=True)
    assert evaluate(ws, None, expected="apple")["reward"] == 0.0  # no file, no stdout.log
    # The last stream-json result event counts; "appel" vs "apple": 3 in place, 5 shared, same
    # length: 0.6·3/5 + 0.2·5/5 + 0.2 = 0.76, times 0.3 = 0.228.
    (ws.parent / "stdout.log").write_text('{"type": "result", "result": "zzzzzz"}\nnot json\n'
                                          '{"type": "result", "result": "I wrote: appel!"}\n')
    got = evaluate(ws, None, expected="apple")
    assert got["reward"] == pytest.approx(0.228) and got["closest_word"] == "appel"
    (ws / "answer.txt").write_text("appel\n")
    assert evaluate(ws, None, expected="apple") == {"reward": pytest.approx(0.5 + 0.5 * 0.76), "answer": "appel"}


@pytest.mark.jobs
@pytest.mark.slow
@pytest.mark.multirank
def test_the_readme_cpu_smoke_command_trains_two_steps_through_the_stand_in(tmp_path):
    pytest.importorskip("anthropic")
    make, train = readme_commands(EXAMPLE / "README.md", "standin_claude.py")
    assert make[:3] == ["python", "-m", "examples.claude_code.task"] and train[0] == "torchrun", (make, train)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, *make[1:]], cwd=tmp_path, env=env, check=True, capture_output=True)

    # Exactly as documented, from a fresh directory.
    cmd = RUNS["claude_code_example"].documented(
        [sys.executable, "-m", "torch.distributed.run", *[a.replace("$PWD", str(ROOT)) for a in train[1:]]])
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]

    run = tmp_path / train[train.index("--run-dir") + 1]
    summary = assert_trained(run, steps=2)
    results = [json.loads(p.read_text()) for p in (run / "executions").glob("*/result.json")]
    completed = [r for r in results if r["outcome"] == "completed"]
    for r in completed:
        d = run / "executions" / r["execution_id"]
        events = [json.loads(x) for x in (d / "stdout.log").read_text().splitlines()]
        assert events[0]["type"] == "assistant" and events[-1]["type"] == "result", (d / "stderr.log").read_text()[-2000:]
        assert r["reward"]["status"] == "valid" and 0.0 <= r["reward"]["reward"] <= 1.0
        assert (run / "tito" / f"{r['execution_id']}.tito").stat().st_size > 0
    assert summary["calls"] >= len(completed) > 0


@pytest.mark.skipif(CLAUDE is None, reason=NO_CLI)
def test_real_claude_code_writes_the_answer_through_the_proxy(tmp_path):
    from gyre.backends.models.tokenizer import load_tokenizer
    from gyre.executions.evaluator import Outcome
    from gyre.proxy import MemorySink

    tok = load_tokenizer()

    def script(ids):
        if "<tool_response>" not in tok.decode(ids):
            call = {"name": "Bash", "arguments": {"command": "echo apple > answer.txt", "description": "write the answer"}}
            return "I will write it.\n<tool_call>\n" + json.dumps(call) + "\n</tool_call>"
        return "Done: apple."

    sink = MemorySink()
    res, logs = _run_real_cli(tmp_path, sink, script, tok, "cc-0", max_turns=4, timeout_s=240)
    assert res.outcome is Outcome.COMPLETED, logs
    assert res.reward.reward == 1.0, logs
    recs = sink.for_execution("cc-0")
    assert len(recs) >= 2, logs
    assert [r.role.name for r in recs] == ["MAIN"] * len(recs), logs  # both turns of the one agent


def test_claude_code_is_told_the_proxy_context_so_it_compacts_in_time():
    """Claude Code assumes a 1M window for a model name it does not know; run_claude.py gives it
    the proxy's (GYRE_MAX_CONTEXT_TOKENS, which the runner sets from the proxy's config) as the
    model's window, caps its output so its compaction point (window - output - 13,000) stays
    above its first prompt, and caps a tool output to what that reserve holds."""
    from examples.claude_code.run_claude import COMPACT_RESERVE, claude_env
    from gyre.proxy.config import ProxyConfig
    from gyre.runtime.proxy_access import GyreProxyAccess

    env = claude_env("m", api_timeout_ms=1, bash_timeout_ms=1, max_output_tokens=32000, context_tokens=32768)
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "32768" and env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "2048"
    # Compaction at 32768 - 2048 - 13000 = 17720, above the 12.7k-token first prompt of 2.1.337.
    assert 32768 - int(env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"]) - COMPACT_RESERVE == 17720
    assert int(env["BASH_MAX_OUTPUT_LENGTH"]) <= 2 * (COMPACT_RESERVE - 3000)  # >= 2 characters a token
    assert "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in env  # read as >= 100k: it cannot bring compaction forward
    env = claude_env("m", api_timeout_ms=1, bash_timeout_ms=1, max_output_tokens=512, context_tokens=131072)
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "131072" and env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "512"
    env = claude_env("m", api_timeout_ms=1, bash_timeout_ms=1, max_output_tokens=32000, context_tokens=None)
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "32000" and "CLAUDE_CODE_MAX_CONTEXT_TOKENS" not in {
        k for k in env if k not in os.environ}

    class P:
        config = ProxyConfig(max_context_tokens=98304)

    assert GyreProxyAccess(P(), "http://x").context_tokens == 98304


@pytest.mark.slow
@pytest.mark.skipif(CLAUDE is None, reason=NO_CLI)
def test_real_claude_code_compacts_at_the_default_context_and_goes_on(tmp_path):
    """The real CLI, set up as documented (run_claude.py), at the proxy's default context: long
    tool outputs fill it, Claude Code compacts before the proxy must refuse a prompt (no 400),
    the compaction is recorded `main_summary`, the agent goes on from its summary (`main`) and
    finishes the task. GYRE_RECORD_CLAUDE_FIXTURE=<path> writes the run's request log there
    (tests/fixtures/claude_code_compaction.json, replayed by tests/proxy/test_claude_code_replay.py)."""
    from gyre.backends.models.tokenizer import load_tokenizer
    from gyre.executions.evaluator import Outcome
    from gyre.proxy import MemorySink, ProxyConfig
    from gyre.trajectory.record import Role
    from tests.proxy.claude_code_log import pack, recording

    tok = load_tokenizer()
    context = ProxyConfig().max_context_tokens
    big = {"name": "Bash", "arguments": {"command": "python3 -c \"print('word ' * 5000)\"", "description": "print a lot"}}
    write = {"name": "Bash", "arguments": {"command": "echo apple > answer.txt", "description": "write the answer"}}
    state = {"summaries": 0, "wrote": False}

    def script(ids):  # long outputs until a compaction, then the task, then done
        last_user = tok.decode(ids).rsplit("<|im_start|>user", 1)[-1]
        if "summary of the conversation" in last_user.lower():
            state["summaries"] += 1
            return "<summary>The user wants the word apple in answer.txt; long outputs were printed.</summary>"
        if state["wrote"] and "<tool_response>" in last_user:
            return "Done: apple."
        if state["summaries"]:
            state["wrote"] = True
            return "Writing it now.\n<tool_call>\n" + json.dumps(write) + "\n</tool_call>"
        return "More output first.\n<tool_call>\n" + json.dumps(big) + "\n</tool_call>"

    sink, log = MemorySink(), []
    with recording(log):
        res, logs = _run_real_cli(tmp_path, sink, script, tok, "cc-full", max_turns=30, timeout_s=600, context=context, cli_args=[])
    assert res.outcome is Outcome.COMPLETED and res.reward.reward == 1.0, logs
    assert [e["status"] for e in log] == [200] * len(log), ([(e["path"], e["status"]) for e in log], logs)
    recs = sorted(sink.for_execution("cc-full"), key=lambda r: r.call_id)
    roles = [r.role for r in recs]
    assert Role.MAIN_SUMMARY in roles, (roles, logs)
    after = roles[roles.index(Role.MAIN_SUMMARY) + 1:]
    assert Role.MAIN in after and set(roles) <= {Role.MAIN, Role.MAIN_SUMMARY}, roles
    assert max(len(r.input_ids) for r in recs) < context
    events = [json.loads(x) for x in (res.exec_dir / "stdout.log").read_text().splitlines() if x.startswith("{")]
    compacts = [e["compact_metadata"] for e in events if e.get("subtype") == "compact_boundary"]
    assert compacts and compacts[0]["trigger"] == "auto", compacts  # before the limit, not on a refusal
    assert next(e for e in events if e.get("type") == "result")["modelUsage"]["gyre-policy"]["contextWindow"] == context

    if out := os.environ.get("GYRE_RECORD_CLAUDE_FIXTURE"):
        messages = [e for e in log if e["path"] == "/v1/messages"]
        assert len(messages) == len(recs)
        for e, r in zip(messages, recs):
            e |= {"role": r.role.name, "prompt_tokens": len(r.input_ids), "sampled": tok.decode(r.output_ids, skip_special_tokens=True)}
        version = next(e for e in events if e.get("subtype") == "init")["claude_code_version"]
        Path(out).write_text(json.dumps({"claude_code_version": version, "context_tokens": context, "model": "gyre-policy",
                                         **pack(log)}, indent=1) + "\n")


def _run_real_cli(tmp_path, sink, script, tok, execution_id: str, *, max_turns: int, timeout_s: int,
                  context: int = 65536, cli_args=("--max-output-tokens", "512")):
    """One execution of the real Claude Code CLI (run_claude.py) through a real proxy (`context`
    tokens) whose deterministic engine answers with `script`; its result and the tail of its logs."""
    from gyre.backends.engines.det_engine import DeterministicEngine
    from gyre.backends.models.tokenizer import byte_token_ids
    from gyre.executions.config import EvaluatorConfig, RunnerConfig
    from gyre.executions.evaluator import Evaluator
    from gyre.executions.runner import HarnessRunner
    from gyre.executions.tasks import ExecutionSpec, Task
    from gyre.proxy import Proxy, ProxyConfig, serve_proxy
    from gyre.runtime.proxy_access import GyreProxyAccess

    proxy = Proxy(ProxyConfig(max_context_tokens=context), sink=sink)
    proxy.router.add_engine(DeterministicEngine("det", script=script, byte_ids=byte_token_ids(tok)), kind="cell", index=0)
    handle = serve_proxy(proxy)
    try:
        task = Task.from_json(make_tasks(1)[0] | {"timeout_s": timeout_s, "harness": [
            "{python}", str(EXAMPLE / "run_claude.py"), "--max-turns", str(max_turns), *cli_args]})
        cli_dir = str(Path(CLAUDE).resolve().parent)  # outside /usr: the sandbox must be told about it
        runner = HarnessRunner(RunnerConfig(run_dir=str(tmp_path / "runs"), timeout_s=timeout_s, home="per_execution",
                                            env={"GYRE_CLAUDE_BIN": CLAUDE},
                                            sandbox_ro_paths=[str(EXAMPLE / "settings.json"), cli_dir]),
                               Evaluator(EvaluatorConfig()), GyreProxyAccess(proxy, handle.url))

        async def one():
            return await runner.dispatch(ExecutionSpec(execution_id, task, "g"))

        res = asyncio.run(one())
    finally:
        handle.stop()
    return res, (res.exec_dir / "stdout.log").read_text()[-3000:] + (res.exec_dir / "stderr.log").read_text()[-2000:]
