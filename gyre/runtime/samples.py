"""A finished group → its training work: micro-step *bundles* (docs/design.md §5–6).

The scheduler hands out work items; here one item is a bundle of micro-steps that share an
execution. Packing keeps an execution in one micro-step whenever it fits, so nearly every bundle
is a single micro-step; when an execution had to be split, its micro-steps travel together and
the cell that trains them runs the forward-only pre-pass for s_i first (`train_bundle`). That
keeps s_i exact without a cross-cell reduction in the middle of a step.

Loss denominator. A step consumes B groups of N executions; with streaming, a group's
micro-steps are made before the step knows its other groups, so a group is packed with the
nominal |E| = B·N. Then every token weight −A_i/(|E|·L_i) is final when the group is packed,
and any cell can train any item. The spec's E is the step's executions with a valid reward
(docs/design.md §6; excluded ones leave it, harness-failure placeholders stay): the loss is
linear in 1/|E|, so `step_denominator` gives the one factor B·N/valid by which the core
multiplies the summed gradient before clipping (`Actor.optimizer_step(grad_scale=...)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from gyre.executions.evaluator import RewardStatus
from gyre.loss.config import LossConfig
from gyre.trajectory.advantages import Outcome
from gyre.trajectory.materialize import ScoredExecution, ScoredGroup, materialize_step
from gyre.trajectory.microstep import MicroStep


@dataclass
class GroupWork:
    bundles: list[list[MicroStep]]
    rewards: list[float | None]  # per execution, None when excluded (not in E)
    dropped_trajectories: int = 0  # selected trajectories that claimed no target (the step row's)
    zero_advantage: bool = False  # valid rewards all equal: no micro-steps (`materialize_step`), counted

    @property
    def trains(self) -> bool:
        """Some bundle holds a micro-step (False: the group costs no forward or backward)."""
        return any(len(b) for b in self.bundles)


def outcome(reward: Any) -> Outcome:
    """A runner reward result (`gyre.executions.evaluator.RewardResult`, None when there is none)
    → the trajectory processor's outcome (docs/design.md §5): EXCLUDED leaves E, a PLACEHOLDER
    (the harness failed) stays in it at 0.0."""
    if reward is None or reward.status is RewardStatus.EXCLUDED:
        return Outcome.eval_failed()
    if reward.status is RewardStatus.PLACEHOLDER:
        return Outcome.harness_failed()
    return Outcome.scored(reward.reward)


def step_denominator(rewards_by_group: Sequence[Sequence[float | None]], *, nominal: int,
                     loss: LossConfig) -> tuple[int, float | None]:
    """(valid, grad_scale) of a step from its groups' `GroupWork.rewards`.

    valid = executions with a reward (placeholders count, at 0.0; excluded ones are None);
    grad_scale = `loss.grad_scale(nominal=B·N, valid=valid)`, None when valid is 0 (no update).
    Example: two groups [1.0, None], [0.0, 0.5] with B·N = 4 → (3, 4/3) under 'valid'.
    """
    valid = sum(r is not None for rewards in rewards_by_group for r in rewards)
    return valid, loss.grad_scale(nominal=nominal, valid=valid)


def bundle_micro_steps(micro_steps: Sequence[MicroStep]) -> list[list[MicroStep]]:
    """Group micro-steps that share an execution (connected components), order preserved."""
    parent = list(range(len(micro_steps)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for i, ms in enumerate(micro_steps):
        for e in ms.exec_index[ms.target_mask].unique().tolist():
            if e in owner:
                parent[find(i)] = find(owner[e])
            else:
                owner[e] = i
    comps: dict[int, list[MicroStep]] = {}
    for i, ms in enumerate(micro_steps):
        comps.setdefault(find(i), []).append(ms)
    return list(comps.values())


def audit_bundle(audit_dir: str, step: int, group: int, item: int, cell: int, bundle: Sequence[MicroStep]) -> None:
    """--train.audit-dir: a bundle as it is sent to be trained, for offline checks."""
    import torch
    from pathlib import Path

    path = Path(audit_dir) / f"step_{step:06d}"
    path.mkdir(parents=True, exist_ok=True)
    torch.save({"cell": cell, "bundle": bundle}, path / f"bundle_{group}_{item}.pt")


def tito_records(tito: Any, execution_id: str) -> tuple[list, bool]:
    """An execution's TITO records in `tito` (a `gyre.trajectory.store.TitoStore`) and whether its
    file's tail was torn; ([], False) when it has no file (its harness never made a call)."""
    if not tito.path_for(execution_id).is_file():
        return [], False
    read = tito.read(execution_id)
    return read.records, read.torn


