"""Random packed problems for the loss tests (independent of the code under test)."""

from __future__ import annotations

import torch

CLIP = {"eps_low": 0.005, "eps_high": 0.005, "cap": 5.0}
"""ε_low, ε_high and C for the tests that do not vary them (the hand examples are worked with these)."""


def random_step(gen: torch.Generator, num_exec: int, max_len: int, vocab: int, hidden: int, dtype=torch.float64):
    """A step of `num_exec` executions with L_i in [1, max_len] targets each, as flat token rows.

    Returns a dict: hidden [N, H], targets [N], exec_index [N], behavior [N] (log-probs under a
    perturbed head, with a few made very unlikely so that ω gets capped), advantages [E],
    lengths [E], weight [V, H].
    """
    lengths = torch.randint(1, max_len + 1, (num_exec,), generator=gen)
    exec_index = torch.repeat_interleave(torch.arange(num_exec), lengths)
    n = int(lengths.sum())
    h = torch.randn(n, hidden, generator=gen, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=gen, dtype=dtype) * 0.5
    y = torch.randint(0, vocab, (n,), generator=gen)
    w_b = w + 0.01 * torch.randn(vocab, hidden, generator=gen, dtype=dtype)
    b = torch.log_softmax(h @ w_b.t(), -1).gather(-1, y[:, None]).squeeze(-1)
    low = torch.rand(n, generator=gen) < 0.1
    b = torch.where(low, b - 3.0, b)  # exp(δ) ≈ e³ > 5: capped
    adv = torch.randn(num_exec, generator=gen, dtype=torch.float64)
    return {"hidden": h, "targets": y, "exec_index": exec_index, "behavior": b.detach(),
            "advantages": adv, "lengths": lengths, "weight": w}


def token_weight(advantages: torch.Tensor, lengths: torch.Tensor, exec_index: torch.Tensor, num_exec: int) -> torch.Tensor:
    """−A_i/(|E|·L_i) per token (the packer's job, written out here independently)."""
    return -advantages[exec_index] / (num_exec * lengths[exec_index].double())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error ‖a − b‖ / ‖b‖ in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))
