"""Chat formats: which template text a family's turns, tool calls and reasoning look like, as data.

    fmt = format_for(tokenizer)                  # from its chat template (and config)
    fmt = format_for(tokenizer, override="qwen3") # --proxy.chat-format qwen3

Known formats (one module each; adding one: docs/proxy_harnesses.md):

    qwen2.5      ChatML, Hermes <tool_call> JSON            (Gyre's own tokenizer too)
    qwen3        ChatML, Hermes tool calls, <think>, enable_thinking
    qwen3-coder  ChatML, XML <function=NAME><parameter=P> tool calls
    qwen3.5      ChatML, XML tool calls, <think> opened by the prompt, enable_thinking
    llama3.1     <|start_header_id|> turns, <|eot_id|>, JSON tool calls, ipython results
    chatml       plain ChatML turns, no tool calls or reasoning (SmolLM2): detected when the
                 template has ChatML markers and no markup a richer format reads

A template none of them recognises is refused with this list: a guessed format would render
prompts the model was not trained on, or parse its calls wrongly, without a word.
"""

from __future__ import annotations

import logging
from typing import Any

from gyre.proxy.formats import chatml, llama31, qwen3, qwen3_coder, qwen25, qwen35
from gyre.proxy.formats.base import ChatFormat, OutputParser, Reasoning, ReasoningParser, ReasoningTags, split_output

logger = logging.getLogger(__name__)

FORMATS: dict[str, ChatFormat] = {f.name: f for f in (qwen25.FORMAT, qwen3.FORMAT, qwen3_coder.FORMAT, qwen35.FORMAT, llama31.FORMAT,
                                                chatml.FORMAT)}

# config.json model_type of each family, to warn when the template and the model disagree.
_MODEL_TYPES = {"qwen2": "qwen2.5", "qwen3": "qwen3", "qwen3_moe": "qwen3", "llama": "llama3.1"}


class UnknownChatFormat(ValueError):
    pass


def _known() -> str:
    return ", ".join(f"{n} ({f.description})" for n, f in FORMATS.items())


def _model_type(config: Any) -> str | None:
    if config is None:
        return None
    if isinstance(config, dict):
        return config.get("model_type")
    return getattr(config, "model_type", None)


def format_for(tokenizer: Any = None, config: Any = None, override: str | None = None, *, template: str | None = None) -> ChatFormat:
    """The chat format of a checkpoint: `override` (a name in FORMATS; "auto"/None = detect) or
    the one whose markers its chat template (`template`, else `tokenizer.chat_template`) holds.
    Refuses (UnknownChatFormat, naming the known formats) a template no format recognises, or one
    several recognise. `config` (config.json, a dict or HF config) only cross-checks."""
    if override not in (None, "", "auto"):
        fmt = FORMATS.get(override)
        if fmt is None:
            raise UnknownChatFormat(f"--proxy.chat-format {override!r} is not a known chat format; known: {_known()}")
        return fmt
    if template is None and tokenizer is not None:
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # several named templates: the default one renders chats
            template = template.get("default")
    if not template:
        raise UnknownChatFormat("the tokenizer has no chat template, so its chat format cannot be known; "
                                f"name one with --proxy.chat-format. Known: {_known()}")
    hits = [f for f in FORMATS.values() if f.detect(template)]
    if len(hits) != 1:
        why = "no known chat format recognises" if not hits else f"several formats ({', '.join(f.name for f in hits)}) match"
        raise UnknownChatFormat(f"{why} this chat template (its first line: {template.strip().splitlines()[0][:120]!r}); "
                                f"if it is one of these, name it with --proxy.chat-format: {_known()}")
    fmt = hits[0]
    mt = _model_type(config)
    # chatml is no family's own (SmolLM2 is model_type llama): nothing to cross-check
    if mt in _MODEL_TYPES and fmt.name != "chatml" and _MODEL_TYPES[mt] != fmt.name and not (mt == "qwen3" and fmt.name == "qwen3-coder"):
        logger.warning("chat format: the template is %s, the model's config says model_type=%s; using the template's",
                       fmt.name, mt)
    return fmt


__all__ = ["FORMATS", "ChatFormat", "OutputParser", "Reasoning", "ReasoningParser", "ReasoningTags", "UnknownChatFormat",
           "format_for", "split_output"]
