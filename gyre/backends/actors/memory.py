"""Memory hand-over inside a cell (docs/design.md §3): an actor's state leaves the accelerator
while the cell serves rollouts, and comes back when it trains.

Entering rollout, an actor moves its parameters, gradients (`.grad`, Megatron's fp32
`.main_grad`) and optimizer state (AdamW moments and step, fp32 masters) to host memory —
page-locked where CUDA runs, so the copies run at PCIe speed — and the CUDA caching allocator
gives the freed blocks back (`torch.cuda.empty_cache`), so the engine can take them. Entering
training, `restore` moves everything back to the actor's device. Both are exact copies: a step
after offload → restore equals one without (tests/backends/actors/test_cpu_actor.py,
tests/backends/actors/test_megatron_actor.py).

`--backend.offload-actor` (default) does this at every switch; `--backend.no-offload-actor`
keeps the actor resident when the device has memory for both (no copy, no latency).

On CPU the copies are real (new host buffers, then the old ones are dropped), so the CPU tests
exercise the same code; only pinning and `empty_cache` are CUDA-only.

    state = ActorMemory.of(params, optimizers=[opt], extra=masters)
    n = state.offload()      # bytes moved to host
    state.restore()          # back on the device, bit for bit
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch


def _pin_here(device: torch.device) -> bool:
    """Pinned host buffers only when the state lives on CUDA (pinning needs a CUDA context)."""
    return device.type == "cuda"


def _to(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """A copy of `t` on `device` (host: page-locked when `pin`)."""
    if device.type == "cpu":
        out = torch.empty_like(t, device="cpu", pin_memory=pin)
        out.copy_(t, non_blocking=pin)
        return out
    return t.to(device, non_blocking=True, copy=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class ActorMemory:
    """Everything an actor holds on its device: `tensors` (parameters and other tensors it owns,
    moved through `.data` so every reference to them stays valid), each tensor's `.grad` and
    `.main_grad`, and the tensor state of `optimizers` (keyed by those same tensors)."""

    tensors: list[torch.Tensor]
    optimizers: list[torch.optim.Optimizer]
    device: torch.device
    offloaded: bool = False
    _opt_slots: list[tuple[dict, str]] = dataclasses.field(default_factory=list)  # optimizer state moved

    @classmethod
    def of(cls, tensors: Iterable[torch.Tensor], *, optimizers: Iterable[torch.optim.Optimizer | None] = ()) -> "ActorMemory":
        seen, unique = set(), []
        for t in tensors:  # fp32 parameters are their own masters: move each tensor once
            if id(t) not in seen:
                seen.add(id(t))
                unique.append(t)
        device = unique[0].device if unique else torch.device("cpu")
        return cls(unique, [o for o in optimizers if o is not None], device)

    def _move(self, to: torch.device, opt_slots: list[tuple[dict, str]]) -> int:
        pin = _pin_here(self.device)
        moved = 0
        with torch.no_grad():
            for t in self.tensors:
                t.data = _to(t.data, to, pin)  # data first: a .grad must match its tensor's device
                moved += t.numel() * t.element_size()
                if t.grad is not None:
                    t.grad = _to(t.grad, to, pin)
                    moved += t.grad.numel() * t.grad.element_size()
                main = getattr(t, "main_grad", None)
                if main is not None:
                    t.main_grad = _to(main, to, pin)
                    moved += main.numel() * main.element_size()
            for state, k in opt_slots:
                state[k] = _to(state[k], to, pin)
                moved += state[k].numel() * state[k].element_size()
        _sync(self.device)
        return moved

    def offload(self) -> int:
        """Move everything to host memory and free the device's cached blocks; bytes moved
        (0 when already offloaded)."""
        if self.offloaded:
            return 0
        # AdamW's `step` is a host scalar unless capturable: only what lives on the device moves
        self._opt_slots = [(state, k) for opt in self.optimizers for state in opt.state.values()
                           for k, v in state.items() if torch.is_tensor(v) and v.device == self.device]
        moved = self._move(torch.device("cpu"), self._opt_slots)
        self.offloaded = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the freed blocks go back to the driver, for the engine
        return moved

    def restore(self) -> int:
        """Move everything back to the device; bytes moved (0 when not offloaded)."""
        if not self.offloaded:
            return 0
        moved = self._move(self.device, self._opt_slots)
        self.offloaded, self._opt_slots = False, []
        return moved
