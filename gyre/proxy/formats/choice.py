"""The run's chat format and what it does with tools: one function, `chat_setup`, for the proxy,
the job's stop ids, gyre.run's preflight (gyre/config_checks.py) and the doctor.

    setup = chat_setup(tokenizer, config, chat_format="auto", tool_format="auto", tool_parser="auto")
    setup.format   # the ChatFormat the proxy renders and parses with
    setup.tools    # ToolSupport: who renders a request's tools, or why they are refused

Whether the template renders tools is asked of the template itself: it is rendered with a probe
tool and the tool's name must show up (`template_renders_tools`). `--proxy.tool-format`:

- `auto`: the template's own tool rendering when it has one; otherwise a request with `tools`
  (or a history with tool calls) gets a 400 naming `tools` and `--proxy.tool-format hermes`;
- `hermes`: a template without tool rendering gets the tools declared in its system turn the
  Hermes / Qwen2.5 way and the Hermes `<tool_call>` parser (gyre/proxy/formats/hermes_prompt.py);
  a template that renders tools keeps its own rendering and parser;
- `none`: every request with tools gets a 400.

Tools are never dropped without a word: the model would never be told about them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gyre.proxy.errors import ApiError
from gyre.proxy.formats import ChatFormat, format_for
from gyre.proxy.formats import hermes_prompt

PROBE_TOOL = "gyre_probe_tool_b7e1"
TOOL_FORMATS = ("auto", "hermes", "none")


class ToolsRefused(ApiError):
    """A 400 for a request whose tools this run does not render (names the field and the flag)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(400, "invalid_request", message, param=param)


class ChatSetupError(ValueError):
    """A chat format and tool settings that cannot serve this tokenizer (names the flag)."""


def _template(tokenizer: Any) -> str | None:
    t = getattr(tokenizer, "chat_template", None)
    return t.get("default") if isinstance(t, dict) else t


def _render(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=False)


def template_renders_tools(tokenizer: Any) -> bool:
    """Does the chat template put a request's tools in the prompt? (Rendered with a probe tool; a
    template that raises on it cannot.)"""
    tool = {"type": "function", "function": {"name": PROBE_TOOL, "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}
    try:
        return PROBE_TOOL in _render(tokenizer, [{"role": "user", "content": "hi"}], [tool])
    except Exception:  # noqa: BLE001 — jinja errors of any kind: the template does not take tools
        return False


def template_default_system(tokenizer: Any) -> str | None:
    """The system prompt the template adds when the conversation has none (SmolLM2's "You are a
    helpful AI assistant named SmolLM, ..."), or None: the text that stands where a system
    message's content would, in a rendering without one."""
    s, u = "\ue000gyre-system\ue001", "\ue000gyre-user\ue001"
    try:
        with_system = _render(tokenizer, [{"role": "system", "content": s}, {"role": "user", "content": u}])
        without = _render(tokenizer, [{"role": "user", "content": u}])
    except Exception:  # noqa: BLE001 — a template that refuses either has no default to keep
        return None
    if s not in with_system or u not in with_system or u not in without:
        return None
    before, after = with_system.split(s)[0], with_system.split(s)[1].split(u)[0]
    head = without.split(u)[0]
    if not head.startswith(before) or not head.endswith(after) or len(head) < len(before) + len(after):
        return None
    return head[len(before): len(head) - len(after)] or None


@dataclass(frozen=True)
class ToolSupport:
    """Who renders a request's tools: `template` (its own), `hermes` (declared in the system
    turn, gyre/proxy/formats/hermes_prompt.py) or `refuse` (a 400 saying `why`)."""

    mode: str
    why: str = ""
    default_system: str | None = None

    def check(self, messages: list[dict] | None, tools: list[dict] | None) -> None:
        """Raise `ToolsRefused` for a request this run would otherwise render without its tools."""
        if self.mode != "refuse":
            return
        if tools:
            raise ToolsRefused(f"tools: {self.why}", "tools")
        for i, m in enumerate(messages or ()):
            if m.get("tool_calls"):
                raise ToolsRefused(f"messages[{i}].tool_calls: an assistant turn with tool calls, but {self.why}",
                                   f"messages[{i}].tool_calls")

    def rewrite(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
        """(messages, tools) to hand the template."""
        if self.mode != "hermes":
            return messages, tools
        return hermes_prompt.rewrite(messages, tools, self.default_system), None

    def describe(self) -> str:
        if self.mode == "template":
            return "the chat template renders tools itself"
        if self.mode == "hermes":
            return "tools declared in the system turn the Hermes way, <tool_call> JSON parsed (--proxy.tool-format hermes)"
        return self.why


@dataclass(frozen=True)
class ChatSetup:
    format: ChatFormat
    tools: ToolSupport


def chat_setup(tokenizer: Any, config: Any = None, *, chat_format: str = "auto", tool_format: str = "auto",
               tool_parser: str = "auto") -> ChatSetup:
    """The chat format (`format_for`: UnknownChatFormat for a template no format knows) and tool
    support (see the module docstring) of a run with this tokenizer. Raises ChatSetupError when the
    tokenizer lacks the format's end-of-turn token, or --proxy.tool-parser hermes meets a format
    that writes other tool calls."""
    if tool_format not in TOOL_FORMATS:
        raise ChatSetupError(f"--proxy.tool-format {tool_format!r}: must be one of {', '.join(TOOL_FORMATS)}")
    fmt = format_for(tokenizer, config, override=chat_format)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.token_to_id(fmt.end_of_turn) is None:
        raise ChatSetupError(f"chat format {fmt.name}: the tokenizer has no {fmt.end_of_turn!r} token; "
                             "is --proxy.chat-format right for this checkpoint?")
    own = template_renders_tools(tokenizer) if _template(tokenizer) else False
    if tool_format == "none":
        tools = ToolSupport("refuse", "this run refuses tools (--proxy.tool-format none)")
    elif own:
        tools = ToolSupport("template")
    elif tool_format == "hermes":
        tools = ToolSupport("hermes", default_system=template_default_system(tokenizer))
        fmt = hermes_prompt.hermes_tools(fmt)
    else:
        tools = ToolSupport("refuse", f"the model's chat template ({fmt.name}) cannot render tools, so the model would "
                                      "never see them; start the run with --proxy.tool-format hermes to declare them in "
                                      "the system turn the Hermes / Qwen2.5 way (<tool_call> JSON parsed)")
    if tool_parser == "hermes" and fmt.tool_syntax != "hermes":
        raise ChatSetupError(f"proxy.tool_parser=hermes, but the chat format {fmt.name} writes {fmt.tool_syntax} tool calls; "
                             "use proxy.tool_parser=auto")
    return ChatSetup(fmt, tools)
