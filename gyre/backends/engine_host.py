"""A rollout engine served over HTTP from its own thread, driven synchronously by its cell.

The proxy on rank 0 reaches every cell's engine through `gyre.backends.engine_http.HttpEngine`;
the cell's worker thread calls `release()`, `resume()` and `update()` here when the cell
switches roles or a new policy is published. The URL is announced in the store under
`engine/<rank>` so the controller can find it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from gyre.backends.protocols import RolloutEngine
from gyre.backends.engine_http import serve_engine

logger = logging.getLogger(__name__)


class EngineHost:
    def __init__(self, engine: RolloutEngine, *, host: str = "127.0.0.1", timeout: float = 600.0) -> None:
        self.engine = engine
        self.timeout = timeout
        self.handle = serve_engine(engine, host=host, port=0)
        self.handle.call(engine.start(), timeout=timeout)
        logger.info("engine %s serving at %s", engine.name, self.url)

    @property
    def url(self) -> str:
        return self.handle.url

    def release(self) -> None:
        self.handle.call(self.engine.release_memory(), timeout=self.timeout)

    def resume(self) -> None:
        self.handle.call(self.engine.resume(), timeout=self.timeout)

    def update(self, params: dict[str, torch.Tensor], version: int) -> None:
        self.handle.call(self.engine.update_weights(params, version), timeout=self.timeout)

    def health(self) -> Any:
        return self.handle.call(self.engine.health(), timeout=self.timeout)

    def stop(self) -> None:
        stop = getattr(self.engine, "stop", None)  # optional in RolloutEngine (see there)
        if stop is not None:
            try:
                self.handle.call(stop(), timeout=self.timeout)
            except Exception as e:  # shutting down anyway
                logger.warning("engine stop: %r", e)
        self.handle.stop()
