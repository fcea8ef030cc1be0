"""Llama 3.1+: header turns closed by `<|eot_id|>`, JSON tool calls.

    <|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "f", "parameters": {...}}<|eot_id|>

Tools are declared in the first user turn; results come back as an `ipython` turn
(tests/chat_templates/llama3.1.jinja). A tool call is the whole message: the JSON object
`{"name": ..., "parameters": ...}` (or "arguments"), optionally after `<|python_tag|>`.

Parsing follows SGLang 0.5.23's Llama32Detector.detect_and_parse
(sglang/srt/function_call/llama32_detector.py:53-118): the output is a call when it begins with
`{` or holds `<|python_tag|>` (the text before the tag is content); the JSON objects are read one
after another, separated by `;`; the arguments are `parameters` or else `arguments`
(base_format_detector.py:93-96). Differences, on purpose (nothing the model wrote is dropped):
an object that is not a call (no string `name`, non-object arguments) and unparsable text come
back as text, where SGLang would drop them or try them as Python dicts; calls to functions that
are not among the request's tools are returned as written (SGLang skips them by default).
Streaming: text that starts with `{` is held to the end (it is a call only if it parses).
"""

from __future__ import annotations

import json

from gyre.proxy.formats.base import ChatFormat
from gyre.proxy.textstream import ToolCall, _prefix_overlap

PYTHON_TAG = "<|python_tag|>"


def parse_calls(action: str) -> tuple[list[tuple[str, dict]], str]:
    """(calls, trailing text) of the JSON objects in `action` (separated by `;` / whitespace).
    No calls if any object is not a call."""
    dec = json.JSONDecoder()
    calls: list[tuple[str, dict]] = []
    i, n = 0, len(action)
    while i < n:
        while i < n and action[i] in " \t\r\n;":
            i += 1
        if i >= n:
            break
        try:
            obj, end = dec.raw_decode(action, i)
        except ValueError:
            break
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return [], action
        args = obj.get("parameters") or obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return [], action
        if not isinstance(args, dict):
            return [], action
        calls.append((obj["name"], args))
        i = end
    return calls, action[i:].strip() if calls else action


class JsonToolParser:
    """Streaming Llama tool calls (see the module docstring)."""

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools
        self.buf = ""
        self.mode = "start"  # start | text | held (a possible call: parsed at the end)
        self.tagged = False  # the call text followed <|python_tag|>

    def push(self, text: str) -> list:
        self.buf += text
        if self.mode == "start":
            if not self.buf:
                return []
            self.mode = "held" if self.buf.startswith("{") else "text"
        if self.mode == "held":
            return []
        i = self.buf.find(PYTHON_TAG)
        if i >= 0:
            head, self.buf, self.mode, self.tagged = self.buf[:i], self.buf[i + len(PYTHON_TAG):], "held", True
            return [head] if head else []
        keep = _prefix_overlap(self.buf, PYTHON_TAG)
        emit, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return [emit] if emit else []

    def flush(self) -> list:
        buf, self.buf = self.buf, ""
        if self.mode != "held":
            return [buf] if buf else []
        calls, rest = parse_calls(buf)
        if not calls:
            raw = (PYTHON_TAG if self.tagged else "") + buf
            return [raw] if raw else []
        out: list = [ToolCall(name=name, arguments=args, index=k) for k, (name, args) in enumerate(calls)]
        return out + ([rest] if rest else [])


def tool_call_opening(name: str | None) -> str:
    """The template's call opening, `{"name": "NAME", "parameters":` (before the space a BPE
    tokenizer attaches to the next token), or `{"name": "` for any function."""
    if name is None:
        return '{"name": "'
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "parameters":'


def detect(template: str) -> bool:
    return "<|start_header_id|>" in template and "<|eot_id|>" in template and '"parameters": ' in template


FORMAT = ChatFormat(
    name="llama3.1",
    description="Llama 3.1+: <|start_header_id|> turns, <|eot_id|>, JSON tool calls, ipython results",
    turn_start="<|start_header_id|>",
    generation_prompt="<|start_header_id|>assistant<|end_header_id|>\n\n",
    end_of_turn="<|eot_id|>",
    stop_tokens=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
    tool_syntax="json",
    make_tool_parser=JsonToolParser,
    tool_call_opening=tool_call_opening,
    detect=detect,
    sglang_tool_parser="llama3",
)
