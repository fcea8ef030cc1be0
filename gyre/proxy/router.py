"""Routing of model calls to rollout engines, and rerouting in-flight calls on drain (docs/design.md §3).
(Over 600 lines: selection, drain, failure backoff, gray-failure timeouts and migration share one call loop.)

Selection: least-loaded among engines in rollout (the router's own count of in-flight calls), with
prefix affinity per execution: stay on the engine that holds its KV unless it is `affinity_slack`
calls busier than the least loaded.

Drain: `await router.drain(name)` stops new calls going to the engine, aborts each in-flight call
there (`abort` returns every token generated so far) and continues it on a retained engine —
standalone pool first, then cells by descending index — from input + tokens generated, with
`max_tokens` reduced. The caller of `Router.generate` sees one stream of `TokenEvent`s. A failed
engine, or a frozen one (no token for `progress_timeout_s`: marked *stalled* until a health check
answers), is treated the same way after a backoff; a call whose engines fail `max_failures` times
in a row without a token gives up (`NoEngineError`); a dead one (its connection gone) is kept out
without a backoff until it answers or a restart takes its name (gyre/proxy/failover.py). With a
`MigrationPolicy` a call is paused with `migrate_out` instead of aborted and its KV moves
(`gyre.backends.transfer.migration`); any failure falls back to recompute, never an abort. Every reroute is a `RerouteRecord` in
`reroute_log` (in full: docs/design.md §3; docs/backends.md, "KV migration on reroute").

Engine slot lifecycle (`SlotState`):
    ACTIVE   --drain()-->   DRAINING  (no new calls; in-flight calls being moved)
    DRAINING --(empty)-->   DRAINED
    DRAINING|DRAINED --resume()--> ACTIVE
    DRAINED  --remove_engine()--> (gone)      ACTIVE/DRAINING are drained first
Any other transition raises.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Literal

from gyre.backends.transfer.migration_policy import MigrationPolicy
from gyre.backends.protocols import RolloutEngine, SamplingParams, TokenEvent, can_migrate
from gyre.proxy.failover import Failover

logger = logging.getLogger(__name__)

EngineKind = Literal["pool", "cell"]


class SlotState(enum.Enum):
    ACTIVE = "active"
    DRAINING = "draining"
    DRAINED = "drained"


_TRANSITIONS = {
    (SlotState.ACTIVE, SlotState.DRAINING),
    (SlotState.DRAINING, SlotState.DRAINED),
    (SlotState.DRAINING, SlotState.ACTIVE),
    (SlotState.DRAINED, SlotState.ACTIVE),
}


class NoEngineError(RuntimeError):
    """No engine in rollout within the wait limit."""


class EngineStalled(RuntimeError):
    """The engine sent no token for the progress limit (a frozen rank)."""


@dataclass(eq=False)
class _Progress:
    """The progress limit of one engine stream: one timer per limit period, not one per token.

    (`asyncio.wait_for` around each token made a task and a timer per token, ~20 µs: five times
    the rest of routing a token, and the proxy's event loop routes every token of the run;
    benchmarks/scale_bench.py.) While the consumer waits for a token, `waiting` is set and the
    wait's start kept; the timer, when it fires, cancels the consumer task if that wait is older
    than the limit and otherwise re-arms for the current wait's deadline. The cancel lands in the
    awaited `anext`, the only place the task can be suspended while `waiting` is set."""

    __slots__ = ("loop", "limit", "task", "since", "waiting", "fired", "handle")

    def __init__(self, limit: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.limit = limit
        self.task: asyncio.Task | None = None
        self.since = self.loop.time()
        self.waiting = self.fired = False
        self.handle = self.loop.call_at(self.since + limit, self._check)

    def _check(self) -> None:
        now = self.loop.time()
        if self.waiting and now - self.since >= self.limit and self.task is not None:
            self.fired = True
            self.task.cancel()
        else:
            self.handle = self.loop.call_at((self.since if self.waiting else now) + self.limit, self._check)

    def close(self) -> None:
        self.handle.cancel()


@dataclass
class _Running:
    """One engine request of a routed call (a call has one per engine it ran on)."""

    request_id: str
    drained: bool = False
    abort_result: asyncio.Future | None = None
    tokens: int = 0  # prompt + tokens generated so far (what a recompute would prefill)
    handle: dict | None = None  # set when drain paused it with migrate_out (the source holds its KV)
    paused_at: float = 0.0
    fallback: str | None = None  # why a migrate_out that was tried did not happen


@dataclass
class RerouteRecord:
    """One reroute of one call: how it continued and what that cost."""

    call_key: str
    source: str
    target: str
    mode: Literal["migrate", "recompute"]
    tokens_recomputed: int  # tokens the target prefilled again (0 for a migrated call)
    bytes_moved: int  # KV bytes pulled by the target
    latency_s: float  # from the pause on the source to the first token on the target (-1: none came)
    fallback: str | None = None  # why a migration that was tried fell back to recompute


@dataclass
class _Handoff:
    """A paused call's way back in: the source slot holding its KV (if migrated out), when it paused."""

    source: EngineSlot
    handle: dict | None
    paused_at: float
    fallback: str | None = None


