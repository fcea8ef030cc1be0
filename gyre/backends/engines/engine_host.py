"""A rollout engine served over HTTP from its own thread, driven synchronously by its cell.

The proxy on rank 0 reaches every cell's engine through `gyre.backends.engines.engine_http.HttpEngine`;
the cell's worker thread calls `release()`, `resume()` and `update()` here when the cell
switches roles or a new policy is published. The URL is announced in the store under
`engine/<rank>` so the controller can find it; the engine's secret is not (`share_secret`, and
the module docstring of `engine_http`).

Where it listens (`bind_address`): loopback when every rank is on one host, whatever
`--proxy.host` says (only rank 0's proxy calls engines); across hosts the configured address,
and when that is a wildcard the announced URL names the interface that routes to the rendezvous
host (rank 0), never 0.0.0.0.

An engine process that dies SIGQUITs the rank (SGLang's scheduler, managers/scheduler.py:6373,
and its tokenizer manager's subprocess watchdog, utils/watchdog.py:221); SGLang handles that only
when it starts on the main thread (entrypoints/engine.py:1969-1992, tokenizer_manager.py:2453-2459),
never here. `SigquitWatch` turns it into `EngineDied` on the rank's main thread.
"""

from __future__ import annotations

import base64
import collections
import logging
import secrets
import signal
import threading
from typing import Any

import torch

from gyre.backends.engines.engine_http import serve_engine
from gyre.backends.protocols import RolloutEngine
from gyre.errors import EngineDied
from gyre.serving import is_loopback, route_address

_WILDCARDS = ("", "0.0.0.0", "::")

logger = logging.getLogger(__name__)


def share_secret(group: Any, src: int) -> str:
    """The run's engine secret, drawn on rank `src` and broadcast over `group` (gloo: the job's
    own TCP connections; collective, every rank of the group calls it). Not through the store,
    which any local process can read."""
    import torch.distributed as dist

    buf = torch.zeros(32, dtype=torch.uint8)
    if dist.get_rank() == src:
        buf = torch.frombuffer(bytearray(secrets.token_bytes(32)), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return base64.urlsafe_b64encode(bytes(buf.tolist())).decode().rstrip("=")


def bind_address(host: str, *, single_node: bool, peer: str | None) -> tuple[str, str]:
    """(address to bind, address to announce) for an engine server.

    single_node: loopback, whatever `host` is. Across hosts: a wildcard `host` is bound and the
    interface routing to `peer` (the rendezvous host, where rank 0's proxy runs) announced; a
    loopback `host` (the default) could not be reached from rank 0, so that interface is bound
    instead (narrower than a wildcard); any other address is bound and announced as is.
    """
    if single_node:
        return "127.0.0.1", "127.0.0.1"
    if host in _WILDCARDS or is_loopback(host):
        if not peer:
            raise ValueError(f"engine: cannot find a routable address to announce for --proxy.host {host!r} "
                             "without the rendezvous host (MASTER_ADDR); set --proxy.host to this host's address")
        routed = route_address(peer)
        return (host if host in _WILDCARDS else routed), routed
    return host, host


class _Tail(logging.Handler):
    """The last `n` lines logged by the engine's loggers in this process."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lines: collections.deque[str] = collections.deque(maxlen=n)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string must not hide the rest
            text = str(record.msg)
        first, *rest = text.splitlines() or [""]
        self.lines.append(f"{record.levelname} {record.name}: {first}")
        self.lines.extend(f"    {line}" for line in rest)


class SigquitWatch:
    """SIGQUIT on this rank → `EngineDied` raised on its main thread, once, naming the engine and
    its last log lines (records of the `sglang` and `gyre.backends.engines` loggers here; a
    scheduler's own traceback is logged by its process, to this rank's stderr).

    The main thread is where the rank waits (for an engine call, for its next command); the
    exception ends that wait and the job reports it like any handler's failure (`job.serve`: the
    controller is told and states it once, the rank exits with WorkerFailed). Without it, SIGQUIT's
    default action ended the rank on the spot (a core dump, no diagnosis). More SIGQUITs follow one
    failure (a scheduler per TP rank, the watchdog): logged, not raised again; none while the
    engine is being stopped. `install()` only on the main thread (Python's rule for handlers)."""

    LOGGERS = ("sglang", "gyre.backends.engines")

    def __init__(self, name: str, lines: int = 20) -> None:
        self.name = name
        self.tail = _Tail(lines)
        self.fired = False
        self.stopping = False
        self._previous: Any = None
        self.installed = False

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("engine %s: SIGQUIT watch not installed (not on the main thread): a dying engine "
                           "process will end this rank without a diagnosis", self.name)
            return False
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self.tail)
        self._previous = signal.signal(signal.SIGQUIT, self._handle)
        self.installed = True
        return True

    def uninstall(self) -> None:
        if not self.installed:
            return
        signal.signal(signal.SIGQUIT, signal.SIG_DFL if self._previous is None else self._previous)
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self.tail)
        self.installed = False

    def diagnosis(self) -> str:
        last = "\n".join(self.tail.lines) or "(none logged in this process)"
        return (f"engine {self.name} died: one of its processes failed and sent this rank SIGQUIT (SGLang's "
                f"scheduler does on any exception; its traceback, 'Scheduler hit an exception', is in this rank's "
                f"stderr). The engine's last log lines here:\n{last}")

    def _handle(self, signum: int, frame: Any = None) -> None:
        if self.fired or self.stopping:
            logger.warning("engine %s: SIGQUIT again (%s); not raised again", self.name,
                           "stopping" if self.stopping else "its failure is being reported")
            return
        self.fired = True
        raise EngineDied(self.diagnosis())


