"""A harness that never ends on its own: one model call, a background child, then sleep.

argv: MARKER [CALLS]. The marker is on the command line of the harness and of its `sleep`
child, so a test finds both in /proc from outside any pid namespace."""

import os
import subprocess
import sys
import time

from openai import OpenAI


def main() -> int:
    marker = sys.argv[1]
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    subprocess.Popen(["sleep", f"{3000 + os.getpid() % 1000}.{marker}"], start_new_session=False)
    client = OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"], max_retries=0, timeout=600)
    with open("answer.txt", "a") as f:
        for _ in range(calls):
            r = client.chat.completions.create(model=os.environ.get("GYRE_MODEL", "gyre-policy"),
                                               messages=[{"role": "user", "content": "Say a word."}],
                                               max_tokens=8, temperature=1.0)
            f.write((r.choices[0].message.content or "") + "\n")
            f.flush()
    (open("called", "w")).close()
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
