"""Token sampling (pure): temperature, top-p, an explicit generator, and the reported log-prob.

    >>> g = torch.Generator().manual_seed(0)
    >>> tok, policy_lp, sampling_lp = sample_token(logits, temperature=0.7, top_p=0.9, generator=g)

`policy_lp` is log-softmax of the unmodified logits at the sampled token — the quantity a
trainer computes for the same weights (docs/design.md §6's ℓ_t), independent of temperature and top-p.
`sampling_lp` is the log-prob under the distribution actually sampled from.

    >>> top_logprobs(torch.log_softmax(logits.float(), -1), k=5)   # [(id, lp), ...] most likely first

`top_logprobs` is the k most likely tokens of a log-prob vector, for `TokenEvent.top`;
`sampling_logprobs` is the log of the distribution `sample_token` draws from (-inf outside it).
"""

from __future__ import annotations

import torch


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Boolean mask [V] of the top-p nucleus: the most probable tokens whose mass before each
    one is < top_p (so the token that crosses top_p is kept; never empty). probs [V]."""
    if top_p >= 1.0:
        return probs > 0
    sorted_p, order = probs.sort(descending=True, stable=True)
    before = sorted_p.cumsum(0) - sorted_p  # mass strictly before each sorted token
    keep_sorted = before < top_p
    keep_sorted[0] = True
    keep = torch.zeros_like(keep_sorted)
    keep[order] = keep_sorted
    return keep


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k largest entries of a log-prob vector [V] as [(token_id, logprob)], largest first,
    ties by ascending id; -inf entries (tokens outside a truncated distribution) are left out,
    so fewer than k come back when fewer are possible.

    >>> top_logprobs(torch.log(torch.tensor([0.1, 0.6, 0.3])), 2)   # [(1, log 0.6), (2, log 0.3)]
    """
    if k <= 0:
        return []
    k = min(k, logprobs.numel())
    kth = torch.topk(logprobs, k, sorted=True).values[-1]
    # topk's choice among values equal to the k-th is unspecified: take those by ascending id
    above = (logprobs > kth).nonzero()[:, 0].tolist()
    tied = (logprobs == kth).nonzero()[:, 0].tolist()[: k - len(above)]
    pairs = [(i, float(logprobs[i])) for i in above + tied]
    pairs.sort(key=lambda p: (-p[1], p[0]))
    return [p for p in pairs if p[1] != float("-inf")]


def sampling_logprobs(logits: torch.Tensor, *, temperature: float, top_p: float, banned: list[int] | None = None) -> torch.Tensor:
    """Log of the distribution `sample_token` draws from, [V] float32: tempered, banned ids
    removed, top-p truncated and renormalised (-inf outside). temperature 0: 0 at the argmax."""
    logits = logits.float()
    if banned:
        logits = logits.clone()
        logits[banned] = float("-inf")
    if temperature == 0:
        out = torch.full_like(logits, float("-inf"))
        out[int(torch.argmax(logits))] = 0.0
        return out
    probs = torch.softmax(logits / temperature, dim=-1)
    probs = torch.where(nucleus(probs, top_p), probs, torch.zeros_like(probs))
    return torch.log(probs / probs.sum())


def sample_token(logits: torch.Tensor, *, temperature: float, top_p: float,
                 generator: torch.Generator | None, banned: list[int] | None = None) -> tuple[int, float, float]:
    """Sample one token from logits [V]; return (token, policy_logprob, sampling_logprob).

    temperature 0 is greedy (sampling_logprob 0). One uniform draw from `generator` per call,
    inverse-CDF over token ids in ascending order, so a seed fixes the outcome. `banned` ids
    (EOS before min_tokens) are removed from the sampled distribution, not from the policy's.
    """
    if temperature < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"sampling: temperature {temperature} must be ≥ 0 and top_p {top_p} in (0, 1]")
    logits = logits.float()
    policy = torch.log_softmax(logits, dim=-1)
    if banned:
        logits = logits.clone()
        logits[banned] = float("-inf")
    if temperature == 0:
        tok = int(torch.argmax(logits))
        return tok, float(policy[tok]), 0.0
    probs = torch.softmax(logits / temperature, dim=-1)
    keep = nucleus(probs, top_p)
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    probs = probs / probs.sum()
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    cdf = probs.double().cumsum(0)
    tok = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True)[0])
    if tok >= len(probs) or not keep[tok]:  # u·cdf[-1] < cdf[-1] makes this unreachable; guard anyway
        tok = int(keep.nonzero().max())
    return tok, float(policy[tok]), float(torch.log(probs[tok]))
