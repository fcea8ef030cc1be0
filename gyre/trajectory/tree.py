"""Per-execution prefix tree (radix tree) over the token sequences of all model calls (docs/design.md §5).

Every call contributes the sequence input_ids + output_ids. Identical prefixes share nodes, so
compaction, sub-agents, retries and edited histories appear as branches; the candidate
trajectories are the leaves.

Provenance. A tree position is a *target* iff some call sampled the token at that position. A
tree position is its full prefix, so this is exactly "the same token id in the same context": an
earlier output that reappears verbatim, at the same position, in a later call's input stays a
target; a later input that diverges inside an earlier output branches off, and the new branch is
context unless that later call sampled it itself. If several calls sampled the same position, the
first in `call_id` order supplies the behavior log-prob.

Message nodes: where calls report `message_starts`, every position where some call starts a
message is *marked*; a message node ends just before a marked position or at a leaf
(docs/trajectory.md, "Prefix tree and provenance").

Implementation: a compressed radix tree whose edges ("segments") own growable numpy arrays.
Inserting a call walks O(branch points) segments and compares tokens vectorized, about one int32
comparison per input token; a call that extends a leaf appends in place. `PrefixTree` is the
frozen, flat result: arrays of length U (unique tokens) plus a segment table, memory O(U + segments).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from gyre.trajectory.record import CallRecord, Role

logger = logging.getLogger(__name__)

__all__ = ["PrefixTree", "TreeStats", "build_tree", "unique_call_ids"]


class _Seg:
    """A radix-tree edge: a run of tree positions with no branching inside."""

    __slots__ = ("tok", "tgt", "lp", "src", "mark", "n", "children", "parent", "end_calls")

    def __init__(self, parent: int, cap: int) -> None:
        cap = max(cap, 1)
        self.tok = np.empty(cap, np.int32)
        self.tgt = np.zeros(cap, np.bool_)
        self.lp = np.zeros(cap, np.float32)
        self.src = np.full(cap, -1, np.int32)
        self.mark = np.zeros(cap, np.bool_)
        self.n = 0
        self.children: dict[int, int] = {}
        self.parent = parent
        self.end_calls: list[int] = []  # calls whose sequence ends exactly at this segment's end

    def reserve(self, extra: int) -> None:
        need = self.n + extra
        if need <= len(self.tok):
            return
        cap = max(need, 2 * len(self.tok))
        for name in ("tok", "tgt", "lp", "src", "mark"):
            old = getattr(self, name)
            new = np.empty(cap, old.dtype) if name == "tok" else np.zeros(cap, old.dtype)
            if name == "src":
                new[:] = -1
            new[: self.n] = old[: self.n]
            setattr(self, name, new)

    def compact(self, lo: int, hi: int) -> None:
        for name in ("tok", "tgt", "lp", "src", "mark"):
            setattr(self, name, getattr(self, name)[lo:hi].copy())
        self.n = hi - lo


@dataclass
class TreeStats:
    """Per-execution statistics (the report of docs/design.md §5). Token and segment counts are always known;
    message counts are None when no call reported message boundaries."""

    calls: int
    unique_tokens: int
    token_segments: int  # edges of the compressed radix tree
    leaves: int
    expanded_tokens: int  # Σ over leaves of root-to-leaf path length
    duplicate_tokens_saved: int  # expanded_tokens - unique_tokens
    segment_occurrences: int  # Σ over leaves of segments on the path
    unique_target_tokens: int
    expanded_target_tokens: int  # Σ over leaves of target tokens on the path
    message_nodes: int | None = None
    message_occurrences: int | None = None
    message_duplicates_saved: int | None = None
    leaves_by_role: dict[str, int] = field(default_factory=dict)
    helper_calls: int = 0  # HELPER records left out of the tree (never trained)
    duplicate_calls: int = 0  # records repeating an earlier record exactly (call id included): dropped
    renumbered_calls: int = 0  # records reusing an earlier record's call id with other content: kept, fresh ids

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class PrefixTree:
    """Frozen prefix tree of one execution. Segments are numbered in BFS order (parents first).

    Flat token arrays, length U (unique tree positions), segment s owns
    [seg_offset[s], seg_offset[s] + seg_len[s]):
      tokens      [U] int32    token id
      is_target   [U] bool     sampled by the policy at this exact prefix
      logprob     [U] float32  behavior log-prob where is_target, else 0
      src_call    [U] int32    index into `call_ids` of the call that sampled it, -1 for context
      mark        [U] bool     a message starts here (see module docstring)
    Segment table, length S:
      seg_offset, seg_len, seg_parent (-1 for a top-level segment), seg_depth (tree depth of the
      segment's first token), seg_num_targets, seg_path_targets (targets from the root through
      the end of the segment), seg_is_leaf.
    Leaves, length Lf (leaf k ends segment leaf_seg[k]):
      leaf_seg [Lf] int64, leaf_role [Lf] int8 (best priority among the calls ending there),
      leaf_call [Lf] int64 (index into call_ids of the first such call).
    """

    execution_id: str
    tokens: np.ndarray
    is_target: np.ndarray
    logprob: np.ndarray
    src_call: np.ndarray
    mark: np.ndarray
    seg_offset: np.ndarray
    seg_len: np.ndarray
    seg_parent: np.ndarray
    seg_depth: np.ndarray
    seg_num_targets: np.ndarray
    seg_path_targets: np.ndarray
    seg_is_leaf: np.ndarray
    leaf_seg: np.ndarray
    leaf_role: np.ndarray
    leaf_call: np.ndarray
    call_ids: np.ndarray  # [C] int64, call_id of each call, in the order the tree numbered them
    call_roles: np.ndarray  # [C] int8
    call_versions: np.ndarray  # [C] int64 policy_version
    stats: TreeStats

    @classmethod
    def empty(cls, execution_id: str) -> "PrefixTree":
        """The tree of an execution without records (e.g. a harness that failed at once)."""
        z, b = np.zeros(0, np.int64), np.zeros(0, np.bool_)
        stats = TreeStats(0, 0, 0, 0, 0, 0, 0, 0, 0)
        return cls(execution_id, np.zeros(0, np.int32), b, np.zeros(0, np.float32), np.zeros(0, np.int32), b,
                   z, z, z, z, z, z, b, z, np.zeros(0, np.int8), z, z, np.zeros(0, np.int8), z, stats)

    @property
    def num_leaves(self) -> int:
        return len(self.leaf_seg)

    @property
    def num_segments(self) -> int:
        return len(self.seg_offset)

    def path_segments(self, seg: int) -> list[int]:
        """Segment ids from the root to `seg`, inclusive, root side first."""
        out = []
        while seg >= 0:
            out.append(int(seg))
            seg = int(self.seg_parent[seg])
        out.reverse()
        return out

    def leaf_path(self, leaf: int) -> list[int]:
        return self.path_segments(int(self.leaf_seg[leaf]))

    def path_array(self, segs: Sequence[int], arr: np.ndarray) -> np.ndarray:
        """Concatenate `arr` (one of the [U] arrays) over the segments `segs`."""
        return np.concatenate([arr[self.seg_offset[s] : self.seg_offset[s] + self.seg_len[s]] for s in segs])

    def leaf_tokens(self, leaf: int) -> np.ndarray:
        """[depth] int32: the full root-to-leaf token sequence of leaf `leaf`."""
        return self.path_array(self.leaf_path(leaf), self.tokens)


class _Builder:
    def __init__(self) -> None:
        self.segs: list[_Seg] = [_Seg(-1, 1)]  # 0 = root, holds no tokens

    def _fill(self, seg: _Seg, seq: np.ndarray, pos: int, n_in: int, rec: CallRecord, ci: int, ms: np.ndarray) -> None:
        """Append seq[pos:] (positions pos.. of the call's sequence) at the end of `seg`."""
        add = len(seq) - pos
        seg.reserve(add)
        a = seg.n
        seg.tok[a : a + add] = seq[pos:]
        o = max(pos, n_in)
        if o < len(seq):
            b = a + (o - pos)
            seg.tgt[b : a + add] = True
            seg.lp[b : a + add] = rec.output_logprobs[o - n_in :]
            seg.src[b : a + add] = ci
        lo = np.searchsorted(ms, pos)
        seg.mark[ms[lo:] - pos + a] = True
        seg.n += add

    def _merge(self, seg: _Seg, k: int, seq_pos: int, n_in: int, rec: CallRecord, ci: int, ms: np.ndarray) -> None:
        """The call matched seg[0:k] at sequence positions seq_pos..seq_pos+k: add its provenance."""
        end = seq_pos + k
        o = max(seq_pos, n_in)
        if o < end:
            a = o - seq_pos
            fresh = ~seg.tgt[a:k]
            if fresh.any():
                seg.lp[a:k][fresh] = rec.output_logprobs[o - n_in : end - n_in][fresh]
                seg.src[a:k][fresh] = ci
                seg.tgt[a:k] = True
        lo, hi = np.searchsorted(ms, (seq_pos, end))
        if hi > lo:
            seg.mark[ms[lo:hi] - seq_pos] = True

    def _split(self, si: int, k: int) -> None:
        """Cut segment si after its first k tokens; the tail becomes its only child."""
        seg = self.segs[si]
        low = _Seg(si, 1)
        low.tok, low.tgt, low.lp, low.src, low.mark = seg.tok, seg.tgt, seg.lp, seg.src, seg.mark
        low.n = seg.n
        low.compact(k, seg.n)
        low.children, low.end_calls = seg.children, seg.end_calls
        li = len(self.segs)
        self.segs.append(low)
        for c in low.children.values():
            self.segs[c].parent = li
        seg.compact(0, k)
        seg.children = {int(low.tok[0]): li}
        seg.end_calls = []

    def insert(self, rec: CallRecord, ci: int) -> None:
        n_in = len(rec.input_ids)
        seq = np.concatenate([rec.input_ids, rec.output_ids]) if len(rec.output_ids) else rec.input_ids
        n = len(seq)
        ms = rec.message_starts
        segs = self.segs
        si, pos = 0, 0
        while pos < n:
            seg = segs[si]
            ci_child = seg.children.get(int(seq[pos]))
            if ci_child is None:
                if si != 0 and not seg.children:  # a leaf: extend it in place
                    self._fill(seg, seq, pos, n_in, rec, ci, ms)
                    seg.end_calls = [ci]
                else:
                    new = _Seg(si, n - pos)
                    self._fill(new, seq, pos, n_in, rec, ci, ms)
                    new.end_calls = [ci]
                    seg.children[int(seq[pos])] = len(segs)
                    segs.append(new)
                return
            child = segs[ci_child]
            m = min(child.n, n - pos)
            diff = np.flatnonzero(child.tok[:m] != seq[pos : pos + m])
            k = int(diff[0]) if diff.size else m
            self._merge(child, k, pos, n_in, rec, ci, ms)
            if k < child.n:
                if pos + k == n:
                    return  # ends strictly inside a segment: not a leaf
                self._split(ci_child, k)
                new = _Seg(ci_child, n - pos - k)
                self._fill(new, seq, pos + k, n_in, rec, ci, ms)
                new.end_calls = [ci]
                child.children[int(seq[pos + k])] = len(segs)
                segs.append(new)
                return
            pos += child.n
            si = ci_child
        segs[si].end_calls.append(ci)


def _validate(rec: CallRecord, execution_id: str) -> None:
    where = f"CallRecord {rec.execution_id}/{rec.call_id}"
    if rec.execution_id != execution_id:
        raise ValueError(f"{where}: execution_id differs from the first record's {execution_id!r}")
    if len(rec.input_ids) == 0:
        raise ValueError(f"{where}: input_ids is empty (a sampled token needs a context)")
    ms = rec.message_starts
    if len(ms):
        if ms[0] < 0 or ms[-1] >= len(rec.input_ids) or (len(ms) > 1 and np.any(np.diff(ms) <= 0)):
            raise ValueError(f"{where}: message_starts must be strictly increasing offsets in [0, {len(rec.input_ids)})")


def _same_call(a: CallRecord, b: CallRecord) -> bool:
    """The same sample written twice: role, ids, log-probs, versions and message starts (the
    times and payload may differ; the tree holds none of them)."""
    return (a.role == b.role and np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.output_ids, b.output_ids)
            and np.array_equal(a.output_logprobs, b.output_logprobs) and np.array_equal(a.output_versions, b.output_versions)
            and np.array_equal(a.message_starts, b.message_starts))


