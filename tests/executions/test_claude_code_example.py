"""examples/claude_code: the evaluator's partial credit by hand; the README's CPU smoke command
(the stand-in harness), read from the README itself and run for its 2 steps from a fresh
directory (slow); and the real `claude` CLI through run_claude.py against the proxy with a
scripted model, skipped unless a binary is found (GYRE_CLAUDE_BIN, or `claude` on PATH)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from examples.claude_code.task import evaluate, make_tasks
from tests.executions.helpers import assert_trained
from tests.jobs import RUNS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "claude_code"
CLAUDE = os.environ.get("GYRE_CLAUDE_BIN") or shutil.which("claude")


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


@pytest.mark.skipif(CLAUDE is None, reason="no claude binary (npm install -g @anthropic-ai/claude-code, or set GYRE_CLAUDE_BIN)")
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
    """Claude Code takes a window from the model name (200k / 1M); run_claude.py gives it the
    proxy's (GYRE_MAX_CONTEXT_TOKENS, which the runner sets from the proxy's config) as its
    auto-compact window, and caps its output to leave the prompt room."""
    from examples.claude_code.run_claude import claude_env
    from gyre.runtime.proxy_access import GyreProxyAccess
    from gyre.proxy.config import ProxyConfig

    env = claude_env("m", api_timeout_ms=1, bash_timeout_ms=1, max_output_tokens=32000, context_tokens=65536)
    assert env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "65536" and env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "16384"
    env = claude_env("m", api_timeout_ms=1, bash_timeout_ms=1, max_output_tokens=32000, context_tokens=None)
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "32000" and "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in {
        k for k in env if k not in os.environ}

    class P:
        config = ProxyConfig(max_context_tokens=98304)

    assert GyreProxyAccess(P(), "http://x").context_tokens == 98304


@pytest.mark.slow
@pytest.mark.skipif(CLAUDE is None, reason="no claude binary (npm install -g @anthropic-ai/claude-code, or set GYRE_CLAUDE_BIN)")
def test_real_claude_code_compacts_past_the_proxy_context_and_keeps_its_roles(tmp_path):
    """Issue 34: the real CLI fills the proxy's context with long tool outputs, gets Anthropic's
    `prompt is too long` 400, compacts, and finishes; its compaction is recorded `main_summary`
    and the calls after it `main` (its billing line changes at compaction)."""
    from gyre.backends.models.tokenizer import load_tokenizer
    from gyre.executions.evaluator import Outcome
    from gyre.proxy import MemorySink
    from gyre.trajectory.record import Role

    tok = load_tokenizer()
    big = {"name": "Bash", "arguments": {"command": "python3 -c \"print('word ' * 5000)\"", "description": "print a lot"}}
    write = {"name": "Bash", "arguments": {"command": "echo apple > answer.txt", "description": "write the answer"}}

    def script(ids):
        text = tok.decode(ids)
        last_user = text.rsplit("<|im_start|>user", 1)[-1]
        if "summary of the conversation" in last_user.lower():
            return "<summary>The user wants the word apple in answer.txt; long outputs were printed.</summary>"
        if "continued from a previous conversation" in text and "<tool_response>" not in text.rsplit("continued from", 1)[-1]:
            return "Writing it now.\n<tool_call>\n" + json.dumps(write) + "\n</tool_call>"
        if "<tool_response>" in last_user and "apple" in last_user:
            return "Done: apple."
        return "More output first.\n<tool_call>\n" + json.dumps(big) + "\n</tool_call>"

    sink = MemorySink()
    res, logs = _run_real_cli(tmp_path, sink, script, tok, "cc-full", max_turns=40, timeout_s=600)
    assert res.outcome is Outcome.COMPLETED, logs
    roles = [r.role for r in sink.for_execution("cc-full") if r.role is not Role.HELPER]
    assert Role.MAIN_SUMMARY in roles, (roles, logs)
    after = roles[roles.index(Role.MAIN_SUMMARY) + 1:]
    assert after and set(after) == {Role.MAIN}, (roles, logs)
    assert Role.SUB not in roles and Role.SUB_SUMMARY not in roles, roles


def _run_real_cli(tmp_path, sink, script, tok, execution_id: str, *, max_turns: int, timeout_s: int):
    """One execution of the real Claude Code CLI (run_claude.py) through a real proxy (64k context)
    whose deterministic engine answers with `script`; its result and the tail of its logs."""
    from gyre.backends.engines.det_engine import DeterministicEngine
    from gyre.backends.models.tokenizer import byte_token_ids
    from gyre.executions.config import EvaluatorConfig, RunnerConfig
    from gyre.executions.evaluator import Evaluator
    from gyre.executions.runner import HarnessRunner
    from gyre.executions.tasks import ExecutionSpec, Task
    from gyre.proxy import Proxy, ProxyConfig, serve_proxy
    from gyre.runtime.proxy_access import GyreProxyAccess

    proxy = Proxy(ProxyConfig(max_context_tokens=65536), sink=sink)
    proxy.router.add_engine(DeterministicEngine("det", script=script, byte_ids=byte_token_ids(tok)), kind="cell", index=0)
    handle = serve_proxy(proxy)
    try:
        task = Task.from_json(make_tasks(1)[0] | {"timeout_s": timeout_s, "harness": [
            "{python}", str(EXAMPLE / "run_claude.py"), "--max-turns", str(max_turns), "--max-output-tokens", "512"]})
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
