"""OpenAI adapter: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`.

Parses requests into `ChatRequest` (every known field type-checked; unknown fields ignored, as
harnesses send vendor extras), and turns a `Call` into a JSON body or an SSE stream of
`chat.completion.chunk`s. Errors use OpenAI's body: {"error": {"message", "type", "param", "code"}}.
Media parts, reasoning, `tool_choice`, `response_format` and `top_logprobs`: docs/proxy_harnesses.md.
"""

from __future__ import annotations

import json
import math
import secrets
from contextlib import aclosing
import time
from typing import Any, Iterator

from aiohttp import web

from gyre.proxy import validate as V
from gyre.proxy.core import ApiError, Call, ChatRequest, ToolForce, abort_on_disconnect
from gyre.proxy.endings import told
from gyre.proxy.formats import Reasoning
from gyre.proxy.pacing import PacedResponse, charge_entries, lp_due, sse_start
from gyre.proxy.render import SPLICE_CALL
from gyre.proxy.tool_ids import named_call, tool_call_id
from gyre.proxy.textstream import ToolCall

_ROLES = {"system", "developer", "user", "assistant", "tool"}
_ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "not_found": "invalid_request_error",
    "too_large": "invalid_request_error",
    "rate_limit": "rate_limit_exceeded",
    "overloaded": "server_error",
    "internal": "server_error",
}


def error_body(e: ApiError) -> dict:
    code = e.code
    if code is None and e.kind == "authentication":
        code = "invalid_api_key"
    if code is None and e.kind == "rate_limit":
        code = "rate_limit_exceeded"
    return {"error": {"message": e.message, "type": _ERROR_TYPES.get(e.kind, "invalid_request_error"), "param": e.param, "code": code}}


def _media_part(part: dict, kind: str, f: str) -> str:
    """A chat `image_url` / `input_audio` / `file` part or a Responses `input_image` / `input_file`
    part as its placeholder line (validate.media_text); nothing is fetched or decoded."""
    if kind == "image_url":
        img = V.get_obj(part, "image_url", f + ".")
        return V.media_text("image", url=V.req_str(img, "url", f + ".image_url."))
    if kind == "input_audio":
        au = V.get_obj(part, "input_audio", f + ".")
        fmt = V.opt_str(au, "format", f + ".input_audio.")
        return V.media_text("audio", media_type=f"audio/{fmt}" if fmt else None, data=V.req_str(au, "data", f + ".input_audio."))
    if kind == "input_image":
        url, fid = V.opt_str(part, "image_url", f + "."), V.opt_str(part, "file_id", f + ".")
        if url is None and fid is None:
            raise V.bad(f + ".image_url", "is required (or file_id)")
        return V.media_text("image", url=url, file_id=fid if url is None else None)
    fobj, where = (V.get_obj(part, "file", f + "."), f + ".file.") if kind == "file" else (part, f + ".")
    data, fid = V.opt_str(fobj, "file_data", where), V.opt_str(fobj, "file_id", where)
    url = V.opt_str(fobj, "file_url", where) if kind == "input_file" else None
    name = V.opt_str(fobj, "filename", where)
    if data is not None and data.startswith("data:"):
        data, url = None, data
    if data is None and url is None and fid is None:
        raise V.bad(where + "file_data", "is required (or file_id)")
    return V.media_text("file", data=data, url=url, file_id=fid if data is None and url is None else None, name=name)


_MEDIA_PARTS = {"image_url", "input_audio", "file", "input_image", "input_file"}


