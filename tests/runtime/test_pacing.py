"""The longtail harness's paced think time (examples/longtail/harness.py): with
`--think-tokens-per-s R` each turn's model call asks for round(R × scaled think time) tokens
(at least 1) and as many at least (`min_tokens`), over the stdlib client (`--client http`), against a stand-in OpenAI server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from examples.longtail.harness import draw_plan

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "examples" / "longtail" / "harness.py"


class _Server:
    """Records every chat-completions body; answers with a one-word completion."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.auth: list[str] = []
        rec = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):
                n = int(self.headers["Content-Length"])
                rec.bodies.append(json.loads(self.rfile.read(n)))
                rec.auth.append(self.headers.get("Authorization", ""))
                out = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                               "finish_reason": "stop"}]}).encode()
                self.send_response(200 if self.path == "/v1/chat/completions" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def _run(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, _Server]:
    """Run the harness against a fresh stand-in server; returns the process and the server's record."""
    server = _Server()
    try:
        return _harness(tmp_path, server, *extra), server
    finally:
        server.httpd.shutdown()


def _harness(tmp_path: Path, server: _Server, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPENAI_BASE_URL": f"http://127.0.0.1:{server.port}/v1", "OPENAI_API_KEY": "k-test",
           "GYRE_EXECUTION_ID": "e-7"}
    return subprocess.run([sys.executable, str(HARNESS), "--seed", "3", "--time-scale", "1e-5", "--turns-mean", "5",
                           "--client", "http", *extra], check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_think_tokens_per_s_asks_for_the_think_time_in_tokens(tmp_path):
    proc, server = _run(tmp_path, "--think-tokens-per-s", "2000")
    assert proc.returncode == 0, proc.stderr
    plan = draw_plan(3, "e-7", turns_mean=5)
    want = [max(1, round(t * 1e-5 * 2000)) for t in plan.think_s]
    assert [b["max_tokens"] for b in server.bodies] == want
    assert [b["min_tokens"] for b in server.bodies] == want  # no early EOS: the call lasts its think time
    assert len(set(want)) > 1  # the plan's turns differ, so the test tells the rule from a constant
    assert all(a == "Bearer k-test" for a in server.auth)
    assert json.loads((tmp_path / "progress.json").read_text())["turns_done"] == plan.turns


def test_without_the_rate_every_call_asks_for_max_tokens(tmp_path):
    proc, server = _run(tmp_path, "--max-tokens", "9")
    assert proc.returncode == 0, proc.stderr
    assert [b["max_tokens"] for b in server.bodies] == [9] * draw_plan(3, "e-7", turns_mean=5).turns
    assert not any("min_tokens" in b for b in server.bodies)
