"""Qwen3: ChatML turns, Hermes tool calls, `<think>` reasoning, `enable_thinking`.

    <|im_start|>assistant\\n<think>\\nREASONING\\n</think>\\n\\nTEXT\\n<tool_call>\\n{...}\\n</tool_call><|im_end|>

The template (tests/chat_templates/qwen3.jinja) renders the reasoning of assistant turns after
the last user query and drops it from earlier ones (`--proxy.past-reasoning` decides what the
proxy does with it: gyre/proxy/render.py), and `enable_thinking=false` (chat_template_kwargs)
appends an empty `<think>\\n\\n</think>\\n\\n` to the generation prompt. Reasoning is parsed as
SGLang 0.5.23's `--reasoning-parser qwen3` does (gyre.proxy.formats.base.ReasoningParser), tool
calls as `--tool-call-parser qwen25` (gyre.proxy.formats.qwen25).
"""

from __future__ import annotations

from gyre.proxy.formats.base import CHATML, QWEN3_THINKING, ChatFormat
from gyre.proxy.formats.qwen25 import hermes_parser
from gyre.proxy.textstream import tool_call_opening


def detect(template: str) -> bool:
    return ("<|im_start|>" in template and "<tool_call>" in template and '"arguments"' in template
            and "<think>" in template and "<function=" not in template)


FORMAT = ChatFormat(
    name="qwen3",
    description="Qwen3: ChatML, Hermes <tool_call> JSON, <think> reasoning, enable_thinking",
    **CHATML,
    tool_syntax="hermes",
    make_tool_parser=hermes_parser,
    tool_call_opening=tool_call_opening,
    detect=detect,
    **QWEN3_THINKING,
    sglang_tool_parser="qwen25",
)
