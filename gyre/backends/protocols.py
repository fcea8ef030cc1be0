"""Backend protocols (docs/design.md §1, §3): what the proxy and the runtime need from a rollout engine,
a training actor and a weight transport. Small on purpose; implementations do not inherit from
each other. `gyre.backends.factory` builds them; tests/contracts/ holds the tests every
implementation passes.

Implementations: `gyre.backends.engines.cpu_engine` (built-in torch engine), `gyre.backends.engines.sglang_engine`
(embedded SGLang, GPU), an HTTP client for an engine living in another process
(`gyre.backends.engines.engine_http`), and a deterministic test engine. Actors: `gyre.backends.actors.cpu_actor`,
`gyre.backends.actors.megatron_actor` (GPU). Weight transports: `gyre.backends.transfer.weights.SnapshotBoard`,
`gyre.backends.transfer.weights`.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:  # annotations only: the proxy (and its body-parsing workers) never import torch
    import torch


class EngineState(enum.Enum):
    """A rollout engine's lifecycle, the same for every engine: CREATED → RUNNING (start) |
    STOPPED; RUNNING → RELEASED (release_memory, when idle) | STOPPED; RELEASED → RUNNING (resume)
    | STOPPED. STOPPED is final."""

    CREATED = "created"
    RUNNING = "running"
    RELEASED = "released"
    STOPPED = "stopped"

    def move(self, to: "EngineState", *, require: "EngineState | None" = None, who: str = "engine") -> "EngineState":
        """The state after moving to `to`; RuntimeError naming `who` if the move is not allowed
        (or `require` is given and this is not it)."""
        if to not in _ENGINE_MOVES[self] or (require is not None and self is not require):
            raise RuntimeError(f"{who}: illegal transition {self.value} → {to.value}")
        return to


_ENGINE_MOVES = {
    EngineState.CREATED: {EngineState.RUNNING, EngineState.STOPPED},
    EngineState.RUNNING: {EngineState.RELEASED, EngineState.STOPPED},
    EngineState.RELEASED: {EngineState.RUNNING, EngineState.STOPPED},
    EngineState.STOPPED: set(),
}

@dataclass
class SamplingParams:
    """Per-request sampling options, in token space (the proxy turns string stops into ids)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    # Stop sequences as token-id sequences: generation stops after the last token of a match.
    stop_sequences: list[list[int]] = field(default_factory=list)
    seed: int | None = None
    # EOS and stop_token_ids cannot be sampled before this many tokens (SGLang's min_new_tokens,
    # vLLM's min_tokens); policy log-probs are still those of the unmasked distribution.
    min_tokens: int = 0
    # Also report the k most likely tokens at each position (`TokenEvent.top`), from the same
    # distribution as `TokenEvent.logprob`. 0: not computed (no cost).
    top_logprobs: int = 0
    # Transport, not sampling: an engine's server may hold this request's tokens after the first
    # up to this long and send them together (the proxy's `engine_hold_s` for a call that needs
    # its text only at the end, `stream_interval_s` for one that streams or has stop strings).
    # Engines ignore it; 0 sends each at once.
    hold_s: float = 0.0


