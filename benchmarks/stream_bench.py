"""Streamed calls at scale: what `ProxyConfig.stream_interval_s` saves the proxy.

Claude Code and Codex stream every call. Without an interval the engine sends each token as
its own frame and the proxy turns each into its own SSE chunk: per-token work on the proxy's one
event loop (read a frame, wake the call, detokenize, encode a chunk, write it). With an interval
the engine's server holds a call's tokens after the first (which comes at once) up to that long,
and the proxy streams each frame as one chunk.

The same load is run once per interval, side by side in one run: `benchmarks/scale_bench.py`'s
proxy series (a spawned proxy + TITO store, deterministic engines in other processes reached over
the websocket mux, N async harnesses with think times, multi-turn) with every call streamed.
Printed per interval: the proxy's CPU a call and a token, chunks a call, time to first chunk and
added latency (p50/p99), records lost; then the ratios against interval 0.

    python benchmarks/stream_bench.py                       # 256 open, 200 tokens a call, intervals 0 and 0.1 s (~2 min)
    python benchmarks/stream_bench.py --intervals 0 0.02 0.05 0.1

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import scale_bench  # noqa: E402

KEEP = ("stream_interval_s", "open_executions", "calls_per_s", "tokens_per_call", "proxy_cpu_ms_per_call", "proxy_cpu_us_per_token",
        "proxy_cpu_fraction", "chunks_per_call", "ttft_ms_p50_p99", "proxy_added_ms_p50", "proxy_added_ms_p99",
        "engine_cpu_ms_per_call", "proxy_run_wait_fraction", "records_lost", "errors")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--intervals", type=float, nargs="+", default=[0.0, 0.1], help="stream_interval_s values, 0 first (the baseline)")
    ap.add_argument("--open-executions", type=int, default=256)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--engine-procs", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=200, help="tokens a call (the engines always reach it)")
    ap.add_argument("--token-delay", type=float, default=0.02, help="engine seconds per token (50 tokens/s a stream)")
    ap.add_argument("--think-s", type=float, default=10.0)
    ap.add_argument("--window-s", type=float, default=15.0)
    ap.add_argument("--out", help="the results file to write (machine, versions, config, commit, figures); default: none, print only")
    a = ap.parse_args()
    if a.intervals[0] != 0:
        ap.error("--intervals: the first is the baseline and must be 0")
    from benchmarks.provenance import provenance, write_results

    base = dict(engines=[a.engines], open_executions=[a.open_executions], engine_procs=a.engine_procs, in_process_engines=False,
                token_delay=a.token_delay, max_tokens=a.max_tokens, think_s=a.think_s, window_s=a.window_s, proxy_cpus=None,
                load_cpus=None, proxy_gc_young=None, proxy_gc_every_s=None, proxy_hold_s=None, stream=True, proxy_impl="gyre")
    rows = []
    for interval in a.intervals:
        (row,) = scale_bench.proxy_series(argparse.Namespace(**base, proxy_stream_interval_s=interval))
        rows.append({k: row[k] for k in KEEP})
        print("stream", rows[-1], flush=True)
    b = rows[0]
    figures = {"open_executions": a.open_executions, "tokens_per_call": b["tokens_per_call"],
               "records_lost": sum(r["records_lost"] for r in rows), "errors": sum(r["errors"] for r in rows)}
    for r in rows:
        tag = f"i{r['stream_interval_s']:g}"
        figures[tag] = {k: r[k] for k in ("proxy_cpu_ms_per_call", "proxy_cpu_us_per_token", "chunks_per_call", "ttft_ms_p50_p99",
                                          "proxy_added_ms_p50", "proxy_added_ms_p99")}
        if r is not b:
            figures[tag]["cpu_per_call_vs_i0"] = round(r["proxy_cpu_ms_per_call"] / b["proxy_cpu_ms_per_call"], 3)
    config = vars(a) | {"out": a.out and os.path.relpath(a.out, ROOT)}
    write_results(a.out, {"benchmark": "stream_bench", **provenance("aiohttp", "numpy"), "config": config, "rows": rows, "figures": figures,
                          "left_out": ["a real model: engines are deterministic, instant apart from their token delay",
                                       "other nodes: load generator, proxy and engine processes share this machine's cores"]})


if __name__ == "__main__":
    main()
