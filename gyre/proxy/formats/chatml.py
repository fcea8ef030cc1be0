"""Plain ChatML: `<|im_start|>role\\n...<|im_end|>` turns and nothing else (SmolLM2-Instruct and
other small instruct models whose template neither declares tools nor reasons).

    <|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
    <|im_start|>user\\nHi<|im_end|>
    <|im_start|>assistant\\nHello!<|im_end|>

Detected when a template has the ChatML markers and no tool or reasoning markup: every richer
ChatML format (qwen2.5, qwen3, qwen3-coder, qwen3.5) needs `<tool_call>` or `<function=` in the
template, so the two never both match, and a ChatML template with markup no format knows
(tools, `<think>`) is refused rather than served as plain text. A default system prompt the
template adds is rendered by the template itself (Gyre renders through it: gyre/proxy/render.py).

It writes no tool calls: a request with `tools` gets a 400 unless `--proxy.tool-format hermes`
declares them the Hermes / Qwen2.5 way (gyre/proxy/formats/hermes_prompt.py, which also gives
this format the Hermes `<tool_call>` parser; gyre/proxy/formats/choice.py decides).
"""

from __future__ import annotations

from gyre.proxy.formats.base import CHATML, ChatFormat, PassThrough

RICHER_MARKUP = ("<tool_call>", "<function=", "<think>", "tools", "tool_calls")


def no_tool_parser(tools: list[dict] | None = None) -> PassThrough:
    return PassThrough()


def no_tool_call_opening(name: str | None) -> str:
    raise ValueError("the chatml format has no tool calls of its own (--proxy.tool-format hermes gives it Hermes ones)")


def detect(template: str) -> bool:
    return "<|im_start|>" in template and "<|im_end|>" in template and not any(m in template for m in RICHER_MARKUP)


FORMAT = ChatFormat(
    name="chatml",
    description="plain ChatML turns, no tool calls or reasoning of its own (SmolLM2)",
    **CHATML,
    tool_syntax="none",
    make_tool_parser=no_tool_parser,
    tool_call_opening=no_tool_call_opening,
    detect=detect,
)
