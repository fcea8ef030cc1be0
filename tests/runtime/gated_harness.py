"""A tiny harness with a gate in the middle, for tests that act while an execution is surely in
flight: BEFORE chat turns (tiny_harness's), then `phase1` in the workspace, then wait for `go` there
(written by the test), then AFTER more turns. Its pid goes to `pid`. argv: BEFORE AFTER [MAX_TOKENS]."""

import os
import sys
import time

from tiny_harness import chat


def main() -> int:
    before, after = int(sys.argv[1]), int(sys.argv[2])
    max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 12
    with open("pid", "w") as f:
        f.write(str(os.getpid()))
    messages = [{"role": "system", "content": "You write short words."}, {"role": "user", "content": "Say a word."}]
    with open("answer.txt", "a") as f:
        for turn in range(before + after):
            if turn == before:
                open("phase1", "w").close()
                while not os.path.exists("go"):
                    time.sleep(0.02)
            text = chat(messages, max_tokens)
            f.write(text + "\n")
            f.flush()
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Another."}]
    return 0


if __name__ == "__main__":
    sys.exit(main())