@dataclass
class _CallMigration:
    """A routed call's pending handover: set when its engine paused it, cleared at its next
    engine's first token (then recorded as a `RerouteRecord`)."""

    handoff: _Handoff | None = None
    record: RerouteRecord | None = None


@dataclass(eq=False)
class EngineSlot:
    engine: RolloutEngine
    name: str
    kind: EngineKind
    index: int
    state: SlotState = SlotState.ACTIVE
    inflight: dict[str, _Running] = field(default_factory=dict)
    served: int = 0
    failed_at: float = float("-inf")  # loop time of the engine's last failure (see the cooldown)
    stalled: bool = False  # sent no token for the progress limit; no new calls until a health check answers
    dead: bool = False  # its connection failed (gyre/proxy/failover.py); no new calls until it answers

    def set_state(self, new: SlotState) -> None:
        if (self.state, new) not in _TRANSITIONS:
            raise RuntimeError(f"engine {self.name}: illegal transition {self.state.value} -> {new.value}")
        self.state = new

    @property
    def load(self) -> int:
        return len(self.inflight)


@dataclass
class RouteInfo:
    """Filled in while a call runs: the engines it ran on, in order, and its reroute count."""

    engines: list[str] = field(default_factory=list)
    reroutes: int = 0


def call_finished(events: list[TokenEvent], sampling: SamplingParams, eos_ids: frozenset[int]) -> bool:
    """Did the generation end on its own terms (stop token, stop sequence, max_tokens)?"""
    if len(events) >= sampling.max_tokens:
        return True
    if not events:
        return False
    if events[-1].finish_reason is not None:
        return True
    if events[-1].token_id in eos_ids or events[-1].token_id in sampling.stop_token_ids:
        return True
    for seq in sampling.stop_sequences:
        n = len(seq)
        if n and len(events) >= n and [e.token_id for e in events[-n:]] == list(seq):
            return True
    return False


