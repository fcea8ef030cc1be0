"""Trajectory processor (docs/design.md §4–6; docs/trajectory.md): TITO records and store, prefix
tree, selection, advantages, packing. One step, every function pure and deterministic given its
explicit generator:

    records   = load_execution(path)                      # store.py   list[CallRecord]
    tree      = build_tree(records)                       # tree.py    PrefixTree (+ .stats)
    selection = select_trajectories(tree, j_max, rng)     # selection.py
    groups    = compute_advantages([[Outcome, ...], ...]) # advantages.py
    micro     = pack_step([ExecutionSample(...)], max_tokens)  # packing.py  list[MicroStep]

or all of it at once: `materialize_step([ScoredGroup(...)], max_tokens=..., rng=...)`
(materialize.py). `python -m gyre.trajectory FILE.tito ...` inspects store files. Nothing is
imported at package import time; import the submodules you need.
"""
