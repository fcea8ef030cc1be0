"""A scripted policy for the cpu_demo agent, written over the rendered prompt text.

It reads what a model would read (the Qwen-format prompt the proxy renders) and answers what
a competent model would answer: write the next file, delegate the helper words, finish, or
summarize when asked. Used two ways:
  - demonstrations for the supervised warm start (warm_start.py), with `correct_prob` < 1 so
    the written numbers are mostly random: the warm-started model knows the format, not the
    answers, and RL has room to raise the reward;
  - the deterministic test engine's script (tests), to drive the real harness through the real
    proxy and check the call tree.
"""

from __future__ import annotations

import json
import random
import re

from examples.cpu_demo.harness import SUMMARY_PROMPT, SYSTEM_SUB
from examples.cpu_demo.task import answer

_NEXT = re.compile(r"next: (none|[a-z]+)(?:\.txt)?(?: \| helper: (done|[a-z ]+))?")


def tool_call(name: str, arguments: dict) -> str:
    """Exactly the text the chat template renders for one tool call (Hermes / Qwen2.5)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def scripted_reply(prompt: str, rng: random.Random | None = None, correct_prob: float = 1.0,
                   wrong: str = "off_by_one") -> str:
    """The next assistant output for a rendered prompt (ending in `<|im_start|>assistant\\n`).

    With probability 1 − `correct_prob` the written number is wrong: `off_by_one` (the length
    ± 1, a miscount that still depends on the word) or `random` (2..7, independent of it)."""
    system = prompt.split("<|im_end|>", 1)[0]
    is_sub = SYSTEM_SUB[:30] in system
    last_user = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    if SUMMARY_PROMPT in last_user:
        return "Progress is saved in the files."
    found = _NEXT.findall(prompt)
    if not found:
        return "I cannot find my todo list."
    nxt, helper = found[-1]
    if nxt != "none":
        value = answer(nxt)
        if rng is not None and rng.random() >= correct_prob:
            if wrong == "off_by_one":
                value = str(int(value) + rng.choice((-1, 1)))
            elif wrong == "random":
                value = str(rng.randint(2, 7))
            else:
                raise ValueError(f"wrong must be 'off_by_one' or 'random', got {wrong!r}")
        return tool_call("write_next", {"content": value})
    if not is_sub and helper and helper != "done":
        return tool_call("delegate", {})
    return tool_call("finish", {})