def _text_of(content: Any, field: str, media: list[str] | None = None) -> str:
    """Text of a message's content; media parts become placeholder lines, their fields noted in
    `media` (None: media parts are refused here)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, dict):
                raise V.bad(f"{field}[{i}]", "must be an object")
            kind = part.get("type")
            if kind in ("text", "input_text", "output_text"):
                out.append(V.req_str(part, "text", f"{field}[{i}]."))
            elif kind == "refusal":
                out.append(V.req_str(part, "refusal", f"{field}[{i}]."))
            elif kind in _MEDIA_PARTS and media is not None:
                out.append(_media_part(part, kind, f"{field}[{i}]"))
                media.append(f"{field}[{i}]")
            else:
                raise V.bad(f"{field}[{i}].type", f"unsupported content part type {kind!r} here")
        return "".join(out)
    raise V.bad(field, "must be a string, an array of content parts, or null")


def _tool_calls(v: Any, field: str) -> list[dict]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise V.bad(field, "must be an array")
    out = []
    for i, tc in enumerate(v):
        where = f"{field}[{i}]."
        if not isinstance(tc, dict):
            raise V.bad(f"{field}[{i}]", "must be an object")
        fn = V.get_obj(tc, "function", where)
        name = V.req_str(fn, "name", where + "function.")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # kept as the raw string; rendered as a JSON string
        elif not isinstance(args, dict):
            raise V.bad(where + "function.arguments", "must be a JSON string")
        out.append({"name": name, "arguments": args})
    return out


def parse_messages(raw: Any, media: list[str] | None = None) -> list[dict]:
    media = [] if media is None else media
    if raw is None:
        raise V.bad("messages", "is required")
    if not isinstance(raw, list) or not raw:
        raise V.bad("messages", "must be a non-empty array")
    msgs = []
    for i, m in enumerate(raw):
        f = f"messages[{i}]"
        if not isinstance(m, dict):
            raise V.bad(f, "must be an object")
        role = m.get("role")
        if role not in _ROLES:
            raise V.bad(f + ".role", f"must be one of {sorted(_ROLES)}")
        content = _text_of(m.get("content"), f + ".content", media if role in ("user", "tool") else None)
        if role == "developer":
            role = "system"
        msg: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            calls = _tool_calls(m.get("tool_calls"), f + ".tool_calls")
            if calls:
                msg["tool_calls"] = calls
                named = named_call([tc.get("id") for tc in m["tool_calls"]])
                if named is not None:  # the ids name the call that sampled this turn (gyre.proxy.tool_ids)
                    msg[SPLICE_CALL] = named
            for name in ("reasoning_content", "reasoning"):  # SGLang's name, vLLM's newer one
                r = V.opt_str(m, name, f + ".")
                if r:
                    msg["reasoning_content"] = r
                    break
        elif role == "tool":
            V.opt_str(m, "tool_call_id", f + ".")
        msgs.append(msg)
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
        fn = V.get_obj(t, "function", f"tools[{i}].")
        V.req_str(fn, "name", f"tools[{i}].function.")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise V.bad(f"tools[{i}].function.parameters", "must be an object")
        out.append({"type": "function", "function": fn})
    return out or None


def _common(body: dict, api: str) -> ChatRequest:
    V.opt_str(body, "model")
    n = V.opt_int(body, "n", 1)
    if n != 1:
        raise V.bad("n", "only n=1 is supported")
    max_tokens = V.opt_int(body, "max_completion_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = V.opt_int(body, "max_tokens", None, lo=1)
    req = ChatRequest(
        api=api,
        max_tokens=max_tokens,
        min_tokens=V.opt_int(body, "min_tokens", 0, lo=0),
        temperature=V.opt_num(body, "temperature", 1.0, 0.0, 2.0),
        top_p=V.opt_num(body, "top_p", 1.0, 0.0, 1.0),
        seed=V.opt_int(body, "seed"),
        stop=V.stop_list(body.get("stop"), "stop"),
        stream=V.opt_bool(body, "stream"),
    )
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise V.bad("stream_options", "must be an object")
    req.include_usage = V.opt_bool(so or {}, "include_usage", where="stream_options.")
    return req


def _tool_choice(tc: Any) -> ToolForce | None:
    """Chat `tool_choice`: "auto" / "none" (None), "required" (any tool), or
    {"type": "function", "function": {"name"}} (that one); forced by prefix (gyre.proxy.core)."""
    if tc is None or tc in ("auto", "none"):
        return None
    if tc == "required":
        return ToolForce()
    if isinstance(tc, str):
        raise V.bad("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")
    if not isinstance(tc, dict):
        raise V.bad("tool_choice", "must be a string or an object")
    if tc.get("type") != "function":
        raise V.bad("tool_choice.type", f"{tc.get('type')!r} is not supported: use 'function' (or 'required' / 'auto' / 'none')")
    return ToolForce(V.req_str(V.get_obj(tc, "function", "tool_choice."), "name", "tool_choice.function."))


# JSON-schema constrained decoding needs a grammar-constrained sampler, which the built-in engine
# does not have; answering free text to a client that relies on the schema would break it later
# and quietly, so the field is refused up front.
_NO_STRUCTURED = "is not supported: structured output (JSON mode / JSON schema) is not enforced by this proxy's engines; use {'type': 'text'}"


def _response_format(rf: Any) -> None:
    if rf is None:
        return
    if not isinstance(rf, dict):
        raise V.bad("response_format", "must be an object")
    if rf.get("type") != "text":
        raise V.bad("response_format", f"{rf.get('type')!r} " + _NO_STRUCTURED)


def template_kwargs(body: dict) -> dict:
    """`chat_template_kwargs` (SGLang / vLLM extension): variables for the chat template."""
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return {}
    if not isinstance(kw, dict) or not all(isinstance(k, str) for k in kw):
        raise V.bad("chat_template_kwargs", "must be an object")
    if "enable_thinking" in kw and not isinstance(kw["enable_thinking"], bool):
        raise V.bad("chat_template_kwargs.enable_thinking", "must be a boolean")
    return dict(kw)


def parse_chat(body: dict) -> ChatRequest:
    req = _common(body, "openai")
    req.template_kwargs = template_kwargs(body)
    req.messages = parse_messages(body.get("messages"), req.media)
    req.tools = parse_tools(body.get("tools"))
    req.force = _tool_choice(body.get("tool_choice"))
    req.parse_tools = body.get("tool_choice") != "none"
    _response_format(body.get("response_format"))
    req.logprobs = V.opt_bool(body, "logprobs")
    req.top_logprobs = V.opt_int(body, "top_logprobs", 0, lo=0, hi=20) or 0
    if req.top_logprobs and not req.logprobs:
        raise V.bad("top_logprobs", "requires logprobs: true")
    return req


def parse_completion(body: dict) -> ChatRequest:
    req = _common(body, "completions")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req.prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        req.prompt_ids = list(prompt)
    else:
        raise V.bad("prompt", "must be a string, one string in an array, or an array of token ids")
    req.parse_tools = False
    n_lp = V.opt_int(body, "logprobs", None, lo=0, hi=5)
    req.logprobs = n_lp is not None
    req.top_logprobs = n_lp or 0
    return req


def validate_prompt_ids(req: ChatRequest, vocab: int) -> None:
    if req.prompt_ids is not None and any(t < 0 or t >= vocab for t in req.prompt_ids):
        raise V.bad("prompt", f"token ids must be in [0, {vocab})")


# ---- responses ------------------------------------------------------------------------------
def _usage(call: Call) -> dict:
    n_out = len(call.tokens)
    return {"prompt_tokens": call.prompt_tokens, "completion_tokens": n_out, "total_tokens": call.prompt_tokens + n_out}


def _finish(call: Call) -> str:
    # The record keeps the truth (abort / error); OpenAI clients know no such finish reasons.
    return {"abort": "stop", "error": "stop"}.get(call.finish, call.finish)


def _tool_json(tc: ToolCall, ids: dict[int, str], call_id: int) -> dict:
    tid = ids.setdefault(tc.index, tool_call_id("call_", call_id))
    return {"id": tid, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments_json}}


def _num(x: float) -> str:
    # What json writes: float.__repr__ for a finite float; the rare rest (inf, nan, an int) through json itself.
    return float.__repr__(x) if type(x) is float and -math.inf < x < math.inf else json.dumps(x)


def _lp_json(call: Call, start: int, end: int, memo: dict[int, tuple[str, str]]) -> str:
    """Chat / Responses log-prob entries of the visible tokens in call.tokens[start:end], with
    the engine's alternatives (`TokenEvent.top`, k = the request's top_logprobs), as the text
    `json.dumps(entries, ensure_ascii=False)` writes. It is spliced from each token id's JSON, made
    once per call (`memo`), not built as dicts: a top-20 stream writes 21 entries a token."""
    table, hidden, k = call.proxy.token_table, call.proxy.eos_ids, call.req.top_logprobs

    def entry(t: int, lp: float) -> str:
        if (f := memo.get(t)) is None:
            b = table[t]
            f = memo[t] = ('{"token": ' + json.dumps(b.decode("utf-8", "replace"), ensure_ascii=False) + ', "logprob": ',
                           ', "bytes": ' + json.dumps(list(b)))
        return f[0] + _num(lp) + f[1]

    out = []
    for ev in call.tokens[start:end]:
        if ev.token_id not in hidden:
            tops = ", ".join([entry(t, lp) + "}" for t, lp in (ev.top or ())[:k]]) if k else ""
            out.append(entry(ev.token_id, ev.logprob) + ', "top_logprobs": [' + tops + "]}")
        ev.top = None  # read once: k tuples a token kept alive would bring on a full collection (collector.py)
    charge_entries(call, len(out) * (1 + k))
    return "[" + ", ".join(out) + "]"


def _lp_entries(call: Call, start: int, end: int) -> list[dict]:
    return json.loads(_lp_json(call, start, end, {}))


def lp_body_parts(call: Call, body: dict, choice: dict) -> Iterator[str]:
    """`json.dumps(body, ensure_ascii=False)` with choice["logprobs"] = {"content": the entries of
    every token}, in pieces: the entries a pacing frame at a time (`lp_due`), each built only when
    the piece before it has been taken. A non-streamed top-20 answer of 30k tokens is ~50 MB of
    JSON: built and written in one step, it would hold the loop for every other execution."""
    mark = secrets.token_hex(16)  # a quoted marker: in a JSON string a quote is always escaped, so this one is unique
    choice["logprobs"] = {"content": mark}
    head, tail = json.dumps(body, ensure_ascii=False).split(f'"{mark}"', 1)
    yield head + "["
    memo: dict[int, tuple[str, str]] = {}
    seen, sep = 0, ""
    while seen < len(call.tokens):
        part = _lp_json(call, seen, lp_due(call, seen), memo)[1:-1]
        seen = lp_due(call, seen)
        if part:
            yield sep + part
            sep = ", "
    yield "]" + tail


async def _paced_json(request: web.Request, call: Call, parts: Iterator[str]) -> web.StreamResponse:
    """A JSON body written piece by piece through `PacedResponse` (a loop turn after each, a
    client that takes none of it for `client_stall_s` cut off); chunked, its length unknown ahead."""
    resp = PacedResponse(call, "application/json; charset=utf-8")
    await resp.prepare(request)
    for part in parts:
        await resp.write(part.encode())
    await resp.write_eof()
    return resp


async def respond_chat(request: web.Request, call: Call, model: str) -> web.StreamResponse:
    rid = "chatcmpl-" + secrets.token_hex(12)
    created = int(time.time())
    want_lp = call.req.logprobs
    if not call.req.stream:
        with abort_on_disconnect(request):
            async with aclosing(told(call)) as events:
                async for _ in events:
                    pass
        ids: dict[int, str] = {}
        msg: dict[str, Any] = {"role": "assistant", "content": call.content or (None if call.tool_calls else "")}
        if call.proxy.format.reasoning is not None:
            msg["reasoning_content"] = call.reasoning or None
        if call.tool_calls:
            msg["tool_calls"] = [_tool_json(tc, ids, call.call_id) for tc in call.tool_calls]
        choice = {"index": 0, "message": msg, "logprobs": None, "finish_reason": _finish(call)}
        body = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice], "usage": _usage(call)}
        if want_lp:
            return await _paced_json(request, call, lp_body_parts(call, body, choice))
        return web.json_response(body)

    resp = await sse_start(request, call)
    ids = {}
    seen = 0
    memo: dict[int, tuple[str, str]] = {}

    def chunk(delta: dict, finish: str | None = None, lp: bool = False) -> bytes:
        nonlocal seen
        lps = "null"
        if lp and want_lp:
            lps = '{"content": ' + _lp_json(call, seen, lp_due(call, seen), memo) + "}"
            seen = lp_due(call, seen)
        data = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [{"index": 0, "delta": delta}]}
        head = json.dumps(data, ensure_ascii=False)[:-3]  # less the closing '}]}': the choice's last two fields follow
        return f'data: {head}, "logprobs": {lps}, "finish_reason": {json.dumps(finish)}}}]}}\n\n'.encode()

    async def catch_up() -> None:  # log-probs of tokens whose text the parser held back, a bounded frame each
        while want_lp and lp_due(call, seen) < len(call.tokens):
            await resp.write(chunk({"content": ""}, lp=True))

    await resp.write(chunk({"role": "assistant", "content": ""}))
    try:
        async with aclosing(told(call)) as events:
            async for item in events:
                if isinstance(item, ToolCall):
                    await resp.write(chunk({"tool_calls": [{"index": item.index, **_tool_json(item, ids, call.call_id)}]}))
                    continue
                await catch_up()
                await resp.write(chunk({"reasoning_content": item.text} if isinstance(item, Reasoning) else {"content": item}, lp=True))
    except ApiError as e:
        await resp.write(b"data: " + json.dumps(error_body(e)).encode() + b"\n\n")
        return resp
    await catch_up()
    tail = chunk({}, _finish(call), lp=True)
    if call.req.include_usage:
        usage = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [], "usage": _usage(call)}
        tail += b"data: " + json.dumps(usage).encode() + b"\n\n"
    await resp.write(tail + b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def respond_completion(request: web.Request, call: Call, model: str) -> web.StreamResponse:
    rid = "cmpl-" + secrets.token_hex(12)
    created = int(time.time())
    want_lp = call.req.logprobs

    def lp_block(start: int, end: int) -> dict | None:
        if not want_lp:
            return None
        ents = _lp_entries(call, start, end)
        top = None
        if call.req.top_logprobs:  # legacy shape: {token: logprob} per position, the sampled token always in it
            top = [{t["token"]: t["logprob"] for t in reversed(e["top_logprobs"] + [e])} for e in ents]
            top = [dict(sorted(d.items(), key=lambda kv: -kv[1])) for d in top]
        return {"tokens": [e["token"] for e in ents], "token_logprobs": [e["logprob"] for e in ents], "top_logprobs": top, "text_offset": []}

    if not call.req.stream:
        with abort_on_disconnect(request):
            async with aclosing(told(call)) as events:
                async for _ in events:
                    pass
        choice = {"index": 0, "text": call.content, "logprobs": lp_block(0, len(call.tokens)), "finish_reason": _finish(call)}
        return web.json_response({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice], "usage": _usage(call)})
    resp = await sse_start(request, call)
    seen = 0

    async def send(text: str) -> None:
        nonlocal seen
        ch = {"index": 0, "text": text, "logprobs": lp_block(seen, lp_due(call, seen)), "finish_reason": None}
        seen = lp_due(call, seen)
        await resp.write(b"data: " + json.dumps({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [ch]}, ensure_ascii=False).encode() + b"\n\n")

    try:
        async with aclosing(told(call)) as events:
            async for item in events:
                while want_lp and lp_due(call, seen) < len(call.tokens):  # held-back tokens' log-probs first
                    await send("")
                await send(item)
    except ApiError as e:
        await resp.write(b"data: " + json.dumps(error_body(e)).encode() + b"\n\n")
        return resp
    while want_lp and lp_due(call, seen) < len(call.tokens):
        await send("")
    ch = {"index": 0, "text": "", "logprobs": lp_block(seen, len(call.tokens)), "finish_reason": _finish(call)}
    out = b"data: " + json.dumps({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [ch]}).encode() + b"\n\n"
    if call.req.include_usage:
        out += b"data: " + json.dumps({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [], "usage": _usage(call)}).encode() + b"\n\n"
    await resp.write(out + b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp



def models_body(model: str) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "gyre"}]}
