"""What a fault costs, per fault kind and execution plane, against the same run undisturbed.

Every run is a real `torchrun --max-restarts 1` job of 3 gloo ranks (the core and two
satellites, cells of one rank), the tiny model, groups of N executions of a 3-turn harness, S
steps, a checkpoint every step. For each plane in `--planes` (`--executions.plane rank0`: the
proxy and the harnesses live in rank 0; `process`: in a process of their own that outlives the
workers) one run goes undisturbed, then one per fault in `--faults`, injected once
`--kill-after` steps are done:

- satellite: rank 1 SIGKILLed (torchrun restarts every worker; the job resumes from the newest
  complete checkpoint);
- rank0: rank 0 SIGKILLed (the controller; under `rank0` the proxy and harnesses die with it).
  On this CPU path a cell is one rank, so the core's rank is rank 0: "core rank SIGKILL" and
  "rank 0 SIGKILL" are the same fault here and are reported once, as rank0 (a core rank other
  than rank 0 needs cell_size > 1, a GPU cluster);
- freeze (optional): rank 2 SIGSTOPped for `--freeze-s` seconds, then continued (its calls move
  off it within `--proxy.engine-progress-timeout-s`; no restart).

A rank killed on node 1 of a two-node job is not measured here (one node; see the results'
"not_measured"). Per (fault, plane): executions cancelled, groups run again, calls recomputed
because their engine died, time lost (wall − the undisturbed wall, same plane); the goal is
0 cancelled and 0 groups run again for every fault on the process plane (`goal_met`). How each
figure is read: benchmarks/fault_figures.py.

    python -m benchmarks.fault_bench [--faults satellite,rank0] [--planes rank0,process] [--steps 10]

The last line printed is one JSON object of figures; `--out benchmarks/results/fault_bench.json`
writes the results file.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.fault_figures import calls_recomputed, cell, journal_losses, lines, table
from benchmarks.provenance import OUT_HELP, ROOT, provenance, write_results
from tests.jobs import env, rows, worker_pid, write_tasks

HARNESS = ROOT / "tests" / "runtime" / "tiny_harness.py"
FAULTS = {"satellite": 1, "rank0": 0, "freeze": 2}  # the rank each fault hits
PLANES = ("rank0", "process")


def _command(args, tasks: Path, run_dir: Path, plane: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", "--max-restarts", "1",
            "-m", "gyre.run", "--job", "train", "--model.preset", "tiny", "--executions.dataset.path", str(tasks),
            "--run-dir", str(run_dir), "--executions.runner.timeout-s", "180", "--executions.plane", plane,
            "--scheduler.n-per-group", str(args.n), "--scheduler.batch-groups", "2", "--scheduler.mu", "1",
            "--scheduler.phi", "0.5", "--scheduler.tick-s", "0.1", "--train.steps", str(args.steps),
            "--train.checkpoint-every", "1", "--train.max-tokens", "512", "--train.drain-at-end-s", "5",
            "--proxy.engine-progress-timeout-s", str(args.progress_timeout_s),
            "--train.control-timeout-s", str(max(120.0, 4 * args.freeze_s))]


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not there yet, or being replaced
        return None


def run(args, work: Path, plane: str, fault: str | None) -> dict:
    """One job, disturbed by `fault` (None: undisturbed); its raw figures."""
    name = f"{plane}-{fault or 'undisturbed'}"
    run_dir = work / name
    tasks = write_tasks(work / "tasks.jsonl", [sys.executable, str(HARNESS), "3", "8"], n=8)
    log_path = work / f"{name}.log"
    summaries: dict[int, dict] = {}  # each attempt's summary.json, read as it appears (the next attempt replaces it)
    hit = thaw_at = None
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(_command(args, tasks, run_dir, plane), cwd=work, env=env(), stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None and time.monotonic() - t0 < args.timeout_s:
                if (s := _read(run_dir / "summary.json")) is not None:
                    summaries[s.get("attempt", 0)] = s
                done = len(rows(run_dir / "metrics.jsonl")) if (run_dir / "metrics.jsonl").exists() else 0
                if fault and hit is None and done >= args.kill_after and (hit := worker_pid(proc.pid, FAULTS[fault])):
                    os.kill(hit, signal.SIGSTOP if fault == "freeze" else signal.SIGKILL)
                    thaw_at = time.monotonic() + args.freeze_s if fault == "freeze" else None
                    print(f"[{name}] step {done}: rank {FAULTS[fault]} (pid {hit}) "
                          f"{'frozen' if fault == 'freeze' else 'SIGKILLed'}", flush=True)
                if thaw_at is not None and time.monotonic() >= thaw_at:
                    os.kill(hit, signal.SIGCONT)
                    thaw_at = None
                time.sleep(0.2)
            rc = proc.poll()
        finally:
            if proc.poll() is None:
                proc.kill()
            if (plane_file := _read(run_dir / "execution_plane.json")) is not None:  # only when the run failed
                try:
                    os.kill(plane_file["pid"], signal.SIGKILL)
                except (ProcessLookupError, KeyError):
                    pass
    wall = time.monotonic() - t0
    if (s := _read(run_dir / "summary.json")) is not None:
        summaries[s.get("attempt", 0)] = s
    last = summaries[max(summaries)] if summaries else {}
    metrics = rows(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    attempts = (_read(run_dir / "run.json") or {}).get("attempts", [])
    journal = rows(run_dir / "groups.jsonl") if (run_dir / "groups.jsonl").exists() else []
    groups_again, cancelled = journal_losses(journal)
    total = last.get("run", {})  # totals over every attempt that reached its end
    figures = {
        "returncode": rc,
        "steps_completed": len(metrics),
        "versions_continuous": [r["version"] for r in metrics] == list(range(1, len(metrics) + 1)),
        "attempts": len(attempts),
        "executions_cancelled": cancelled,
        "groups_run_again": groups_again,
        "lost_in_flight_summary": total.get("lost_in_flight"),  # summary.json's count, beside the journal's
        "carried_over_groups": total.get("carried_over_groups"),
        "calls_recomputed": calls_recomputed(summaries, plane),
        "aborted_calls": total.get("aborted_calls"),
        "engine_stalls": last.get("engine_stalls"),
        "attempts_not_ended": total.get("attempts_not_ended"),
        "error": last.get("error"),
        "wall_s": round(wall, 1),
        "hit": hit is not None,
        "log": str(log_path),
    }
    print(f"[{name}] " + json.dumps(figures), flush=True)
    return figures


def _names(text: str, known, flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if bad := [n for n in names if n not in known]:
        hint = " (the core rank is rank 0 on this CPU path: use rank0)" if "core" in bad else ""
        raise SystemExit(f"{flag}: unknown {bad}; choose from {sorted(known)}{hint}")
    return names


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", default="satellite,rank0", help=f"comma-separated, of {sorted(FAULTS)}")
    p.add_argument("--planes", default=",".join(PLANES), help="comma-separated, of rank0, process")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--n", type=int, default=2, help="executions per group")
    p.add_argument("--kill-after", type=int, default=4, help="steps done before the fault")
    p.add_argument("--freeze-s", type=float, default=10.0, help="how long the freeze fault holds rank 2")
    p.add_argument("--progress-timeout-s", type=float, default=3.0)
    p.add_argument("--timeout-s", type=float, default=600.0, help="per job")
    p.add_argument("--out", help=OUT_HELP)
    args = p.parse_args()
    faults, planes = _names(args.faults, FAULTS, "--faults"), _names(args.planes, PLANES, "--planes")
    work = Path(tempfile.mkdtemp(prefix="gyre-fault-bench-"))
    runs: dict[str, dict] = {}
    cells: dict[str, dict] = {f: {} for f in faults}
    for plane in planes:
        runs[f"{plane}-undisturbed"] = base = run(args, work, plane, None)
        for fault in faults:
            runs[f"{plane}-{fault}"] = hit = run(args, work, plane, fault)
            cells[fault][plane] = cell(base, hit)
    for line in lines(cells):
        print(line, flush=True)
    write_results(args.out, {**provenance(), "config": vars(args), "runs": runs, "figures": table(cells)})


if __name__ == "__main__":
    main()
