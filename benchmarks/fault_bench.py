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
  off it within `--proxy.engine-progress-timeout-s`; no restart);
- node1 (optional: needs root): two "nodes" on this machine (tests/cluster/netns.py: two network
  namespaces joined by a veth), one torchrun agent each with one rank, started with launch.sh's own
  line for GYRE_MAX_RESTARTS=1 (c10d rendezvous hosted by node 0, a store per round); the rank on
  node 1 SIGKILLed, and both nodes' ranks restart. Its undisturbed run is a two-node one.

Per (fault, plane): executions cancelled, groups run again, calls recomputed because their
engine died, time lost (wall − the undisturbed wall, same plane and topology); the goal is
0 cancelled and 0 groups run again for every measured fault on the process plane (`goal_met`,
over `goal_faults`). How each figure is read: benchmarks/fault_figures.py.

    python -m benchmarks.fault_bench [--faults satellite,rank0,node1] [--planes rank0,process] [--steps 10]

The last line printed is one JSON object of figures; `--out benchmarks/results/fault_bench.json`
writes the results file, and `--merge` adds this run's fault kinds to the one already there.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.fault_figures import calls_recomputed, cell, journal_losses, lines, merge, table
from benchmarks.provenance import OUT_HELP, ROOT, provenance, write_results
from tests.cluster.netns import TwoNodes, problem as netns_problem
from tests.jobs import env, rows, worker_pid, write_tasks

HARNESS = ROOT / "tests" / "runtime" / "tiny_harness.py"
FAULTS = {"satellite": 1, "rank0": 0, "freeze": 2, "node1": 1}  # the rank each fault hits
TWO_NODES = ("node1",)  # the faults run on two nodes
PLANES = ("rank0", "process")
_PORTS = itertools.count(29500)  # a rendezvous port per two-node run (none is reused while it may linger)


