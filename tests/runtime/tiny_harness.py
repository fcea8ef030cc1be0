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
    """Reward: the fraction of distinct lowercase vowels in the answers (a signal that varies)."""
    text = (workspace / "answer.txt").read_text() if (workspace / "answer.txt").exists() else ""
    return len(set(text) & set("aeiou")) / 5.0


if __name__ == "__main__":
    sys.exit(main())
