"""Start-up memory of a Megatron satellite rank: the old way (a full random HF model built only to
shape Megatron, then its state dict imported) vs the new way (the GPTModel shaped from the HF
config alone, weights left for the first snapshot import). Each way runs in its own subprocess
(one gloo rank, TP 1, CPU), which reports its peak RSS (ru_maxrss) and its RSS after the imports.

    python -m benchmarks.megatron_startup_bench            # ~1.07B params (Qwen2.5-1.5B dims, 18 layers), fp32
    python -m benchmarks.megatron_startup_bench --layers 4 # smaller

The last line printed is one JSON object; `--out benchmarks/results/megatron_startup_bench.json` writes the results file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.provenance import OUT_HELP, ROOT, provenance, write_results

# Qwen2.5-1.5B's dimensions (hidden 1536, 12 heads, 2 KV heads, FFN 8960, vocab 151936, tied),
# 18 of its 28 layers: ~1.07B parameters.
DIMS = dict(hidden_size=1536, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
            max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu")


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(mode: str, layers: int, dtype: str) -> dict:
    """One satellite's start-up in this process; what it measured."""
    import resource
    import tempfile
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config

    import megatron.core  # noqa: F401  (imported before the baseline, as in a running gyre rank)
    from gyre.backends.config import MegatronConfig
    from gyre.backends.actors.megatron_actor import MegatronActor
    from gyre.backends.models.hf import build_model

    torch.set_num_threads(1)
    store = tempfile.mktemp(prefix="gyre-startup-bench-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    config = Qwen2Config(num_hidden_layers=layers, **DIMS)
    mc = MegatronConfig(params_dtype=dtype)
    base = _rss_mib()
    t0 = time.perf_counter()
    if mode == "old":  # what gyre.backends.factory.build_actor did: a seeded random HF model, then import
        model = build_model(config, dtype=getattr(torch, dtype))
        actor = MegatronActor(model.config, model.state_dict(), is_core=False, config=mc)
        del model
    else:  # shaped from the config alone; the weights come with the first snapshot
        actor = MegatronActor(config, None, is_core=False, config=mc)
    seconds = time.perf_counter() - t0
    before_written = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # Uninitialised (torch.empty) pages are not resident until written; the first snapshot import
    # writes every parameter, so both ways are measured with the parameters written (the snapshot
    # dict itself is the same in both ways and left out).
    with torch.no_grad():
        for p in actor.model.parameters():
            p.fill_(0.5)
    params = sum(p.numel() for p in actor.model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    dist.destroy_process_group()
    return dict(mode=mode, params=params, baseline_rss_mib=round(base), peak_rss_mib=round(peak),
                peak_before_params_written_mib=round(before_written),
                rise_mib=round(peak - base), model_bytes_mib=round(params * torch.finfo(getattr(torch, dtype)).bits / 8 / 2**20),
                seconds=round(seconds, 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--child", choices=["old", "new"])
    ap.add_argument("--out", help=OUT_HELP)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.layers, args.dtype)))
        return
    runs = {}
    for mode in ("new", "old"):
        r = subprocess.run([sys.executable, "-m", "benchmarks.megatron_startup_bench", "--child", mode,
                            "--layers", str(args.layers), "--dtype", args.dtype], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
        lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        if r.returncode or not lines:
            raise SystemExit(f"{mode} run failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
        runs[mode] = json.loads(lines[-1][len("RESULT "):])
        print(mode, runs[mode], flush=True)
    old, new = runs["old"], runs["new"]
    figures = {
        "params": new["params"],
        "dtype": args.dtype,
        "peak_rss_mib_old": old["peak_rss_mib"],
        "peak_rss_mib_new": new["peak_rss_mib"],
        "rise_over_baseline_mib_old": old["rise_mib"],
        "rise_over_baseline_mib_new": new["rise_mib"],
        "rise_ratio_old_over_new": round(old["rise_mib"] / max(new["rise_mib"], 1), 2),
        "peak_ratio_old_over_new": round(old["peak_rss_mib"] / max(new["peak_rss_mib"], 1), 2),
        "model_bytes_mib": new["model_bytes_mib"],
        "startup_seconds_old": old["seconds"],
        "startup_seconds_new": new["seconds"],
    }
    write_results(args.out, {
        "benchmark": "megatron_startup_bench",
        **provenance("megatron-core", "transformers"),
        "config": {"dims": DIMS, "layers": args.layers, "dtype": args.dtype, "tp": 1, "device": "cpu",
                   "what": "one satellite rank's MegatronActor start-up, each way in its own subprocess"},
        "runs": runs,
        "figures": figures,
        "note": "peak = ru_maxrss of the subprocess; baseline = RSS after importing torch, transformers, "
                "megatron and gyre and initialising gloo; rise = peak - baseline. The new way's rise is "
                "the GPTModel's own parameters, measured after writing them (as the first snapshot import does: "
                "torch.empty pages are not resident before; peak_before_params_written_mib shows that). "
                "Shared 2-core machine.",
    })


if __name__ == "__main__":
    main()
