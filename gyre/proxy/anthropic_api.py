"""Anthropic adapter: `POST /v1/messages` (plain and streamed) and `POST /v1/messages/count_tokens`.

Content blocks map onto the chat template: `text` -> message text, assistant `tool_use` ->
tool_calls, user `tool_result` -> a `tool` message (rendered inside `<tool_response>`), assistant
`thinking` -> the message's `reasoning_content` (the template renders or drops it as it does;
`redacted_thinking` is unreadable and left out). A user `image` or `document` block, also inside
`tool_result` content, becomes a line of text for the text-only policy (`[image: image/png, 48213
bytes]`; context, never a target), or a 400 with `--proxy.media reject`.

With a chat format that has a reasoning channel the model's thinking comes back as a `thinking`
block before the text and tool_use blocks; the request's `thinking` field switches the template's
thinking. A trailing assistant message (a prefill) is continued as Anthropic continues it: the
reply holds only the continuation, and re-sent as one assistant message it splices back exactly.
`tool_choice` any / tool forces a tool call by a forced prefix (gyre.proxy.core); structured
outputs (`output_format`, `output_config.format`) are a 400 naming the field. Claude Code's
`x-anthropic-billing-header:` system line is left out of the prompt. Each of these in full:
docs/proxy_harnesses.md.

Streams follow Anthropic's event sequence: message_start, per block content_block_start / _delta
/ _stop (text_delta, thinking_delta, input_json_delta), message_delta (stop_reason, usage),
message_stop. Errors use Anthropic's body: {"type": "error", "error": {"type", "message"}}; a
prompt over the context is `prompt is too long: N tokens > M maximum` (gyre/proxy/limits.py),
which Claude Code answers by compacting.
"""

from __future__ import annotations

import json
import secrets
from contextlib import aclosing
from typing import Any

from aiohttp import web

from gyre.proxy import validate as V
from gyre.proxy.core import ApiError, Call, ChatRequest, ToolForce, abort_on_disconnect, object_arguments
from gyre.proxy.endings import told
from gyre.proxy.formats import Reasoning
from gyre.proxy.pacing import sse_start
from gyre.proxy.render import SPLICE_CALL
from gyre.proxy.tool_ids import named_call, tool_call_id
from gyre.proxy.textstream import ToolCall

_ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "not_found": "not_found_error",
    "too_large": "request_too_large",
    "rate_limit": "rate_limit_error",
    "overloaded": "overloaded_error",
    "internal": "api_error",
}
_IGNORED_BLOCKS = {"redacted_thinking"}
_MEDIA_BLOCKS = {"image", "document"}


def error_body(e: ApiError) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.kind, "api_error"), "message": e.message}}


def error_status(e: ApiError) -> int:
    return 529 if e.kind == "overloaded" else e.status


def _media_block(b: dict, bf: str, media: list[str]) -> str:
    """An `image` / `document` block as text: a text document is its text; anything else is a
    placeholder (validate.media_text) and its field is noted in `media` (reject mode refuses it)."""
    kind = b["type"]
    src = b.get("source")
    if not isinstance(src, dict):
        raise V.bad(bf + ".source", "must be an object")
    st, sf = src.get("type"), bf + ".source."
    if kind == "document" and st == "text":
        return V.req_str(src, "data", sf)
    if kind == "document" and st == "content":
        return _text_blocks(src.get("content"), sf + "content", media)
    name = V.opt_str(b, "title", bf + ".") if kind == "document" else None
    if st == "base64":
        text = V.media_text(kind, media_type=V.opt_str(src, "media_type", sf), data=V.req_str(src, "data", sf), name=name)
    elif st == "url":
        text = V.media_text(kind, url=V.req_str(src, "url", sf), name=name)
    elif st == "file":
        text = V.media_text(kind, file_id=V.req_str(src, "file_id", sf), name=name)
    else:
        raise V.bad(sf + "type", f"unsupported {kind} source type {st!r}")
    media.append(bf)
    return text


