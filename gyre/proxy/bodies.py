"""Request bodies: read, parse and validate without stalling other executions (docs/design.md §4,
"No body shape stalls other executions").

    parsed = await read_body(proxy, request, key, api)   -> Parsed(body, req, model)

`json.loads` and the adapters' field checks are pure CPU under the GIL (a thread would not free
the event loop: 0.2-1.2 s for 10-15 MiB of small items). So a body's JSON values are counted first
(`admission.value_count`, C speed); a body with fewer than `inline_parse_values` is parsed on the
loop (about a millisecond), a larger one in a worker process (`parse_processes` plain
subprocesses per proxy process, started when the proxy starts serving), which parses, checks the structural limits and validates it
with the API's own parser, and sends back only the parsed request (bounded by the limits) or the
error. Each execution has one such body in work at a time. Structural limits, a 400 naming the
limit, far beyond any real harness: `max_body_items` messages / input items + content blocks,
`max_tools` tools, `max_json_depth` levels of nesting.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from gyre.proxy.admission import COUNT_WINDOW, value_count
from gyre.proxy.core import ApiError, ChatRequest


class _Worker:
    """One `gyre.proxy.bodies._serve` child: length-prefixed pickles over its stdin / stdout.
    A plain subprocess (not multiprocessing): it works from a daemonic process and never
    re-imports the embedding program's `__main__`."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        # The protocol's pipe is a copy of fd 1 taken first; fd 1 itself then points at stderr, so
        # nothing an import prints can corrupt the protocol.
        code = "import os, sys; fd = os.dup(1); os.dup2(2, 1); from gyre.proxy.bodies import _serve; _serve(fd)"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def call(self, args: tuple) -> tuple:
        data = pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)
        self.proc.stdin.write(struct.pack("<Q", len(data)) + data)  # blocking pipe I/O releases the GIL
        self.proc.stdin.flush()
        head = self.proc.stdout.read(8)
        if len(head) < 8:
            raise EOFError("the body-parsing worker exited")
        return pickle.loads(self.proc.stdout.read(struct.unpack("<Q", head)[0]))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class _Pool:
    """`n` workers (`warm`, or on first use), shared by every proxy in this process; calls run on
    `n` threads that only wait on the pipes."""

    def __init__(self, n: int) -> None:
        self.idle: queue.Queue = queue.Queue()
        self.started = 0
        self.n = n
        self.lock = threading.Lock()
        self.threads = ThreadPoolExecutor(n, thread_name_prefix="gyre-parse")

    def _start(self, all_of_them: bool) -> None:
        """Start one worker (when none is idle), or every one not started yet, up to `n`."""
        with self.lock:
            while self.started < self.n and (all_of_them or self.idle.empty()):
                self.started += 1
                self.idle.put(_Worker())

    def warm(self) -> None:
        """Start the workers now (the proxy calls it on a thread at serve time), so that the first
        large body does not pay a worker's start-up beside other executions' calls."""
        self._start(all_of_them=True)

    def _call(self, args: tuple) -> tuple:
        self._start(all_of_them=False)
        w = self.idle.get()
        try:
            out = w.call(args)
        except (OSError, EOFError, pickle.UnpicklingError):
            w.kill()
            with self.lock:
                self.started -= 1
            raise
        self.idle.put(w)
        return out

    async def call(self, args: tuple) -> tuple:
        return await asyncio.get_running_loop().run_in_executor(self.threads, self._call, args)


_pools: dict[int, _Pool] = {}
_pools_lock = threading.Lock()


def parse_pool(n: int) -> _Pool:
    """The process's pool of `n` body-parsing workers (one per `n`, shared)."""
    with _pools_lock:
        pool = _pools.get(n)
        if pool is None:
            pool = _pools[n] = _Pool(max(1, n))
        return pool


@dataclass
class Parsed:
    body: dict  # the whole body (inline / Responses), or only {"model": ...} when `req` is set
    req: ChatRequest | None = None  # the API's parsed request, when it was parsed in a worker


def _depth(v: Any, limit: int) -> tuple[int, str]:
    """(depth, path) of the first place `v` nests past `limit`, or (0, "")."""
    stack = [(v, 1, "")]
    while stack:
        x, d, path = stack.pop()
        if d > limit:
            return d, path or "the body"
        if isinstance(x, dict):
            stack.extend((y, d + 1, f"{path}.{k}" if path else str(k)) for k, y in x.items() if isinstance(y, (dict, list)))
        elif isinstance(x, list):
            stack.extend((y, d + 1, f"{path}[{i}]") for i, y in enumerate(x) if isinstance(y, (dict, list)))
    return 0, ""


