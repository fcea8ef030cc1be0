"""cpu_demo harness: a small long-horizon agent that talks to the model only through the
official `openai` SDK (a black box to Gyre: it depends on nothing but `openai` and the stdlib).

What it does, like a real coding agent, so that each execution's calls form a branching tree:
  - many turns with tool calls that change the workspace: `write_next(content)` writes the next
    file of its todo list (from `TODO.md`); every tool result restates what is next
    ("next: green.txt | helper: pink teal");
  - context compaction: when the prompt passes `--compact-at` tokens (from `usage`), it asks the
    model to summarize the conversation so far and restarts from [system, task + summary + todo];
  - delegation: the `delegate` tool starts a sub-agent with its own system prompt and its own
    conversation (which may compact too) for the helper words;
  - retry: an invalid tool call (unparseable, unknown tool, content not a number) is discarded
    and the same request is sent again (up to `--retries` times); after that the error is shown
    to the model as the tool result.

The task (see task.py): TODO.md lists words, "main: red blue ..." and "helper: pink ...";
`<word>.txt` must contain the number of letters of the word. The evaluator scores the fraction
of words done right, so partial progress counts. The format is easy to pick up (the harness
says which file is next); the number for each word is what the policy has to learn.

Environment (set by gyre's runner): OPENAI_BASE_URL, OPENAI_API_KEY, GYRE_MODEL, and the
workspace as the working directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol

SYSTEM_MAIN = "You are the main agent. Write the letter count of each word into its file. Delegate helper words."
SYSTEM_SUB = "You are a helper agent. Write the letter count of each word into its file, then finish."
SUMMARY_PROMPT = "Summarize the conversation so far."

# Short schemas (no descriptions): every token of the tool list is in every prompt.
_WRITE = {"type": "function", "function": {
    "name": "write_next",
    "parameters": {"type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"]}}}
_DELEGATE = {"type": "function", "function": {"name": "delegate", "parameters": {"type": "object", "properties": {}}}}
_FINISH = {"type": "function", "function": {"name": "finish", "parameters": {"type": "object", "properties": {}}}}
TOOLS_MAIN = [_WRITE, _DELEGATE, _FINISH]
TOOLS_SUB = [_WRITE, _FINISH]


@dataclass
class Reply:
    content: str
    tool_calls: list[dict[str, Any]]  # [{"id", "name", "arguments" (str)}]
    prompt_tokens: int


class ChatBackend(Protocol):
    def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Reply: ...


class OpenAIBackend:
    """The real path: the official SDK against OPENAI_BASE_URL (the Gyre proxy)."""

    def __init__(self, model: str, max_tokens: int, temperature: float) -> None:
        from openai import OpenAI

        self.client = OpenAI(max_retries=2, timeout=600)  # reads OPENAI_BASE_URL / OPENAI_API_KEY
        self.model, self.max_tokens, self.temperature = model, max_tokens, temperature

    def complete(self, messages, tools) -> Reply:
        resp = self.client.chat.completions.create(model=self.model, messages=messages, tools=tools,
                                                   max_tokens=self.max_tokens, temperature=self.temperature)
        msg = resp.choices[0].message
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in (msg.tool_calls or [])]
        return Reply(msg.content or "", calls, resp.usage.prompt_tokens if resp.usage else 0)


@dataclass
class Todo:
    """The agent's todo list (from TODO.md). `write_next` writes the first file not yet written
    on the current agent's list; tool results restate what is next."""

    main: list[str]
    helper: list[str]
    done: set[str] = field(default_factory=set)

    @classmethod
    def from_file(cls, path: str) -> "Todo":
        main, helper = [], []
        for line in open(path).read().splitlines():
            key, _, words = line.partition(":")
            if key.strip() == "main":
                main = words.split()
            elif key.strip() == "helper":
                helper = words.split()
        return cls(main, helper)

    def next(self, kind: str) -> str | None:
        for w in self.main if kind == "main" else self.helper:
            if w not in self.done:
                return w
        return None

    def line(self, kind: str) -> str:
        nxt = self.next(kind)
        head = f"next: {nxt}.txt" if nxt else "next: none"
        if kind == "main":
            return f"{head} | helper: {'done' if self.next('sub') is None else ' '.join(self.helper)}"
        return head


@dataclass
class Stats:
    calls: int = 0
    retries: int = 0
    compactions: int = 0
    sub_agents: int = 0
    tool_errors: int = 0
    valid_calls: int = 0  # replies that were one well-formed, accepted tool call


