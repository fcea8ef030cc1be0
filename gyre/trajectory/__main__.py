"""Inspect TITO store files: `python -m gyre.trajectory RUN_DIR/tito/*.tito [--j-max 5] [--seed 0]`.

Prints, per execution, the store's state (records, torn tail) and the prefix-tree statistics of
docs/design.md §5 (requests, unique nodes, leaves, occurrences, duplicates saved), then the selection at
the given J_max: trajectories, dropped, L_i and the forward-backward token budget.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from gyre.trajectory.selection import select_trajectories
from gyre.trajectory.store import read_execution
from gyre.trajectory.tree import build_tree


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gyre.trajectory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="store files (<execution_id>.tito)")
    ap.add_argument("--j-max", type=int, default=5, help="0 = unlimited")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for path in args.paths:
        res = read_execution(path)
        out: dict = {"path": path, "records": len(res.records), "torn_tail_bytes": res.torn_tail_bytes}
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
