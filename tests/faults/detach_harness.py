"""A harness that leaves daemons: N children that each call setsid() and fork again (the classic
double fork), so they are in no session or process group of the harness and their parent is gone.

argv: MARKER N THEN [CHATTER]. Each daemon is `sleep MARKER` (MARKER is a number of seconds, and
unique: a test finds the daemons by it in /proc). Before THEN the harness writes CHATTER bytes to
stdout (default 0) and `daemons.json` in its working directory: the daemons' pids, how many were
alive and outside its session right after the spawn. THEN: `exit` (exit 0), `hang` (sleep until
killed), `tiny` (then run tests/runtime/tiny_harness.py with one turn: a model call, exit 0)."""

import json
import os
import runpy
import sys
import time
from pathlib import Path


def spawn(marker: str) -> int:
    """One double-forked daemon; returns its pid."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.setsid()
        daemon = os.fork()
        if daemon == 0:
            os.execvp("sleep", ["sleep", marker])
        os.write(w, str(daemon).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return int(f.read())


def alive_elsewhere(pid: int) -> bool:
    try:
        state, _, _, sid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:4]
    except OSError:
        return False
    return state not in ("Z", "X") and int(sid) != os.getsid(0)


def main() -> int:
    marker, n, then = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    chatter = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    pids = [spawn(marker) for _ in range(n)]
    time.sleep(0.2)  # the last execs land
    Path("daemons.json").write_text(json.dumps({"pids": pids, "alive_elsewhere": sum(map(alive_elsewhere, pids))}))
    line = b"chatter " * 16 + b"\n"
    while chatter > 0:
        os.write(1, line[:chatter])
        chatter -= len(line)
    os.write(1, b"THE END\n")
    if then == "hang":
        while True:
            time.sleep(1)
    if then == "tiny":
        sys.argv = [str(Path(__file__).parents[1] / "runtime" / "tiny_harness.py"), "1", "8"]
        runpy.run_path(sys.argv[0], run_name="__main__")  # exits with its status
    return 0


if __name__ == "__main__":
    sys.exit(main())
