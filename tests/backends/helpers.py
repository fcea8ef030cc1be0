"""Shared builders for backend tests: tiny models and packed micro-steps from random data."""

from __future__ import annotations

import torch

from gyre.backends.models.hf import build_model, model_config, packed_logits
from gyre.trajectory.microstep import MicroStep

VOCAB = 256


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, vocab: int = VOCAB, jitter: float = 0.3):
    """A tiny Qwen2 with weights moved off the near-uniform init, so log-probs vary."""
    model = build_model(model_config("tiny", vocab), seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * jitter)
    return model


def pack(sequences, targets_from, exec_of_seq, advantages, behavior_model, *, gen, index=0, noise=1e-3):
    """One MicroStep holding `sequences` (lists of ids) back to back.

    Positions t ≥ targets_from[s] − 1 (all but the last) of sequence s predict training targets
    of execution exec_of_seq[s]. Behaviour log-probs are `behavior_model`'s plus noise, so the
    execution ratios sit around 1. exec_lengths / token_weight are filled by `finish_step`.
    """
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    pos = torch.cat([torch.arange(len(s)) for s in sequences])
    cu = torch.tensor([0] + list(torch.tensor([len(s) for s in sequences]).cumsum(0)), dtype=torch.long)
    n = ids.numel()
    targets = torch.zeros(n, dtype=torch.long)
    mask = torch.zeros(n, dtype=torch.bool)
    exec_index = torch.full((n,), -1, dtype=torch.long)
    for s, seq in enumerate(sequences):
        a = int(cu[s])
        for j in range(len(seq) - 1):
            targets[a + j] = seq[j + 1]
            if j + 1 >= targets_from[s]:
                mask[a + j] = True
                exec_index[a + j] = exec_of_seq[s]
    with torch.no_grad():
        logits = packed_logits(behavior_model, ids, pos, cu).double()
    lp = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    behavior = torch.where(mask, lp + noise * torch.randn(n, generator=gen, dtype=torch.float64), torch.zeros_like(lp)).float()
    E = len(advantages)
    return MicroStep(
        input_ids=ids, position_ids=pos, cu_seqlens=cu, targets=targets, target_mask=mask,
        behavior_logprobs=behavior, exec_index=exec_index, token_weight=torch.zeros(n, dtype=torch.float64),
        advantages=torch.tensor(advantages, dtype=torch.float64), exec_lengths=torch.zeros(E, dtype=torch.long),
        num_executions=E, index=index,
    )


def finish_step(micro_steps: list[MicroStep]) -> list[MicroStep]:
    """Fill exec_lengths (L_i over the whole step) and token_weight = −A_i/(|E|·L_i)."""
    E = micro_steps[0].num_executions
    lengths = torch.zeros(E, dtype=torch.long)
    for ms in micro_steps:
        lengths += torch.bincount(ms.exec_index[ms.target_mask], minlength=E)
    for ms in micro_steps:
        ms.exec_lengths = lengths.clone()
        w = torch.zeros_like(ms.token_weight)
        i = ms.exec_index[ms.target_mask]
        w[ms.target_mask] = -ms.advantages[i] / (E * lengths[i].double())
        ms.token_weight = w
    return micro_steps


def random_step(model, *, seed: int, num_exec: int = 4, seqs_per_exec: int = 2, num_micro: int = 4, vocab: int = VOCAB):
    """A step of `num_micro` micro-steps; an execution's sequences may land in different ones."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for e in range(num_exec):
        for _ in range(seqs_per_exec):
            length = int(torch.randint(6, 20, (1,), generator=gen))
            seq = torch.randint(0, vocab, (length,), generator=gen).tolist()
            seqs.append((seq, int(torch.randint(1, length - 1, (1,), generator=gen)), e))
    adv = (torch.randn(num_exec, generator=gen, dtype=torch.float64)).tolist()
    order = torch.randperm(len(seqs), generator=gen).tolist()
    buckets = [order[i::num_micro] for i in range(num_micro)]
    steps = [pack([seqs[j][0] for j in b], [seqs[j][1] for j in b], [seqs[j][2] for j in b], adv, model, gen=gen, index=k)
             for k, b in enumerate(buckets)]
    return finish_step(steps)


def merge(micro_steps: list[MicroStep]) -> MicroStep:
    """Concatenate micro-steps of one step into a single micro-step (same tokens, same table)."""
    cat = lambda name: torch.cat([getattr(ms, name) for ms in micro_steps])
    offsets, cu = 0, [torch.zeros(1, dtype=torch.long)]
    for ms in micro_steps:
        cu.append(ms.cu_seqlens[1:] + offsets)
        offsets += ms.num_tokens
    first = micro_steps[0]
    return MicroStep(
        input_ids=cat("input_ids"), position_ids=cat("position_ids"), cu_seqlens=torch.cat(cu), targets=cat("targets"),
        target_mask=cat("target_mask"), behavior_logprobs=cat("behavior_logprobs"), exec_index=cat("exec_index"),
        token_weight=cat("token_weight"), advantages=first.advantages, exec_lengths=first.exec_lengths,
        num_executions=first.num_executions,
    )


def check_backends_of(cfg) -> None:
    """`factory.check_backends` on a parsed command line's sections, as gyre.config_checks hands them."""
    from gyre.backends import factory

    factory.check_backends(cfg.backend, cfg.transfer, cfg.model, cfg.parallel, cfg.train.resumed())


def engine_of(cfg, model_config, params, **kw):
    """`factory.build_engine` on a parsed command line's sections, as gyre/runtime/job.py hands them."""
    from gyre.backends import factory

    return factory.build_engine(cfg.model, cfg.engine, cfg.backend, model_config, params, transfer=cfg.transfer,
                                sglang=cfg.sglang, cell_size=cfg.parallel.cell_size, run_dir=cfg.run_dir, **kw)
