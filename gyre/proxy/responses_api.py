"""OpenAI Responses adapter: `POST /v1/responses` (plain and streamed), `GET /v1/responses/{id}`.

The OpenAI Agents SDK (`OpenAIResponsesModel`) and Codex CLI (`wire_api = "responses"`) speak
this API. Input items map onto the same normalized chat messages the chat adapter produces, so
the core renders, splices and records them unchanged (docs/design.md §4). Reasoning is a
`reasoning` output item before the message; `function` and `custom` tools become chat-template
functions, hosted tools are left out of the prompt, and other tool types are a 400. A response
with `store` is kept per execution within `proxy.responses_store_bytes`
(gyre/proxy/responses_store.py) for `previous_response_id` and `GET /v1/responses/{id}`.

The item mapping, the tools, what is refused with a 400 naming the field and what is accepted and
ignored: docs/proxy_harnesses.md, "The Responses API"; stored responses: "Stored Responses".
"""

from __future__ import annotations

import itertools
import json
import secrets
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gyre.proxy import validate as V
from gyre.proxy.core import ApiError, Call, ChatRequest, Proxy, ToolForce, abort_on_disconnect
from gyre.proxy.state import ExecutionState
from gyre.proxy.keys import KeyInfo
from gyre.proxy.endings import told
from gyre.proxy.formats import Reasoning
from gyre.proxy.pacing import sse_start
from gyre.proxy.openai_api import _lp_entries, _text_of, error_body, template_kwargs
from gyre.proxy.render import SPLICE_CALL
from gyre.proxy.responses_store import Evicted, ResponseStore, plain
from gyre.proxy.textstream import ToolCall

_MESSAGE_ROLES = {"system", "developer", "user", "assistant"}
_CALL_ITEMS = {"function_call", "custom_tool_call"}
_OUTPUT_ITEMS = {"function_call_output", "custom_tool_call_output"}
_REFUSED_FIELDS = ("conversation", "prompt")  # server-side state / templates the proxy does not have
_LOGPROBS = "message.output_text.logprobs"
# Run by OpenAI's servers, never by the client: nothing here could execute a call to them.
_HOSTED_TOOLS = {"web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26", "file_search",
                 "code_interpreter", "image_generation", "mcp", "tool_search"}


@dataclass
class ResponsesRequest:
    chat: ChatRequest
    tools: Tools
    store: bool = True
    previous_response_id: str | None = None
    instructions: str | None = None
    new_messages: list[dict] = field(default_factory=list)  # the input items, without instructions
    echo: dict = field(default_factory=dict)  # request fields the Response object repeats


# ---- request ------------------------------------------------------------------------------
def _arguments(item: dict, where: str) -> Any:
    raw = V.req_str(item, "arguments", where)
    try:
        return json.loads(raw) if raw.strip() else {}
    except ValueError:
        return raw  # kept as the raw string, as the chat adapter does


