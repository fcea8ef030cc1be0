"""Inspect TITO store files: `python -m gyre.trajectory RUN_DIR/tito/*.tito [--j-max 5] [--seed 0]`.

Prints, per execution, the store's state (records, torn tail) and the prefix-tree statistics of
docs/design.md §5 (requests, unique nodes, leaves, occurrences, duplicates saved), then the selection at
the given J_max: trajectories, dropped, L_i and the forward-backward token budget. With `--calls`,
the call tree first: one line a model call, indented under the earlier call whose whole sequence
(input + output) its input extends, with its role, token counts, policy version and finish reason.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from gyre.trajectory.selection import select_trajectories
from gyre.trajectory.store import read_execution
from gyre.trajectory.tree import build_tree


def call_tree(records: list) -> list[str]:
    """One line a call, indented under its parent: the latest earlier call whose whole sequence is
    a prefix of this call's input (a call that extends none is a root: a new context, e.g. a
    sub-agent or a compaction)."""
    seqs = {r.call_id: np.concatenate([r.input_ids, r.output_ids]) for r in records}
    depth: dict[int, int] = {}
    lines = []
    for r in sorted(records, key=lambda r: r.call_id):
        parent = None
        for q in sorted(depth, reverse=True):
            s = seqs[q]
            if len(s) <= len(r.input_ids) and np.array_equal(r.input_ids[:len(s)], s):
                parent = q
                break
        depth[r.call_id] = 0 if parent is None else depth[parent] + 1
        lines.append("  " * depth[r.call_id] + f"call {r.call_id} {r.role.name.lower()}: {len(r.input_ids)} in, "
                     f"{len(r.output_ids)} out, v{r.policy_version}, {r.finish_reason}"
                     + (f" (extends call {parent})" if parent is not None else " (new context)"))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gyre.trajectory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="store files (<execution_id>.tito)")
    ap.add_argument("--j-max", type=int, default=5, help="0 = unlimited")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calls", action="store_true", help="print each execution's call tree first")
    args = ap.parse_args(argv)
    for path in args.paths:
        res = read_execution(path)
        out: dict = {"path": path, "records": len(res.records), "torn_tail_bytes": res.torn_tail_bytes}
        if res.records and args.calls:
            print(f"{path}:")
            for line in call_tree(res.records):
                print("  " + line)
        if res.records:
            tree = build_tree(res.records)
            sel = select_trajectories(tree, args.j_max or None, np.random.default_rng(args.seed))
            out["tree"] = tree.stats.as_dict()
            out["selection"] = {
                "j_max": args.j_max or None,
                "trajectories": [(t.role.name, t.num_targets, t.seq_len) for t in sel.trajectories],
                "dropped": sel.dropped,
                "L": sel.num_targets,
                "fwd_bwd_tokens": sel.num_tokens,
            }
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
