"""Multiplexed engine transport: all generate / abort traffic of one client over one websocket.

The proxy makes thousands of calls per second to a few engines, and an HTTP request per call costs
a request/response cycle on both sides, so `HttpEngine` (transport="ws", the default) keeps one
websocket per engine and event loop. Tokens produced back to back are coalesced into one frame; a
request whose `sampling.hold_s` > 0 has its tokens after the first held up to that long and sent
together; every token of a frame but the last is marked (`TokenEvent.more`).

Client -> server, one frame each:
    generate: binary, `{"op": "generate", "rid", "sampling", "window"}` as JSON, a newline, the
              prompt's ids as little-endian int32 (a text frame with "input_ids" is also taken);
              a prompt over PART_IDS ids is sent ahead in `{"op": "part", "rid"}` frames.
    abort:    {"op": "abort", "rid"}; "reply": false (the client closed the stream): no answer,
              and a later abort of that request is answered with no rows
    credit:   {"op": "credit", "rid", "n"}: the client has handed on n more bytes of the stream
Server -> client, text frames of newline-terminated lines:
    t <rid> <token_id> <logprob repr> <version> [finish_reason] [top=<id>:<lp>,...]   a token
    e <rid> | x <rid> <message>                                     the stream ended | failed
    a <rid> <json [[id, logprob, version, finish_reason(, top)], ...]>  reply to abort
`top=` and the fifth row element only for requests that asked for `top_logprobs`; `sampling`
leaves out zero fields added later (an older server refuses unknown fields). Request ids have no
whitespace. A dropped connection fails every open stream (the router continues those calls
elsewhere) and makes the server abort their requests.

Flow control: with "window" W, the server stops taking a request's tokens from the engine while
W or more bytes of its token lines (the text after "t <rid> ") are sent and not yet credited: a
stream whose reader stalls holds at most W plus one line in the client, the other streams on the
connection flow on. An abort ends the stream at once, whether or not the engine honours it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import weakref
from typing import AsyncIterator

import numpy as np
from aiohttp import WSCloseCode, WSMsgType, web

from gyre.backends.protocols import RolloutEngine, SamplingParams, TokenEvent, TokenIds, free_ids, int32_ids

logger = logging.getLogger(__name__)

_END = object()
WINDOW_BYTES = 256 << 10  # per stream: token-line bytes the server may send ahead of the client's reader


class _Flow:
    """The server's side of one stream's window: bytes sent and not yet credited (window 0: none)."""

    __slots__ = ("window", "unacked", "stopped", "abandoned", "_room")

    def __init__(self, window: int) -> None:
        self.window, self.unacked, self.stopped = window, 0, False
        self.abandoned = False  # the client closed the stream (an abort asking no reply)
        self._room = asyncio.Event()

    def credit(self, n: int) -> None:
        self.unacked -= n
        if self.unacked < self.window:
            self._room.set()

    def stop(self) -> None:
        self.stopped = True
        self._room.set()

    async def room(self) -> None:
        while self.window and self.unacked >= self.window and not self.stopped:
            self._room.clear()
            await self._room.wait()


_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def sampling_to_json(sp: SamplingParams) -> dict:
    """`dataclasses.asdict` without its deep-copy machinery (hot path: once per call). Fields
    added later are left out at their default, so an older engine server still accepts it."""
    d = {name: getattr(sp, name) for name in _SAMPLING_FIELDS}
    for name in ("top_logprobs", "hold_s"):
        if not d[name]:
            del d[name]
    return d


def event_text(ev: TokenEvent) -> str:
    """One event as the wire's fields: "<id> <logprob repr> <version>[ <finish>][ top=<id>:<lp>,...]"."""
    line = f"{ev.token_id} {ev.logprob!r} {ev.version}"
    if ev.finish_reason:
        line += f" {ev.finish_reason}"
    if ev.top is not None:
        line += " top=" + ",".join(f"{t}:{lp!r}" for t, lp in ev.top)
    return line


def parse_event(f: list[str]) -> TokenEvent:
    """The inverse of `event_text`, from its whitespace-split fields."""
    fin, top = None, None
    for extra in f[3:]:
        if extra.startswith("top="):
            top = [(int(t), float(lp)) for t, lp in (p.split(":") for p in extra[4:].split(",") if p)]
        else:
            fin = extra
    return TokenEvent(int(f[0]), float(f[1]), int(f[2]), fin, top)


