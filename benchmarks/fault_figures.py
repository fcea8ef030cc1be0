"""fault_bench's figures from a run directory's records, pure: what a fault cost, per fault kind
and execution plane (`benchmarks/fault_bench.py` runs the jobs and reads the files).

- executions cancelled, groups run again: the groups journal's "lost" rows (a resume found the
  group in flight, not evaluated, and runs its task again) and the executions of each lost group's
  last dispatch (what summary.json's `run.lost_in_flight` counts);
- calls recomputed: the router's `dead_engine_calls` (calls running on an engine when it died,
  recomputed elsewhere) in each attempt's summary.json. Under `--executions.plane rank0` each
  attempt has a router of its own (the attempts add up); under `process` one router serves every
  attempt, so each summary holds the run so far (the last one is the run's);
- time lost: the disturbed run's wall time less the undisturbed run's on the same plane (and the
  same topology: node1's against an undisturbed two-node run).
"""

from __future__ import annotations

from typing import Any

NOT_RUN = {"node1": "not run: `--faults node1` runs it (two network namespaces on this machine: needs root and "
                    "iproute2)"}  # the kinds a default run leaves out, and why


def journal_losses(journal: list[dict[str, Any]]) -> tuple[int, int]:
    """(groups run again, executions cancelled) from groups.jsonl's rows: each "lost" row is a group
    whose task ran again; its executions are those of its dispatch before the loss."""
    last_dispatch: dict[str, list[str]] = {}
    groups = executions = 0
    for row in journal:
        if row.get("kind") == "dispatched":
            last_dispatch[row["group_id"]] = list(row.get("executions", []))
        elif row.get("kind") == "lost":
            groups += 1
            executions += len(last_dispatch.get(row["group_id"], []))
    return groups, executions


def calls_recomputed(summaries: dict[int, dict[str, Any]], plane: str) -> int | None:
    """Calls recomputed because their engine died, from the summary.json each attempt wrote (by
    attempt number; an attempt whose rank 0 was killed wrote none). None when no summary has the
    figure."""
    counts = [s["dead_engine_calls"] for _, s in sorted(summaries.items()) if s.get("dead_engine_calls") is not None]
    if not counts:
        return None
    if plane == "process":  # one router across the attempts: cumulative
        return max(counts)
    if plane == "rank0":  # a router per attempt
        return sum(counts)
    raise ValueError(f"--planes: unknown plane {plane!r} (rank0 or process)")


def cell(undisturbed: dict[str, Any], disturbed: dict[str, Any]) -> dict[str, Any]:
    """One (fault, plane) cell: the four headline figures, then what says the run was whole."""
    return {"cancelled": disturbed["executions_cancelled"], "groups_run_again": disturbed["groups_run_again"],
            "calls_recomputed": disturbed["calls_recomputed"],
            "time_lost_s": round(disturbed["wall_s"] - undisturbed["wall_s"], 1),
            "wall_ratio": round(disturbed["wall_s"] / undisturbed["wall_s"], 2),
            **{k: disturbed[k] for k in ("steps_completed", "versions_continuous", "attempts", "carried_over_groups",
                                         "lost_in_flight_summary", "returncode", "hit")}}


def table(cells: dict[str, dict[str, dict[str, Any]]], not_measured: dict[str, str] | None = None) -> dict[str, Any]:
    """The results' figures: {fault: {plane: cell}}, each kind not measured as null with a note why
    (`not_measured` adds reasons to NOT_RUN's), and goal_met: every measured fault on the process
    plane cost 0 executions and 0 groups (`goal_faults` names them)."""
    missing = {k: why for k, why in {**NOT_RUN, **(not_measured or {})}.items() if k not in cells}
    process = {f: c["process"] for f, c in cells.items() if "process" in c}
    goal = bool(process) and all(c["cancelled"] == 0 and c["groups_run_again"] == 0 for c in process.values())
    return {**cells, **{k: None for k in missing}, "not_measured": missing, "goal_met": goal,
            "goal_faults": sorted(process)}


def measured(figures: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """The cells of a results file's figures: every fault kind that has them."""
    return {k: v for k, v in figures.items() if k not in ("not_measured", "goal_met", "goal_faults") and v}


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A results record holding `new`'s fault kinds and `old`'s others (a run of some kinds added to
    the file of an earlier run): the kinds' cells and runs, the figures and goal recomputed over
    both, `commit_by_fault` saying which commit measured each kind and `earlier` what the kept
    kinds ran on. A kind in both is `new`'s."""
    new_cells, old_cells = measured(new["figures"]), measured(old["figures"])
    kept = {k: v for k, v in old_cells.items() if k not in new_cells}
    by_commit = {**{k: old.get("commit_by_fault", {}).get(k, old.get("git_commit")) for k in kept},
                 **{k: new.get("git_commit") for k in new_cells}}
    why = {**old["figures"].get("not_measured", {}), **new["figures"].get("not_measured", {})}
    earlier = {k: old.get(k) for k in ("git_commit", "machine", "versions", "config")}
    return {**new, "runs": {**old.get("runs", {}), **new.get("runs", {})},
            "figures": table({**kept, **new_cells}, why), "commit_by_fault": by_commit, "earlier": earlier}


def lines(cells: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """The figures for a person: one line per (fault, plane)."""
    out = []
    for fault, planes in cells.items():
        for plane, c in planes.items():
            out.append(f"{fault:>9} / {plane:<7}: {c['cancelled']} executions cancelled, {c['groups_run_again']} groups "
                       f"run again, {c['calls_recomputed']} calls recomputed, {c['time_lost_s']:+.1f} s "
                       f"(x{c['wall_ratio']:.2f} the undisturbed wall)")
    return out