class Router:
    def __init__(self, *, affinity_slack: int = 2, max_reroutes: int = 16, engine_wait_s: float = 600.0,
                 failure_backoff_s: float = 0.05, failure_cooldown_s: float = 5.0, max_failures: int = 3,
                 progress_timeout_s: float = 0.0, health_interval_s: float = 5.0,
                 migration: MigrationPolicy | None = None, migrate_timeout_s: float = 60.0) -> None:
        self.affinity_slack = affinity_slack
        self.max_reroutes = max_reroutes
        self.engine_wait_s = engine_wait_s
        self.failure_backoff_s = failure_backoff_s
        self.failure_cooldown_s = failure_cooldown_s
        self.max_failures = max_failures
        self.progress_timeout_s = progress_timeout_s  # 0: no limit
        self.health_interval_s = health_interval_s
        self.slots: dict[str, EngineSlot] = {}
        self._affinity: dict[str, str] = {}
        self._changed: asyncio.Event | None = None  # set (and replaced) when the engine set changes
        self._background: set[asyncio.Task] = set()
        self.reroutes = 0
        self.engine_failures = 0
        self.stalls = 0  # calls moved off an engine that sent no token for progress_timeout_s
        self.closed = False
        self.failover = Failover(self)
        self.migration = migration or MigrationPolicy(mode="off")
        self.migrate_timeout_s = migrate_timeout_s
        self.reroute_log: list[RerouteRecord] = []
        self._engine_info: dict[str, dict] = {}  # engine name → its migration_info() (asked once)
        self._totals: dict[str, float] = {}  # sums over reroute_log, never trimmed
        self._logged_total = 0  # records ever appended to reroute_log
        self._taken = 0  # of which take_reroutes() has handed out

    async def close(self) -> None:
        """The run is over: calls waiting for a rollout engine (and any new ones) fail now with
        `NoEngineError` instead of waiting out `engine_wait_s`, so the server can stop."""
        self.closed = True
        await self._notify()

    # ---- engine set -------------------------------------------------------------------------
    def _change(self) -> asyncio.Event:
        """The event the next change of the engine set sets. An event, not a Condition: a waiter
        cancelled twice (its execution closed, then its client gone) while `wait_for` cancelled its
        `Condition.wait` could leave the condition's lock held for good, and every later notify,
        the proxy's close with them, waited on it forever (an end-of-run hang in e2e_modes)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    async def _notify(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    def add_engine(self, engine: RolloutEngine, *, kind: EngineKind = "cell", index: int = 0) -> EngineSlot:
        if kind not in ("pool", "cell"):
            raise ValueError(f"add_engine: kind must be 'pool' or 'cell', got {kind!r}")
        if (old := self.slots.get(engine.name)) is not None:  # a restart: it takes the old one's place
            self.failover.retire(old, kind, index)
            self._engine_info.pop(engine.name, None)
        slot = EngineSlot(engine=engine, name=engine.name, kind=kind, index=index)
        self.slots[engine.name] = slot
        self._wake()
        return slot

    def _wake(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._spawn(loop, self._notify())

    def _spawn(self, loop: asyncio.AbstractEventLoop, coro) -> None:
        task = loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def remove_engine(self, name: str) -> int:
        """Drain (if needed) and forget an engine. Returns the number of calls rerouted."""
        slot = self._slot(name)
        moved = 0
        if slot.state is not SlotState.DRAINED:
            moved = await self.drain(name)
        del self.slots[name]
        return moved

    def resume(self, name: str) -> None:
        """Back to rollout (the cell left TRAIN)."""
        self._slot(name).set_state(SlotState.ACTIVE)
        self._wake()

    def _slot(self, name: str) -> EngineSlot:
        try:
            return self.slots[name]
        except KeyError:
            raise KeyError(f"router: no engine named {name!r} (have {sorted(self.slots)})") from None

    async def drain(self, name: str) -> int:
        """Take `name` out of rollout; move its in-flight calls to retained engines. Returns how
        many calls were moved, once no call is running on it (or `resume` cancelled the drain)."""
        slot = self._slot(name)
        if slot.state is SlotState.ACTIVE:
            slot.set_state(SlotState.DRAINING)
        moved = 0
        loop = asyncio.get_running_loop()
        while slot.inflight and slot.state is SlotState.DRAINING:  # resume() cancels a drain
            batch = [r for r in slot.inflight.values() if not r.drained]
            for running in batch:
                running.drained = True
                running.abort_result = loop.create_future()
            moved += len(batch)
            results = await asyncio.gather(*(self._pause(slot, r) for r in batch), return_exceptions=True)
            for running, result in zip(batch, results):
                if isinstance(result, BaseException):  # going away anyway: continue from what was seen
                    logger.warning("router: abort of %s on %s failed: %r", running.request_id, name, result)
                    result = None
                if not running.abort_result.done():
                    running.abort_result.set_result(result)
            await asyncio.sleep(0)
            if slot.inflight:
                await asyncio.sleep(0.001)
        if slot.state is SlotState.DRAINING:
            slot.set_state(SlotState.DRAINED)
        logger.info("router: drained %s, %d in-flight calls moved", name, moved)
        return moved

    async def _pause(self, slot: EngineSlot, running: _Running) -> list[TokenEvent]:
        """Stop one drained call on `slot`: by `migrate_out` where migration pays (the source then
        holds its KV), else by `abort`. Returns every event it generated."""
        running.paused_at = asyncio.get_running_loop().time()
        if await self._migration_pays(slot, running):
            try:
                events, running.handle = await asyncio.wait_for(slot.engine.migrate_out(running.request_id),
                                                                self.migrate_timeout_s)
                if running.handle is None:
                    running.fallback = "source: stopped the request but could not hold its state"
                return events
            except Exception as e:  # refused (nothing cached yet), gone, or timed out: recompute instead
                logger.info("router: %s on %s not migrated (%r); aborting it", running.request_id, slot.name, e)
                running.fallback = f"source: {type(e).__name__}: {e}"[:200]
        return await slot.engine.abort(running.request_id)

    async def _migration_pays(self, slot: EngineSlot, running: _Running) -> bool:
        if self.migration.mode == "off" or not can_migrate(slot.engine):
            return False
        if not any(s.state is SlotState.ACTIVE and not s.dead and can_migrate(s.engine) for s in self.slots.values()):
            return False  # no retained engine could import it
        info = self._engine_info.get(slot.name)
        if info is None:
            try:
                info = await slot.engine.migration_info()
            except Exception as e:  # asked once: an engine that cannot tell is never migrated from
                logger.warning("router: %s gave no migration info (%r); recomputing its calls", slot.name, e)
                info = {}
            self._engine_info[slot.name] = info
        if not info.get("kv_bytes_per_token"):
            return False
        try:
            return self.migration.pays(running.tokens, int(info["kv_bytes_per_token"]), info.get("prefill_tok_s"))
        except ValueError as e:  # auto with no prefill rate anywhere
            logger.warning("router: %r; recomputing", e)
            return False

    async def _handover(self, handoff: _Handoff, target: EngineSlot, request_id: str) -> int | None:
        """Phase 2 and 3: the target pulls the KV (its return is the ack), then the source releases
        it. Returns the bytes moved, or None (fell back: `handoff.fallback` says why). The source's
        copy is released on every path, but on success only after the ack."""
        moved = None
        try:
            if not can_migrate(target.engine):
                handoff.fallback = f"target {target.name} cannot import"
            else:
                t0 = asyncio.get_running_loop().time()
                moved = await asyncio.wait_for(target.engine.migrate_in(request_id, handoff.handle), self.migrate_timeout_s)
                self.migration.observe(moved, asyncio.get_running_loop().time() - t0)  # the learned bandwidth
        except asyncio.CancelledError:
            raise
        except Exception as e:  # refused, transport error, source gone mid-transfer
            handoff.fallback = f"{type(e).__name__}: {e}"[:200]
            logger.warning("router: migrating %s from %s to %s failed (%s); recomputing", request_id,
                           handoff.source.name, target.name, handoff.fallback)
        finally:
            await self._release(handoff)
        return moved

    async def _release(self, handoff: _Handoff) -> None:
        handle, handoff.handle = handoff.handle, None
        if handle is None:
            return
        try:
            await handoff.source.engine.migrate_release(handle["key"])
        except Exception as e:  # the source is gone: so is what it held
            logger.info("router: release of %s on %s: %r", handle.get("key"), handoff.source.name, e)

    # ---- selection --------------------------------------------------------------------------
    def _pick(self, execution_id: str, rerouting: bool) -> EngineSlot | None:
        active = [s for s in self.slots.values() if s.state is SlotState.ACTIVE and not (s.stalled or s.dead)]
        if not active:
            return None
        if any(s.failed_at > float("-inf") for s in active):  # pass over engines that just failed
            now = asyncio.get_running_loop().time()
            healthy = [s for s in active if now - s.failed_at >= self.failure_cooldown_s]
            active = healthy or active
        if rerouting:
            pool = [s for s in active if s.kind == "pool"]
            if pool:
                return min(pool, key=lambda s: (s.load, s.name))
            return max(active, key=lambda s: (s.index, -s.load, s.name))
        best = min(active, key=lambda s: (s.load, s.served, s.name))
        pinned = self.slots.get(self._affinity.get(execution_id, ""))
        if pinned is not None and pinned.state is SlotState.ACTIVE and pinned.load <= best.load + self.affinity_slack:
            return pinned
        return best

    async def _acquire(self, execution_id: str, rerouting: bool) -> EngineSlot:
        if self.closed:
            raise NoEngineError("the proxy is shutting down")
        slot = self._pick(execution_id, rerouting)
        if slot is not None:
            return slot
        logger.warning("router: no engine in rollout; call of %s waits (up to %.0fs)", execution_id, self.engine_wait_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.engine_wait_s
        while (slot := self._pick(execution_id, rerouting)) is None:
            if self.closed:
                raise NoEngineError("the proxy is shutting down")
            left = deadline - loop.time()
            if left <= 0:
                raise NoEngineError(f"no rollout engine available for {self.engine_wait_s:.0f}s")
            try:  # the event is taken after the pick with no await between: no change is missed
                await asyncio.wait_for(self._change().wait(), timeout=min(left, 1.0))
            except asyncio.TimeoutError:
                pass
        return slot

    def forget(self, execution_id: str) -> None:
        self._affinity.pop(execution_id, None)

    # ---- the routed call --------------------------------------------------------------------
    async def generate(
        self,
        call_key: str,
        execution_id: str,
        input_ids: list[int],
        sampling: SamplingParams,
        info: RouteInfo | None = None,
        eos_ids: frozenset[int] = frozenset(),
    ) -> AsyncIterator[TokenEvent]:
        """Stream the tokens of one call, moving it between engines as needed."""
        info = info if info is not None else RouteInfo()
        call = _CallMigration()
        try:
            async for ev in self._route(call_key, execution_id, input_ids, sampling, info, eos_ids, call):
                yield ev
        finally:
            if call.handoff is not None and call.handoff.handle is not None:  # ended before continuing
                self._spawn(asyncio.get_running_loop(), self._release(call.handoff))

    async def _route(self, call_key: str, execution_id: str, input_ids: list[int], sampling: SamplingParams,
                     info: RouteInfo, eos_ids: frozenset[int], call: "_CallMigration") -> AsyncIterator[TokenEvent]:
        events: list[TokenEvent] = []
        attempt = 0
        failures = 0  # engine failures in a row without a new token
        while True:
            slot = await self._acquire(execution_id, rerouting=attempt > 0)
            self._affinity[execution_id] = slot.name
            # The engine's id: the call key (names the execution in engine logs) plus 96 random bits,
            # so an engine request cannot be aborted by one who knows only the execution id.
            running = _Running(request_id=f"{call_key}.{attempt}.{secrets.token_hex(12)}")
            slot.inflight[running.request_id] = running
            slot.served += 1
            info.engines.append(slot.name)
            consumed = 0
            failed = dead = done = False
            sp = replace(sampling, max_tokens=sampling.max_tokens - len(events),
                         min_tokens=max(0, sampling.min_tokens - len(events)))
            prompt = input_ids + [e.token_id for e in events] if events else input_ids
            running.tokens = len(prompt)
            if call.handoff is not None:
                await self._continue(call, slot, running.request_id, call_key, len(prompt))
            progress = _Progress(self.progress_timeout_s) if self.progress_timeout_s else None
            try:
                stream = slot.engine.generate(running.request_id, prompt, sp)
                try:
                    finished = False
                    while True:
                        try:
                            ev = await self._next_token(stream, slot, call_key, len(events), progress)
                        except StopAsyncIteration:
                            done = True
                            break
                        if finished:
                            break  # the engine went past the end of the call: stop it (below)
                        events.append(ev)
                        consumed += 1
                        running.tokens += 1
                        if call.record is not None:  # the continuation's first token: the reroute is done
                            self._log_reroute(call, asyncio.get_running_loop().time())
                        yield ev
                        # Keep reading to the stream's own end rather than breaking here: an HTTP
                        # engine's connection can then be reused instead of being torn down.
                        finished = call_finished(events, sampling, eos_ids)
                finally:
                    if not done and not running.drained and not slot.dead:
                        # The consumer went away (client disconnect, stop string): free the engine.
                        self._spawn(asyncio.get_running_loop(), self._quiet_abort(slot, running.request_id))
                    await stream.aclose()
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except ValueError:
                raise  # the engine rejected the request itself: another engine would too
            except Exception as e:
                failed = True
                dead = self.failover.failed(slot, call_key, len(events), e)  # dead: no backoff, kept out
            finally:
                slot.inflight.pop(running.request_id, None)
                if progress is not None:
                    progress.close()
            if call.record is not None:  # this engine ended before its first token: the reroute led nowhere
                self._log_reroute(call, None)
            if running.drained and running.abort_result is not None:
                result = await running.abort_result
                if result is not None:
                    for ev in result[consumed:]:
                        if call_finished(events, sampling, eos_ids):
                            break
                        events.append(ev)
                        yield ev
                if running.handle is not None:  # paused by migrate_out: the source holds its KV for us
                    call.handoff = _Handoff(source=slot, handle=running.handle, paused_at=running.paused_at)
            if call_finished(events, sampling, eos_ids):
                return
            if not running.drained and not failed:
                return  # the engine ended the request on its own terms
            if failed and not dead:  # a dead one is kept out until it answers or is replaced (max_reroutes bounds it)
                failures = failures + 1 if consumed == 0 else 1
                if failures >= self.max_failures:
                    raise NoEngineError(f"call {call_key}: engines failed {failures} times in a row, giving up")
                await asyncio.sleep(min(self.failure_backoff_s * 2 ** (failures - 1), 2.0))
            if call.handoff is None:  # recompute: aborted on drain, or the engine failed
                call.handoff = _Handoff(source=slot, handle=None, fallback=running.fallback,
                                        paused_at=running.paused_at or asyncio.get_running_loop().time())
            attempt += 1
            info.reroutes += 1
            self.reroutes += 1
            if attempt > self.max_reroutes:
                raise NoEngineError(f"call {call_key}: rerouted {attempt} times, giving up")
            logger.info("router: call %s continues after %d tokens (attempt %d)", call_key, len(events), attempt)

    # ---- gray failures ----------------------------------------------------------------------
    async def _next_token(self, stream: AsyncIterator[TokenEvent], slot: EngineSlot, call_key: str,
                          have: int, progress: _Progress | None = None) -> TokenEvent:
        """The stream's next event within the progress limit (`progress`); EngineStalled (and the
        engine marked stalled, a health check started) when none comes."""
        if progress is None:
            return await anext(stream)
        progress.task = asyncio.current_task()
        progress.since = progress.loop.time()
        progress.waiting = True
        try:
            return await anext(stream)
        except asyncio.CancelledError:
            if not progress.fired or progress.task.uncancel() > 0:
                raise  # cancelled from outside (client gone, execution closed): not a stall
            self.stalls += 1
            if not slot.stalled:
                slot.stalled = True
                logger.warning("router: engine %s sent no token for %.1fs (call %s, %d tokens so far): marked "
                               "stalled, its calls continue elsewhere; no new calls until it answers a health check",
                               slot.name, self.progress_timeout_s, call_key, have)
                self._spawn(asyncio.get_running_loop(), self.failover.watch(slot, "stalled"))
            raise EngineStalled(f"engine {slot.name} sent no token for {self.progress_timeout_s:.1f}s") from None
        finally:
            progress.waiting = False

    async def _continue(self, call: _CallMigration, target: EngineSlot, request_id: str, call_key: str, tokens: int) -> None:
        """Before a paused call's next engine request: migrate its KV there if its source holds it;
        open the reroute's record (closed at the first token, `_log_reroute`)."""
        handoff = call.handoff
        moved = await self._handover(handoff, target, request_id) if handoff.handle is not None else None
        call.record = RerouteRecord(call_key=call_key, source=handoff.source.name, target=target.name,
                                    mode="migrate" if moved is not None else "recompute",
                                    tokens_recomputed=0 if moved is not None else tokens, bytes_moved=moved or 0,
                                    latency_s=-1.0, fallback=handoff.fallback)

    def _log_reroute(self, call: _CallMigration, now: float | None) -> None:
        record, handoff = call.record, call.handoff
        if now is not None:
            record.latency_s = now - handoff.paused_at
        self.reroute_log.append(record)
        self._logged_total += 1
        if len(self.reroute_log) > 100_000:  # a long run: keep the newest (the sums in stats() are exact)
            del self.reroute_log[: len(self.reroute_log) - 50_000]
        self._totals[record.mode] = self._totals.get(record.mode, 0) + 1
        for k, v in (("tokens_recomputed", record.tokens_recomputed), ("bytes_moved", record.bytes_moved),
                     ("fallbacks", int(record.fallback is not None))):
            self._totals[k] = self._totals.get(k, 0) + v
        if record.latency_s >= 0:
            self._totals[f"{record.mode}_latency_s"] = self._totals.get(f"{record.mode}_latency_s", 0.0) + record.latency_s
        call.record, call.handoff = None, None

    def take_reroutes(self) -> list[RerouteRecord]:
        """The reroutes recorded since the previous call (one metrics row's worth)."""
        start = max(0, len(self.reroute_log) - (self._logged_total - self._taken))
        self._taken = self._logged_total
        return self.reroute_log[start:]

    def migration_stats(self) -> dict:
        """Totals over every reroute so far: counts by mode, fallbacks, tokens recomputed, KV bytes
        moved, mean latency by mode (seconds, pause to first token on the target)."""
        t = self._totals
        out = {"mode": self.migration.mode, "migrated": t.get("migrate", 0), "recomputed": t.get("recompute", 0),
               "fallbacks": t.get("fallbacks", 0), "tokens_recomputed": t.get("tokens_recomputed", 0),
               "bytes_moved": t.get("bytes_moved", 0)}
        for mode, name in (("migrate", "migrated"), ("recompute", "recomputed")):
            n = t.get(mode, 0)
            out[f"{name}_latency_s_mean"] = t.get(f"{mode}_latency_s", 0.0) / n if n else None
        return out

    async def _quiet_abort(self, slot: EngineSlot, request_id: str) -> None:
        try:
            await slot.engine.abort(request_id)
        except Exception as e:  # best effort
            logger.debug("router: abort of %s on %s: %r", request_id, slot.name, e)

    def stats(self) -> dict:
        return {
            "reroutes": self.reroutes,
            "engine_failures": self.engine_failures,
            "engine_stalls": self.stalls, "engine_deaths": self.failover.deaths,
            "dead_engine_calls": self.failover.dead_engine_calls,
            "migration": self.migration_stats(),
            "engines": {
                n: {"kind": s.kind, "index": s.index, "state": s.state.value, "inflight": s.load, "served": s.served,
                    "stalled": s.stalled, "dead": s.dead}
                for n, s in self.slots.items()
            },
        }