def unique_call_ids(records: Sequence[CallRecord]) -> tuple[list[CallRecord], int, int]:
    """(records with unique call ids, duplicates dropped, records renumbered). A proxy before
    call ids survived its restarts reissued them from 0 in the same file; no such file may cost its
    execution. Taken in the given order (a store file's: the order they were written): a record
    equal to an earlier one with its call id (`_same_call`) is dropped; any other record whose
    call id was taken gets a fresh one past every id in `records` (copies; the inputs are unchanged),
    so every distinct call is trained once, later calls after earlier ones."""
    seen: dict[int, list[CallRecord]] = {}
    out: list[CallRecord] = []
    dropped = renumbered = 0
    fresh = max((r.call_id for r in records), default=-1) + 1
    for r in records:
        same_id = seen.get(r.call_id)
        if same_id is None:
            seen[r.call_id] = [r]
            out.append(r)
        elif any(_same_call(r, o) for o in same_id):
            dropped += 1
        else:
            same_id.append(r)
            out.append(dataclasses.replace(r, call_id=fresh))
            fresh += 1
            renumbered += 1
    if dropped or renumbered:
        logger.warning("build_tree: execution %r reuses call ids (a proxy restarted by an older gyre): %d exact "
                       "duplicate(s) dropped, %d other call(s) kept under fresh ids", records[0].execution_id, dropped, renumbered)
    return out, dropped, renumbered


