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
  transports (`gyre.backends.transfer.weights`); with `--transfer.transport store` the snapshots too.

Waiting is polling with a backed-off sleep (`Backoff`): 2 ms after a message, doubling while
nothing comes, up to `max_poll` (50 ms). Polling keeps the store's own timeout machinery (and its
socket warnings) out of the way, and a blocking `wait` would hold the rank's one store connection
that other threads of the rank share; backing off keeps what idle ranks cost the one TCPStore
server small (`benchmarks/store_poll_bench.py` compares it with a fixed poll) while a command still reaches an
idle rank within `max_poll` plus one round trip. A wait that lasts longer than `progress_every`
seconds is logged, so a hang is never silent, then again at a doubling gap (at most
`SLOWEST_NOTE_S`): an idle rank of a long run writes a handful of such lines, not hundreds.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import os
import pickle
import signal
import threading
import time
from collections import deque
from typing import Any, Callable

import torch

from gyre.backoff import Backoff

logger = logging.getLogger(__name__)

CONTROLLER = "ctl"  # the controller's mailbox (it lives on rank 0 beside that rank's own worker)


def default_store() -> Any:
    """The store of the default process group (torchrun's rendezvous store), namespaced."""
    import torch.distributed as dist

    return dist.PrefixStore("gyre/", dist.distributed_c10d._get_default_store())


class TamperedStore(RuntimeError):
    """A store value that is not signed with this run's secret: another process wrote into the run's
    store (torchrun's TCPStore has no authentication). The run stops rather than trust it."""


class SignedStore:
    """torchrun's store with every value Gyre writes signed and every value it reads checked.

    torchrun's rendezvous store has no authentication: a process on the same host that finds its
    port (in a rank's environment) can read and write any key. Gyre's control traffic lives there:
    mailboxes and blobs are unpickled (a forged one would run code in the trainer), engine URLs
    tell the proxy where to send model calls, version pointers tell ranks which weights to load.
    So each value carries HMAC-SHA256(secret, key ∥ value), with the run's secret broadcast over
    the job's gloo group (`gyre.backends.engines.engine_host.share_secret`), never through the store; a read
    whose tag does not match raises `TamperedStore` before anything is unpickled or trusted. What
    this does not stop: replaying a value captured from the same key earlier in the run, and
    deleting keys or queue entries (a denial of service) — keep harnesses off the store's port
    (`--executions.runner.sandbox bwrap`, network only to the proxy) for that.
    """

    _TAG = 32  # bytes of HMAC-SHA256

    def __init__(self, store: Any, secret: str | bytes) -> None:
        self.inner = store
        self._secret = secret.encode() if isinstance(secret, str) else bytes(secret)

    def _tag(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._secret, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def _seal(self, key: str, value: str | bytes) -> bytes:
        v = value.encode() if isinstance(value, str) else bytes(value)
        return self._tag(key, v) + v

    def _open(self, key: str, data: bytes) -> bytes:
        tag, value = data[: self._TAG], data[self._TAG :]
        if len(data) < self._TAG or not hmac.compare_digest(tag, self._tag(key, value)):
            raise TamperedStore(f"store value {key!r} is not signed with this run's secret: another process wrote "
                                f"into the run's store (run harnesses with --executions.runner.sandbox bwrap)")
        return value

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, self._seal(key, value))

    def get(self, key: str) -> bytes:
        return self._open(key, self.inner.get(key))

    def queue_push(self, key: str, value: str | bytes) -> None:
        self.inner.queue_push(key, self._seal(key, value))

    def queue_pop(self, key: str) -> bytes:
        return self._open(key, self.inner.queue_pop(key))

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def queue_len(self, key: str) -> int:
        return self.inner.queue_len(key)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def clone(self) -> "SignedStore":
        return SignedStore(self.inner.clone(), self._secret)


SLOWEST_NOTE_S = 600.0  # a wait's notes come at most this far apart


class ControlPlane:
    """Mailboxes and blobs over the store (module docstring). `poll`: the first sleep of a wait;
    `max_poll`: the longest (the bound on how late an idle rank sees a message; `max_poll ==
    poll` polls at a fixed period)."""

    def __init__(self, store: Any, rank: int | str, *, poll: float = 0.002, max_poll: float = 0.05,
                 progress_every: float = 30.0) -> None:
        self.store = store
        self.rank = rank
        self.poll = poll
        self.max_poll = max(poll, max_poll)
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
        start = time.monotonic()
        say_at, gap = start + self.progress_every, self.progress_every
        backoff = Backoff(self.poll, self.max_poll)  # a new wait starts fast: commands come in bursts
        while True:
            got = probe()
            if got is not None:
                return got
            now = time.monotonic()
            if timeout is not None and now - start > timeout:
                raise TimeoutError(f"rank {self.rank}: no {what} after {timeout:.0f}s")
            if now >= say_at:  # once, then at a doubling gap: a long wait is not a flood of lines
                gap = min(2 * gap, SLOWEST_NOTE_S)
                logger.info("rank %s still waiting for %s (%.0fs; next note in %.0fs)", self.rank, what,
                            now - start, gap)
                say_at = now + gap
            delay = backoff.next()
            if timeout is not None:  # never sleep far past the timeout
                delay = min(delay, max(0.0, start + timeout - now) + self.poll)
            time.sleep(delay)

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