def _text_blocks(v: Any, field: str, media: list[str] | None = None) -> str:
    """Text blocks joined by newlines; `image` / `document` blocks too where `media` is given."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise V.bad(field, "must be a string or an array of content blocks")
    out = []
    for i, b in enumerate(v):
        if not isinstance(b, dict):
            raise V.bad(f"{field}[{i}]", "must be an object")
        kind = b.get("type")
        if kind in _MEDIA_BLOCKS and media is not None:
            out.append(_media_block(b, f"{field}[{i}]", media))
            continue
        if kind != "text":
            raise V.bad(f"{field}[{i}].type", f"unsupported block type {kind!r} here ({'text, image, document' if media is not None else 'text only'})")
        out.append(V.req_str(b, "text", f"{field}[{i}]."))
    return "\n".join(out)


_BILLING = "x-anthropic-billing-header:"


def _drop_billing(text: str) -> str:
    """The system text without Claude Code's `x-anthropic-billing-header:` line: request metadata
    for Anthropic's billing (its hash changes at compaction), never model input; kept, it would
    change the prompt's first tokens between the agent's calls and lose their shared prefix."""
    if _BILLING not in text:
        return text
    return "\n".join(ln for ln in text.split("\n") if not ln.lstrip().startswith(_BILLING))


def parse_messages(raw: Any, system: Any, media: list[str] | None = None) -> list[dict]:
    """Messages -> normalized chat messages; the fields of media blocks turned into text are
    appended to `media`."""
    media = [] if media is None else media
    msgs: list[dict] = []
    if system is not None:
        sys_text = _drop_billing(_text_blocks(system, "system"))
        if sys_text:
            msgs.append({"role": "system", "content": sys_text})
    if raw is None:
        raise V.bad("messages", "is required")
    if not isinstance(raw, list) or not raw:
        raise V.bad("messages", "must be a non-empty array")
    for i, m in enumerate(raw):
        f = f"messages[{i}]"
        if not isinstance(m, dict):
            raise V.bad(f, "must be an object")
        role = m.get("role")
        if role == "system":
            # Claude Code (2.1.x) sends its environment block as a system entry inside `messages`;
            # it stays a system turn where it was sent, as the OpenAI adapter does with one.
            msgs.append({"role": "system", "content": _text_blocks(m.get("content"), f + ".content")})
            continue
        if role not in ("user", "assistant"):
            raise V.bad(f + ".role", "must be 'user', 'assistant' or 'system'")
        content = m.get("content")
        if isinstance(content, str):
            msgs.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise V.bad(f + ".content", "must be a string or an array of content blocks")
        texts: list[str] = []
        calls: list[dict] = []
        use_ids: list[str] = []
        thinking: list[str] = []
        for j, b in enumerate(content):
            bf = f"{f}.content[{j}]"
            if not isinstance(b, dict):
                raise V.bad(bf, "must be an object")
            kind = b.get("type")
            if kind == "text":
                texts.append(V.req_str(b, "text", bf + "."))
            elif kind in _MEDIA_BLOCKS and role == "user":
                texts.append(_media_block(b, bf, media))
            elif kind == "tool_use" and role == "assistant":
                use_ids.append(V.req_str(b, "id", bf + "."))
                name = V.req_str(b, "name", bf + ".")
                inp = b.get("input", {})
                if not isinstance(inp, dict):
                    raise V.bad(bf + ".input", "must be an object")
                calls.append({"name": name, "arguments": inp})
            elif kind == "tool_result" and role == "user":
                V.req_str(b, "tool_use_id", bf + ".")
                if texts:  # keep order: text that came before the result
                    msgs.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                res = b.get("content", "")
                msgs.append({"role": "tool", "content": _text_blocks(res, bf + ".content", media) if res is not None else ""})
            elif kind == "thinking" and role == "assistant":
                thinking.append(V.req_str(b, "thinking", bf + "."))
            elif kind in _IGNORED_BLOCKS or kind == "thinking":
                continue
            else:
                raise V.bad(bf + ".type", f"unsupported block type {kind!r} in a {role} message")
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
                named = named_call(use_ids)
                if named is not None:  # the ids name the call that sampled this turn (gyre.proxy.tool_ids)
                    msg[SPLICE_CALL] = named
            if any(thinking):
                msg["reasoning_content"] = "\n".join(t for t in thinking if t)
            msgs.append(msg)
        elif texts or not msgs or msgs[-1]["role"] != "tool":
            msgs.append({"role": "user", "content": "\n".join(texts)})
    return msgs


def parse_tools(raw: Any) -> list[dict] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise V.bad("tools", "must be an array")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict):
            raise V.bad(f"tools[{i}]", "must be an object")
        name = V.req_str(t, "name", f"tools[{i}].")
        schema = t.get("input_schema")
        if schema is None and t.get("type") not in (None, "custom"):
            continue  # a server tool (web search, ...): nothing the policy can call here
        if not isinstance(schema, dict):
            raise V.bad(f"tools[{i}].input_schema", "must be an object")
        fn = {"name": name, "description": V.opt_str(t, "description", f"tools[{i}].", ""), "parameters": schema}
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(tc: dict | None) -> ToolForce | None:
    """`tool_choice` auto / none (None), any (any tool), tool + name (that one); forced by a
    prefix (gyre.proxy.core)."""
    kind = (tc or {}).get("type", "auto")
    if kind in ("auto", "none"):
        return None
    if kind == "any":
        return ToolForce()
    if kind == "tool":
        return ToolForce(V.req_str(tc, "name", "tool_choice."))
    raise V.bad("tool_choice.type", f"must be 'auto', 'any', 'tool' or 'none', got {kind!r}")


def _output_format(body: dict) -> None:
    """Structured outputs (`output_format`, or `output_config.format`) are refused: no engine here
    constrains decoding to a JSON schema. `output_config`'s other keys (effort) are accepted."""
    if body.get("output_format") is not None:
        raise V.bad("output_format", "is not supported: structured output (JSON schema) is not enforced by this proxy's engines")
    oc = body.get("output_config")
    if oc is not None and not isinstance(oc, dict):
        raise V.bad("output_config", "must be an object")
    if (oc or {}).get("format") is not None:
        raise V.bad("output_config.format", "is not supported: structured output (JSON schema) is not enforced by this proxy's engines")


