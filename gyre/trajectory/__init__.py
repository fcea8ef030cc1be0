"""Trajectory processor: TITO records and store, prefix tree, selection, packing, advantages.

Pipeline for one training step (docs/design.md §4–6), every function pure and deterministic given its
explicit generator:

    records   = load_execution(path)                      # store.py   list[CallRecord]
    tree      = build_tree(records)                       # tree.py    PrefixTree (+ .stats)
    selection = select_trajectories(tree, j_max, rng)     # selection.py
    groups    = compute_advantages([[Outcome, ...], ...]) # advantages.py
    micro     = pack_step([ExecutionSample(...)], max_tokens)  # packing.py  list[MicroStep]

or all of it at once: `materialize_step([ScoredGroup(...)], max_tokens=..., rng=...)`.

Public API (import from `gyre.trajectory.<module>`):

record.py      `CallRecord`, `Role` — one TITO record per model call (shared contract).
microstep.py   `MicroStep` — one packed micro-step for an actor (shared contract); `exec_split`
               [E] bool says which executions span several micro-steps (need the Σδ pre-pass).
store.py       `TitoWriter(path, execution_id, fsync=False, delta_window=4)` — the proxy's
               per-execution appender; `append(record)` is thread-safe, refuses other
               executions' records; reopening truncates a torn tail.
               `TitoStore(root)` — `writer(eid)`, `path_for(eid)`, `load(eid)`, `read(eid)`.
               `load_execution(path) -> list[CallRecord]`; `read_execution(path) ->
               StoreReadResult(records, valid_bytes, torn_tail_bytes)`; `StoreCorruptError`.
tree.py        `build_tree(records) -> PrefixTree` (radix tree, provenance: `is_target`,
               `logprob`; leaves with roles; `stats: TreeStats` — calls, unique tokens,
               segments, leaves, expanded tokens/targets, message nodes/occurrences/saved).
selection.py   `select_trajectories(tree, j_max=5, rng) -> Selection` (`trajectories`,
               `dropped`, `num_targets` = L_i, `num_tokens` = fwd-bwd budget).
advantages.py  `Outcome.scored(r) / .eval_failed() / .harness_failed()`;
               `group_advantages(outcomes, normalize_std=True) -> GroupAdvantages`
               (`advantages` NaN where excluded, `all_equal`, `empty`); `compute_advantages`.
packing.py     `ExecutionSample(execution_id, tree, selection, advantage)`;
               `pack_step(samples, max_tokens, num_executions=None, step=0,
               context_parallel_size=1, pad_token_id=0) -> list[MicroStep]`;
               `cp_shard_index(cu_seqlens, cp, rank)` (zigzag CP shard of a micro-step);
               `TrajectoryTooLongError`; `plan_bins` (the pure bin plan).
materialize.py `ScoredGroup(group_id, v_d, [ScoredExecution(execution_id, outcome, tito_path |
               records)])`; `materialize_step(groups, max_tokens, rng, j_max=5, normalize_std=True,
               skip_zero_advantage=True, step=0, train_version=None, num_executions=None,
               context_parallel_size=1) -> StepBatch`. (Which ready group a step takes is the
               scheduler's heap, oldest dispatch version first: `gyre.scheduler`.)
__main__.py    `python -m gyre.trajectory FILE.tito ... [--j-max 5]`: store state, tree stats,
               selection and token budget as JSON lines.

Nothing is imported at package import time; import the submodules you need.
"""