def build_tree(records: Sequence[CallRecord]) -> PrefixTree:
    """Build the prefix tree of one execution's records (any order; processed by call_id).

    HELPER calls (a harness's background calls, `Role.HELPER`) are left out: they are recorded but
    never trained, so they own no position and no leaf. An execution with only helper calls gives
    `PrefixTree.empty` (its stats count the helper calls).

    Records that reuse a call id (files of a proxy restarted before call ids outlived it) never
    fail the execution: `unique_call_ids`, counted in `TreeStats.duplicate_calls` and
    `renumbered_calls`. Raises ValueError on an empty list, mixed executions, empty inputs or
    malformed message_starts.
    """
    if not records:
        raise ValueError("build_tree: no records")
    exec_id = records[0].execution_id
    records, dropped, renumbered = unique_call_ids(records)
    helpers = sum(1 for r in records if not r.role.trained)
    if helpers:
        records = [r for r in records if r.role.trained]
        if not records:
            tree = PrefixTree.empty(exec_id)
            tree.stats.helper_calls, tree.stats.duplicate_calls, tree.stats.renumbered_calls = helpers, dropped, renumbered
            return tree
    recs = sorted(records, key=lambda r: r.call_id)
    has_marks = False
    builder = _Builder()
    for ci, rec in enumerate(recs):
        _validate(rec, exec_id)
        has_marks |= len(rec.message_starts) > 0
        builder.insert(rec, ci)
    tree = _freeze(builder, recs, has_marks)
    tree.stats.helper_calls, tree.stats.duplicate_calls, tree.stats.renumbered_calls = helpers, dropped, renumbered
    return tree


