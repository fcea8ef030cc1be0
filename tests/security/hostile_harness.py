"""A harness that attacks the engines before doing its work (tests/security/test_engine_auth.py).

What a same-uid process on the host can do: read MASTER_ADDR/MASTER_PORT from an ancestor's
/proc/<pid>/environ and connect to torchrun's store (no authentication; recorded as "store");
learn the engines' URLs (here from argv[1]/urls.txt, which the test fills from the job's log:
reading them from the store needs the key prefixes torchrun adds, which this test does not
chase) and call every route without the secret. It records what it got under argv[1] (once per
run), then does the tiny harness's honest turns so the run still trains.
"""

import json
import os
import sys
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.runtime.tiny_harness import main as honest  # noqa: E402

PROBES = [("POST", "/update_weights?version=4242", b""), ("POST", "/release_memory", b""), ("POST", "/abort", b'{"request_id": "x"}'),
          ("POST", "/generate", b'{"request_id": "x", "input_ids": [1, 2]}'), ("GET", "/ws", b""), ("GET", "/info", b"")]


def _store_address() -> tuple[str, int] | None:
    pid = os.getppid()
    while pid > 1:
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0") if "=" in kv)
            if "MASTER_PORT" in env:
                return env.get("MASTER_ADDR", "127.0.0.1"), int(env["MASTER_PORT"])
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            return None
    return None


def _status(url: str, method: str, body: bytes) -> int:
    req = urllib.request.Request(url, data=body if method == "POST" else None, method=method,
                                 headers={"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                                          "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="} if url.endswith("/ws") else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def attack(out: Path) -> None:
    import torch.distributed as dist

    report: dict = {"store": None, "urls": [], "status": {}}
    addr = _store_address()
    if addr is not None:
        dist.TCPStore(addr[0], addr[1], is_master=False, timeout=timedelta(seconds=10)).check(["x"])
        report["store"] = list(addr)  # connected: nothing stops a local process from reading it
    urls_file = out.with_name("urls.txt")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(report["urls"]) < 2:
        report["urls"] = urls_file.read_text().split() if urls_file.exists() else []
        time.sleep(0.2)
    for url in report["urls"]:
        report["status"][url] = {path: _status(url + path, method, body) for method, path, body in PROBES}
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    report_dir = Path(sys.argv[1])
    try:
        fd = os.open(report_dir / "claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # the first execution attacks
        os.close(fd)
        attack(report_dir / "attack.json")
    except FileExistsError:
        pass
    sys.argv = [sys.argv[0], "1", "24"]
    sys.exit(honest())
