"""Backend protocols (docs/design.md §1): what the proxy and scheduler need from a rollout engine and a
training actor. Small on purpose; implementations do not inherit from each other.

Implementations: `gyre.backends.cpu_engine` (built-in torch engine), `gyre.backends.sglang_engine`
(embedded SGLang, GPU), an HTTP client for an engine living in another process
(`gyre.proxy.engine_http`), and a deterministic test engine. Actors: `gyre.backends.cpu_actor`,
`gyre.backends.megatron_actor` (GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol, runtime_checkable

import torch


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

    def generate(self, request_id: str, input_ids: list[int], sampling: SamplingParams) -> AsyncIterator[TokenEvent]:
        """Stream the sampled tokens of one request. Ends at EOS/stop/max_tokens or on abort."""
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
class TrainActor(Protocol):
    """A training actor replica in one cell (docs/design.md §3). Only the core's actor holds optimizer
    state; satellites compute gradients on the micro-steps they claim."""

    def forward_logprobs(self, micro_step: Any) -> torch.Tensor:
        """Per-token trainer log-probs ℓ_t [N] for a packed micro-step (no grad)."""
        ...

    def forward_backward(self, micro_step: Any, exec_logratio_sum: torch.Tensor | None = None) -> dict[str, float]:
        """Accumulate gradients of the GSPO loss on one micro-step; returns loss metrics."""
        ...

    def reduce_gradients(self, group: Any) -> None:
        """Sum accumulated gradients over `group` (the prefix group of the cells in the step)."""
        ...

    def optimizer_step(self, max_grad_norm: float | None = None, *, grad_scale: float = 1.0) -> dict[str, float]:
        """Multiply the reduced gradients by `grad_scale` (the step's |E| correction,
        `gyre.loss.LossConfig.grad_scale`), clip, apply one optimizer update (core only).
        Returns grad norm etc."""
        ...

    def export_parameters(self) -> dict[str, torch.Tensor]: ...

    def import_parameters(self, params: dict[str, torch.Tensor]) -> None: ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...