def _freeze(builder: _Builder, recs: list[CallRecord], has_marks: bool) -> PrefixTree:
    segs = builder.segs
    # BFS from the root, children in token order, so numbering is canonical for a set of calls.
    order: list[int] = []
    queue = deque(segs[0].children[t] for t in sorted(segs[0].children))
    while queue:
        s = queue.popleft()
        order.append(s)
        ch = segs[s].children
        queue.extend(ch[t] for t in sorted(ch))
    new_id = {old: i for i, old in enumerate(order)}
    S = len(order)
    seg_len = np.array([segs[s].n for s in order], np.int64)
    seg_offset = np.zeros(S, np.int64)
    if S:
        np.cumsum(seg_len[:-1], out=seg_offset[1:])
    U = int(seg_len.sum())

    def flat(name: str, dtype) -> np.ndarray:
        out = np.empty(U, dtype)
        for i, s in enumerate(order):
            out[seg_offset[i] : seg_offset[i] + seg_len[i]] = getattr(segs[s], name)[: segs[s].n]
        return out

    tokens, is_target, logprob = flat("tok", np.int32), flat("tgt", np.bool_), flat("lp", np.float32)
    src_call, mark = flat("src", np.int32), flat("mark", np.bool_)
    seg_parent = np.array([new_id.get(segs[s].parent, -1) for s in order], np.int64)
    seg_is_leaf = np.array([not segs[s].children for s in order], np.bool_)
    seg_num_targets = np.add.reduceat(is_target, seg_offset, dtype=np.int64) if S else np.zeros(0, np.int64)
    seg_depth = np.zeros(S, np.int64)
    seg_path_targets = np.zeros(S, np.int64)
    seg_path_segs = np.zeros(S, np.int64)
    if has_marks:
        top = seg_offset[seg_parent < 0]
        mark[top] = True  # the first message of every sequence starts at depth 0
        seg_marks = np.add.reduceat(mark, seg_offset, dtype=np.int64) if S else np.zeros(0, np.int64)
    else:
        seg_marks = np.zeros(S, np.int64)
    seg_path_marks = np.zeros(S, np.int64)
    for i in range(S):  # parents precede children in BFS order
        p = seg_parent[i]
        if p >= 0:
            seg_depth[i] = seg_depth[p] + seg_len[p]
            seg_path_targets[i] = seg_path_targets[p] + seg_num_targets[i]
            seg_path_segs[i] = seg_path_segs[p] + 1
            seg_path_marks[i] = seg_path_marks[p] + seg_marks[i]
        else:
            seg_path_targets[i] = seg_num_targets[i]
            seg_path_segs[i] = 1
            seg_path_marks[i] = seg_marks[i]
    leaf_seg = np.flatnonzero(seg_is_leaf).astype(np.int64)
    leaf_role = np.zeros(len(leaf_seg), np.int8)
    leaf_call = np.zeros(len(leaf_seg), np.int64)
    for k, i in enumerate(leaf_seg):
        ends = segs[order[i]].end_calls
        best = min(ends, key=lambda c: (int(recs[c].role), c))
        leaf_role[k], leaf_call[k] = int(recs[best].role), best

    leaf_depth_end = seg_depth[leaf_seg] + seg_len[leaf_seg]
    expanded = int(leaf_depth_end.sum())
    msg_nodes = msg_occ = msg_saved = None
    if has_marks:
        inner = int(sum(mark[seg_offset[i] + 1 : seg_offset[i] + seg_len[i]].sum() for i in range(S)))
        # positions whose child (first token of a child segment) is marked; one per parent
        parents_with_marked_child = {int(seg_parent[i]) for i in range(S) if seg_parent[i] >= 0 and mark[seg_offset[i]]}
        msg_nodes = len(leaf_seg) + inner + len(parents_with_marked_child)
        msg_occ = int(seg_path_marks[leaf_seg].sum())
        msg_saved = msg_occ - msg_nodes
    by_role: dict[str, int] = {}
    for r in leaf_role:
        by_role[Role(int(r)).name] = by_role.get(Role(int(r)).name, 0) + 1
    stats = TreeStats(
        calls=len(recs),
        unique_tokens=U,
        token_segments=S,
        leaves=len(leaf_seg),
        expanded_tokens=expanded,
        duplicate_tokens_saved=expanded - U,
        segment_occurrences=int(seg_path_segs[leaf_seg].sum()),
        unique_target_tokens=int(is_target.sum()),
        expanded_target_tokens=int(seg_path_targets[leaf_seg].sum()),
        message_nodes=msg_nodes,
        message_occurrences=msg_occ,
        message_duplicates_saved=msg_saved,
        leaves_by_role=by_role,
    )
    return PrefixTree(
        execution_id=recs[0].execution_id,
        tokens=tokens,
        is_target=is_target,
        logprob=logprob,
        src_call=src_call,
        mark=mark,
        seg_offset=seg_offset,
        seg_len=seg_len,
        seg_parent=seg_parent,
        seg_depth=seg_depth,
        seg_num_targets=seg_num_targets,
        seg_path_targets=seg_path_targets,
        seg_is_leaf=seg_is_leaf,
        leaf_seg=leaf_seg,
        leaf_role=leaf_role,
        leaf_call=leaf_call,
        call_ids=np.array([r.call_id for r in recs], np.int64),
        call_roles=np.array([int(r.role) for r in recs], np.int8),
        call_versions=np.array([r.policy_version for r in recs], np.int64),
        stats=stats,
    )
