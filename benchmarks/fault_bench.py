"""A run disturbed by a killed satellite and a frozen one, against the same run undisturbed.

Both runs are real `torchrun --max-restarts 1` jobs of 3 gloo ranks (the core and two
satellites, cells of one rank), the tiny model, groups of N executions of a 3-turn harness, S
steps, a checkpoint every step. In the disturbed run, once `--freeze-after` steps are done, rank 2
is SIGSTOPped for `--freeze-s` seconds (its calls must continue elsewhere within
`--proxy.engine-progress-timeout-s`), and once `--kill-after` steps are done rank 1 is SIGKILLed
(torchrun restarts the job, which resumes from the newest complete checkpoint and runs the lost
executions' tasks again first). docs/design.md §5.

Figures per run: steps completed, versions continuous, executions launched / completed
(evaluated) / lost in flight (their groups run again) / carried over (evaluated groups trained after
the restart), aborted calls and calls moved off the frozen engine (summary.json's run totals, every
attempt that ended), attempts, wall time; and the disturbed run's wall time over the undisturbed one's.

    python -m benchmarks.fault_bench [--steps 16] [--freeze-after 2] [--freeze-s 10] [--kill-after 8]

The last line printed is one JSON object of figures; `--out benchmarks/results/fault_bench.json` writes the results file.
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

from benchmarks.provenance import OUT_HELP, ROOT, provenance, write_results
from tests.jobs import env, rows, worker_pid, write_tasks

HARNESS = ROOT / "tests" / "runtime" / "tiny_harness.py"


def _command(args, tasks: Path, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", "--max-restarts", "1",
            "-m", "gyre.run", "--job", "train", "--model.preset", "tiny", "--executions.dataset.path", str(tasks),
            "--run-dir", str(run_dir), "--executions.runner.timeout-s", "180",
            "--scheduler.n-per-group", str(args.n), "--scheduler.batch-groups", "2", "--scheduler.mu", "1",
            "--scheduler.phi", "0.5", "--scheduler.tick-s", "0.1", "--train.steps", str(args.steps),
            "--train.checkpoint-every", "1", "--train.max-tokens", "512", "--train.drain-at-end-s", "5",
            "--proxy.engine-progress-timeout-s", str(args.progress_timeout_s),
            "--train.control-timeout-s", str(max(120.0, 4 * args.freeze_s))]


def run(args, work: Path, disturb: bool) -> dict:
    name = "disturbed" if disturb else "undisturbed"
    run_dir = work / name
    tasks = write_tasks(work / "tasks.jsonl", [sys.executable, str(HARNESS), "3", "8"], n=8)
    log_path = work / f"{name}.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(_command(args, tasks, run_dir), cwd=work, env=env(), stdout=log, stderr=subprocess.STDOUT)
        frozen = killed = thaw_at = None
        try:
            while disturb and proc.poll() is None and (killed is None or thaw_at):
                done = len(rows(run_dir / "metrics.jsonl")) if (run_dir / "metrics.jsonl").exists() else 0
                if frozen is None and done >= args.freeze_after:
                    frozen = worker_pid(proc.pid, 2)
                    if frozen:
                        os.kill(frozen, signal.SIGSTOP)
                        thaw_at = time.monotonic() + args.freeze_s
                        print(f"[{name}] step {done}: rank 2 (pid {frozen}) frozen for {args.freeze_s:.0f} s", flush=True)
                if thaw_at and time.monotonic() >= thaw_at:
                    os.kill(frozen, signal.SIGCONT)
                    thaw_at = 0.0
                    print(f"[{name}] step {done}: rank 2 thawed", flush=True)
                if killed is None and done >= args.kill_after:
                    killed = worker_pid(proc.pid, 1)
                    if killed:
                        os.kill(killed, signal.SIGKILL)
                        print(f"[{name}] step {done}: rank 1 (pid {killed}) killed", flush=True)
                time.sleep(0.1)
            rc = proc.wait(timeout=args.timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
    wall = time.monotonic() - t0
    metrics = rows(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    attempts = json.loads((run_dir / "run.json").read_text()).get("attempts", []) if (run_dir / "run.json").exists() else []
    journal = rows(run_dir / "groups.jsonl") if (run_dir / "groups.jsonl").exists() else []
    # distinct executions: a carried-over group is journalled as dispatched again, under its own ids
    launched = len({e for r in journal if r["kind"] == "dispatched" for e in r["executions"]})
    # summary.json's "run": totals over every attempt that reached its end (all, unless rank 0 died)
    total = summary.get("run", {})
    results = [json.loads(p.read_text()) for p in (run_dir / "executions").glob("*/result.json")]
    figures = {
        "returncode": rc,
        "steps_completed": len(metrics),
        "versions_continuous": [r["version"] for r in metrics] == list(range(1, len(metrics) + 1)),
        "duplicate_step_rows": len(metrics) - len({r["step"] for r in metrics}),
        "attempts": len(attempts),
        "executions_launched": launched,
        "executions_completed": sum(r["outcome"] == "completed" for r in results),  # whichever attempt ran them
        "lost_in_flight": total.get("lost_in_flight"),
        "carried_over_groups": total.get("carried_over_groups"),
        "aborted_calls": total.get("aborted_calls"),
        "engine_stalls": total.get("engine_stalls"),
        "attempts_not_ended": total.get("attempts_not_ended"),
        "error": summary.get("error"),
        "wall_s": round(wall, 1),
        "froze_rank": frozen is not None,
        "killed_rank": killed is not None,
        "log": str(log_path),
    }
    print(f"[{name}] " + json.dumps(figures), flush=True)
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--n", type=int, default=2, help="executions per group")
    p.add_argument("--freeze-after", type=int, default=2, help="steps done before rank 2 is frozen")
    p.add_argument("--freeze-s", type=float, default=10.0)
    p.add_argument("--kill-after", type=int, default=8, help="steps done before rank 1 is killed")
    p.add_argument("--progress-timeout-s", type=float, default=3.0)
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--out", help=OUT_HELP)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gyre-fault-bench-"))
    base = run(args, work, disturb=False)
    hit = run(args, work, disturb=True)
    out = {"steps": args.steps,
           "undisturbed": {k: base[k] for k in ("steps_completed", "executions_launched", "executions_completed", "wall_s")},
           "disturbed": {k: hit[k] for k in ("steps_completed", "versions_continuous", "duplicate_step_rows", "attempts",
                                            "executions_launched", "executions_completed", "lost_in_flight",
                                            "carried_over_groups", "aborted_calls", "engine_stalls",
                                            "attempts_not_ended", "wall_s")},
           "wall_ratio_disturbed_over_undisturbed": round(hit["wall_s"] / base["wall_s"], 2)}
    write_results(args.out, {**provenance(), "config": vars(args), "runs": {"undisturbed": base, "disturbed": hit},
                            "figures": out})


if __name__ == "__main__":
    main()
