"""A harness that never ends on its own: one model call, a background child, then sleep.

argv: MARKER [CALLS]. The marker is on the command line of the harness and of its `sleep`
child, so a test finds both in /proc from outside any pid namespace."""

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from tiny_harness import chat  # noqa: E402  (stdlib only: no SDK import per harness)


def main() -> int:
    marker = sys.argv[1]
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    subprocess.Popen(["sleep", f"{3000 + os.getpid() % 1000}.{marker}"], start_new_session=False)
    with open("answer.txt", "a") as f:
        for _ in range(calls):
            f.write(chat([{"role": "user", "content": "Say a word."}], 8) + "\n")
            f.flush()
    (open("called", "w")).close()
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
