"""The runtime's adapter between the harness runner and Gyre's own proxy, and the data plane's
start on rank 0 (docs/design.md §1, §5): `serve_data_plane` is its one build (the proxy over the
run's TITO store, its server, the harness runner with a `GyreProxyAccess`), used in rank 0 and in
the plane's own process (`gyre.runtime.execution_plane`); `start_data_plane` adds every cell's and
pool engine's server to the router once the rank announced it.

`GyreProxyAccess` is the runner's `ProxyAccess` (`gyre.executions.runner`): keys come from
`Proxy.issue_key` and are revoked (the execution's store file closed) by `Proxy.close_execution`
when the harness ends. The `CallStats` closing returns go to their owners: the execution's calls
and unwritten records to its `ExecutionRecord` in the run's ledger (the health check and the
TITO completeness check read them there), and the integer counts summed into `totals` (the
summary's proxy totals, the step rows' unmatched turns). Without a ledger nothing is kept per
execution: `calls_made` is None (unknown), as with the runner's `LocalKeys`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

from gyre.backends.engines.engine_http import HttpEngine
from gyre.backends.config import ModelConfig
from gyre.executions.config import ExecutionsConfig
from gyre.executions.evaluator import Evaluator
from gyre.executions.runner import HarnessRunner
from gyre.proxy import Proxy, StoreSink, start_proxy
from gyre.proxy.config import ProxyConfig
from gyre.proxy.state import CallStats
from gyre.runtime.writes import WatchedSink

if TYPE_CHECKING:  # the ledger imports the trajectory code, and so torch: the execution plane needs neither
    from gyre.runtime.ledger import RunLedger

logger = logging.getLogger(__name__)


class GyreProxyAccess:
    """`ProxyAccess` over `proxy` (a `gyre.proxy.Proxy`) served at `url`, writing to `ledger`."""

    def __init__(self, proxy: Any, url: str, ledger: RunLedger | None = None) -> None:
        self.proxy = proxy
        self.url = url.rstrip("/")
        self.ledger = ledger
        self.totals: dict[str, int] = defaultdict(int)
        self._unmatched_seen = 0  # unmatched turns already reported in a step row

    @property
    def context_tokens(self) -> int | None:
        """The proxy's context limit (`--proxy.max-context-tokens`), given to harnesses as GYRE_MAX_CONTEXT_TOKENS."""
        return getattr(getattr(self.proxy, "config", None), "max_context_tokens", None)

    def open_execution(self, execution_id: str, group_id: str) -> str:
        return self.proxy.issue_key(execution_id)

    def close_execution(self, execution_id: str) -> None:
        stats: CallStats = self.proxy.close_execution(execution_id)
        if self.ledger is not None:
            self.ledger.closed(execution_id, stats.calls, stats.sink_errors)
        for k, v in stats.counts().items():
            self.totals[k] += v

    def calls_made(self, execution_id: str) -> int | None:
        """The closed execution's model calls (None: it was not closed here)."""
        return self.ledger.execution(execution_id).calls if self.ledger is not None else None

    def take_unmatched(self) -> int:
        """Unmatched turns of the executions closed since the last call."""
        total = self.totals["unmatched_turns"]
        new, self._unmatched_seen = total - self._unmatched_seen, total
        return new


def engine_ranks(topo: Any) -> list[tuple[str, int, int]]:
    """(kind, index, rank) of every engine the proxy routes to: each cell's and each pool engine's
    server, on its first rank."""
    return [("cell", c, topo.cell_ranks(c)[0]) for c in range(topo.num_cells)] + [
        ("pool", e, topo.pool_engine_ranks(e)[0]) for e in range(topo.num_pool_engines)]


async def engine_url(store: Any, rank: int, timeout: float = 600.0) -> str:
    """The URL `rank` announced for its engine's server (`engine/<rank>` in the store)."""
    key, start = f"engine/{rank}", time.monotonic()
    while not store.check([key]):
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"rank {rank} never announced its engine")
        await asyncio.sleep(0.01)
    return store.get(key).decode()


class DataPlane(Protocol):
    """What the controller and the stop use of the data plane (the proxy, its router and the
    harness runner), wherever it runs: `LocalPlane` in rank 0's own loop, or a client of an
    execution-plane process that outlives the ranks. Getters are cheap (no I/O on the caller's loop)."""

    executions_dir: Path  # <run_dir>/executions: one directory per execution

    def dispatch_group(self, group: Any) -> list[Awaitable[Any]]:
        """Start the group's executions; one awaitable per execution, done when it has ended."""

    survives: bool  # outlives rank 0: an interrupted stop leaves the executions running (`detach`)

    def adopt(self, execution_id: str) -> Awaitable[Any]:
        """An execution an earlier attempt dispatched, still running here: done when it has ended."""

    async def detach(self) -> None:
        """Leave the executions running for the next attempt (only when `survives`)."""

    def in_flight(self) -> list[str]: ...

    async def shutdown(self, evaluate: bool = True, timeout: float | None = None) -> None:
        """Stop every execution (`HarnessRunner.shutdown`)."""

    async def drain(self, engine: str) -> int:
        """Drain `engine` (cellN) in the router: its calls continue elsewhere; how many moved."""

    def resume(self, engine: str) -> None: ...

    def router_stats(self) -> dict: ...

    def reroutes(self) -> int: ...

    def take_reroutes(self) -> list: ...

    def take_unmatched(self) -> int: ...

    def totals(self) -> dict[str, int]: ...

    def worst_unmatched(self, n: int) -> list: ...

    def sink_errors(self) -> int: ...

    async def close(self) -> None:
        """The router's calls ended, then the proxy's server stopped."""