def group_work(
    group_id: str,
    dispatch_version: int,
    executions: Sequence[ScoredExecution],
    *,
    num_executions: int,
    max_tokens: int,
    j_max: int | None,
    normalize_std: bool,
    rng: np.random.Generator,
) -> GroupWork:
    """The group's N scored executions (records given) → its bundles and per-execution rewards."""
    g = ScoredGroup(group_id, dispatch_version, list(executions))
    batch = materialize_step([g], max_tokens=max_tokens, rng=rng, j_max=j_max, normalize_std=normalize_std,
                             num_executions=num_executions)
    bundles = bundle_micro_steps(batch.micro_steps) or [[]]  # an empty item keeps the group countable
    return GroupWork(bundles, [e.outcome.value for e in executions], batch.dropped_trajectories,
                     zero_advantage=bool(batch.all_equal_groups))


SUMMABLE = ("loss", "tokens", "num_executions", "num_targets", "num_clipped", "num_omega_capped", "abs_delta_sum")


def merge_metrics(acc: dict[str, float], m: dict[str, float]) -> dict[str, float]:
    """Add one micro-step's (or cell's) loss metrics into `acc`: counts add, s_i extremes combine."""
    for k in SUMMABLE + ("micro_steps", "ratio_sum"):
        if k in m:
            acc[k] = acc.get(k, 0.0) + float(m[k])
    if "ratio_mean" in m:
        acc["ratio_sum"] = acc.get("ratio_sum", 0.0) + float(m["ratio_mean"]) * float(m.get("num_executions", 0.0))
    if m.get("num_executions", 0) or "ratio_sum" in m:
        for k, f in (("ratio_min", min), ("ratio_max", max)):
            if k in m:
                acc[k] = f(acc[k], float(m[k])) if k in acc else float(m[k])
    return acc


def summarize_metrics(acc: dict[str, float]) -> dict[str, float]:
    """Step-level loss metrics from merged counts (docs/design.md §6: clip fraction, mean s_i, ω capped)."""
    n_exec, n_tok = acc.get("num_executions", 0.0), acc.get("num_targets", 0.0)
    return {
        "loss": acc.get("loss", 0.0),
        "tokens_trained": acc.get("tokens", 0.0),
        "targets_trained": n_tok,
        "micro_steps": acc.get("micro_steps", 0.0),
        "clip_frac": acc.get("num_clipped", 0.0) / n_exec if n_exec else 0.0,
        "ratio_mean": acc.get("ratio_sum", 0.0) / n_exec if n_exec else 1.0,
        "ratio_min": acc.get("ratio_min", 1.0),
        "ratio_max": acc.get("ratio_max", 1.0),
        "omega_capped_frac": acc.get("num_omega_capped", 0.0) / n_tok if n_tok else 0.0,
        "abs_delta_mean": acc.get("abs_delta_sum", 0.0) / n_tok if n_tok else 0.0,
    }


def train_bundle(actor: Any, bundle: Sequence[MicroStep]) -> dict[str, float]:
    """Accumulate the gradients of one bundle on `actor`; returns its merged loss metrics."""
    if not bundle:
        return {"micro_steps": 0.0}
    logratio = None
    if len(bundle) > 1:  # the execution spans micro-steps: s_i needs Σδ over all of them first
        logratio = sum(actor.exec_logratio_partial_sums(ms) for ms in bundle)
    acc: dict[str, float] = {"micro_steps": float(len(bundle))}
    for ms in bundle:
        merge_metrics(acc, actor.forward_backward(ms, exec_logratio_sum=logratio))
    return acc
