"""tool_agent harness: a shop assistant that looks a price up with a tool, then answers in words.

Gyre starts it once per execution with the workspace as the working directory and the proxy in the
environment (OPENAI_BASE_URL, OPENAI_API_KEY, GYRE_MODEL, GYRE_INSTRUCTION_FILE). It depends on the
official `openai` SDK and the standard library only, so it runs inside Gyre's sandbox as it is.

The loop (at most MAX_CALLS model calls, each at most --max-tokens tokens):
  1. The question goes to the model with one tool, `get_price(item)`. The first call forces that tool
     (`tool_choice` naming it): the proxy starts the reply with the tool-call opening and the model
     writes the arguments. A small model never starts a `<tool_call>` on its own at temperature 1
     (0 of 32 samples, see README), so without the forced first call there is nothing to learn from.
  2. Each tool call is answered with a tool message: the price from `prices.json` in the workspace
     (which the prompt does not contain) of the one item the arguments name (`{"item": "mango"}`, or
     forgivingly any JSON naming exactly one shop item), or an `error: ...` string (unknown tool,
     arguments that are not JSON, no item or several). Nothing the model writes makes the harness fail.
  3. Later calls use `tool_choice="auto"`. The first reply without a tool call is the answer, written
     to `answer.txt`; the evaluator checks that it names the price.

`Episode` is the loop without I/O (messages in, next request out), so that `base_rate.py` runs the
very same loop offline with transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_CALLS = 3
TOOL_NAME = "get_price"
# The system prompt the harness sends (the proxy appends the tool block to it, Hermes-style).
# It shows one call spelled out: a 135M model copies the shape far more often than it follows the
# tool block's generic instruction. The example item is not sold, so copying it verbatim earns an error.
SYSTEM = ("You are a shop assistant. You do not know the prices: look them up with the get_price tool, then tell "
          'the customer the price. To call it, reply exactly:\n<tool_call>\n{"name": "get_price", "arguments": '
          '{"item": "teapot"}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {
    "name": TOOL_NAME,
    "description": "Get the price of an item in the shop, in dollars.",
    "parameters": {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}}]
FORCED = {"type": "function", "function": {"name": TOOL_NAME}}


def normalize(item: Any) -> str:
    """'Mangos ' -> 'mango': what the shop's lookup forgives (case, spaces, a plural s)."""
    s = str(item).strip().lower()
    return s[:-1] if s.endswith("s") and not s.endswith("ss") else s


def run_tool(name: str, arguments: str, prices: dict[str, int]) -> str:
    """The tool's result for one call, as the model will read it. Never raises."""
    if name != TOOL_NAME:
        return f"error: unknown tool {name!r}; the only tool is {TOOL_NAME}"
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        return "error: the arguments are not JSON"
    if isinstance(args, dict) and isinstance(args.get("item"), str) and normalize(args["item"]) in prices:
        item = normalize(args["item"])
    else:  # forgiving: the one shop item named anywhere in the arguments ({"item": {"name": "Mangos"}} too)
        named = sorted({normalize(w) for w in re.findall(r"[A-Za-z]+", arguments or "")} & prices.keys())
        if len(named) != 1:
            return ('error: name one item of the shop, like {"item": "mango"}' if not named
                    else f"error: name one item, not {len(named)} ({', '.join(named)})")
        item = named[0]
    return f"{'An' if item[0] in 'aeiou' else 'A'} {item} costs {prices[item]} dollars."


@dataclass
class Call:
    id: str
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it


@dataclass
class Episode:
    """The harness's conversation without I/O: `request()` is the next call's arguments, `observe()`
    takes the model's reply (content and parsed tool calls) and says whether the episode is over."""

    question: str
    prices: dict[str, int]
    max_calls: int = MAX_CALLS
    messages: list[dict[str, Any]] = field(default_factory=list)
    calls: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    answer: str = ""
    done: bool = False

    def __post_init__(self) -> None:
        self.messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.question}]

    def request(self) -> dict[str, Any]:
        return {"messages": self.messages, "tools": TOOLS, "tool_choice": FORCED if self.calls == 0 else "auto"}

    def observe(self, content: str | None, calls: list[Call]) -> bool:
        self.calls += 1
        content = content or ""
        if not calls:  # a plain reply is the answer
            self.answer, self.done = content.strip(), True
            return True
        self.messages.append({"role": "assistant", "content": content, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]})
        for c in calls:
            result = run_tool(c.name, c.arguments, self.prices)
            self.tool_calls += 1
            self.tool_errors += result.startswith("error:")
            self.messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
        if self.calls >= self.max_calls:  # out of calls while still calling tools: no answer
            self.done = True
        return self.done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Defaults from the environment too: Gyre's `--executions.runner.env NAME VALUE` reaches a harness
    # whose argv is shared by every task (a word starting with "-" would end the harness-command list).
    p.add_argument("--max-tokens", type=int, default=int(os.environ.get("TOOL_AGENT_MAX_TOKENS", 48)),
                   help="tokens per model call (env TOOL_AGENT_MAX_TOKENS)")
    p.add_argument("--temperature", type=float, default=float(os.environ.get("TOOL_AGENT_TEMPERATURE", 1.0)),
                   help="sampling temperature (env TOOL_AGENT_TEMPERATURE)")
    args = p.parse_args(argv)
    from openai import OpenAI

    client = OpenAI(max_retries=2, timeout=3600)  # OPENAI_BASE_URL and OPENAI_API_KEY: the proxy's
    model = os.environ.get("GYRE_MODEL", "gyre-policy")
    question = Path(os.environ["GYRE_INSTRUCTION_FILE"]).read_text(encoding="utf-8").strip()
    prices = json.loads(Path("prices.json").read_text(encoding="utf-8"))
    ep = Episode(question, prices)
    while not ep.done:
        r = client.chat.completions.create(model=model, max_tokens=args.max_tokens, temperature=args.temperature,
                                           **ep.request())
        msg = r.choices[0].message
        ep.observe(msg.content, [Call(c.id, c.function.name, c.function.arguments)
                                 for c in msg.tool_calls or [] if c.type == "function"])
    Path("answer.txt").write_text(ep.answer + "\n", encoding="utf-8")
    print(json.dumps({"calls": ep.calls, "tool_calls": ep.tool_calls, "tool_errors": ep.tool_errors,
                      "answer": ep.answer[:200]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
