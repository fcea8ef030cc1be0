"""What the client is told when a call does not end normally (docs/proxy_harnesses.md).

Every adapter reads a call's events through `told(call)`, which turns the two endings a client
must not take for a complete answer into an `ApiError` the adapter sends in its API's own shape
(a JSON error body before the stream started; an `error` event / error chunk after):

- the engine ended the call early (its stream stopped without a finish reason, or it said
  `error`): the record says `error`; the client gets HTTP 500 / an error event, never
  `stop` / `end_turn` with a truncated answer;
- the execution was closed while the call ran (`Proxy.close_execution` / `aclose_execution`: the
  harness's time is up or the run is ending): the call is aborted (recorded `abort` by
  `aclose_execution`, not recorded by `close_execution`, as before) and the client gets an error
  body or event instead of a cut connection.

A client that went away gets nothing (there is no one to tell): that stays `ClientGone`.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Any, AsyncIterator

from gyre.proxy.errors import ApiError


def _early(call: Any) -> ApiError:
    return ApiError(500, "internal", f"the model's engine ended this call early after {len(call.tokens)} tokens "
                    "(recorded as finish_reason 'error'); the partial answer is not complete, retry the call")


def _closed() -> ApiError:
    return ApiError(500, "internal", "this execution was closed while the call ran (its time is up or the run is ending); "
                    "the call was aborted")


def closed_by_close(call: Any) -> ApiError | None:
    """In an `except CancelledError`: when it is the close's own cancellation, uncancel it and
    return the error the client is told instead; None for any other cancellation (re-raise it)."""
    task = asyncio.current_task()
    if (call.state.closed or call.state.closing) and task is not None and task.cancelling() == 1:
        task.uncancel()
        return _closed()
    return None


async def told(call: Any) -> AsyncIterator:
    """`call.events()`, raising `ApiError` for an early engine end or a closed execution (a
    cancellation that lands in a frame's write instead: `gyre.proxy.pacing.PacedResponse`)."""
    try:
        async with aclosing(call.events()) as events:
            async for item in events:
                yield item
    except asyncio.CancelledError:
        if (err := closed_by_close(call)) is not None:
            raise err from None
        raise
    if call.finish == "error":
        raise _early(call)
