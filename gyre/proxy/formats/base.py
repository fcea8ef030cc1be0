"""A chat format as declared data, and the output pipeline built from it.

A `ChatFormat` says what the renderer and the output parser need to know about a model family's
chat template: the special token each turn starts with, the generation prompt (the assistant
turn's header, exactly as `add_generation_prompt` renders it), the token closing an assistant
turn, the ids that stop generation, the tool-call syntax (a streaming parser and the opening a
forced call starts with) and the reasoning tags. Adding a family is one module declaring one of
these and a line in `gyre/proxy/formats/__init__.py` (docs/proxy_harnesses.md).

    sampled text --ReasoningParser--> Reasoning | text --tool parser--> text | ToolCall

`OutputParser` chains them: reasoning first (tool calls inside `<think>` are thinking, as in
SGLang, whose serving layer runs the reasoning parser before the function-call parser).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from gyre.proxy.textstream import ToolCall


@dataclass
class Reasoning:
    """A piece of the model's thinking (the text between the reasoning tags)."""

    text: str


class ToolParser(Protocol):
    """Streaming tool-call parser: `push(text)` / `flush()` return text pieces and `ToolCall`s in
    order; stream and one-shot give the same result however the text is chunked."""

    def push(self, text: str) -> list: ...

    def flush(self) -> list: ...


class PassThrough:
    """No tool parsing (tool_choice none, or proxy.tool_parser none)."""

    def push(self, text: str) -> list:
        return [text] if text else []

    def flush(self) -> list:
        return []


@dataclass(frozen=True)
class ReasoningTags:
    """Reasoning delimiters. `tool_start`: a tool-call opening that ends reasoning when no end tag
    follows (sglang 0.5.23 sglang/srt/parser/reasoning_parser.py:479, Qwen3Detector)."""

    start: str = "<think>"
    end: str = "</think>"
    tool_start: str | None = "<tool_call>"


@dataclass(frozen=True)
class ChatFormat:
    """A family's chat format (see the module docstring). All strings are template text."""

    name: str
    description: str
    turn_start: str  # special token every rendered turn begins with (message starts, encode cache chunks)
    generation_prompt: str  # the assistant header add_generation_prompt appends (without reasoning extras)
    end_of_turn: str  # the token the template closes an assistant turn with
    stop_tokens: tuple[str, ...]  # generation stops at any of these (those the tokenizer has)
    tool_syntax: str  # "hermes" | "xml" | "json" | "none": what `make_tool_parser` reads
    make_tool_parser: Callable[[list[dict] | None], ToolParser]  # tools (OpenAI shape) -> parser
    tool_call_opening: Callable[[str | None], str]  # forced call prefix: named function, or any (None)
    detect: Callable[[str], bool]  # does this chat template render this format?
    reasoning: ReasoningTags | None = None
    strips_past_reasoning: bool = False  # the template drops reasoning of turns before the last user query
    thinking_switch: str | None = None  # chat_template_kwargs key that turns thinking on/off
    sglang_tool_parser: str = ""  # the matching `--tool-call-parser` of SGLang 0.5.23
    sglang_reasoning_parser: str | None = None  # and `--reasoning-parser`
    examples: dict[str, Any] = field(default_factory=dict)


CHATML: dict[str, Any] = {
    "turn_start": "<|im_start|>",
    "generation_prompt": "<|im_start|>assistant\n",
    "end_of_turn": "<|im_end|>",
    "stop_tokens": ("<|im_end|>", "<|endoftext|>"),
}
"""The turn fields of every ChatML format (Qwen2.5, Qwen3, Qwen3-Coder, Qwen3.5): `ChatFormat(**CHATML, ...)`."""

QWEN3_THINKING: dict[str, Any] = {
    "reasoning": ReasoningTags("<think>", "</think>", "<tool_call>"),
    "strips_past_reasoning": True,
    "thinking_switch": "enable_thinking",
    "sglang_reasoning_parser": "qwen3",
}
"""Qwen3's thinking, shared by Qwen3 and Qwen3.5: `<think>` tags, past reasoning dropped by the
template, `enable_thinking`, SGLang's `--reasoning-parser qwen3`."""


