"""Peak RSS of one CPU-actor rank doing forward + backward + AdamW step, against its accounting.

A SmolLM2-135M-shaped Llama (hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate 1536, vocab
49152, tied embeddings; random init from the config, no download) trains one micro-step of T
tokens through `CpuActor.forward_backward` + `optimizer_step`, each configuration in a fresh
process (ru_maxrss is a high-water mark). Printed per configuration: peak RSS, the process's RSS
before the model was built (Python + torch), `gyre.backends.actors.accounting.memory_accounting`'s terms
and the ratio peak / (base + accounting), and the seconds of the forward/backward.

    python benchmarks/actor_memory.py                      # T = 1024, 2048, 4096, checkpointing off/on
    python benchmarks/actor_memory.py --tokens 4096 --checkpointing on --compute-dtype bfloat16
    python benchmarks/actor_memory.py --shape tiny         # a seconds-long smoke

The last line is one JSON object with every row; `--out PATH` writes them with the machine, versions,
config and commit.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's gyre, not an installed one

from benchmarks.provenance import OUT_HELP, provenance, write_results  # noqa: E402

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1024, tie_word_embeddings=True),
}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def one(shape: str, tokens: int, checkpointing: bool, compute_dtype: str, seqs: int, full_logits: bool = False) -> dict:
    """One configuration in this process: build, one forward/backward + step, measure."""
    import torch
    from transformers import LlamaConfig

    from gyre.backends.actors.accounting import memory_accounting
    from gyre.backends.actors.cpu_actor import LOGPROB_CHUNK, CpuActor
    from gyre.backends.config import OptimizerConfig
    from gyre.backends.models.hf import build_model, num_parameters

    base = _rss_mb()
    s = SHAPES[shape]
    cfg = LlamaConfig(**s, max_position_embeddings=8192, rms_norm_eps=1e-5, architectures=["LlamaForCausalLM"],
                      rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    model = build_model(cfg, seed=0)
    actor = CpuActor(model, is_core=True, config=OptimizerConfig(lr=1e-6, activation_checkpointing=checkpointing,
                                                                 compute_dtype=compute_dtype))
    if full_logits:  # the path before issue 51: the model's [T, V] logits, then the fused log-softmax
        actor._head = None
    g = torch.Generator().manual_seed(0)

    def micro_step(n: int):
        return _micro_step(n, seqs, s["vocab_size"], g)

    # A first step on 16 tokens: AdamW's moments exist from then on, as in every later step of a run.
    actor.forward_backward(micro_step(16))
    actor.optimizer_step()
    ms = micro_step(tokens)
    built = _rss_mb()
    t0 = time.perf_counter()
    actor.forward_backward(ms)
    fb_s = time.perf_counter() - t0
    actor.optimizer_step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    acct = memory_accounting(num_parameters(model), tokens, s["hidden_size"], s["num_hidden_layers"], s["vocab_size"],
                             intermediate=s["intermediate_size"], heads=s["num_attention_heads"],
                             kv_heads=s["num_key_value_heads"], checkpointing=checkpointing, chunk=LOGPROB_CHUNK,
                             act_bytes=2 if compute_dtype == "bfloat16" else 4)
    expect = base + acct["total_bytes"] / 2**20
    return {"shape": shape, "tokens": tokens, "sequences": seqs, "checkpointing": checkpointing,
            "compute_dtype": compute_dtype, "full_logits": full_logits, "peak_rss_mb": round(peak), "base_rss_mb": round(base),
            "before_step_rss_mb": round(built), "accounting_mb": {k: round(v / 2**20) for k, v in acct.items()},
            "ratio": round(peak / expect, 3), "ratio_over_base": round((peak - base) / (acct["total_bytes"] / 2**20), 3),
            "forward_backward_s": round(fb_s, 1), "tokens_per_s": round(tokens / fb_s, 1),
            "threads": torch.get_num_threads()}


def _micro_step(n: int, seqs: int, vocab: int, g):
    """`seqs` random sequences packed into n tokens, one execution, the last 3/4 of each a target."""
    import torch

    from gyre.trajectory.microstep import MicroStep

    bounds = [round(i * n / seqs) for i in range(seqs + 1)]
    ids = torch.randint(0, vocab, (n,), generator=g)
    pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])
    targets = torch.zeros(n, dtype=torch.int64)
    mask = torch.zeros(n, dtype=torch.bool)
    for a, b in zip(bounds, bounds[1:]):
        targets[a:b - 1] = ids[a + 1:b]
        mask[a + (b - a) // 4:b - 1] = True  # the last 3/4 of each sequence is "sampled"
    exec_index = torch.where(mask, 0, -1)
    L = int(mask.sum())
    return MicroStep(input_ids=ids, position_ids=pos, cu_seqlens=torch.tensor(bounds), targets=targets,
                     target_mask=mask, behavior_logprobs=torch.where(mask, -10.8, 0.0).float(), exec_index=exec_index,
                     token_weight=torch.where(mask, -1.0 / L, 0.0).double(),
                     advantages=torch.tensor([1.0], dtype=torch.float64), exec_lengths=torch.tensor([L]),
                     num_executions=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--checkpointing", nargs="+", default=["off", "on"], choices=["off", "on"])
    ap.add_argument("--compute-dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--sequences", type=int, default=1, help="sequences packed into the micro-step")
    ap.add_argument("--full-logits", action="store_true",
                    help="the path before issue 51: [T, V] logits from the model (the accounting leaves them out)")
    ap.add_argument("--out", help=OUT_HELP)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one configuration
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.shape, a.tokens[0], a.checkpointing[0] == "on", a.compute_dtype[0], a.sequences, a.full_logits)))
        return
    rows = []
    for dt in a.compute_dtype:
        for t in a.tokens:
            for c in a.checkpointing:
                cmd = [sys.executable, __file__, "--one", "--shape", a.shape, "--tokens", str(t), "--checkpointing", c,
                       "--compute-dtype", dt, "--sequences", str(a.sequences), *(["--full-logits"] if a.full_logits else [])]
                out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
                if out.returncode:
                    print(out.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"{cmd} failed ({out.returncode})")
                row = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(row)
                acct = row["accounting_mb"]
                print(f"T={t:5d} ckpt={c:3s} {dt:8s}{' full logits' if a.full_logits else ''}: peak {row['peak_rss_mb']:6d} MB  accounting {acct['total_bytes']:5d} MB "
                      f"(+ base {row['base_rss_mb']} MB)  ratio {row['ratio']:.2f}  fwd/bwd {row['forward_backward_s']:6.1f}s "
                      f"({row['tokens_per_s']:.0f} tok/s)", flush=True)
    write_results(a.out, {"benchmark": "actor_memory", **provenance(), "config": vars(a), "figures": {"rows": rows}})


if __name__ == "__main__":
    main()