class EngineHost:
    """`watch_sigquit`: install a `SigquitWatch` (on the main thread) before the engine starts,
    removed once it has stopped."""

    def __init__(self, engine: RolloutEngine, *, host: str = "127.0.0.1", announce: str | None = None,
                 secret: str | None = None, timeout: float = 600.0, watch_sigquit: bool = False) -> None:
        self.engine = engine
        self.timeout = timeout
        kind = getattr(type(engine), "name", None)  # "sglang": the class's; `name` is the rank's label
        self.watch = SigquitWatch(engine.name if kind in (None, engine.name) else f"{engine.name} ({kind})")
        if watch_sigquit:
            self.watch.install()
        self.handle = serve_engine(engine, host=host, port=0, secret=secret)
        announce = announce or host
        self.url = f"http://[{announce}]:{self.handle.port}" if ":" in announce else f"http://{announce}:{self.handle.port}"
        try:
            self.handle.call(engine.start(), timeout=timeout)
        except BaseException:
            # The start's own error is the diagnosis: SIGQUITs of the engine's other processes that
            # follow it are logged, not raised over it (the watch stays, log-only: SIG_DFL would
            # core-dump the rank), and the server goes.
            self.watch.stopping = True
            self.handle.stop()
            raise
        logger.info("engine %s serving at %s (bound to %s)", engine.name, self.url, host or "*")

    def release(self) -> None:
        self.handle.call(self.engine.release_memory(), timeout=self.timeout)

    def resume(self) -> None:
        self.handle.call(self.engine.resume(), timeout=self.timeout)

    def update(self, params: dict[str, torch.Tensor], version: int) -> None:
        self.handle.call(self.engine.update_weights(params, version), timeout=self.timeout)

    def read_back(self, params: dict[str, torch.Tensor], version: int, *, full: bool) -> int | None:
        """`gyre.backends.transfer.readback.check` against this engine (None: the engine has no
        `read_weights`); raises WeightReadbackMismatch naming the parameter that differs."""
        from gyre.backends.transfer.readback import check

        read = getattr(self.engine, "read_weights", None)
        if read is None:
            return None
        return check(lambda names, rows: self.handle.call(read(names, rows), timeout=self.timeout), params, version,
                     dtype=getattr(self.engine, "weights_dtype", None), full=full, engine=self.engine.name)

    def stop(self) -> None:
        self.watch.stopping = True  # an engine process ended by its stop is no failure
        stop = getattr(self.engine, "stop", None)  # optional in RolloutEngine (see there)
        if stop is not None:
            try:
                self.handle.call(stop(), timeout=self.timeout)
            except Exception as e:  # shutting down anyway
                logger.warning("engine stop: %r", e)
        self.handle.stop()
        self.watch.uninstall()