class TokenIds(Sequence):
    """A prompt's token ids as the proxy hands them on, held only packed as little-endian int32
    (`packed`): read as a sequence of Python ints by whoever needs them (an in-process engine),
    never built as Python ints by the proxy, which ships them to an engine
    (`gyre.backends.engines.engine_mux`) and records them as `packed` (building, then freeing,
    a list of ~1M Python ints would hold the proxy's event loop, and the conversions would cost
    every call). A slice is a plain list; `ids + more` is
    a TokenIds (a router continuing a call after a reroute)."""

    __slots__ = ("packed",)
    CHUNK = 1 << 14  # ids per step when iterating: each a short GIL hold

    def __init__(self, packed: np.ndarray) -> None:
        if packed.dtype != np.dtype("<i4") or packed.ndim != 1:
            raise ValueError(f"TokenIds: packed must be a 1-d little-endian int32 array, got {packed.ndim}-d {packed.dtype}")
        self.packed = packed

    @classmethod
    def from_array(cls, ids) -> "TokenIds":
        """From 4-byte C ints (an `array('i')` or any int32 buffer), in one copy."""
        return cls(np.frombuffer(ids, dtype=np.intc).astype("<i4"))

    def __len__(self) -> int:
        return len(self.packed)

    def __getitem__(self, i):
        return self.packed[i].tolist() if isinstance(i, slice) else int(self.packed[i])

    def __iter__(self):
        for i in range(0, len(self.packed), self.CHUNK):
            yield from self.packed[i : i + self.CHUNK].tolist()

    def __add__(self, more) -> "TokenIds":
        return TokenIds(np.concatenate([self.packed, np.asarray(more, dtype="<i4")]))

    def __eq__(self, other) -> bool:
        if isinstance(other, TokenIds):
            return bool(np.array_equal(self.packed, other.packed))
        return isinstance(other, (list, tuple)) and len(other) == len(self) and self.packed.tolist() == list(other)

    __hash__ = None

    def __repr__(self) -> str:
        return f"TokenIds({len(self)} ids)"

    def tolist(self) -> list[int]:
        return self.packed.tolist()


def free_ids(box: list, chunk: int = 1 << 14) -> bool:
    """Free the id list in `box` (a one-item list, its only holder) `chunk` ids at a time, when
    nothing else holds it: ~1M Python ints freed at once hold the GIL ~6 ms, so the engine host
    frees a received long prompt this way on a thread, not on its event loop. Returns
    whether it did; a list still shared is left to whoever holds it."""
    ids = box.pop()
    if sys.getrefcount(ids) > 2:  # beyond `ids` and getrefcount's own argument: still in use
        return False
    while ids:
        del ids[-chunk:]
    return True


def int32_ids(ids: list[int]) -> np.ndarray:
    """`ids` as a little-endian int32 array: `TokenIds.packed` as it is, else converted."""
    return ids.packed if isinstance(ids, TokenIds) else np.asarray(ids, dtype="<i4")


@dataclass
class TokenEvent:
    """One sampled token: id, its behavior log-prob under the weights that sampled it, and the
    policy version of those weights."""

    token_id: int
    logprob: float
    version: int
    # Set on the last event of a finished stream: 'stop' (EOS / stop id / stop sequence, the stop
    # token included in the output) or 'length' (max_tokens / max_model_len). None otherwise; an
    # aborted stream simply ends.
    finish_reason: str | None = None
    # With `SamplingParams.top_logprobs` = k > 0: the k most likely tokens at this position as
    # (token_id, logprob), most likely first, from the distribution `logprob` is taken from
    # (so the sampled token appears with `logprob` when it is among them). None otherwise.
    top: list[tuple[int, float]] | None = None
    # Transport, not sampling: more of this stream's tokens came in the same delivery (one
    # websocket frame of a held stream, `SamplingParams.hold_s`) and follow at once. A consumer
    # may wait for the last of them before acting on the text (`Call.events` makes one chunk of
    # them). Never part of equality.
    more: bool = field(default=False, compare=False, repr=False)


