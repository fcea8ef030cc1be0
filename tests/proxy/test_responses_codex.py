"""The real Codex CLI (`codex exec`, wire_api = "responses") against the proxy, configured by
examples/codex/config.toml: one tool-using turn, the command really run, call 2 spliced.
Skipped unless a `codex` binary is found (GYRE_CODEX_BIN, or `codex` on PATH)."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gyre.backends.models.tokenizer import byte_token_ids, load_tokenizer
from gyre.backends.engines.det_engine import DeterministicEngine

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "codex" / "config.toml"
CODEX = os.environ.get("GYRE_CODEX_BIN") or shutil.which("codex")


def _script(input_ids):
    prompt = load_tokenizer().decode(input_ids)
    if "<tool_response>" not in prompt:
        call = {"name": "exec_command", "arguments": {"cmd": "echo gyre > out.txt && cat out.txt"}}
        return "I will create the file.\n<tool_call>\n" + json.dumps(call) + "\n</tool_call>"
    return "Created out.txt."


@pytest.mark.skipif(CODEX is None, reason="no codex binary (npm install -g @openai/codex, or set GYRE_CODEX_BIN)")
def test_codex_exec_tool_turn(make_server, tmp_path):
    engine = DeterministicEngine("codex", script=_script, byte_ids=byte_token_ids(load_tokenizer()))
    proxy, h = make_server([(engine, "cell", 0)])
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    shutil.copy(CONFIG, home / "config.toml")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "CODEX_HOME": str(home), "OPENAI_API_KEY": proxy.issue_key("ex-codex")}
    cmd = [CODEX, "exec", "--strict-config", "--skip-git-repo-check", "--ephemeral", "--dangerously-bypass-approvals-and-sandbox",
           "-c", f'model_providers.gyre.base_url="{h.url}/v1"', "Create out.txt"]
    done = subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (work / "out.txt").read_text() == "gyre\n"  # Codex ran the parsed function_call
    assert "Created out.txt." in done.stdout
    recs = proxy.sink.for_execution("ex-codex")
    assert [r.payload_ref["api"] for r in recs] == ["responses", "responses"]
    assert [r.finish_reason for r in recs] == ["tool_calls", "stop"]
    assert recs[1].payload_ref["spliced_turns"] == 1 and recs[1].payload_ref["unmatched_turns"] == 0
    start, end = recs[1].payload_ref["spliced_spans"][0]
    assert list(recs[1].input_ids[start:end]) == list(recs[0].output_ids)