def event_row(ev: TokenEvent) -> list:
    """An event as a JSON row (abort replies): [id, logprob, version, finish_reason(, top)]."""
    row = [ev.token_id, ev.logprob, ev.version, ev.finish_reason]
    if ev.top is not None:
        row.append([[t, lp] for t, lp in ev.top])
    return row


def parse_events(rows) -> list[TokenEvent]:
    return [TokenEvent(token_id=int(t[0]), logprob=float(t[1]), version=int(t[2]), finish_reason=t[3],
                       top=[(int(a), float(b)) for a, b in t[4]] if len(t) > 4 and t[4] is not None else None) for t in rows]


def add_mux_route(app: web.Application, engine: RolloutEngine, sampling_from_json) -> None:
    sockets: "weakref.WeakSet[web.WebSocketResponse]" = weakref.WeakSet()

    async def close_all(app: web.Application) -> None:  # server stopping: end every connection
        for ws in list(sockets):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"engine server shutdown")

    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=0, compress=False, autoping=True)
        await ws.prepare(request)
        sockets.add(ws)
        out: list[str] = []
        wake = asyncio.Event()
        tasks: dict[str, asyncio.Task] = {}
        flows: dict[str, _Flow] = {}
        parts: dict[str, list[np.ndarray]] = {}  # rid -> the prompt's ids sent ahead in `part` frames

        def push(line: str) -> None:
            out.append(line)
            wake.set()

        async def flusher() -> None:
            while not ws.closed:
                await wake.wait()
                wake.clear()
                if out:
                    data = "".join(out)
                    out.clear()
                    await ws.send_str(data)

        async def run(rid: str, ids: list[int] | np.ndarray, sp: SamplingParams, flow: _Flow) -> None:
            if isinstance(ids, np.ndarray):
                ids = await _ids_list(ids)
            if flow.stopped:  # aborted before it started
                tasks.pop(rid, None)
                flows.pop(rid, None)
                return
            box = [ids] if len(ids) > PART_IDS else None  # a long prompt is freed off the loop when done
            stream = engine.generate(rid, ids, sp)
            del ids
            held: list[str] = []  # tokens kept back (`SamplingParams.hold_s`), sent by `release`
            timer: asyncio.TimerHandle | None = None

            def release() -> None:
                nonlocal timer
                if timer is not None:
                    timer.cancel()
                    timer = None
                if held:
                    push("".join(held))
                    held.clear()

            try:
                first, finished = True, False
                async for ev in stream:
                    finished = bool(ev.finish_reason)
                    text = event_text(ev)
                    held.append(f"t {rid} {text}\n")
                    if first or sp.hold_s <= 0 or ev.finish_reason:  # the first at once: TTFT stays exact
                        release()
                    elif timer is None:
                        timer = asyncio.get_running_loop().call_later(sp.hold_s, release)
                    first = False
                    flow.unacked += len(text)
                    if flow.window and flow.unacked >= flow.window:  # the reader is a window behind: wait for it
                        release()  # held tokens count against the window: the client must have them to credit them
                        await flow.room()
                    if flow.stopped:  # aborted: not one more token from the engine
                        break
                release()
                if finished or flow.stopped:
                    push(f"e {rid}\n")
                else:  # the engine ended it unfinished (it is stopping: its rank is going): a death to the router
                    push(f"x {rid} ConnectionError: engine {engine.name} ended {rid} unfinished (stopping)\n")
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.warning("engine %s: generate %s failed: %r", engine.name, rid, e)
                release()
                push(f"x {rid} {type(e).__name__}: {e}".replace("\n", " ") + "\n")
            finally:
                if timer is not None:
                    timer.cancel()
                tasks.pop(rid, None)
                flows.pop(rid, None)
                await stream.aclose()
                if box:
                    asyncio.get_running_loop().run_in_executor(None, free_ids, box)

        async def abort(rid: str, reply: bool) -> None:
            try:
                toks = await engine.abort(rid)
            except Exception as e:  # unknown / finished request: nothing more to return
                logger.debug("engine %s: abort %s: %r", engine.name, rid, e)
                toks = []
            if (flow := flows.get(rid)) is not None:  # after the engine's answer: it returns every token made
                flow.stop()
                if flow.abandoned:  # a stream its client closed has nobody to take its tokens: none are sent back
                    toks = []  # (a router's later abort of a call whose client left: tens of MB of JSON for nothing)
            if reply:
                push(f"a {rid} " + json.dumps([event_row(e) for e in toks]) + "\n")

        flush_task = asyncio.create_task(flusher())
        try:
            async for msg in ws:
                if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                    continue
                d = None
                try:
                    if msg.type == WSMsgType.BINARY:
                        head, _, raw = msg.data.partition(b"\n")
                        d = json.loads(head)
                        if len(raw) % 4:
                            raise ValueError(f"the prompt's {len(raw)} bytes are not whole int32 ids")
                        ids = np.frombuffer(raw, dtype="<i4")
                        if d["op"] == "part":
                            parts.setdefault(str(d["rid"]), []).append(ids)
                            continue
                        if d["op"] == "generate" and str(d["rid"]) in parts:
                            ids = np.concatenate(parts.pop(str(d["rid"])) + [ids])
                    else:
                        d = json.loads(msg.data)
                        ids = [int(t) for t in d["input_ids"]] if d["op"] == "generate" else []
                    rid = str(d["rid"])
                    if d["op"] == "generate":
                        flow = flows[rid] = _Flow(max(0, int(d.get("window") or 0)))
                        tasks[rid] = asyncio.create_task(run(rid, ids, sampling_from_json(d.get("sampling", {})), flow))
                    elif d["op"] == "credit":
                        if (flow := flows.get(rid)) is not None:  # (a stream that has ended needs none)
                            flow.credit(int(d["n"]))
                    elif d["op"] == "abort":
                        parts.pop(rid, None)
                        if d.get("reply", True) is False and (flow := flows.get(rid)) is not None:
                            flow.abandoned = True
                        tasks_abort = asyncio.create_task(abort(rid, d.get("reply", True) is not False))
                        tasks[f"abort:{rid}"] = tasks_abort
                        tasks_abort.add_done_callback(lambda _t, k=f"abort:{rid}": tasks.pop(k, None))
                    else:
                        raise ValueError(f"unknown op {d['op']!r}")
                except (ValueError, KeyError, TypeError) as e:
                    rid = d.get("rid", "?") if isinstance(d, dict) else "?"
                    push(f"x {rid} bad request: {e}".replace("\n", " ") + "\n")
        finally:
            for rid, task in list(tasks.items()):
                if not rid.startswith("abort:"):
                    try:
                        await engine.abort(rid)  # the client is gone: free the engine
                    except Exception:
                        pass
                task.cancel()
            flush_task.cancel()
        return ws

    app.router.add_get("/ws", handler)
    app.on_shutdown.append(close_all)