def parse_request(body: dict, count_only: bool = False) -> ChatRequest:
    V.req_str(body, "model")
    req = ChatRequest(api="anthropic")
    req.messages = parse_messages(body.get("messages"), body.get("system"), req.media)
    _prefill(req, len(body["messages"]) - 1)
    req.tools = parse_tools(body.get("tools"))
    _thinking(body, req)  # count_tokens renders the same prompt
    if count_only:
        return req
    if body.get("max_tokens") is None:
        raise V.bad("max_tokens", "is required")
    req.max_tokens = V.opt_int(body, "max_tokens", lo=1)
    req.temperature = V.opt_num(body, "temperature", 1.0, 0.0, 1.0)
    req.top_p = V.opt_num(body, "top_p", 1.0, 0.0, 1.0)
    V.opt_int(body, "top_k", None, lo=0)
    req.stop = V.stop_list(body.get("stop_sequences"), "stop_sequences", max_items=64)
    if isinstance(body.get("stop_sequences"), str):
        raise V.bad("stop_sequences", "must be an array of strings")
    req.stream = V.opt_bool(body, "stream")
    tc = body.get("tool_choice")
    if tc is not None and not isinstance(tc, dict):
        raise V.bad("tool_choice", "must be an object")
    req.parse_tools = not (tc and tc.get("type") == "none")
    req.force = _tool_choice(tc)
    _output_format(body)
    md = body.get("metadata")
    if md is not None and not isinstance(md, dict):
        raise V.bad("metadata", "must be an object")
    return req


def _prefill(req: ChatRequest, index: int) -> None:
    """A trailing assistant message with text (no tool_use) is a prefill: the answer continues it,
    as Anthropic's API does. Its text becomes `req.prefill` (input after the generation prompt;
    the reply holds only the continuation). Trailing whitespace is refused as Anthropic refuses it."""
    last = req.messages[-1]
    if last["role"] != "assistant" or last.get("tool_calls") or len(req.messages) < 2:
        return
    req.messages.pop()
    text = last["content"]
    if text != text.rstrip():
        raise V.bad(f"messages[{index}].content", "final assistant content cannot end with trailing whitespace")
    req.prefill = text  # count_tokens counts it too: the prefill's tokens are input


