"""Streaming that neither stalls the other executions nor waits forever on a client.

A fast engine can deliver thousands of tokens at once, each with up to 20 alternatives. So a
call hands the event loop back every `frame_tokens` tokens and closes a stream frame there
(`Call.events`), and a frame carries the log-probs of at most that many tokens (`lp_due`). Every
frame an adapter writes goes through `PacedResponse`: the execution is charged for what the
frame holds, counted as the body admission counts (`value_count`, `body_values_per_call`), and
a client that has taken none of its stream for `client_stall_s` (the proxy's send buffer full)
has its call ended: the engine request is aborted, the record says `abort`, the connection is
dropped. Unsent bytes per call stay within the transport's high-water mark plus one frame.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Callable

from aiohttp import web

from gyre.proxy.admission import value_count

if TYPE_CHECKING:
    from gyre.proxy.core import Call

FRAME_ENTRIES = 256  # log-prob entries (a token and each of its alternatives) one frame may carry


def frame_tokens(top_logprobs: int, logprobs: bool) -> int:
    """Tokens per frame, and between turns given to the event loop."""
    return max(1, FRAME_ENTRIES // (1 + top_logprobs)) if logprobs else FRAME_ENTRIES


def lp_due(call: "Call", seen: int) -> int:
    """Where the next frame's log-probs end, from `seen` (at most `frame_tokens` further)."""
    return min(len(call.tokens), seen + frame_tokens(call.req.top_logprobs, call.req.logprobs))


class ClientStalled(ConnectionResetError):
    """The client took none of its stream for `client_stall_s`; the call was aborted (as
    `core.ClientGone`)."""


class PacedResponse(web.StreamResponse):
    """An SSE response whose `write` gives the loop a turn, charges the frame to `charge(units)`
    and ends the call (`ClientStalled`) when the client has not made room for it in `stall_s`."""

    def __init__(self, stall_s: float, charge: Callable[[float], None], per_unit: int) -> None:
        super().__init__(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        self.stall_s, self.charge, self.per_unit = stall_s, charge, per_unit

    async def write(self, data) -> None:
        if self.per_unit:
            self.charge(value_count(data) / self.per_unit)
        try:
            async with asyncio.timeout(self.stall_s or None):
                await super().write(data)
        except TimeoutError:
            if self._req is not None and self._req.transport is not None:
                self._req.transport.abort()  # its unsent bytes go with it
            raise ClientStalled(f"the client read none of its stream for {self.stall_s:g} s (proxy.client_stall_s); "
                                "call aborted") from None
        await asyncio.sleep(0)


async def sse_start(request: web.Request, call: "Call") -> PacedResponse:
    p = call.proxy
    resp = PacedResponse(p.config.client_stall_s, lambda units: p.admission.charge(call.state.execution_id, units),
                         p.config.body_values_per_call)
    await resp.prepare(request)
    return resp
