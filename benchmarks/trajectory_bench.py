"""Trajectory processor benchmark (issue 3): one long synthetic execution → tree + selection + packing.

The execution has the paper's case-study scale: 636 calls, ~1M unique tokens, 10 candidate
leaves: a main agent with 2 compactions (3 epochs) and one retried call deep in its last epoch,
5 sub-agents (one compacts) whose answers return to the main agent as tool results. Call inputs are views of
one token buffer per agent thread (as a proxy that shares prefix memory would hold them), so
the records themselves cost O(unique tokens); the tree compares every input token once.

Side by side, on the same records:
  * gyre:            build_tree + select_trajectories(J_max) + pack_step, timed (best of N)
  * per-call:        train every request as its own sample (Σ input + output tokens)
  * expanded leaves: every leaf path trained in full, no sharing (Σ leaf path lengths)
  * TITO store:      prefix-shared frames vs verbatim frames (file size, write, load)
  * python trie:     a per-token dict trie (the obvious implementation) on the same records
Prints time, peak memory (tracemalloc, numpy allocations included) at two scales to show it is
linear in unique tokens, the unique/expanded token ratio, and the forward-backward token budget
at J_max = 1, 5 and unlimited (paper: 41.4 % / 74.8 % / 100 %). The last line is one JSON object.

    python benchmarks/trajectory_bench.py [--repeats 3] [--scale 1.0]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.provenance import OUT_HELP, provenance, write_results  # noqa: E402
from gyre.trajectory.packing import ExecutionSample, pack_step  # noqa: E402
from gyre.trajectory.record import CallRecord, Role  # noqa: E402
from gyre.trajectory.selection import select_trajectories  # noqa: E402
from gyre.trajectory.store import TitoWriter, load_execution  # noqa: E402
from gyre.trajectory.tree import build_tree  # noqa: E402

HEADER = np.array([151644, 77091, 198], np.int32)  # "<|im_start|>assistant\n"
PAPER_BUDGET = {"1": 41.4, "5": 74.8, "unlimited": 100.0}


class Synth:
    def __init__(self, seed: int, scale: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.scale = scale
        self.records: list[CallRecord] = []

    def toks(self, mean: float) -> np.ndarray:
        n = max(1, int(self.rng.lognormal(np.log(mean * self.scale), 0.6)))
        return self.rng.integers(1000, 150_000, n, dtype=np.int32)

    def record(self, inp: np.ndarray, out: np.ndarray, role: Role, marks: np.ndarray) -> None:
        cid = len(self.records)
        lp = (-np.abs(self.rng.normal(0.3, 0.5, len(out)))).astype(np.float32)
        self.records.append(CallRecord("bench", cid, role, inp, out, lp, policy_version=cid // 100,
                                       message_starts=marks[marks < len(inp)]))

    def thread(self, sys_msg: np.ndarray, user: np.ndarray, n_calls: int, role: Role, *,
               summary_role: Role | None = None, retry_at: int | None = None,
               inject: dict[int, np.ndarray] | None = None) -> np.ndarray:
        """One agent thread; returns the last output (the answer, or the summary)."""
        parts, marks, calls = [sys_msg, user], [0, len(sys_msg)], []
        pos = len(sys_msg) + len(user)
        n_turns = n_calls + (summary_role is not None)
        for k in range(n_turns):
            last = k == n_turns - 1
            if summary_role is not None and last:
                req = self.toks(60)
                parts.append(req), marks.append(pos)
                pos += len(req)
            out = self.toks(1500 if (summary_role is not None and last) else 250)
            marks.append(pos)
            parts += [HEADER, out]
            calls.append((pos + len(HEADER), out, summary_role if (summary_role is not None and last) else role, k))
            pos += len(HEADER) + len(out)
            if not last and not (summary_role is not None and k == n_turns - 2):
                tool = self.toks(1050)
                if inject and k in inject:
                    tool = np.concatenate([tool[:20], inject[k]])
                parts.append(tool), marks.append(pos)
                pos += len(tool)
        full = np.concatenate(parts)
        marks_a = np.array(marks, np.int32)
        for start, out, r, k in calls:
            if k == retry_at:  # sampled, abandoned, re-requested with the same input
                self.record(full[:start], self.toks(250), r, marks_a)
            self.record(full[:start], full[start : start + len(out)], r, marks_a)
        return calls[-1][1]


def synthesize(seed: int = 0, scale: float = 1.0) -> list[CallRecord]:
    """636 calls: main 150 + 140 + 190 calls in 3 epochs (2 summary calls, call 170 of the last
    epoch retried), sub-agents A (35 calls, summary, 20 more), B 25, C, D, E 24 each."""
    s = Synth(seed, scale)
    sys_main, sys_sub = s.toks(12_000), s.toks(4_000)
    sub_a = s.thread(sys_sub, s.toks(300), 35, Role.SUB, summary_role=Role.SUB_SUMMARY)
    answers = [
        s.thread(sys_sub, np.concatenate([s.toks(100), sub_a]), 20, Role.SUB),
        s.thread(sys_sub, s.toks(300), 25, Role.SUB),
        s.thread(sys_sub, s.toks(300), 24, Role.SUB),
        s.thread(sys_sub, s.toks(300), 24, Role.SUB),
        s.thread(sys_sub, s.toks(300), 24, Role.SUB),
    ]
    user = s.toks(800)
    summary = None
    epochs = [150, 140, 190]
    for e, c in enumerate(epochs):
        first = user if summary is None else np.concatenate([s.toks(200), summary])
        final = e == len(epochs) - 1
        summary = s.thread(sys_main, first, c, Role.MAIN, summary_role=None if final else Role.MAIN_SUMMARY,
                           retry_at=170 if final else None,
                           inject={10 + 20 * i: answers[i] for i in range(len(answers))} if e == 1 else None)
    return s.records


def process(records, j_max, seed, max_tokens):
    tree = build_tree(records)
    sel = select_trajectories(tree, j_max, np.random.default_rng(seed))
    micro = pack_step([ExecutionSample("bench", tree, sel, 1.0)], max_tokens)
    return tree, sel, micro


def python_trie(records) -> int:
    """The obvious per-token trie: dict children, one Python step per input token."""
    root: dict = {}
    count = 0
    for r in sorted(records, key=lambda r: r.call_id):
        node = root
        for t in np.concatenate([r.input_ids, r.output_ids]).tolist():
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                count += 1
            node = nxt
    return count


def write_store(path: str, records, window: int) -> None:
    with TitoWriter(path, "bench", delta_window=window) as w:
        for r in records:
            w.append(r)


def timed(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def peak_memory(fn) -> int:
    gc.collect()
    tracemalloc.start()
    tracemalloc.reset_peak()
    out = fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del out
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="token-size scale of the synthetic execution")
    ap.add_argument("--max-tokens", type=int, default=524_288)
    ap.add_argument("--budget-seeds", type=int, default=16, help="selection seeds averaged for the J_max budgets")
    ap.add_argument("--out", help=OUT_HELP)
    args = ap.parse_args()

    t0 = time.perf_counter()
    records = synthesize(0, args.scale)
    gen_s = time.perf_counter() - t0
    per_call_tokens = sum(r.num_tokens for r in records)

    build_tree(records)  # warm-up (first touch of the record buffers)
    t_tree, tree = timed(lambda: build_tree(records), args.repeats)
    t_all, (tree, sel, micro) = timed(lambda: process(records, 5, 0, args.max_tokens), args.repeats)
    st = tree.stats
    print(f"execution: {st.calls} calls, {st.leaves} leaves {st.leaves_by_role}, {st.unique_tokens:,} unique tokens, "
          f"{st.expanded_tokens:,} expanded, {per_call_tokens:,} per-call (Σ input+output); generated in {gen_s:.2f}s")
    print(f"  message nodes {st.message_nodes}, occurrences {st.message_occurrences}, saved {st.message_duplicates_saved}; "
          f"token segments {st.token_segments}")
    print(f"gyre tree build: {t_tree * 1e3:.0f} ms; tree + selection(J_max=5) + packing: {t_all * 1e3:.0f} ms "
          f"({len(micro)} micro-steps, {sum(m.num_tokens for m in micro):,} tokens) [goal < 1000 ms]")

    # Memory: peak while processing, at half and full scale → bytes per unique token.
    mem = {}
    for sc in (0.5 * args.scale, args.scale):
        recs = records if sc == args.scale else synthesize(0, sc)
        u = build_tree(recs).stats.unique_tokens
        tree_peak = peak_memory(lambda: build_tree(recs))
        all_peak = peak_memory(lambda: process(recs, 5, 0, args.max_tokens))
        mem[sc] = {"unique_tokens": u, "tree_peak_mb": tree_peak / 2**20, "total_peak_mb": all_peak / 2**20,
                   "tree_bytes_per_unique_token": tree_peak / u, "total_bytes_per_unique_token": all_peak / u}
        print(f"  scale {sc:.2f}: {u:,} unique tokens, peak tree {tree_peak / 2**20:.1f} MiB "
              f"({tree_peak / u:.1f} B/token), tree+select+pack {all_peak / 2**20:.1f} MiB ({all_peak / u:.1f} B/token)")
        del recs

    # Forward-backward token budgets.
    budgets = {}
    for j in (1, 5, None):
        toks = [select_trajectories(tree, j, np.random.default_rng(s)).num_tokens for s in range(args.budget_seeds)]
        budgets["unlimited" if j is None else str(j)] = float(np.mean(toks))
    full = budgets["unlimited"]
    frac = {k: 100.0 * v / full for k, v in budgets.items()}
    print("fwd-bwd token budget (mean over selection seeds) vs unlimited:")
    for k in ("1", "5", "unlimited"):
        print(f"  J_max={k:>9}: {budgets[k]:>12,.0f} tokens  {frac[k]:6.1f} %   (paper {PAPER_BUDGET[k]:.1f} %)")
    print(f"  competitors: expanded leaves {st.expanded_tokens:,} tokens ({st.expanded_tokens / full:.2f}x unlimited), "
          f"per-call samples {per_call_tokens:,} ({per_call_tokens / full:.1f}x unlimited, "
          f"{per_call_tokens / budgets['5']:.1f}x J_max=5)")
    ratio = st.unique_tokens / st.expanded_tokens
    print(f"unique / expanded tokens: {ratio:.3f}; unique / per-call tokens: {st.unique_tokens / per_call_tokens:.4f}")

    # TITO store: prefix-shared frames vs verbatim frames, write all records then load them back.
    store = {}
    with tempfile.TemporaryDirectory() as d:
        for name, window in (("prefix_shared", 4), ("verbatim", 0)):
            path = os.path.join(d, f"{name}.tito")
            t_w, _ = timed(lambda: write_store(path, records, window), 1)
            t_l, loaded = timed(lambda: load_execution(path), 1)
            assert len(loaded) == len(records) and all(
                np.array_equal(a.input_ids, b.input_ids) for a, b in zip(records, loaded))
            del loaded
            store[name] = {"file_mib": os.path.getsize(path) / 2**20, "write_s": t_w, "load_s": t_l}
            os.remove(path)
    ps, vb = store["prefix_shared"], store["verbatim"]
    print(f"TITO store: prefix-shared {ps['file_mib']:.1f} MiB (write {ps['write_s']:.2f} s, load {ps['load_s']:.2f} s) vs "
          f"verbatim {vb['file_mib']:.1f} MiB (write {vb['write_s']:.2f} s, load {vb['load_s']:.2f} s) → "
          f"{vb['file_mib'] / ps['file_mib']:.0f}x smaller, load {vb['load_s'] / ps['load_s']:.1f}x faster")

    # The obvious implementation on the same records, once (it takes seconds, not milliseconds).
    t_py, n_py = timed(lambda: python_trie(records), 1)
    assert n_py == st.unique_tokens, (n_py, st.unique_tokens)
    print(f"python per-token dict trie on the same execution: {t_py:.2f} s vs gyre tree build "
          f"{t_tree * 1e3:.0f} ms → {t_py / t_tree:.0f}x")

    figures = {
        "calls": st.calls,
        "leaves": st.leaves,
        "unique_tokens": st.unique_tokens,
        "expanded_tokens": st.expanded_tokens,
        "per_call_tokens": per_call_tokens,
        "unique_to_expanded_ratio": round(ratio, 4),
        "tree_build_s": round(t_tree, 4),
        "tree_select_pack_s": round(t_all, 4),
        "peak_mem_mb": round(mem[args.scale]["total_peak_mb"], 1),
        "bytes_per_unique_token_half_scale": round(mem[0.5 * args.scale]["total_bytes_per_unique_token"], 1),
        "bytes_per_unique_token_full_scale": round(mem[args.scale]["total_bytes_per_unique_token"], 1),
        "budget_pct_jmax1": round(frac["1"], 1),
        "budget_pct_jmax5": round(frac["5"], 1),
        "budget_pct_unlimited": round(frac["unlimited"], 1),
        "store_mib": round(ps["file_mib"], 2),
        "store_load_s": round(ps["load_s"], 3),
        "store_verbatim_mib": round(vb["file_mib"], 1),
        "python_trie_s": round(t_py, 2),
        "python_trie_speedup": round(t_py / t_tree, 1),
    }
    result = {
        "benchmark": "trajectory_bench",
        **provenance("numpy"),
        "config": vars(args),
        "figures": figures,
        "memory": {str(k): v for k, v in mem.items()},
        "left_out": [
            "no real Claude Code trace: the execution is synthetic (token sizes lognormal, random ids)",
            "store load time is reported separately, not in the tree+selection+packing time",
            "context-parallel splitting of a single over-long trajectory is not implemented",
        ],
    }
    write_results(args.out, result)


if __name__ == "__main__":
    main()