PART_IDS = 1 << 16  # ids per frame of a long prompt (256 KiB)


async def _ids_bytes(ids: list[int], chunk: int = 1 << 16) -> bytes:
    """`ids` as little-endian int32 bytes (`TokenIds`: as packed off the loop), else converted
    `chunk` ids at a time with the loop let run in between: a 1M-id prompt is ~15 short GIL
    holds, not one long hold that stalls every other call on the loop."""
    if isinstance(ids, TokenIds) or len(ids) <= chunk:
        return int32_ids(ids).tobytes()
    parts = []
    for i in range(0, len(ids), chunk):
        parts.append(np.asarray(ids[i : i + chunk], dtype="<i4").tobytes())
        await asyncio.sleep(0)
    return b"".join(parts)


async def _ids_list(ids: np.ndarray, chunk: int = 1 << 14) -> list[int]:
    """The inverse on the server: a received prompt as Python ints, `chunk` at a time with the
    loop let run in between (other requests' tokens keep flowing while a 1M-id prompt lands)."""
    if len(ids) <= chunk:
        return ids.tolist()
    out: list[int] = []
    for i in range(0, len(ids), chunk):
        out.extend(ids[i : i + chunk].tolist())
        await asyncio.sleep(0)
    return out

class MuxClient:
    """The client end: one websocket, a reader task, a queue per open stream. `window`: each
    stream's flow-control window in bytes (module docstring; 0: none); `buffered[rid]`: the
    bytes of token lines received for a stream and not yet handed to its reader."""

    def __init__(self, ws, name: str, window: int | None = None) -> None:
        self.ws = ws
        self.name = name
        self.window = WINDOW_BYTES if window is None else window
        self.queues: dict[str, asyncio.Queue] = {}
        self.buffered: dict[str, int] = {}
        self.aborts: dict[str, list[asyncio.Future]] = {}
        self.closed = False
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        error: BaseException = ConnectionError(f"engine {self.name}: connection closed")
        try:
            async for msg in self.ws:
                if msg.type != WSMsgType.TEXT:
                    if msg.type == WSMsgType.ERROR:
                        error = ConnectionError(f"engine {self.name}: {self.ws.exception()!r}")
                    continue
                batch: dict[str, list] = {}
                size: dict[str, int] = {}
                for line in msg.data.split("\n"):
                    if not line:
                        continue
                    kind, rid, rest = (line.split(" ", 2) + [""])[:3]
                    if kind == "t":  # parsed by the stream's reader, at its pace: a frame can hold thousands
                        batch.setdefault(rid, []).append(rest)
                        size[rid] = size.get(rid, 0) + len(rest)
                    elif kind == "e":
                        batch.setdefault(rid, []).append(_END)
                    elif kind == "x":
                        cls = (ValueError if rest.startswith("ValueError:") else
                               ConnectionError if rest.startswith("ConnectionError:") else RuntimeError)
                        batch.setdefault(rid, []).append(cls(f"engine {self.name}: {rest}"))
                    elif kind == "a":
                        for fut in self.aborts.pop(rid, []):
                            if not fut.done():
                                fut.set_result(parse_events(json.loads(rest)))
                for rid, items in batch.items():
                    q = self.queues.get(rid)
                    if q is not None:
                        q.put_nowait(items)
                        self.buffered[rid] += size.get(rid, 0)
        except Exception as e:  # the connection broke
            error = ConnectionError(f"engine {self.name}: {e!r}")
        finally:
            self.closed = True
            for q in self.queues.values():
                q.put_nowait([error])
            for futs in self.aborts.values():
                for fut in futs:
                    if not fut.done():
                        fut.set_exception(error)
            self.aborts.clear()

    async def generate(self, rid: str, input_ids: list[int], sampling: SamplingParams) -> AsyncIterator[TokenEvent]:
        if any(c.isspace() for c in rid):
            raise ValueError(f"request id {rid!r} must not contain whitespace")
        if rid in self.queues:
            raise ValueError(f"engine {self.name}: duplicate request id {rid!r}")
        q: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = q
        self.buffered[rid] = 0
        ended = False
        owed, half = 0, self.window // 2  # bytes handed on and not yet credited; credit each half window
        try:
            op = {"op": "generate", "rid": rid, "sampling": sampling_to_json(sampling)}
            if self.window:
                op["window"] = self.window
            head = json.dumps(op).encode()
            raw, step = await _ids_bytes(input_ids), 4 * PART_IDS
            if len(raw) > step:
                part = json.dumps({"op": "part", "rid": rid}).encode() + b"\n"
                view = memoryview(raw)
                for i in range(0, len(raw) - step, step):
                    await self.ws.send_bytes(part + view[i : i + step])
                    await asyncio.sleep(0)
                raw = raw[i + step :]
            await self.ws.send_bytes(head + b"\n" + raw)
            while True:
                items = await q.get()
                for i, item in enumerate(items):
                    if isinstance(item, str):
                        ev = parse_event(item.split())
                        ev.more = i + 1 < len(items) and isinstance(items[i + 1], str)  # a held stream's frame: the rest are here too
                        self.buffered[rid] -= len(item)
                        owed += len(item)
                        if half and owed >= half and not self.closed:
                            try:
                                await self.ws.send_str(f'{{"op": "credit", "rid": {json.dumps(rid)}, "n": {owed}}}')
                            except ConnectionError:  # the connection broke: the reader ends the stream
                                pass
                            owed = 0
                        yield ev
                        continue
                    ended = True
                    if isinstance(item, BaseException):
                        raise item
                    return
        finally:
            self.queues.pop(rid, None)
            self.buffered.pop(rid, None)
            if not ended and not self.closed:  # the caller stopped reading: stop the engine too (no answer wanted)
                try:
                    await self.ws.send_str(json.dumps({"op": "abort", "rid": rid, "reply": False}))
                except Exception:
                    pass

    async def abort(self, rid: str) -> list[TokenEvent]:
        if self.closed:
            raise ConnectionError(f"engine {self.name}: connection closed")
        fut = asyncio.get_running_loop().create_future()
        self.aborts.setdefault(rid, []).append(fut)
        await self.ws.send_str(json.dumps({"op": "abort", "rid": rid}))
        return await fut

    async def close(self) -> None:
        await self.ws.close()
        self.reader.cancel()
