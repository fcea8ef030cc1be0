"""A STAND-IN for Claude Code, for the CPU smoke run only: not Claude Code.

It speaks the Anthropic Messages API through the official `anthropic` SDK the way `claude -p`
does on the wire (ANTHROPIC_BASE_URL + ANTHROPIC_API_KEY sent as X-Api-Key, a streamed
`POST /v1/messages`, a system prompt as a list of text blocks, tools with JSON-schema
`input_schema`, `tool_use` / `tool_result` turns), so the proxy's Anthropic path, the runner, the
evaluator and training see the same kind of traffic. Everything else about Claude Code (its
system prompt of ~19k tokens, its dozens of tools, sub-agents, compaction) is absent. Use
`run_claude.py` with the real `claude` CLI for anything but the smoke run.

Like `claude -p --output-format stream-json`, it prints one JSON event per line to stdout
(stdout.log) and ends with a `{"type": "result", "result": <last text>}` event, which the
example's evaluator reads. It always exits 0 unless the API fails (that is a harness failure).
Options: `--max-turns` / GYRE_CLAUDE_MAX_TURNS, `--max-output-tokens` /
GYRE_CLAUDE_MAX_OUTPUT_TOKENS, `--bash-timeout-s` / GYRE_CLAUDE_BASH_TIMEOUT_S.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import anthropic

SYSTEM = [
    {"type": "text", "text": "You are a stand-in for Claude Code, an agent that edits files in a workspace."},
    {"type": "text", "text": f"Primary working directory: {os.getcwd()}\nUse the tools to act; answer in text when done."},
]
TOOLS = [
    {"name": "Bash", "description": "Run a bash command in the working directory.",
     "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
    {"name": "Write", "description": "Write a file (relative path) with the given content.",
     "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}},
                      "required": ["file_path", "content"]}},
]


def run_tool(name: str, args: dict, bash_timeout_s: float) -> tuple[str, bool]:
    """(output, is_error) of one tool_use block, run in the workspace."""
    try:
        if name == "Bash":
            done = subprocess.run(["bash", "-c", str(args["command"])], capture_output=True, text=True,
                                  timeout=bash_timeout_s, stdin=subprocess.DEVNULL)
            return (done.stdout + done.stderr)[-4000:], done.returncode != 0
        if name == "Write":
            path = Path(str(args["file_path"]))
            if path.is_absolute() or ".." in path.parts:
                return "file_path must be relative to the workspace", True
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(str(args["content"]))
            return f"wrote {path}", False
        return f"unknown tool {name}", True
    except (KeyError, TypeError, OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}", True


def main(argv: list[str] | None = None) -> int:
    env = os.environ.get
    p = argparse.ArgumentParser(description="a stand-in for `claude -p` against the Gyre proxy (CPU smoke run)")
    p.add_argument("--max-turns", type=int, default=int(env("GYRE_CLAUDE_MAX_TURNS", "3")))
    p.add_argument("--max-output-tokens", type=int, default=int(env("GYRE_CLAUDE_MAX_OUTPUT_TOKENS", "256")))
    p.add_argument("--bash-timeout-s", type=float, default=float(env("GYRE_CLAUDE_BASH_TIMEOUT_S", "60")))
    a = p.parse_args(argv)
    # As Claude Code: the base URL without /v1, the key as X-Api-Key, a long client timeout (a
    # call can wait while a cell switches to training), the SDK's own retries.
    client = anthropic.Anthropic(base_url=os.environ["ANTHROPIC_BASE_URL"], api_key=os.environ["ANTHROPIC_API_KEY"],
                                 timeout=3600.0, max_retries=2)
    model = os.environ.get("ANTHROPIC_MODEL") or os.environ.get("GYRE_MODEL", "gyre-policy")
    messages = [{"role": "user", "content": [{"type": "text", "text": Path(os.environ["GYRE_INSTRUCTION_FILE"]).read_text()}]}]
    text, turns = "", 0
    for turns in range(1, a.max_turns + 1):
        with client.messages.stream(model=model, max_tokens=a.max_output_tokens, system=SYSTEM, tools=TOOLS,
                                    messages=messages) as stream:
            message = stream.get_final_message()
        print(json.dumps({"type": "assistant", "message": message.model_dump(mode="json")}), flush=True)
        messages.append({"role": "assistant", "content": [b.model_dump(mode="json", exclude_none=True) for b in message.content]})
        text = "".join(b.text for b in message.content if b.type == "text") or text
        uses = [b for b in message.content if b.type == "tool_use"]
        if not uses:
            break
        results = []
        for b in uses:
            out, err = run_tool(b.name, b.input if isinstance(b.input, dict) else {}, a.bash_timeout_s)
            results.append({"type": "tool_result", "tool_use_id": b.id, "content": out, "is_error": err})
        messages.append({"role": "user", "content": results})
    print(json.dumps({"type": "result", "subtype": "success", "num_turns": turns, "result": text}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
