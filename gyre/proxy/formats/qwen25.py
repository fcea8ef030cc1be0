"""Qwen2.5 (and Gyre's own tokenizer): ChatML turns, Hermes tool calls, no reasoning.

    <|im_start|>assistant\\nTEXT\\n<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call><|im_end|>

The parser is gyre.proxy.textstream.ToolCallParser. It agrees with SGLang 0.5.23's
Qwen25Detector.detect_and_parse (sglang/srt/function_call/qwen25_detector.py:46-75) on names and
arguments and on content (the text before the first call, stripped: SGLang strips both ends,
Gyre the end only). Differences, on purpose (nothing the model wrote is dropped): a block that is
not valid JSON and text after the calls come back as text (SGLang drops both), and calls to
functions that are not among the request's tools are returned as written (SGLang skips them).
"""

from __future__ import annotations

from gyre.proxy.formats.base import CHATML, ChatFormat
from gyre.proxy.textstream import ToolCallParser, tool_call_opening


def hermes_parser(tools: list[dict] | None = None) -> ToolCallParser:
    return ToolCallParser()


def detect(template: str) -> bool:
    return ("<|im_start|>" in template and "<tool_call>" in template and '"arguments"' in template
            and "<think>" not in template and "<function=" not in template)


FORMAT = ChatFormat(
    name="qwen2.5",
    description="Qwen2.5 / Gyre's tokenizer: ChatML, Hermes <tool_call> JSON",
    **CHATML,
    tool_syntax="hermes",
    make_tool_parser=hermes_parser,
    tool_call_opening=tool_call_opening,
    detect=detect,
    sglang_tool_parser="qwen25",
)
