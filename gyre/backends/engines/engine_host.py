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
"""

from __future__ import annotations

import base64
import logging
import secrets
from typing import Any

import torch

from gyre.backends.engines.engine_http import serve_engine
from gyre.backends.protocols import RolloutEngine
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


class EngineHost:
    def __init__(self, engine: RolloutEngine, *, host: str = "127.0.0.1", announce: str | None = None,
                 secret: str | None = None, timeout: float = 600.0) -> None:
        self.engine = engine
        self.timeout = timeout
        self.handle = serve_engine(engine, host=host, port=0, secret=secret)
        announce = announce or host
        self.url = f"http://[{announce}]:{self.handle.port}" if ":" in announce else f"http://{announce}:{self.handle.port}"
        self.handle.call(engine.start(), timeout=timeout)
        logger.info("engine %s serving at %s (bound to %s)", engine.name, self.url, host or "*")

    def release(self) -> None:
        self.handle.call(self.engine.release_memory(), timeout=self.timeout)

    def resume(self) -> None:
        self.handle.call(self.engine.resume(), timeout=self.timeout)

    def update(self, params: dict[str, torch.Tensor], version: int) -> None:
        self.handle.call(self.engine.update_weights(params, version), timeout=self.timeout)

    def stop(self) -> None:
        stop = getattr(self.engine, "stop", None)  # optional in RolloutEngine (see there)
        if stop is not None:
            try:
                self.handle.call(stop(), timeout=self.timeout)
            except Exception as e:  # shutting down anyway
                logger.warning("engine stop: %r", e)
        self.handle.stop()