class ReasoningParser:
    """Thinking out of streamed text, with SGLang 0.5.23's one-shot semantics
    (sglang/srt/parser/reasoning_parser.py:186-230, BaseReasoningFormatDetector._detect_and_parse_impl):

    - reasoning opens when `force` (the generation prompt already opened `<think>`) or the output
      begins with `<think>`; leading `<think>` tags are dropped (:197-199);
    - it ends at the first `</think>` (:221-228): what follows is normal text;
    - with no `</think>` at all, a `<tool_call>` ends it, the call kept as normal text (:205-212);
      otherwise the whole rest is reasoning (truncated thinking, :214-216).

    Streaming gives the same split as one-shot for any chunking: a `<tool_call>` inside unfinished
    reasoning is held until `</think>` arrives (then it was thinking) or the output ends (then it
    was a call). Divergence from SGLang, on purpose: a `<think>` that is not at the start of the
    output is plain text (SGLang's one-shot parser would turn all text before the later
    `</think>`, answer included, into reasoning; its streaming parser depends on the chunking).
    """

    def __init__(self, tags: ReasoningTags, force: bool = False) -> None:
        self.tags = tags
        self.mode = "reasoning" if force else "start"
        self.at_start = True  # nothing consumed in reasoning yet: leading start tags are dropped
        self.buf = ""
        self.holding_tool = False

    @staticmethod
    def _partial(text: str, token: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of `token`."""
        for n in range(min(len(token) - 1, len(text)), 0, -1):
            if token.startswith(text[-n:]):
                return n
        return 0

    def push(self, text: str) -> list:
        self.buf += text
        out: list = []
        t = self.tags
        while True:
            if self.mode == "start":
                if t.start.startswith(self.buf) and len(self.buf) < len(t.start):
                    return out  # maybe the opening tag
                self.mode = "reasoning" if self.buf.startswith(t.start) else "normal"
                continue
            if self.mode == "normal":
                if self.buf:
                    out.append(self.buf)
                self.buf = ""
                return out
            # reasoning
            if self.at_start:
                while self.buf.startswith(t.start):
                    self.buf = self.buf[len(t.start):]
                if not self.buf or (t.start.startswith(self.buf)):
                    return out
                self.at_start = False
            end = self.buf.find(t.end)
            if end >= 0:
                out.append(Reasoning(self.buf[:end]))  # even empty: marks the end (TemplateTrim)
                self.buf = self.buf[end + len(t.end):]
                self.mode = "normal"
                self.holding_tool = False
                continue
            if self.holding_tool:
                return out  # a call inside unfinished thinking: wait for </think> or the end
            if t.tool_start:
                k = self.buf.find(t.tool_start)
                if k >= 0:
                    if k:
                        out.append(Reasoning(self.buf[:k]))
                    self.buf = self.buf[k:]
                    self.holding_tool = True
                    return out
            hold = max(self._partial(self.buf, t.end), self._partial(self.buf, t.tool_start) if t.tool_start else 0)
            cut = len(self.buf) - hold
            if cut > 0:
                out.append(Reasoning(self.buf[:cut]))
                self.buf = self.buf[cut:]
            return out

    def flush(self) -> list:
        buf, self.buf = self.buf, ""
        if not buf:
            return []
        if self.mode == "reasoning" and not self.holding_tool:
            return [Reasoning(buf)]
        return [buf]  # a partial opening tag, normal text, or the call that ended thinking


class TemplateTrim:
    """The inverse of how the templates render a thinking turn (`'<think>\\n' +
    reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n')`, tests/chat_templates/
    qwen3.jinja): newlines around the reasoning and before the answer are the template's, not
    the model's message. Streaming-safe (trailing newlines of reasoning are held)."""

    def __init__(self) -> None:
        self.r_started = False
        self.r_pending = ""
        self.seen_reasoning = False
        self.c_started = False

    def push(self, items: list) -> list:
        out: list = []
        for it in items:
            if isinstance(it, Reasoning):
                self.seen_reasoning = True
                text = it.text
                if not self.r_started:
                    text = text.lstrip("\n")  # an empty piece still marks that reasoning ended
                    if not text:
                        continue
                    self.r_started = True
                body = text.rstrip("\n")
                if body:
                    out.append(Reasoning(self.r_pending + body))
                    self.r_pending = text[len(body):]
                else:
                    self.r_pending += text
            else:
                self.r_pending = ""
                if not self.c_started and self.seen_reasoning:
                    it = it.lstrip("\n")
                if it:
                    self.c_started = True
                    out.append(it)
        return out


class OutputParser:
    """Sampled text -> text / `Reasoning` / `ToolCall`, for one call (see the module docstring).
    `prefix` is text the prompt already holds at the start of the assistant turn (a reasoning
    block the generation prompt opened or closed, a forced tool-call opening): it is parsed first,
    so the parsers start in the state it leaves, and it is never shown by itself."""

    def __init__(self, fmt: ChatFormat, tools: list[dict] | None, *, parse_tools: bool = True, reasoning: bool = True) -> None:
        self.fmt = fmt
        self.reasoning = ReasoningParser(fmt.reasoning) if (reasoning and fmt.reasoning is not None) else None
        self.trim = TemplateTrim()
        self.tools = fmt.make_tool_parser(tools) if parse_tools else PassThrough()

    def _route(self, items: list) -> list:
        out: list = []
        for it in self.trim.push(items):
            if isinstance(it, Reasoning):
                out.append(it)
            else:
                out.extend(self.tools.push(it))
        return out

    def push(self, text: str) -> list:
        if not text:
            return []
        if self.reasoning is None:
            return self.tools.push(text)
        return self._route(self.reasoning.push(text))

    def flush(self) -> list:
        out = self._route(self.reasoning.flush()) if self.reasoning is not None else []
        return out + self.tools.flush()


def split_output(fmt: ChatFormat, text: str, tools: list[dict] | None = None, *, prefix: str = "") -> tuple[str, str, list[ToolCall]]:
    """One-shot: (reasoning, content, tool_calls) of a whole output (tests, offline use)."""
    p = OutputParser(fmt, tools)
    items = p.push(prefix + text) + p.flush()
    reasoning = "".join(i.text for i in items if isinstance(i, Reasoning))
    content = "".join(i for i in items if isinstance(i, str))
    return reasoning, content, [i for i in items if isinstance(i, ToolCall)]
