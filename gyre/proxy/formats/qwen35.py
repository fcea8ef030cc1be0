"""Qwen3.5: ChatML turns, Qwen3-Coder's XML tool calls, `<think>` reasoning opened by the prompt.

    <|im_start|>assistant\\n<think>\\nREASONING\\n</think>\\n\\nTEXT\\n\\n<tool_call>\\n<function=NAME>\\n...

The template (tests/chat_templates/qwen3.5.jinja) declares tools as JSON in the system turn,
renders a think block on every assistant turn after the last user query (empty when it has no
reasoning) and none before, and its generation prompt opens `<think>\\n` (enable_thinking=false:
closes an empty block). The opened block is input the stored turn starts with (gyre/proxy/render.py),
and the reasoning parser starts inside it (sglang 0.5.23 `--reasoning-parser qwen3` with
force_reasoning, sglang/srt/parser/reasoning_parser.py:441-485); tool calls parse as
`--tool-call-parser qwen3_coder` (gyre.proxy.formats.qwen3_coder).
"""

from __future__ import annotations

from gyre.proxy.formats.base import CHATML, QWEN3_THINKING, ChatFormat
from gyre.proxy.formats.qwen3_coder import XmlToolParser, tool_call_opening


def detect(template: str) -> bool:
    return "<|im_start|>" in template and "<function=" in template and "<parameter=" in template and "<think>" in template


FORMAT = ChatFormat(
    name="qwen3.5",
    description="Qwen3.5: ChatML, XML <function=...> tool calls, <think> opened by the prompt, enable_thinking",
    **CHATML,
    tool_syntax="xml",
    make_tool_parser=XmlToolParser,
    tool_call_opening=tool_call_opening,
    detect=detect,
    **QWEN3_THINKING,
    sglang_tool_parser="qwen3_coder",
)