@dataclass
class EngineHealth:
    ok: bool
    version: int
    running: int  # requests in the running batch
    waiting: int  # requests queued
    released: bool = False  # memory released (cell is training)
    detail: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class RolloutEngine(Protocol):
    """A rollout engine. All methods are async except `name`/`load` (cheap, lock-free reads).

    Lifecycle: start() → generate/abort (many concurrent) ⇄ update_weights(version) between
    decode steps → release_memory() (no requests may be running: the proxy drains first) →
    resume() → ...
    """

    name: str

    async def start(self) -> None: ...

    # An engine served in-process (`gyre.backends.engines.engine_host.EngineHost`) may also have
    # `async stop()`; clients of a remote engine (`HttpEngine`) have `close()` instead.

    def generate(self, request_id: str, input_ids: Sequence[int], sampling: SamplingParams) -> AsyncIterator[TokenEvent]:
        """Stream the sampled tokens of one request. Ends at EOS/stop/max_tokens or on abort.
        `input_ids` is a list, or a `TokenIds` (packed: every prompt from the proxy): not to be modified."""
        ...

    async def abort(self, request_id: str) -> list[TokenEvent]:
        """Stop `request_id` now and return every token it generated so far (exactly the
        tokens already yielded by its stream, plus any produced but not yet consumed)."""
        ...

    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new weights between decode steps; running requests continue with them and
        their later tokens carry `version`."""
        ...

    async def release_memory(self) -> None: ...

    async def resume(self) -> None: ...

    async def health(self) -> EngineHealth: ...

    def load(self) -> int:
        """Requests running or queued here (for least-loaded routing)."""
        ...


@runtime_checkable
class MigratableEngine(Protocol):
    """Optional part of `RolloutEngine`: KV migration of a running request (docs/design.md §3;
    the two-phase handshake is in `gyre.backends.transfer.migration`). An engine has it when
    `supports_migration` is True (`can_migrate`); the router then offers a drained call to a
    target by migration and falls back to recompute on any failure.

    Implementations: `CpuEngine` (with a KV transport attached), `HttpEngine` (forwards to the
    served engine, which may refuse). `SGLangEngine` raises NotImplementedError (see its note)."""

    supports_migration: bool

    async def migration_info(self) -> dict[str, Any]:
        """{"kv_bytes_per_token": int, "transport": str} (what the router's cost rule needs)."""
        ...

    async def migrate_out(self, request_id: str) -> tuple[list[TokenEvent], dict[str, Any] | None]:
        """Phase 1, source: stop `request_id` between decode steps, hold its state; return every
        event it generated (as `abort` does) and a small handle for the target (None: nothing
        held, recompute). Raises `migration.MigrationRefused`/KeyError with the request untouched."""
        ...

    async def migrate_in(self, request_id: str, handle: dict[str, Any]) -> int:
        """Phase 2, target: pull the held state over the KV transport and park it under
        `request_id` (the next `generate(request_id, prompt + generated, ...)` continues it).
        Returning is the acknowledgement (bytes moved); raising is a refusal."""
        ...

    async def migrate_release(self, key: str) -> bool:
        """Phase 3, source: drop the held state `handle["key"]` (after the ack, or a failure)."""
        ...


def can_migrate(engine: Any) -> bool:
    """Does `engine` implement the optional migration methods and say it supports them?"""
    return bool(getattr(engine, "supports_migration", False)) and all(
        callable(getattr(engine, m, None)) for m in ("migration_info", "migrate_out", "migrate_in", "migrate_release"))


@runtime_checkable
class Actor(Protocol):
    """A training actor replica in one cell (docs/design.md §3): exactly what the cell worker
    (`gyre.runtime.worker`) and `gyre.runtime.samples.train_bundle` call. Only the core's actor
    holds optimizer state; satellites compute gradients on the micro-steps they claim.

    `version` counts the optimizer steps behind the parameters it holds (docs/design.md §2); the
    worker sets it when it imports a snapshot (-1: nothing imported yet)."""

    version: int

    def forward_logprobs(self, micro_step: Any) -> torch.Tensor:
        """Per-token trainer log-probs ℓ_t [N] for a packed micro-step (no grad)."""
        ...

    def exec_logratio_partial_sums(self, micro_step: Any) -> torch.Tensor:
        """Forward-only pre-pass of an execution split over micro-steps: Σ_{t here} (ℓ_t − b_t)
        per execution, [E] float64 (`train_bundle` sums them before the backward passes)."""
        ...

    def forward_backward(self, micro_step: Any, exec_logratio_sum: torch.Tensor | None = None) -> dict[str, float]:
        """Accumulate gradients of the GSPO loss on one micro-step; returns loss metrics."""
        ...

    def reduce_gradients(self, group: Any) -> None:
        """Sum accumulated gradients over `group` (the prefix group of the cells in the step; None:
        the core alone)."""
        ...

    def zero_grad(self) -> None:
        """Drop accumulated gradients (a satellite after the reduction; a step with no update)."""
        ...

    def optimizer_step(self, max_grad_norm: float | None = None, *, grad_scale: float = 1.0) -> dict[str, float]:
        """Multiply the reduced gradients by `grad_scale` (the step's |E| correction,
        `gyre.loss.LossConfig.grad_scale`), clip to `max_grad_norm` (None, as the worker calls it:
        the actor's own `--actor.max-grad-norm`; the contract tests pass one), apply one optimizer
        update, zero the gradients, `version += 1` (core only). Returns grad norm etc."""
        ...

    def export_parameters(self) -> dict[str, torch.Tensor]:
        """A copy of every parameter by HF name (what engines and satellites load)."""
        ...

    def import_parameters(self, params: dict[str, torch.Tensor]) -> None:
        """Overwrite every parameter (exactly the names `export_parameters` gives)."""
        ...

    def offload(self) -> int:
        """Entering rollout (docs/design.md §3): move parameters, gradients and optimizer state to
        host memory (pinned where CUDA runs) and free the device's cached blocks for the engine.
        Returns the bytes moved (0 when already offloaded). Exact: `restore` gives back the same
        bits (`gyre.backends.actors.memory.ActorMemory`)."""
        ...

    def restore(self) -> int:
        """Entering training: the inverse of `offload` (0 bytes when not offloaded)."""
        ...

    def save_checkpoint(self, path: str) -> None:
        """Weights, optimizer state (core) and version under directory `path`."""
        ...

    def load_checkpoint(self, path: str, *, weights_only: bool = False) -> None:
        """The inverse of `save_checkpoint` (sets `version`); `weights_only` leaves the optimizer
        fresh (`--train.resume-weights-only`, and a checkpoint that holds no optimizer state)."""
        ...

    def debug_state(self) -> dict[str, Any]:
        """Debug only (`--train.audit-dir`): {"params", "grads" (name → tensor or None), "optimizer"
        (state dict), "version"}, for replaying a step on one rank. A backend whose state is
        sharded may raise NotImplementedError."""
        ...


@runtime_checkable
class WeightTransport(Protocol):
    """How the core's parameter snapshots reach other ranks (docs/design.md §3). Two halves:

    one-sided   the core `post`s every new version; any rank reads a version whenever it likes
                (`fetch*`) without the core's training thread taking part. Retention
                (`gyre.backends.transfer.snapshots.Retention`): the newest `keep` versions plus the
                newest published one; `fetch_published(v)` of an evicted v gives the newest
                published version instead.
    collective  `broadcast` over a prefix group: every member calls it at once, `src` (a global
                rank) passes its parameters, every member gets them back.

    Every read checks a CRC32 of the flat bytes against the poster's (`--transfer.verify`) and
    raises RuntimeError on a mismatch; a version not held raises KeyError. Implementations
    (`--transfer.transport`): `gyre.backends.transfer.weights.SnapshotBoard` (store), `gyre.backends.transfer.weights`
    (`TorchWeights`, `MooncakeWeights`). `stats` (`transfer.TransferStats`) counts the bytes
    this rank moved, by path.
    """

    name: str
    stats: Any

    def post(self, version: int, params: dict[str, torch.Tensor], *, published: bool = False) -> None:
        """Core only: make `version` readable (published: a burst's last step)."""
        ...

    def latest(self) -> int | None:
        """The newest posted version (None before the first post)."""
        ...

    def published(self) -> int | None:
        """The newest published version."""
        ...

    def fetch(self, version: int) -> dict[str, torch.Tensor]: ...

    def fetch_latest(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(v, params) of the newest version held."""
        ...

    def fetch_published(self, version: int) -> tuple[int, dict[str, torch.Tensor]]:
        """(v loaded, params): `version`, or the newest published one if `version` was evicted."""
        ...

    def broadcast(self, group: Any, src: int, params: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]: ...

    def close(self) -> None:
        """Release what the transport holds (threads, registered memory); idempotent."""
        ...
