"""A minimal black-box harness for runtime tests: a few chat turns, each answer appended to
answer.txt in the workspace (its working directory).

Standard library only (urllib + json): a job starts one harness process per execution, and on
a small machine importing the openai SDK in each was a large share of a tiny job's time. The SDK
itself is proven against the proxy in tests/proxy/test_sdk.py; here the wire is plain OpenAI chat
completions: POST $OPENAI_BASE_URL/chat/completions with the execution key as bearer token.
argv: [TURNS [MAX_TOKENS [sdk]]]; `sdk`: through the official openai SDK instead (the one job
whose timing still depends on it: tests/runtime/test_transports_job.py)."""

import json
import os
import sys
import urllib.request


def chat(messages: list[dict], max_tokens: int, timeout: float = 600) -> str:
    """One chat completion through the proxy; the answer's text. An HTTP error raises (the
    harness then exits non-zero, as it did with the SDK and max_retries=0)."""
    body = {"model": os.environ.get("GYRE_MODEL", "gyre-policy"), "messages": messages, "max_tokens": max_tokens,
            "temperature": 1.0}
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"] or ""


def sdk_chat(messages: list[dict], max_tokens: int) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"], max_retries=0, timeout=600)
    r = client.chat.completions.create(model=os.environ.get("GYRE_MODEL", "gyre-policy"), messages=messages,
                                       max_tokens=max_tokens, temperature=1.0)
    return r.choices[0].message.content or ""


def main() -> int:
    turns = int(sys.argv[1]) if len(sys.argv) > 1 else 2  # turns: the task sets it (long-tailed executions)
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    call = sdk_chat if sys.argv[3:4] == ["sdk"] else chat
    messages = [{"role": "system", "content": "You write short words."}, {"role": "user", "content": "Say a word."}]
    with open("answer.txt", "a") as f:
        for _ in range(turns):
            text = call(messages, max_tokens)
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
