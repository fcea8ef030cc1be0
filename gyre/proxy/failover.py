"""Dead engines in the router: a rank's engine server that died costs its calls time, not work.

An engine whose connection fails (refused, reset, closed: its process was killed) is marked
*dead*: no new calls go to it, and every call that was running on it continues as a drained call
does, recomputed on a live engine from its prompt and the tokens sampled so far (their log-probs
and versions kept: the call stays one record). With no live engine the call waits in
`Router._acquire`, bounded by `engine_wait_s`. A dead engine is not retried call by call (no
backoff): it is health-checked every `health_interval_s` and routed to again when it answers (a
dropped connection to a live server). Deaths do not count toward `max_failures` (in a restart
every engine dies, some twice); `max_reroutes` bounds a call whose engines keep dying. The restarted rank's engine is added
under the same name (`Router.add_engine`, the admin API's POST /admin/engines): it takes the old
slot's place, the old incarnation retired as dead, and the calls waiting proceed on it.

Other failures (the engine reported an error, a stall) keep the router's backoff and cooldown.
The router is duck-typed here (it imports this module).
"""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)


def is_dead(exc: BaseException) -> bool:
    """Is this failure the engine's connection going away? OSError covers refused, reset, a closed
    websocket (`engine_mux` raises ConnectionError), aiohttp's connect errors and a connect timeout;
    `HttpEngine` turns a body cut short into ConnectionError."""
    return isinstance(exc, OSError)


class Failover:
    """The router's dead engines: marks them, watches them (stalled ones too), retires them on a restart."""

    def __init__(self, router) -> None:
        self.router = router
        self.deaths = 0  # engines marked dead (each incarnation at most once)
        self.dead_engine_calls = 0  # calls running on an engine when it died: each recomputed elsewhere (or waits)

    def failed(self, slot, call_key: str, have: int, exc: BaseException) -> bool:
        """Count one engine failure of a call (after `have` tokens); True when it was a death."""
        r = self.router
        r.engine_failures += 1
        slot.failed_at = asyncio.get_running_loop().time()
        if not is_dead(exc):
            logger.warning("router: engine %s failed on %s after %d tokens: %r", slot.name, call_key, have, exc)
            return False
        self.dead_engine_calls += 1
        self.mark_dead(slot, f"{exc!r} on {call_key} after {have} tokens")
        return True

    def mark_dead(self, slot, why: str) -> None:
        if slot.dead:
            return
        slot.dead = True
        self.deaths += 1
        logger.warning("router: engine %s is dead (%s): its calls continue on live engines, none go to it "
                       "until it answers a health check or is added again", slot.name, why)
        loop = asyncio.get_running_loop()
        self.router._spawn(loop, self.watch(slot, "dead"))

    async def watch(self, slot, flag: str) -> None:
        """Health-check `slot` while its `flag` ("dead", or "stalled": it sent no token for the
        progress limit) is set: route to it again when it answers; stop when it is replaced or the
        router closes."""
        r = self.router
        while getattr(slot, flag) and not r.closed and r.slots.get(slot.name) is slot:
            await asyncio.sleep(r.health_interval_s)
            if r.slots.get(slot.name) is not slot:
                return
            try:
                await asyncio.wait_for(slot.engine.health(), max(r.progress_timeout_s, 1.0))
            except Exception as e:  # noqa: BLE001 - no answer (refused, reset, timeout, 5xx) is the news
                logger.info("router: %s engine %s: health check got no answer (%r)", flag, slot.name, e)
                continue
            setattr(slot, flag, False)
            logger.warning("router: engine %s answers its health check again; routing to it", slot.name)
            await r._notify()

    def retire(self, old, kind: str, index: int) -> None:
        """A second engine under `old`'s name is its restart: check it takes the same place, and
        retire the old incarnation (dead: its calls still running there continue elsewhere once
        their connection fails; none start there)."""
        if (old.kind, old.index) != (kind, index):
            raise ValueError(f"add_engine: {old.name!r} is routed as kind={old.kind!r} index={old.index}; "
                             f"its restart must keep them, got kind={kind!r} index={index}")
        if not old.dead:
            logger.warning("router: engine %s added again while not known dead: taken as its restart", old.name)
            old.dead = True
            self.deaths += 1
        logger.info("router: engine %s re-attached (restart); %d calls were still on the old one", old.name, old.load)