def check_structure(body: dict, max_items: int, max_tools: int, max_depth: int) -> None:
    """400 naming the limit when `body` holds more items or tools, or nests deeper, than allowed."""
    field = "messages" if "messages" in body else "input"
    items = body.get(field)
    if isinstance(items, list):
        n = len(items) + sum(len(m["content"]) for m in items if isinstance(m, dict) and isinstance(m.get("content"), list))
        system = body.get("system")
        n += len(system) if isinstance(system, list) else 0
        if n > max_items:
            raise ApiError(400, "invalid_request", f"{field}: {n} items (messages and their content blocks); this proxy accepts "
                           f"at most {max_items} (proxy.max_body_items)", param=field)
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > max_tools:
        raise ApiError(400, "invalid_request", f"tools: {len(tools)} tools; this proxy accepts at most {max_tools} "
                       "(proxy.max_tools)", param="tools")
    d, path = _depth(body, max_depth)
    if d:
        path = path if len(path) <= 120 else path[:60] + "..." + path[-57:]
        raise ApiError(400, "invalid_request", f"{path}: the JSON body nests more than {max_depth} levels deep; this proxy "
                       f"accepts at most {max_depth} (proxy.max_json_depth)", param=path.split(".")[0].split("[")[0])


def loads(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, "invalid_request", f"malformed JSON body: {e}") from None
    except RecursionError:
        raise ApiError(400, "invalid_request", "malformed JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_request", "the JSON body must be an object")
    return body


def parse_api(body: dict, api: str, vocab: int) -> ChatRequest | None:
    """The API's parser (its field checks): chat, completions, messages, count_tokens; None for
    Responses (its handler parses the body itself, with its stored history)."""
    from gyre.proxy import anthropic_api, openai_api, responses_api

    if api == "chat":
        return openai_api.parse_chat(body)
    if api == "completions":
        req = openai_api.parse_completion(body)
        openai_api.validate_prompt_ids(req, vocab)
        return req
    if api in ("messages", "count_tokens"):
        return anthropic_api.parse_request(body, count_only=api == "count_tokens")
    responses_api.parse_request(body)  # validated here; the handler parses again (bounded by the limits)
    return None


def _work(raw: bytes, api: str, limits: tuple[int, int, int], vocab: int) -> tuple:
    """In the worker process: the parsed request, or the error's fields."""
    try:
        body = loads(raw)
        check_structure(body, *limits)
        req = parse_api(body, api, vocab)
    except ApiError as e:
        return ("error", (e.status, e.kind, e.message, e.param, e.code))
    except RecursionError:
        return ("error", (400, "invalid_request", "the JSON body is nested too deeply", None, None))
    except Exception as e:  # a bug, not the client's fault: a 500 (as the server answers it), the worker lives on
        import traceback

        traceback.print_exc()
        return ("error", (500, "internal", f"internal error: {type(e).__name__}", None, None))
    if req is None:
        return ("body", body)
    return ("req", ({"model": body.get("model")}, req))


async def read_body(proxy, request, key, api: str) -> Parsed:
    """Read, charge (admission.work_units), parse and validate a request body (see the module docstring)."""
    c = proxy.config
    if request.content_length is not None and request.content_length > c.max_body_bytes:
        raise ApiError(413, "too_large", f"request body is {request.content_length} bytes; the limit is {c.max_body_bytes}")
    raw = await request.read()
    values = value_count(raw) if len(raw) <= COUNT_WINDOW else await asyncio.get_running_loop().run_in_executor(proxy.pool, value_count, raw)
    proxy.admission.charge(key.execution_id, proxy.admission.work_units(len(raw), values, request.content_length is not None))
    limits = (c.max_body_items, c.max_tools, c.max_json_depth)
    vocab = len(proxy.token_table)
    if values < c.inline_parse_values:
        body = loads(raw)
        check_structure(body, *limits)
        return Parsed(body, None if api == "responses" else parse_api(body, api, vocab))
    async with proxy.admission.render_lock(key.execution_id):  # one large body per execution in work at a time
        try:
            kind, out = await parse_pool(c.parse_processes).call((raw, api, limits, vocab))
        except (OSError, EOFError, pickle.UnpicklingError) as e:
            raise ApiError(503, "overloaded", f"the proxy's body parser failed ({type(e).__name__}) and restarts; retry the call",
                           retry_after=1.0) from None
    if kind == "error":
        status, kind_, message, param, code = out
        raise ApiError(status, kind_, message, param=param, code=code)
    if kind == "body":
        return Parsed(out)
    return Parsed(*out)


def _serve(fd: int) -> None:
    """The worker's loop: requests on stdin, replies on `fd`, until stdin closes."""
    inp, out = sys.stdin.buffer, os.fdopen(fd, "wb")
    while True:
        head = inp.read(8)
        if len(head) < 8:
            return
        args = pickle.loads(inp.read(struct.unpack("<Q", head)[0]))
        data = pickle.dumps(_work(*args), protocol=pickle.HIGHEST_PROTOCOL)
        out.write(struct.pack("<Q", len(data)) + data)
        out.flush()

