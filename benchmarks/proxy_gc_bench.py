"""The proxy's garbage collector at 4,096 open executions: `ProxyConfig.gc_every_s` against
Python's automatic collector, side by side in one run.

The proxy makes no cyclic garbage while it serves, yet each of Python's young collections walks
every object of the calls in flight and stops every call meanwhile (gyre/proxy/collector.py).
With `gc_every_s` (the default, 600) automatic collection is off while the proxy serves and a
full collection runs on that clock; `0` is Python's collector (young threshold
`gc_young_objects`, 10,000). The load is `benchmarks/scale_bench.py`'s proxy series (a spawned
proxy + TITO store, deterministic engines in other processes over the websocket mux, N async
harnesses with think times, multi-turn), the two arms alternated `--pairs` times so that the
machine's drift falls on both. Printed per run: added latency p50/p99 (the engine's own time
taken out), its legs, the proxy's CPU a call, its collections in the window and the longest
pause; then each arm's median and the ratio of the medians' p99.

    python benchmarks/proxy_gc_bench.py                 # 4,096 open, 8 engines, 2 pairs (~3 min)
    python benchmarks/proxy_gc_bench.py --full-every-s 5   # the clocked full collection's pause, in the window

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import scale_bench  # noqa: E402

KEEP = ("open_executions", "calls_per_s", "proxy_added_ms_p50", "proxy_added_ms_p99", "legs_ms_p50_p99",
        "proxy_cpu_ms_per_call", "proxy_cpu_fraction", "proxy_run_wait_fraction", "proxy_gc_collections", "proxy_gc_pause_ms_max",
        "proxy_gc_full_collections", "proxy_gc_objects_freed", "rss_kib_per_open_execution", "records_lost", "errors")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--open-executions", type=int, default=4096)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--engine-procs", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=2, help="runs of each arm, alternated")
    ap.add_argument("--full-every-s", type=float, default=None,
                    help="gc_every_s of the clocked arm (default: ProxyConfig's); short to put its full collection in the window")
    ap.add_argument("--think-s", type=float, default=10.0)
    ap.add_argument("--window-s", type=float, default=15.0)
    ap.add_argument("--out", help="the results file to write (machine, versions, config, commit, figures); default: none, print only")
    a = ap.parse_args()
    from benchmarks.provenance import provenance, write_results
    from gyre.proxy import ProxyConfig

    clocked = ProxyConfig().gc_every_s if a.full_every_s is None else a.full_every_s
    if clocked <= 0:
        ap.error("--full-every-s: the clocked arm needs a clock (> 0); 0 is the other arm")
    base = dict(engines=[a.engines], open_executions=[a.open_executions], engine_procs=a.engine_procs, in_process_engines=False,
                token_delay=0.02, max_tokens=16, think_s=a.think_s, window_s=a.window_s, proxy_cpus=None, load_cpus=None,
                proxy_gc_young=None, proxy_hold_s=None, proxy_stream_interval_s=None, stream=False, proxy_impl="gyre")
    rows = []
    for _ in range(a.pairs):
        for every in (clocked, 0.0):
            (row,) = scale_bench.proxy_series(argparse.Namespace(**base, proxy_gc_every_s=every))
            rows.append({"gc_every_s": every} | {k: row[k] for k in KEEP})
            print("gc", rows[-1], flush=True)
    figures = {"open_executions": a.open_executions, "engines": a.engines, "pairs": a.pairs,
               "records_lost": sum(r["records_lost"] for r in rows), "errors": sum(r["errors"] for r in rows)}
    for tag, every in (("clock", clocked), ("python", 0.0)):
        arm = [r for r in rows if r["gc_every_s"] == every]
        figures[tag] = {"gc_every_s": every, "proxy_added_ms_p99": [r["proxy_added_ms_p99"] for r in arm],
                        "proxy_added_ms_p99_median": statistics.median(r["proxy_added_ms_p99"] for r in arm),
                        "proxy_added_ms_p50_median": statistics.median(r["proxy_added_ms_p50"] for r in arm),
                        "proxy_cpu_ms_per_call_median": statistics.median(r["proxy_cpu_ms_per_call"] for r in arm),
                        "gc_collections": sum(r["proxy_gc_collections"] for r in arm),
                        "gc_pause_ms_max": max(r["proxy_gc_pause_ms_max"] for r in arm),
                        "gc_objects_freed": sum(r["proxy_gc_objects_freed"] for r in arm)}
    figures["p99_clock_vs_python"] = round(figures["clock"]["proxy_added_ms_p99_median"] / figures["python"]["proxy_added_ms_p99_median"], 3)
    config = vars(a) | {"out": a.out and os.path.relpath(a.out, ROOT), "gc_every_s_clocked": clocked}
    write_results(a.out, {"benchmark": "proxy_gc_bench", **provenance("aiohttp"), "config": config, "rows": rows, "figures": figures,
                          "left_out": ["a real model: engines are deterministic, instant apart from their token delay",
                                       "other nodes: load generator, proxy and engine processes share this machine's cores"]})


if __name__ == "__main__":
    main()
