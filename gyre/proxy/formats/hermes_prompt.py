"""Tools for a template that cannot render them, declared the Hermes / Qwen2.5 way
(`--proxy.tool-format hermes`; gyre/proxy/formats/choice.py decides when).

The request's messages are rewritten into ones the template renders as plain turns, giving the
text tests/chat_templates/qwen2.5.jinja gives for the same conversation (its default system
prompt aside: the template's own is kept):

- the tool list goes at the end of the system turn (the request's system message, else the
  template's default system prompt, else nothing before it):
  `\\n\\n# Tools\\n\\nYou may call one or more functions ... <tools>\\n{tool}\\n...</tools> ... </tool_call>`;
- an assistant turn's tool calls become its text: `\\n<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`
  after the content (without the first newline when there is no content);
- consecutive `tool` results become one user turn of `<tool_response>\\nRESULT\\n</tool_response>` blocks.

The model's output is read with the Hermes `<tool_call>` parser and a forced call opens with
`<tool_call>\\n` (`hermes_tools`). A re-sent assistant turn the proxy produced is spliced from its
sampled ids before this rewrite (gyre/proxy/render.py): the rewrite only touches text turns.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from gyre.proxy.formats.base import ChatFormat
from gyre.proxy.formats.qwen25 import hermes_parser
from gyre.proxy.textstream import tool_call_opening

# tests/chat_templates/qwen2.5.jinja, verbatim
TOOLS_HEAD = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
              "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
              "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


def tojson(v: Any) -> str:
    """The templates' `tojson` (transformers' chat-template filter: json.dumps, non-ASCII kept)."""
    return json.dumps(v, ensure_ascii=False)


def tools_block(tools: list[dict]) -> str:
    """The declaration appended to the system turn (starts with the two newlines Qwen2.5 puts after it)."""
    return TOOLS_HEAD + "".join("\n" + tojson(t) for t in tools) + TOOLS_TAIL


def calls_text(content: str | None, tool_calls: list[dict]) -> str:
    """An assistant turn's content with its tool calls (OpenAI shape or {name, arguments}) as text."""
    blocks = []
    for tc in tool_calls:
        fn = tc.get("function", tc)
        blocks.append('\n<tool_call>\n{"name": "' + str(fn.get("name", "")) + '", "arguments": '
                      + tojson(fn.get("arguments", {})) + "}\n</tool_call>")
    text = "".join(blocks)
    return (content + text) if content else text[1:]


def rewrite(messages: list[dict], tools: list[dict] | None, default_system: str | None) -> list[dict]:
    """`messages` as plain turns, the tools declared in the system turn (see the module docstring)."""
    out: list[dict] = []
    results_open = False  # the last message of `out` is a user turn of tool results
    for m in messages:
        role = m.get("role")
        if role == "tool":
            block = "\n<tool_response>\n" + (m.get("content") or "") + "\n</tool_response>"
            if results_open:
                out[-1]["content"] += block
            else:
                out.append({"role": "user", "content": block[1:]})
            results_open = True
            continue
        results_open = False
        if role == "assistant" and m.get("tool_calls"):
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": calls_text(m.get("content"), m["tool_calls"])}
        out.append(m)
    if tools:
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": (out[0].get("content") or "") + tools_block(tools)}
        else:
            head = default_system or ""
            out.insert(0, {"role": "system", "content": head + tools_block(tools) if head else tools_block(tools)[2:]})
    return out


def hermes_tools(fmt: ChatFormat) -> ChatFormat:
    """`fmt` reading Hermes `<tool_call>` JSON out of the model's text, a forced call opening with
    `<tool_call>\\n` (the format's turns, stops and reasoning unchanged)."""
    return dataclasses.replace(fmt, tool_syntax="hermes", make_tool_parser=hermes_parser, tool_call_opening=tool_call_opening,
                               sglang_tool_parser="qwen25")
