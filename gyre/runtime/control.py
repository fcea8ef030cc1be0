"""Control plane over the store torchrun provides (docs/design.md §1, §3): no ad-hoc sockets.

Small things travel here:

* **Mailboxes.** `send(dst, msg)` / `recv()`: one FIFO queue per rank and one for the
  controller (the store's queue_push / queue_pop), carrying commands from the controller and
  reports back to it (`gyre.runtime.messages`). Any picklable message travels; this module does
  not look inside.
* **Blobs.** A granted micro-step bundle is put under a key and taken (read and deleted) by the
  cell it was granted to; the grant message on the same store connection comes after the put,
  so the taker always finds it.
* **Weight-transport pointers.** Version pointers, read requests and descriptors of the weight
  transports (`gyre.backends.weights`); with `--transfer.transport store` the snapshots too.

Polling with a short sleep keeps the store's own timeout machinery (and its socket warnings) out
of the way; a wait that lasts longer than `progress_every` seconds is logged, so a hang is never
silent.
"""

from __future__ import annotations

import io
import logging
import pickle
import time
from typing import Any

import torch

logger = logging.getLogger(__name__)

CONTROLLER = "ctl"  # the controller's mailbox (it lives on rank 0 beside that rank's own worker)


def default_store() -> Any:
    """The store of the default process group (torchrun's rendezvous store), namespaced."""
    import torch.distributed as dist

    return dist.PrefixStore("gyre/", dist.distributed_c10d._get_default_store())


class ControlPlane:
    def __init__(self, store: Any, rank: int | str, *, poll: float = 0.002, progress_every: float = 30.0) -> None:
        self.store = store
        self.rank = rank
        self.poll = poll
        self.progress_every = progress_every

    # ------------------------------------------------------------------ mailboxes
    def send(self, dst: int | str, msg: Any) -> None:
        """Queue `msg` for mailbox `dst` (a rank, or CONTROLLER)."""
        self.store.queue_push(f"mb/{dst}", pickle.dumps(msg))

    def try_recv(self) -> Any | None:
        key = f"mb/{self.rank}"
        if self.store.queue_len(key) == 0:
            return None
        return pickle.loads(self.store.queue_pop(key))

    def recv(self, timeout: float | None = None, what: str = "a command") -> Any:
        """Block until a message arrives (logging every `progress_every` s); TimeoutError after `timeout`."""
        return self._wait(self.try_recv, timeout, what)

    def _wait(self, probe, timeout: float | None, what: str):
        start = last = time.monotonic()
        while True:
            got = probe()
            if got is not None:
                return got
            now = time.monotonic()
            if timeout is not None and now - start > timeout:
                raise TimeoutError(f"rank {self.rank}: no {what} after {timeout:.0f}s")
            if now - last > self.progress_every:
                logger.info("rank %d still waiting for %s (%.0fs)", self.rank, what, now - start)
                last = now
            time.sleep(self.poll)

    # ------------------------------------------------------------------ blobs
    def put_blob(self, key: str, obj: Any) -> None:
        buf = io.BytesIO()
        torch.save(obj, buf)
        self.store.set(f"blob/{key}", buf.getvalue())

    def take_blob(self, key: str, timeout: float | None = 60.0) -> Any:
        """Read and delete a blob (waiting for it to appear)."""
        full = f"blob/{key}"
        self._wait(lambda: True if self.store.check([full]) else None, timeout, f"blob {key}")
        data = self.store.get(full)
        self.store.delete_key(full)
        return torch.load(io.BytesIO(data), weights_only=False)