class Agent:
    def __init__(self, backend: ChatBackend, todo: Todo, *, compact_at: int, retries: int, max_calls: int,
                 workdir: str = ".") -> None:
        self.backend, self.todo, self.compact_at = backend, todo, compact_at
        self.retries, self.max_calls, self.workdir = retries, max_calls, workdir
        self.stats = Stats()

    # -- tools -------------------------------------------------------------------------
    def _check(self, call: dict[str, Any], kind: str) -> tuple[str, dict[str, Any]]:
        """Validate a tool call; returns (name, args) or raises ValueError (→ retry)."""
        names = {"main": {"write_next", "delegate", "finish"}, "sub": {"write_next", "finish"}}[kind]
        if call["name"] not in names:
            raise ValueError(f"unknown tool {call['name']!r}")
        try:
            args = json.loads(call["arguments"] or "{}")
        except json.JSONDecodeError:
            raise ValueError("arguments are not JSON") from None
        if not isinstance(args, dict):
            raise ValueError("arguments must be an object")
        if call["name"] == "write_next":
            if self.todo.next(kind) is None:
                raise ValueError("no file left to write")
            content = args.get("content")
            if not isinstance(content, str) or not content.strip().isdigit() or len(content) > 4:
                raise ValueError("content must be a number")
        if call["name"] == "delegate" and self.todo.next("sub") is None:
            raise ValueError("nothing left to delegate")
        return call["name"], args

    def _run_tool(self, name: str, args: dict[str, Any], kind: str) -> str:
        if name == "write_next":
            word = self.todo.next(kind)
            with open(os.path.join(self.workdir, f"{word}.txt"), "w") as f:
                f.write(args["content"])
            self.todo.done.add(word)
            return f"ok. {self.todo.line(kind)}"
        if name == "delegate":
            self.stats.sub_agents += 1
            report = self.run("sub", SYSTEM_SUB, TOOLS_SUB, f"Words: {' '.join(self.todo.helper)}.")
            return f"helper {report}. {self.todo.line(kind)}"
        raise AssertionError(name)

    # -- the loop ----------------------------------------------------------------------
    def run(self, kind: str, system: str, tools: list[dict[str, Any]], task: str) -> str:
        start = [{"role": "system", "content": system}, {"role": "user", "content": f"{task}\n{self.todo.line(kind)}"}]
        messages = list(start)
        for _ in range(self.max_calls):
            for attempt in range(self.retries + 1):
                reply = self._call(messages, tools)
                error, action = "", None
                if len(reply.tool_calls) != 1:
                    error = f"expected one tool call, got {len(reply.tool_calls)}"
                else:
                    try:
                        action = self._check(reply.tool_calls[0], kind)
                    except ValueError as e:
                        error = str(e)
                if not error:
                    self.stats.valid_calls += 1
                    break
                if attempt < self.retries:
                    self.stats.retries += 1  # discard the reply; same request again
            call_id = reply.tool_calls[0]["id"] if reply.tool_calls else "none"
            assistant: dict[str, Any] = {"role": "assistant", "content": reply.content}
            if reply.tool_calls:
                assistant["tool_calls"] = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                                           for c in reply.tool_calls]
            messages.append(assistant)
            if error:
                self.stats.tool_errors += 1
                result = f"error: {error}. {self.todo.line(kind)}"
                if not reply.tool_calls:
                    messages.append({"role": "user", "content": result})
                    continue
            else:
                name, args = action
                if name == "finish":
                    return "done" if self.todo.next(kind) is None else "stopped early"
                result = self._run_tool(name, args, kind)
            for c in reply.tool_calls:
                messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
            if reply.prompt_tokens > self.compact_at:
                messages = self._compact(messages, start, tools, kind)
        return "out of turns"

    def _call(self, messages, tools) -> Reply:
        self.stats.calls += 1
        return self.backend.complete(messages, tools)

    def _compact(self, messages, start, tools, kind: str) -> list[dict[str, Any]]:
        """Context compaction: ask for a summary, restart from it (a new branch of the tree)."""
        self.stats.compactions += 1
        reply = self._call(messages + [{"role": "user", "content": SUMMARY_PROMPT}], tools)
        summary = reply.content.strip() or "(no summary)"
        return [start[0], {"role": "user", "content": f"{start[1]['content'].splitlines()[0]}\nSummary: {summary}\n{self.todo.line(kind)}"}]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compact-at", type=int, default=int(os.environ.get("CPU_DEMO_COMPACT_AT", 650)),
                   help="compact when a prompt passes this many tokens")
    p.add_argument("--retries", type=int, default=2, help="re-samples of an invalid tool call")
    p.add_argument("--max-calls", type=int, default=24, help="turns per agent")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    args = p.parse_args(argv)
    model = os.environ.get("GYRE_MODEL", os.environ.get("OPENAI_MODEL", "gyre-policy"))
    todo = Todo.from_file("TODO.md")
    agent = Agent(OpenAIBackend(model, args.max_tokens, args.temperature), todo, compact_at=args.compact_at,
                  retries=args.retries, max_calls=args.max_calls)
    report = agent.run("main", SYSTEM_MAIN, TOOLS_MAIN, f"Task: words {' '.join(todo.main + todo.helper)}.")
    print(json.dumps({"report": report, **agent.stats.__dict__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
