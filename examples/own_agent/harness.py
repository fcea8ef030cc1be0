"""A minimal agent harness for Gyre: copy it and make it yours.

Gyre starts it once per execution, with the workspace as the working directory, and points it at
its proxy through the environment (OPENAI_BASE_URL, OPENAI_API_KEY, GYRE_MODEL, GYRE_INSTRUCTION_FILE).
Every model call goes through the proxy, which records the tokens Gyre trains on. The agent
speaks a two-command protocol: `READ <file>` shows it a workspace file, `ANSWER <text>` writes
answer.txt. Whatever the model says (a random model says garbage), the harness exits 0 with an
answer written: the evaluator, not the harness, decides how good it is.
"""

import os
import sys
from pathlib import Path

from openai import OpenAI

MAX_TURNS, MAX_TOKENS = 3, 24
SYSTEM = "You are an agent in a workspace. Reply `READ <file>` to see a file, or `ANSWER <text>` to finish."


def main() -> int:
    client = OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"], timeout=3600)
    task = Path(os.environ["GYRE_INSTRUCTION_FILE"]).read_text()
    files = ", ".join(sorted(p.name for p in Path(".").iterdir()))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{task}\nFiles: {files}"}]
    answer = ""
    for turn in range(1, MAX_TURNS + 1):
        r = client.chat.completions.create(model=os.environ.get("GYRE_MODEL", "gyre-policy"), messages=messages,
                                           max_tokens=MAX_TOKENS, temperature=1.0)
        reply = (r.choices[0].message.content or "").strip()
        command, _, arg = reply.partition(" ")
        answer = arg if command == "ANSWER" else reply  # no ANSWER by the last turn: the last reply counts
        if command == "ANSWER":
            break
        name = arg.strip()
        if command == "READ" and name and Path(name).name == name and Path(name).is_file():  # workspace files only
            observation = Path(name).read_text(errors="replace")[:2000]
        else:
            observation = "Unknown command. Reply `READ <file>` or `ANSWER <text>`."
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": observation}]
    Path("answer.txt").write_text(answer.strip() + "\n", encoding="utf-8")
    print(f"turns={turn} answer={ascii(answer.strip()[:80])}")  # lands in stdout.log
    return 0


if __name__ == "__main__":
    sys.exit(main())
