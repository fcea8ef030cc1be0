"""What waiting ranks cost torchrun's one TCPStore (issue 35, item 4), and how late a message
reaches them: today's fixed 2 ms poll vs the backed-off poll (`gyre.backoff.Backoff`, 2 ms
doubling to 50 ms), side by side, at 64 and 256 simulated ranks.

One TCPStore server in a process of its own (its CPU is read from /proc); the simulated ranks are
threads spread over a few client processes, each thread with its own store connection and a
`ControlPlane` waiting in `recv()` exactly as an idle rank does between commands; its store calls
are counted. During the window the main process sends one message per rank on average, at random
times to random ranks, each stamped with its send time; the receiving thread records the delay.

    python -m benchmarks.store_poll_bench                    # 64 and 256 ranks, 6 s windows
    python -m benchmarks.store_poll_bench --ranks 64 --window-s 3

Left out, and why: the ranks share this machine's cores with the server (on a cluster they are
on other nodes), so at high request rates the clients' own CPU competes with the server's and the
fixed poll's achieved rate is capped by the machine, not by the scheme (the results record the
target rate beside the achieved one); no network round trip beyond loopback.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta

SCHEMES = {"fixed_2ms": (0.002, 0.002), "backoff_2_to_50ms": (0.002, 0.05)}  # (poll, max_poll)
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _serve() -> None:
    """The store server: print its port, hold it until stdin closes."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    print(store.port, flush=True)
    sys.stdin.read()


class _Counted:
    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def call(*a, **k):
            self.calls += 1  # one thread per store: no lock needed
            return fn(*a, **k)

        return call


def _clients(port: int, ranks: list[int], poll: float, max_poll: float, out: mp.Queue) -> None:
    """One client process: a thread per simulated rank, each waiting in ControlPlane.recv."""
    from torch.distributed import TCPStore

    from gyre.runtime.control import ControlPlane

    results: list[tuple[int, int, list[float]]] = []
    lock = threading.Lock()

    def rank_main(rank: int) -> None:
        store = _Counted(TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=120)))
        cp = ControlPlane(store, rank, poll=poll, max_poll=max_poll)
        store.inner.add("ready", 1)
        start_calls, latencies = None, []
        while True:
            msg = cp.recv(timeout=300)
            if msg == "start":  # the window opens: count from here
                start_calls = store.calls
            elif msg == "stop":
                break
            else:
                latencies.append(time.time() - msg)
        with lock:
            results.append((rank, store.calls - (start_calls or 0), latencies))

    t0 = time.process_time()
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((results, time.process_time() - t0))


def run_one(ranks: int, scheme: str, window_s: float, procs: int, seed: int) -> dict:
    from torch.distributed import TCPStore

    from gyre.runtime.control import ControlPlane

    poll, max_poll = SCHEMES[scheme]
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.store_poll_bench", "--serve"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    port = int(server.stdout.readline())
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    workers = [ctx.Process(target=_clients, args=(port, list(range(i, ranks, procs)), poll, max_poll, out))
               for i in range(procs)]
    for w in workers:
        w.start()
    main = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=120))
    sender = ControlPlane(main, "bench")
    while int(main.add("ready", 0)) < ranks:
        time.sleep(0.05)
    for r in range(ranks):
        sender.send(r, "start")
    time.sleep(1.0)  # every rank ramped to its idle poll
    rng = random.Random(seed)
    sends = sorted(rng.uniform(0, window_s) for _ in range(ranks))  # one message per rank on average
    cpu0, t0 = _cpu_s(server.pid), time.monotonic()
    for at in sends:
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        sender.send(rng.randrange(ranks), time.time())
    time.sleep(max(0.0, t0 + window_s - time.monotonic()))
    server_cpu = _cpu_s(server.pid) - cpu0
    window = time.monotonic() - t0 + 1.0  # the counts run from "start", 1 s before the window
    for r in range(ranks):
        sender.send(r, "stop")
    rows, client_cpu = [], 0.0
    for _ in workers:
        got, cpu = out.get(timeout=120)
        rows += got
        client_cpu += cpu
    for w in workers:
        w.join()
    server.stdin.close()
    server.wait()
    calls = sum(c for _, c, _ in rows)
    lat = sorted(x for _, _, ls in rows for x in ls)
    per_rank = [c / window for _, c, _ in rows]
    return {"ranks": ranks, "scheme": scheme, "poll_s": poll, "max_poll_s": max_poll,
            "target_requests_per_s": ranks / poll if poll == max_poll else None,
            "requests_per_s": round(calls / window, 1),
            "requests_per_s_per_rank_max": round(max(per_rank), 1),
            "server_cpu_fraction_of_a_core": round(server_cpu / window_s, 3),
            "clients_cpu_s_total": round(client_cpu, 2),
            "messages": len(lat),
            "latency_ms_p50": round(1e3 * statistics.median(lat), 2) if lat else None,
            "latency_ms_p99": round(1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2) if lat else None,
            "latency_ms_max": round(1e3 * lat[-1], 2) if lat else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--window-s", type=float, default=6.0)
    ap.add_argument("--procs", type=int, default=4, help="client processes the simulated ranks are spread over")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", "--results", dest="out", help="the results file to write (machine, versions, config, commit, figures); default: none, print only")
    args = ap.parse_args()
    if args.serve:
        _serve()
        return
    from benchmarks.provenance import provenance, write_results

    runs = []
    for ranks in args.ranks:
        for scheme in SCHEMES:
            row = run_one(ranks, scheme, args.window_s, args.procs, args.seed)
            print(row, flush=True)
            runs.append(row)
    figures = {}
    for ranks in args.ranks:
        fixed, back = (next(r for r in runs if r["ranks"] == ranks and r["scheme"] == s) for s in SCHEMES)
        figures[f"r{ranks}"] = {
            "fixed_requests_per_s": fixed["requests_per_s"], "backoff_requests_per_s": back["requests_per_s"],
            "request_ratio_fixed_over_backoff": round(fixed["requests_per_s"] / max(back["requests_per_s"], 1e-9), 1),
            "fixed_server_cpu": fixed["server_cpu_fraction_of_a_core"],
            "backoff_server_cpu": back["server_cpu_fraction_of_a_core"],
            "fixed_latency_ms_p50_p99": [fixed["latency_ms_p50"], fixed["latency_ms_p99"]],
            "backoff_latency_ms_p50_p99": [back["latency_ms_p50"], back["latency_ms_p99"]]}
    record = {"benchmark": "store_poll_bench", **provenance(), "config": vars(args) | {"schemes": SCHEMES},
              "left_out": "ranks share this machine's cores with the server (on a cluster they are on other nodes): "
                          "the fixed poll's achieved rate is capped by the clients' CPU here, below its target of "
                          "500 requests/s a rank; loopback only, no network round trip",
              "runs": runs, "figures": figures}
    write_results(args.out, record)


if __name__ == "__main__":
    main()