class ReplyWatch:
    """Which rank owes the controller a report, and for how long it has said nothing (a frozen
    rank: SIGSTOP, a hung driver or collective, a lost node). Pure bookkeeping, the caller's clock.

    `expect(rank, command, now)` when a command that is answered is sent (its type's `reply`:
    ToTrain → Joined, Load → Loaded, Stop → Stopped, ...); `heard(rank, report, now)` for every
    report type, which also settles the oldest debt it answers; `silent(now, timeout)` names the
    rank that owes something and has sent nothing for `timeout` seconds (counted from the later of
    the debt and the rank's last report, so a rank busy with a long command that still reports is
    not silent).

    >>> from gyre.runtime.messages import Load
    >>> w = ReplyWatch(); w.expect(1, Load, now=0.0)
    >>> w.silent(now=5.0, timeout=10.0) is None, w.silent(now=11.0, timeout=10.0)[:2]
    (True, (1, <class 'gyre.runtime.messages.Load'>))
    """

    def __init__(self) -> None:
        self._owed: dict[int, deque[tuple[type, float]]] = {}  # rank -> (command type, sent at)
        self._last: dict[int, float] = {}

    def expect(self, rank: int, command: type, now: float) -> None:
        if command.reply is None:
            raise ValueError(f"{command.__name__} is not answered: nothing to expect")
        self._owed.setdefault(rank, deque()).append((command, now))

    def heard(self, rank: int, report: type, now: float) -> None:
        self._last[rank] = now
        owed = self._owed.get(rank)
        if owed:
            for i, (command, _) in enumerate(owed):
                if command.reply is report:
                    del owed[i]
                    break

    def forget(self, rank: int) -> None:
        """The rank is gone (it reported a failure): it owes nothing any more."""
        self._owed.pop(rank, None)

    def owed(self, rank: int) -> list[type]:
        return [command for command, _ in self._owed.get(rank, ())]

    def silent(self, now: float, timeout: float) -> tuple[int, type, float] | None:
        """(rank, command type, seconds silent) of the longest-silent rank past `timeout`, else None."""
        worst = None
        for rank, owed in self._owed.items():
            if not owed:
                continue
            command, sent = owed[0]
            quiet = now - max(sent, self._last.get(rank, float("-inf")))
            if quiet > timeout and (worst is None or quiet > worst[2]):
                worst = (rank, command, quiet)
        return worst


class Interrupts:
    """SIGINT / SIGTERM on a rank → one report to the controller, which stops the run gracefully
    (harness trees killed, ranks stopped, the core's checkpoint, summary, events, plot) and exits
    non-zero. Slurm preemption and `scancel` send SIGTERM; torchrun forwards the signal it gets to
    every rank; Ctrl-C reaches every rank twice (from the terminal and from torchrun), so a repeat
    within `repeat_s` is the same interrupt. A second signal after that, or `timeout_s` after the
    first, forces the exit: `force(code)` (os._exit; PR_SET_PDEATHSIG takes the harnesses along).

    `install()` in the main thread; `notify` is set once the control plane exists (until then a
    signal raises KeyboardInterrupt, Python's default). The handler only sends a message: the
    main thread may be anywhere (a collective, a snapshot read), the controller thread acts.
    """

    def __init__(self, rank: int, timeout_s: float, *, repeat_s: float = 2.0,
                 force: Callable[[int], None] = os._exit) -> None:
        self.rank, self.timeout_s, self.repeat_s, self.force = rank, timeout_s, repeat_s, force
        self.notify: Callable[[str], None] | None = None
        self.first: tuple[str, float] | None = None  # (signal name, monotonic time)
        self.code = 0  # the exit status of a forced exit: 128 + the first signal

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle)

    def handle(self, signum: int, frame: Any = None) -> None:
        name, now = signal.Signals(signum).name, time.monotonic()
        if self.first is None:
            if self.notify is None:
                raise KeyboardInterrupt(name)  # nothing to stop gracefully yet
            self.first, self.code = (name, now), 128 + signum
            logger.warning("rank %d: %s: stopping the run gracefully (at most %.0fs; send it again to force)",
                           self.rank, name, self.timeout_s)
            timer = threading.Timer(self.timeout_s, self._expire)
            timer.daemon = True
            timer.start()
            try:
                self.notify(name)
            except Exception:  # noqa: BLE001 - the store may be gone; the timer still bounds the stop
                logger.exception("rank %d: could not tell the controller about %s", self.rank, name)
            return
        if now - self.first[1] < self.repeat_s:
            return  # the same interrupt delivered twice (terminal + torchrun)
        self._exit(f"second signal ({name})")

    def _expire(self) -> None:
        self._exit(f"the graceful stop took longer than {self.timeout_s:.0f}s (--train.shutdown-timeout-s)")

    def _exit(self, why: str) -> None:
        logger.error("rank %d: %s: exiting now (status %d), without the rest of the graceful stop", self.rank, why,
                     self.code)
        for h in logging.getLogger().handlers:
            h.flush()
        self.force(self.code)