def node_command(node: int, addrs: list[str], port: int, run_id: str, job: list[str]) -> list[str]:
    """Node `node`'s torchrun in the two-node setup: launch.sh's line under GYRE_MAX_RESTARTS=1 and
    one rank a node, as its dry run prints it (so the bench runs what users run), each node named by
    its address (rank 0 on node 0: ranks follow --local-addr's order), with this Python's torchrun."""
    fake_slurm = {"GYRE_DRY_RUN": "1", "SLURM_NNODES": "2", "SLURM_NODEID": str(node), "SLURM_JOB_NODELIST": ",".join(addrs),
                  "SLURM_JOB_ID": run_id, "SLURMD_NODENAME": addrs[node], "GYRE_MASTER_ADDR": addrs[0],
                  "GYRE_MASTER_PORT": str(port), "GYRE_MAX_RESTARTS": "1", "GYRE_NPROC_PER_NODE": "1"}
    r = subprocess.run(["bash", str(ROOT / "launch.sh"), *job], env={"PATH": os.environ["PATH"], **fake_slurm},
                       capture_output=True, text=True)
    argv = shlex.split(r.stdout)
    if r.returncode != 0 or "torchrun" not in argv:
        raise SystemExit(f"launch.sh's dry run for node {node} failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
    i = argv.index("torchrun")
    return [*argv[:i], sys.executable, "-m", "torch.distributed.run", *argv[i + 1:]]


def _job(args, tasks: Path, run_dir: Path, plane: str) -> list[str]:
    """gyre.run's arguments, the same on every topology."""
    return ["--job", "train", "--model.preset", "tiny", "--executions.dataset.path", str(tasks),
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


def _name(plane: str, fault: str | None, two_nodes: bool) -> str:
    return f"{plane}-{fault or ('two-nodes-' if two_nodes else '') + 'undisturbed'}"


def _launch(work: Path, name: str, job: list[str], nodes: TwoNodes | None) -> tuple[list[subprocess.Popen], list[Path]]:
    """The job's torchrun agents, each in a session of its own: one (3 ranks), or one a node."""
    if nodes is None:
        argvs = [[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                  "--max-restarts", "1", "-m", "gyre.run", *job]]
        envs, logs = [env()], [work / f"{name}.log"]
    else:
        port = next(_PORTS)
        argvs = [nodes.argv(i, node_command(i, nodes.addr, port, f"bench-{name}", job)) for i in (0, 1)]
        envs, logs = [{**env(), **nodes.env(i)} for i in (0, 1)], [work / f"{name}.node{i}.log" for i in (0, 1)]
    procs = []
    for argv, e, log in zip(argvs, envs, logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(argv, cwd=work, env=e, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    return procs, logs


def _victim(procs: list[subprocess.Popen], fault: str) -> tuple[int, int | None]:
    """(rank, pid) of the worker the fault hits, in its first attempt; on two nodes node 1's one
    worker (a child of node 1's agent), whatever rank the rendezvous gave it (1 where ranks follow
    the nodes' order)."""
    if fault in TWO_NODES:
        return next(((r, pid) for r in (1, 0) if (pid := worker_pid(procs[1].pid, r))), (FAULTS[fault], None))
    return FAULTS[fault], worker_pid(procs[0].pid, FAULTS[fault])


def run(args, work: Path, plane: str, fault: str | None, nodes: TwoNodes | None = None) -> dict:
    """One job, disturbed by `fault` (None: undisturbed), on one node or on `nodes`; its raw figures."""
    name = _name(plane, fault, nodes is not None)
    run_dir = work / name
    tasks = write_tasks(work / "tasks.jsonl", [sys.executable, str(HARNESS), "3", "8"], n=8)
    summaries: dict[int, dict] = {}  # each attempt's summary.json, read as it appears (the next attempt replaces it)
    hit = thaw_at = None
    t0 = time.monotonic()
    deadline = t0 + args.timeout_s
    procs, logs = _launch(work, name, _job(args, tasks, run_dir, plane), nodes)
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):  # one node failed: the other has 60 s to follow
                deadline = min(deadline, time.monotonic() + 60)
            if (s := _read(run_dir / "summary.json")) is not None:
                summaries[s.get("attempt", 0)] = s
            done = len(rows(run_dir / "metrics.jsonl")) if (run_dir / "metrics.jsonl").exists() else 0
            if fault and hit is None and done >= args.kill_after:
                rank, hit = _victim(procs, fault)
                if hit:
                    os.kill(hit, signal.SIGSTOP if fault == "freeze" else signal.SIGKILL)
                    thaw_at = time.monotonic() + args.freeze_s if fault == "freeze" else None
                    print(f"[{name}] step {done}: rank {rank} (pid {hit}) "
                          f"{'frozen' if fault == 'freeze' else 'SIGKILLed'}", flush=True)
            if thaw_at is not None and time.monotonic() >= thaw_at:
                os.kill(hit, signal.SIGCONT)
                thaw_at = None
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
        rc = None if None in codes else next((c for c in codes if c != 0), 0)  # None: killed at the timeout
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
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
        "returncodes": codes,
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
        "log": ", ".join(map(str, logs)),
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
    p.add_argument("--merge", action="store_true",
                   help="with --out: keep the fault kinds of the results file already there that this run does not "
                        "measure (their figures, runs and commit), and recompute goal_met over all of them")
    args = p.parse_args()
    faults, planes = _names(args.faults, FAULTS, "--faults"), _names(args.planes, PLANES, "--planes")
    old = None
    if args.merge:
        try:
            old = json.loads(Path(args.out).read_text()) if args.out else None
        except (OSError, ValueError) as e:
            raise SystemExit(f"--merge: cannot read the results file {args.out}: {e}")
        if old is None:
            raise SystemExit("--merge: needs --out, the results file to add this run's fault kinds to")
    one, two = [f for f in faults if f not in TWO_NODES], [f for f in faults if f in TWO_NODES]
    why_not: dict[str, str] = {}
    if two and (why := netns_problem()):
        print(f"skipping {', '.join(two)}: two network namespaces cannot be made here ({why}; needs root)", flush=True)
        why_not, two = {f: f"skipped: two network namespaces cannot be made here ({why})" for f in two}, []
    work = Path(tempfile.mkdtemp(prefix="gyre-fault-bench-"))
    runs: dict[str, dict] = {}
    cells: dict[str, dict] = {f: {} for f in one + two}
    with TwoNodes() if two else contextlib.nullcontext() as nodes:
        for plane in planes:
            for kinds, topology in ((one, None), (two, nodes)):
                if not kinds:
                    continue
                runs[_name(plane, None, topology is not None)] = base = run(args, work, plane, None, topology)
                for fault in kinds:
                    runs[_name(plane, fault, topology is not None)] = hit = run(args, work, plane, fault, topology)
                    cells[fault][plane] = cell(base, hit)
    for line in lines(cells):
        print(line, flush=True)
    for fault, why in why_not.items():
        print(f"{fault:>9}: {why}", flush=True)
    record = {**provenance(), "config": vars(args), "runs": runs, "figures": table(cells, why_not)}
    write_results(args.out, merge(old, record) if old is not None else record)


if __name__ == "__main__":
    main()