class LocalPlane:
    """The `DataPlane` in rank 0's own loop: the proxy, its server, the access and the runner."""

    def __init__(self, proxy: Any, handle: Any, access: GyreProxyAccess, runner: HarnessRunner) -> None:
        self.proxy, self.handle, self.access, self.runner = proxy, handle, access, runner
        self.executions_dir = runner.run_dir

    def dispatch_group(self, group: Any) -> list[asyncio.Task]:
        return self.runner.dispatch_group(group)

    survives = False  # the harnesses are this process's children

    def adopt(self, execution_id: str) -> Awaitable[Any]:
        raise RuntimeError(f"execution {execution_id}: nothing outlives rank 0 with --executions.plane rank0")

    async def detach(self) -> None:
        raise RuntimeError("--executions.plane rank0: the executions end with rank 0")

    def in_flight(self) -> list[str]:
        return self.runner.in_flight()

    async def shutdown(self, evaluate: bool = True, timeout: float | None = None) -> None:
        await self.runner.shutdown(evaluate=evaluate, timeout=timeout)

    async def drain(self, engine: str) -> int:
        return await self.proxy.router.drain(engine)

    def resume(self, engine: str) -> None:
        self.proxy.router.resume(engine)

    def router_stats(self) -> dict:
        return self.proxy.router.stats()

    def reroutes(self) -> int:
        return self.proxy.router.reroutes

    def take_reroutes(self) -> list:
        return self.proxy.router.take_reroutes()

    def take_unmatched(self) -> int:
        return self.access.take_unmatched()

    def totals(self) -> dict[str, int]:
        return self.access.totals

    def worst_unmatched(self, n: int) -> list:
        return self.proxy.worst_unmatched(n)

    def sink_errors(self) -> int:
        return self.proxy.sink_errors

    async def close(self) -> None:
        try:
            await self.proxy.router.close()
        finally:
            await self.handle.astop()


async def serve_data_plane(checkpoint: str | None, proxy_cfg: ProxyConfig, executions: ExecutionsConfig, run_dir: Path,
                           ledger: Any, tito: Any, on_error: Callable[..., None], on_event: Callable[[Any], None],
                           access_cls: type = GyreProxyAccess) -> tuple:
    """(proxy, its server handle, access, runner), no engine added yet: the one build of the data
    plane, in rank 0 (`start_data_plane`) or in its own process (`gyre.runtime.execution_plane`).
    checkpoint: the run's --model.checkpoint (the proxy's tokenizer, `load_vocab`); ledger: where
    closed executions' calls go (`RunLedger.closed`, or None); on_error: a failed TITO write
    (`gyre.runtime.writes`); on_event: the runner's execution events."""
    from gyre.backends.models.vocab import load_vocab

    vocab = load_vocab(checkpoint, proxy_cfg.tokenizer_path)  # the job's (cached per path)
    proxy = Proxy(proxy_cfg, sink=WatchedSink(StoreSink(tito), tito.path_for, on_error), tokenizer=vocab.tokenizer,
                  stop_ids=vocab.stop_ids)
    handle = await start_proxy(proxy)
    logger.info("proxy listening at %s", handle.url)
    runner_cfg = dataclasses.replace(executions.runner, run_dir=str(run_dir / "executions"))
    access = access_cls(proxy, handle.url, ledger)
    runner = HarnessRunner(runner_cfg, Evaluator(executions.evaluator, runner_cfg), proxy=access,
                           on_event=on_event)
    return proxy, handle, access, runner


async def start_data_plane(model: ModelConfig, proxy_cfg: ProxyConfig, executions: ExecutionsConfig, run_dir: Path,
                           ledger: RunLedger, tito: Any, store: Any, topo: Any, secret: str | None,
                           on_error: Callable[..., None], on_event: Callable[[Any], None]) -> LocalPlane:
    """The data plane in rank 0's loop (`LocalPlane`): `serve_data_plane` with every
    cell's engine and every pool engine (the server on its first rank, `topo`) behind the proxy's
    router."""
    proxy, handle, access, runner = await serve_data_plane(model.checkpoint, proxy_cfg, executions, run_dir, ledger,
                                                           tito, on_error, on_event)
    for kind, index, rank in engine_ranks(topo):
        url = await engine_url(store, rank)
        proxy.router.add_engine(HttpEngine(url, name=f"{kind}{index}", secret=secret), kind=kind, index=index)
    return LocalPlane(proxy, handle, access, runner)
