"""Streaming that neither stalls the other executions nor waits forever on a client.

A fast engine can deliver thousands of tokens at once, each with up to 20 alternatives. So a
call hands the event loop back every `frame_tokens` tokens and closes a stream frame there
(`Call.events`), and a frame carries the log-probs of at most that many tokens (`lp_due`). Log-prob
entries are charged to the execution's rate budget as JSON values, as admission charges a body's
(`charge_entries`, `body_values_per_call`). Every frame an adapter writes goes through
`PacedResponse`, which gives the loop a turn (so does a non-streamed chat answer with log-probs,
written a frame of entries at a time: `openai_api.lp_body_parts`), and a client that has taken none of its stream for
`client_stall_s` (the proxy's send buffer full) has its call ended: the engine request is
aborted, the record says `abort`, the connection is reset. Unsent bytes per call stay within the
transport's high-water mark plus one frame.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

from aiohttp import web

from gyre.proxy.endings import closed_by_close

FRAME_ENTRIES = 256  # log-prob entries (a token and each of its alternatives) one frame may carry
# Turns of the loop given after each frame: another call's reply is a chain of steps (read,
# route, the engine's answer, write), each waiting behind a frame when a frame gives one.
FRAME_TURNS = 16
ENTRY_VALUES = 8  # JSON values in one entry (token, logprob, bytes and its few ints), for the charge


def frame_tokens(top_logprobs: int, logprobs: bool) -> int:
    """Tokens per frame, and between turns given to the event loop."""
    return max(1, FRAME_ENTRIES // (1 + top_logprobs)) if logprobs else FRAME_ENTRIES


def lp_due(call: Any, seen: int) -> int:
    """Where the next frame's log-probs end, from `seen` (at most `frame_tokens` further)."""
    return min(len(call.tokens), seen + frame_tokens(call.req.top_logprobs, call.req.logprobs))


def charge_entries(call: Any, n: int) -> None:
    per = call.proxy.config.body_values_per_call
    if per:
        call.proxy.admission.charge(call.state.execution_id, n * ENTRY_VALUES / per)


class ClientStalled(ConnectionResetError):
    """The client took none of its stream for `client_stall_s`; the call was aborted (as
    `core.ClientGone`). `unsent`: the bytes written and not sent (the proxy's buffer and the
    kernel's send queue) when the connection was reset."""

    def __init__(self, stall_s: float, execution_id: str = "?", call_id: int | str = "?", unsent: int = 0) -> None:
        super().__init__(f"the client read none of its stream for {stall_s:g} s (proxy.client_stall_s); call aborted")
        self.stall_s, self.execution_id, self.call_id, self.unsent = stall_s, execution_id, call_id, unsent


def _unsent(t: Any) -> int:
    """Bytes written to transport `t` and not yet taken by the peer's kernel (Linux: the send queue too)."""
    n = t.get_write_buffer_size()
    try:
        import fcntl
        import termios

        n += struct.unpack("i", fcntl.ioctl(t.get_extra_info("socket").fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (ImportError, AttributeError, OSError):
        pass
    return n


class PacedResponse(web.StreamResponse):
    """An SSE response whose `write` gives the loop a turn and ends the call (`ClientStalled`)
    when the client has not made room for the frame in `stall_s`."""

    def __init__(self, call: Any, content_type: str = "text/event-stream") -> None:
        super().__init__(headers={"Content-Type": content_type, "Cache-Control": "no-cache"})
        self.call, self.stall_s = call, call.proxy.config.client_stall_s

    async def write(self, data) -> None:
        try:
            async with asyncio.timeout(self.stall_s or None):
                await super().write(data)
        except TimeoutError:
            t, unsent = self._req.transport if self._req is not None else None, 0
            if t is not None:  # a reset, not a FIN queued behind unsent bytes: the kernel's buffer goes too
                unsent = _unsent(t)
                t.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                t.abort()
            raise ClientStalled(self.stall_s, self.call.state.execution_id, self.call.call_id, unsent) from None
        try:
            for _ in range(FRAME_TURNS):
                await asyncio.sleep(0)
        except asyncio.CancelledError:  # the execution's close landed here, between two frames
            if (err := closed_by_close(self.call)) is not None:
                raise err from None
            raise


async def sse_start(request: web.Request, call: Any) -> PacedResponse:
    resp = PacedResponse(call)
    await resp.prepare(request)
    return resp
