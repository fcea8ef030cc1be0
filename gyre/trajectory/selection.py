"""Selection of training trajectories from a prefix tree, without replacement (docs/design.md §5).

Leaves are taken by role priority (main > main summary > sub-agent > sub-agent summary, i.e.
ascending `Role` value; HELPER leaves never), uniformly at random within a priority using the caller's generator.
Each chosen trajectory's targets T_j are the target tokens on its root-to-leaf path not yet
claimed; then its whole path is claimed. So the T_j are disjoint, a shared prefix is trained
once, and L = Σ_j |T_j| = |T_i| is the execution's normalizer (docs/design.md §6).

Because claimed regions are unions of root paths, claims are whole segments and the unclaimed
part of any path is a suffix of its segments: selection does no per-token work.

A trajectory that would claim zero targets (every target on its path is already claimed, or it
has none) is dropped and counted in `Selection.dropped`; it does not use one of the J_max slots,
since it would cost a forward-backward pass for no gradient. A trajectory's sequence is cut
after its last claimed target: later tokens could not change any trained position (causal
attention), so `seq_len` is what a forward-backward pass needs.

Example: a main leaf M and a summary leaf S sharing a prefix with 4 targets, M with 3 more and
S with 2 more: J_max=1 picks M (L=7); J_max=2 gives M (7) then S (2), L = 9.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gyre.trajectory.record import Role
from gyre.trajectory.tree import PrefixTree

__all__ = ["Selection", "Trajectory", "select_trajectories"]


@dataclass
class Trajectory:
    """One selected root-to-leaf path and the targets it claims."""

    leaf: int  # index into tree.leaf_seg
    role: Role
    segments: list[int]  # root-to-leaf segment ids
    first_own: int  # segments[first_own:] are the segments this trajectory claimed
    num_targets: int  # |T_j|
    seq_len: int  # tokens to feed: the path cut just after its last claimed target

    @property
    def own_segments(self) -> list[int]:
        return self.segments[self.first_own :]


@dataclass
class Selection:
    execution_id: str
    trajectories: list[Trajectory]
    dropped: int  # chosen trajectories that claimed no target
    candidates: int  # leaves of the tree
    j_max: int | None
    order: list[int] = field(default_factory=list)  # leaves in the order they were considered

    @property
    def num_targets(self) -> int:
        """L_i = |T_i| = Σ_j |T_j|."""
        return sum(t.num_targets for t in self.trajectories)

    @property
    def num_tokens(self) -> int:
        """Forward-backward token budget: Σ_j seq_len_j."""
        return sum(t.seq_len for t in self.trajectories)


def selection_order(tree: PrefixTree, rng: np.random.Generator) -> list[int]:
    """Leaves by ascending role value, shuffled uniformly within each role by `rng`."""
    order: list[int] = []
    for role in sorted(set(int(r) for r in tree.leaf_role)):
        if not Role(role).trained:  # build_tree leaves helpers out; a hand-built tree is checked here too
            continue
        leaves = np.flatnonzero(tree.leaf_role == role)
        order.extend(int(x) for x in leaves[rng.permutation(len(leaves))])
    return order


def select_trajectories(tree: PrefixTree, j_max: int | None = 5, rng: np.random.Generator | None = None) -> Selection:
    """Choose at most `j_max` trajectories (None = unlimited) of `tree`; see the module docstring.

    `rng` must be given explicitly (a seeded `np.random.Generator`) so selection is reproducible.
    """
    if rng is None:
        raise ValueError("select_trajectories: pass an explicit rng (np.random.default_rng(seed))")
    if j_max is not None and j_max < 1:
        raise ValueError(f"j_max must be >= 1 or None (unlimited), got {j_max}")
    claimed = np.zeros(tree.num_segments, np.bool_)
    chosen: list[Trajectory] = []
    dropped = 0
    order = selection_order(tree, rng)
    for leaf in order:
        if j_max is not None and len(chosen) >= j_max:
            break
        segs = tree.leaf_path(leaf)
        first_own = len(segs)
        while first_own > 0 and not claimed[segs[first_own - 1]]:
            first_own -= 1
        own = segs[first_own:]
        n_t = int(sum(int(tree.seg_num_targets[s]) for s in own))
        claimed[own] = True
        if n_t == 0:
            dropped += 1
            continue
        last = next(s for s in reversed(own) if tree.seg_num_targets[s] > 0)
        off = int(tree.seg_offset[last])
        last_pos = int(np.flatnonzero(tree.is_target[off : off + int(tree.seg_len[last])])[-1])
        chosen.append(
            Trajectory(
                leaf=leaf,
                role=Role(int(tree.leaf_role[leaf])),
                segments=segs,
                first_own=first_own,
                num_targets=n_t,
                seq_len=int(tree.seg_depth[last]) + last_pos + 1,
            )
        )
    return Selection(
        execution_id=tree.execution_id,
        trajectories=chosen,
        dropped=dropped,
        candidates=tree.num_leaves,
        j_max=j_max,
        order=order,
    )