def parse_input(raw: Any, media: list[str] | None = None) -> list[dict]:
    """Input items -> normalized chat messages (see the module docstring for the mapping); fields of
    media parts turned into placeholder text are appended to `media`."""
    media = [] if media is None else media
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise V.bad("input", "must be a string or an array of input items")
    msgs: list[dict] = []
    turn: dict | None = None  # the assistant turn that following call items join
    thinking: list[str] = []  # reasoning items waiting for the assistant turn they precede

    def assistant_turn(new: bool) -> dict:
        nonlocal turn
        if turn is None or new:
            turn = {"role": "assistant", "content": ""}
            msgs.append(turn)
        if thinking:
            turn["reasoning_content"] = "\n".join(thinking)
            thinking.clear()
        return turn

    for i, item in enumerate(raw):
        f = f"input[{i}]"
        if not isinstance(item, dict):
            raise V.bad(f, "must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise V.bad(f + ".role", f"must be one of {sorted(_MESSAGE_ROLES)}")
            text = _text_of(item.get("content"), f + ".content", media if role == "user" else None)
            if role == "assistant":
                # A response's items come back as [message] [call]*; a second message with no
                # call in between is another turn (text after a call still belongs to its turn).
                t = assistant_turn(new=turn is not None and bool(turn["content"]) and "tool_calls" not in turn)
                t["content"] += text
            else:
                turn = None
                msgs.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind in _CALL_ITEMS:
            V.req_str(item, "call_id", f + ".")
            name = V.req_str(item, "name", f + ".")
            args = _arguments(item, f + ".") if kind == "function_call" else {"input": V.req_str(item, "input", f + ".")}
            assistant_turn(new=False).setdefault("tool_calls", []).append({"name": name, "arguments": args})
        elif kind in _OUTPUT_ITEMS:
            V.req_str(item, "call_id", f + ".")
            if "output" not in item:
                raise V.bad(f + ".output", "is required")
            turn = None
            msgs.append({"role": "tool", "content": _text_of(item["output"], f + ".output", media)})
        elif kind == "reasoning":  # see the module docstring; it does not end the assistant turn
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise V.bad(f + ".content", "must be an array")
            text = "".join(V.req_str(x, "text", f + ".content[].") for x in parts if isinstance(x, dict))
            if text:
                if turn is not None and turn["content"] == "" and "tool_calls" not in turn:
                    turn["reasoning_content"] = turn.get("reasoning_content", "") + text
                else:
                    turn = None
                    thinking.append(text)
        elif kind == "item_reference":
            raise V.bad(f + ".type", "item_reference is not supported: send the item itself, or use previous_response_id")
        else:
            raise V.bad(f + ".type", f"unsupported input item type {kind!r}")
    return msgs


def _custom_parameters(t: dict, where: str) -> dict:
    fmt = t.get("format")
    desc = "The tool's whole input, as one string."
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise V.bad(where + "format", "must be an object")
        if fmt.get("type") == "grammar":
            syntax = V.req_str(fmt, "syntax", where + "format.")
            definition = V.req_str(fmt, "definition", where + "format.")
            desc += f" It must match this {syntax} grammar:\n{definition}"
        elif fmt.get("type") != "text":
            raise V.bad(where + "format.type", "must be 'text' or 'grammar'")
    return {"type": "object", "properties": {"input": {"type": "string", "description": desc}}, "required": ["input"]}


@dataclass
class Tools:
    """The request's callable tools as chat-template functions, and how to name their calls."""

    functions: list[dict] = field(default_factory=list)
    custom: set[str] = field(default_factory=set)  # names of custom (freeform) tools
    namespace: dict[str, str] = field(default_factory=dict)  # function name -> its namespace


def parse_tools(raw: Any) -> Tools:
    """Responses tools -> chat-template function tools. A `namespace` tool's functions are listed
    flat (a call names the function; the output item carries its namespace). Hosted tools run on
    OpenAI's servers, not by the client, so the policy cannot call them here: they are left out."""
    tools = Tools()
    if raw is None:
        return tools
    if not isinstance(raw, list):
        raise V.bad("tools", "must be an array")
    names: set[str] = set()

    def add(t: Any, where: str, namespace: str | None) -> None:
        if not isinstance(t, dict):
            raise V.bad(where.rstrip("."), "must be an object")
        kind = t.get("type")
        if kind in _HOSTED_TOOLS and namespace is None:
            return
        if kind == "namespace" and namespace is None:
            ns = V.req_str(t, "name", where)
            for j, sub in enumerate(V.opt_list(t, "tools", where) or []):
                add(sub, f"{where}tools[{j}].", ns)
            return
        name = V.req_str(t, "name", where) if kind in ("function", "custom") else None
        if kind == "function":
            params = t.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise V.bad(where + "parameters", "must be an object")
            # the same keys the chat adapter passes, so one tool renders alike through both APIs
            fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        elif kind == "custom":
            fn = {"name": name, "description": V.opt_str(t, "description", where, ""), "parameters": _custom_parameters(t, where)}
            tools.custom.add(name)
        else:
            raise V.bad(where + "type", f"unsupported tool type {kind!r}: only 'function', 'custom' and 'namespace' tools can be called through this proxy")
        if name in names:
            raise V.bad(where + "name", f"duplicate tool name {name!r}")
        names.add(name)
        if namespace is not None:
            tools.namespace[name] = namespace
        tools.functions.append({"type": "function", "function": fn})

    for i, t in enumerate(raw):
        add(t, f"tools[{i}].", None)
    return tools


def _tool_choice(v: Any) -> ToolForce | None:
    """`tool_choice` auto / none (None), required (any tool), or {"type": "function" | "custom",
    "name"} (that one); forced by a prefix (gyre.proxy.core). Hosted-tool and allowed_tools
    choices are refused."""
    if v is None or v in ("auto", "none"):
        return None
    if v == "required":
        return ToolForce()
    if isinstance(v, str):
        raise V.bad("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}")
    if not isinstance(v, dict):
        raise V.bad("tool_choice", "must be a string or an object")
    if v.get("type") not in ("function", "custom"):
        raise V.bad("tool_choice.type", f"{v.get('type')!r} is not supported: use 'function' or 'custom' with a name, or 'required' / 'auto' / 'none'")
    return ToolForce(V.req_str(v, "name", "tool_choice."))


def parse_request(body: dict) -> ResponsesRequest:
    V.opt_str(body, "model")
    for name in _REFUSED_FIELDS:
        if body.get(name) is not None:
            raise V.bad(name, "is not supported by this proxy (it keeps no server-side conversations or prompts)")
    if V.opt_bool(body, "background"):
        raise V.bad("background", "background responses are not supported")
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise V.bad("text", "must be an object")
        fmt = text.get("format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            kind = fmt.get("type") if isinstance(fmt, dict) else fmt
            raise V.bad("text.format", f"{kind!r} is not supported: structured output is not enforced by this proxy; use {{'type': 'text'}}")
    for name in ("metadata", "reasoning"):
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise V.bad(name, "must be an object")
    V.opt_str(body, "user")
    include = V.opt_list(body, "include") or []
    top = V.opt_int(body, "top_logprobs", 0, lo=0, hi=20) or 0
    chat = ChatRequest(
        api="responses",
        max_tokens=V.opt_int(body, "max_output_tokens", None, lo=1),
        temperature=V.opt_num(body, "temperature", 1.0, 0.0, 2.0),
        top_p=V.opt_num(body, "top_p", 1.0, 0.0, 1.0),
        stream=V.opt_bool(body, "stream"),
        logprobs=_LOGPROBS in include or top > 0,
        top_logprobs=top,
    )
    tools = parse_tools(body.get("tools"))
    chat.tools = tools.functions or None
    chat.force = _tool_choice(body.get("tool_choice"))
    chat.parse_tools = body.get("tool_choice") != "none"
    chat.template_kwargs = template_kwargs(body)
    effort = (body.get("reasoning") or {}).get("effort")
    if effort == "none" and "enable_thinking" not in chat.template_kwargs:
        chat.template_kwargs["enable_thinking"] = False
    req = ResponsesRequest(
        chat=chat,
        tools=tools,
        store=V.opt_bool(body, "store", True),
        previous_response_id=V.opt_str(body, "previous_response_id"),
        instructions=V.opt_str(body, "instructions"),
    )
    raw = body.get("input")
    if raw is None and req.previous_response_id is None:
        raise V.bad("input", "is required")
    req.new_messages = parse_input(raw, chat.media) if raw is not None else []
    req.echo = {
        "instructions": req.instructions,
        "max_output_tokens": chat.max_tokens,
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": V.opt_bool(body, "parallel_tool_calls", True),
        "previous_response_id": req.previous_response_id,
        "reasoning": body.get("reasoning"),
        "store": req.store,
        "temperature": chat.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_logprobs": top,
        "top_p": chat.top_p,
        "truncation": "disabled",
        "user": body.get("user"),
    }
    return req


# ---- kept responses (gyre/proxy/responses_store.py) ---------------------------------------
def store_of(state: ExecutionState, limit_bytes: int) -> ResponseStore:
    if not isinstance(state.responses, ResponseStore):
        state.responses = ResponseStore(limit_bytes)
    return state.responses


def _not_found(rid: str, limit: int) -> ApiError:
    return ApiError(400, "invalid_request", f"Previous response with id '{rid}' not found (previous_response_id). This proxy keeps an execution's stored "
                    f"responses up to {limit} bytes, least recently used evicted first (proxy.responses_store_bytes); "
                    "send the full input instead.", param="previous_response_id", code="previous_response_not_found")


def _keep(store: ResponseStore, rid: str, parent: str | None, messages: list[dict], body: dict) -> None:
    if parent is None and store.newest is not None:
        # A client re-sending the whole history: store it as a delta on the last response.
        try:
            prefix = plain(store.history(store.newest))
        except Evicted:
            prefix = None
        if prefix is not None and len(messages) >= len(prefix) and plain(messages[: len(prefix)]) == prefix:
            parent, messages = store.newest, messages[len(prefix) :]
    store.put(rid, parent, messages, body)


def _previous(proxy: Proxy, key: KeyInfo, rid: str) -> list[dict]:
    limit = proxy.config.responses_store_bytes
    try:
        return store_of(proxy._state(key.execution_id), limit).history(rid)
    except Evicted as e:
        raise _not_found(e.rid, limit) from None


def _overlap(prior: list[dict], new: list[dict]) -> int:
    """How many of `new`'s first items re-send the end of the `previous_response_id` chain (its
    output turn included): a client that sends both gets them once, never spliced twice."""
    if not prior or not new or prior[-1]["role"] != "assistant":
        return 0
    p, n = plain(prior), plain(new)
    for k in range(min(len(p), len(n)), 0, -1):
        if n[:k] == p[-k:]:
            return k
    return 0


def retrieve(proxy: Proxy, key: KeyInfo, rid: str) -> dict:
    state = proxy.executions.get(key.execution_id)
    kept = store_of(state, proxy.config.responses_store_bytes).get(rid) if state is not None else None
    if kept is None:
        raise ApiError(404, "not_found", f"no stored response {rid!r} in this execution", param="response_id")
    return kept.body


# ---- response -----------------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def _custom_input(tc: ToolCall) -> str:
    a = tc.arguments
    if isinstance(a, dict) and set(a) == {"input"} and isinstance(a["input"], str):
        return a["input"]
    return tc.arguments_json


class _Output:
    """The Response's output items, built from a call's events alike for a stream and a body;
    each step returns the SSE bytes it would send (a body ignores them)."""

    def __init__(self, call: Call, tools: Tools) -> None:
        self.call = call
        self.tools = tools
        self.items: list[dict] = []
        self.seq = itertools.count()
        self.msg: dict | None = None  # the open message item
        self.thought: dict | None = None  # the open reasoning item
        self.lp_seen = 0

    def event(self, kind: str, **data: Any) -> bytes:
        data = {"type": kind, **data, "sequence_number": next(self.seq)}
        return b"event: " + kind.encode() + b"\ndata: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _logprobs(self) -> list[dict]:
        if not self.call.req.logprobs:
            return []
        out = _lp_entries(self.call, self.lp_seen, len(self.call.tokens))
        self.lp_seen = len(self.call.tokens)
        return out

    def reasoning(self, piece: str) -> bytes:
        out = self._close_message("completed")
        if self.thought is None:
            self.thought = {"id": _new_id("rs_"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            self.items.append(self.thought)
            out += self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(self.thought, content=[]))
            self.thought["content"].append({"type": "reasoning_text", "text": ""})
        self.thought["content"][0]["text"] += piece
        return out + self.event("response.reasoning_text.delta", **self._where(self.thought), content_index=0, delta=piece)

    def _close_reasoning(self) -> bytes:
        if self.thought is None:
            return b""
        t, self.thought = self.thought, None
        where = self._where(t)
        out = self.event("response.reasoning_text.done", **where, content_index=0, text=t["content"][0]["text"])
        t["status"] = "completed"
        return out + self.event("response.output_item.done", output_index=where["output_index"], item=t)

    def text(self, piece: str) -> bytes:
        out = self._close_reasoning()
        if self.msg is None:
            self.msg = {"id": _new_id("msg_"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            self.items.append(self.msg)
            out += self.event("response.output_item.added", output_index=len(self.items) - 1, item=self.msg)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self.event("response.content_part.added", **self._where(self.msg), content_index=0, part=part)
            self.msg["content"].append(dict(part, logprobs=[]))
        part = self.msg["content"][0]
        lps = self._logprobs()
        part["text"] += piece
        part["logprobs"] += lps
        if piece or lps:
            out += self.event("response.output_text.delta", **self._where(self.msg), content_index=0, delta=piece, logprobs=lps)
        return out

    def _close_message(self, status: str) -> bytes:
        if self.msg is None:
            return b""
        m, self.msg = self.msg, None
        part = m["content"][0]
        where = self._where(m)
        out = self.event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=part["logprobs"])
        out += self.event("response.content_part.done", **where, content_index=0, part=part)
        m["status"] = status
        return out + self.event("response.output_item.done", output_index=where["output_index"], item=m)

    def tool(self, tc: ToolCall) -> bytes:
        out = self._close_reasoning() + self._close_message("completed")
        cid = _new_id("call_")
        if tc.name in self.tools.custom:
            item = {"id": _new_id("ctc_"), "type": "custom_tool_call", "call_id": cid, "name": tc.name, "input": ""}  # no status field
            value, field_, delta, done = _custom_input(tc), "input", "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done"
        else:
            item = {"id": _new_id("fc_"), "type": "function_call", "status": "in_progress", "call_id": cid, "name": tc.name, "arguments": ""}
            value, field_, delta, done = tc.arguments_json, "arguments", "response.function_call_arguments.delta", "response.function_call_arguments.done"
        if tc.name in self.tools.namespace:
            item["namespace"] = self.tools.namespace[tc.name]
        self.items.append(item)
        where = self._where(item)
        out += self.event("response.output_item.added", output_index=where["output_index"], item=dict(item))
        out += self.event(delta, **where, delta=value)
        out += self.event(done, **where, **{field_: value})
        item[field_] = value
        if "status" in item:
            item["status"] = "completed"
        return out + self.event("response.output_item.done", output_index=where["output_index"], item=item)

    def finish(self, status: str) -> bytes:
        out = self._close_reasoning()
        if not any(i["type"] != "reasoning" for i in self.items):  # nothing visible was generated: still one (empty) message, as OpenAI does
            out += self.text("")
        return out + self._close_message("incomplete" if status == "incomplete" else "completed")


def _usage(call: Call) -> dict:
    n_in, n_out = call.prompt_tokens, len(call.tokens)
    return {
        "input_tokens": n_in,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": n_out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": n_in + n_out,
    }


def _turn(call: Call) -> dict:
    """The output as the normalized assistant message the core stored (so it splices re-sent)."""
    msg: dict[str, Any] = {"role": "assistant", "content": call.content, SPLICE_CALL: call.call_id}
    if call.reasoning:
        msg["reasoning_content"] = call.reasoning
    if call.tool_calls:
        msg["tool_calls"] = [{"name": tc.name, "arguments": tc.arguments} for tc in call.tool_calls]
    return msg


async def create(request: web.Request, proxy: Proxy, key: KeyInfo, body: dict, model: str) -> web.StreamResponse:
    """`POST /v1/responses`: parse, prepare the call (render + splice), answer, keep if stored."""
    req = parse_request(body)
    prior = _previous(proxy, key, req.previous_response_id) if req.previous_response_id else []
    req.new_messages = req.new_messages[_overlap(prior, req.new_messages) :]
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    req.chat.messages = system + prior + req.new_messages
    if not req.chat.messages:
        raise V.bad("input", "must not be empty")
    call = await proxy.aprepare(key, request.headers, req.chat)
    rid = _new_id("resp_")
    created = int(time.time())
    out = _Output(call, req.tools)

    def response(status: str, **extra: Any) -> dict:
        return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None, "incomplete_details": None,
                "model": model, "output": out.items, "usage": None, **req.echo, **extra}

    def final() -> tuple[str, dict]:
        status = "incomplete" if call.finish == "length" else "completed"
        details = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return status, response(status, incomplete_details=details, usage=_usage(call), completed_at=int(time.time()) if status == "completed" else None)

    def keep(body_: dict) -> None:
        if req.store:
            _keep(store_of(call.state, proxy.config.responses_store_bytes), rid, req.previous_response_id,
                  req.new_messages + [_turn(call)], body_)

    if not req.chat.stream:
        with abort_on_disconnect(request):
            async with aclosing(told(call)) as events:
                async for item in events:  # the SSE bytes are dropped: only the items are kept
                    if isinstance(item, ToolCall):
                        out.tool(item)
                    elif isinstance(item, Reasoning):
                        out.reasoning(item.text)
                    else:
                        out.text(item)
        status, body_ = final()
        out.finish(status)
        keep(body_)
        return web.json_response(body_)

    resp = await sse_start(request, call)
    await resp.write(out.event("response.created", response=response("in_progress", output=[])) + out.event("response.in_progress", response=response("in_progress", output=[])))
    try:
        async with aclosing(told(call)) as events:
            async for item in events:
                await resp.write(out.tool(item) if isinstance(item, ToolCall) else out.reasoning(item.text) if isinstance(item, Reasoning)
                                 else out.text(item))
    except ApiError as e:
        err = error_body(e)["error"]
        code = err["code"] or ("server_error" if e.status >= 500 else "invalid_request")
        tail = out.event("error", code=code, message=e.message, param=e.param)
        await resp.write(tail + out.event("response.failed", response=response("failed", error={"code": code, "message": e.message})))
        return resp
    status, body_ = final()
    tail = out.finish(status)
    keep(body_)
    await resp.write(tail + out.event("response.completed" if status == "completed" else "response.incomplete", response=body_))
    await resp.write_eof()
    return resp