def _thinking(body: dict, req: ChatRequest) -> None:
    """The `thinking` switch -> the template's enable_thinking (see the module docstring)."""
    th = body.get("thinking")
    if th is not None and not isinstance(th, dict):
        raise V.bad("thinking", "must be an object")
    if th is not None:
        kind = th.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise V.bad("thinking.type", f"must be 'enabled', 'disabled' or 'adaptive', got {kind!r}")
        if kind != "adaptive":
            req.template_kwargs["enable_thinking"] = kind == "enabled"


def _stop_reason(call: Call) -> str:
    if call.stop_string is not None:
        return "stop_sequence"
    return {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn", "error": "end_turn"}[call.finish]


def _tool_block(tc: ToolCall, call_id: int) -> dict:
    # `input` must be an object; a non-object is wrapped, and the stored turn is keyed by the
    # wrapped form, so the re-sent turn splices like the OpenAI path's (core.object_arguments).
    return {"type": "tool_use", "id": tool_call_id("toolu_", call_id), "name": tc.name, "input": object_arguments(tc.arguments)}


def _event(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


async def respond(request: web.Request, call: Call, model: str) -> web.StreamResponse:
    mid = "msg_" + secrets.token_hex(12)
    if not call.req.stream:
        with abort_on_disconnect(request):
            async with aclosing(told(call)) as events:
                async for _ in events:
                    pass
        content: list[dict] = []
        if call.reasoning:
            content.append({"type": "thinking", "thinking": call.reasoning, "signature": ""})
        text = call.content[len(call.req.prefill):] if call.content.startswith(call.req.prefill) else call.content
        if text:
            content.append({"type": "text", "text": text})
        content += [_tool_block(tc, call.call_id) for tc in call.tool_calls]
        body = {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": _stop_reason(call),
            "stop_sequence": call.stop_string,
            "usage": {"input_tokens": call.prompt_tokens, "output_tokens": len(call.tokens)},
        }
        return web.json_response(body)

    resp = await sse_start(request, call)
    start = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": call.prompt_tokens, "output_tokens": 0},
    }
    await resp.write(_event("message_start", {"type": "message_start", "message": start}))
    index = -1
    skip = len(call.req.prefill)  # the prefill comes first in the parsed text; the client has it
    text_open = False
    open_kind = None  # the open block: "text" | "thinking"
    try:
        async with aclosing(told(call)) as events:
            async for item in events:
                if isinstance(item, Reasoning):
                    out = b""
                    if open_kind != "thinking":
                        if text_open:
                            out += _event("content_block_stop", {"type": "content_block_stop", "index": index})
                        index += 1
                        text_open, open_kind = True, "thinking"
                        out += _event("content_block_start", {"type": "content_block_start", "index": index,
                                                              "content_block": {"type": "thinking", "thinking": "", "signature": ""}})
                    out += _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {"type": "thinking_delta", "thinking": item.text}})
                    await resp.write(out)
                    continue
                if isinstance(item, ToolCall):
                    out = b""
                    if text_open:
                        out += _event("content_block_stop", {"type": "content_block_stop", "index": index})
                        text_open, open_kind = False, None
                    index += 1
                    blk = _tool_block(item, call.call_id)
                    out += _event("content_block_start", {"type": "content_block_start", "index": index, "content_block": {**blk, "input": {}}})
                    out += _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": json.dumps(blk["input"], ensure_ascii=False)}})
                    out += _event("content_block_stop", {"type": "content_block_stop", "index": index})
                    await resp.write(out)
                    continue
                if skip:
                    cut = min(skip, len(item))
                    item, skip = item[cut:], skip - cut
                    if not item:
                        continue
                out = b""
                if open_kind != "text":
                    if text_open:
                        out += _event("content_block_stop", {"type": "content_block_stop", "index": index})
                    index += 1
                    text_open, open_kind = True, "text"
                    out += _event("content_block_start", {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}})
                out += _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": item}})
                await resp.write(out)
    except ApiError as e:
        await resp.write(_event("error", error_body(e)))
        return resp
    out = b""
    if text_open:
        out += _event("content_block_stop", {"type": "content_block_stop", "index": index})
    out += _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": _stop_reason(call), "stop_sequence": call.stop_string}, "usage": {"output_tokens": len(call.tokens)}})
    out += _event("message_stop", {"type": "message_stop"})
    await resp.write(out)
    await resp.write_eof()
    return resp
