"""A minimal black-box harness for runtime tests: a few chat turns through the official openai
SDK, each answer appended to answer.txt in the workspace (its working directory)."""

import os
import sys

from openai import OpenAI


def main() -> int:
    turns = int(sys.argv[1]) if len(sys.argv) > 1 else 2  # turns: the task sets it (long-tailed executions)
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    client = OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"], max_retries=0, timeout=600)
    messages = [{"role": "system", "content": "You write short words."}, {"role": "user", "content": "Say a word."}]
    with open("answer.txt", "a") as f:
        for _ in range(turns):
            r = client.chat.completions.create(model=os.environ.get("GYRE_MODEL", "gyre-policy"), messages=messages,
                                               max_tokens=max_tokens, temperature=1.0)
            text = r.choices[0].message.content or ""
            f.write(text + "\n")
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Another."}]
    return 0


def evaluate(workspace, task, **kwargs) -> float:
    """Reward: the fraction of answer lines of even length (a signal that varies between samples)."""
    path = workspace / "answer.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return sum(len(x) % 2 == 0 for x in lines) / len(lines) if lines else 0.0


if __name__ == "__main__":
    sys.exit(main())
