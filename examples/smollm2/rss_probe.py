"""Peak RSS of one rank's CPU actor on a micro-step: what `--train.max-tokens` costs in memory.

    python -m examples.smollm2.rss_probe runs/smollm2/data/model --tokens 1024 2048 4096

Each size runs in a fresh process (ru_maxrss is a high-water mark): the checkpoint loaded as the
run loads it (`--model.dtype auto`: float32 on CPU), a core actor (AdamW), one forward+backward of
a micro-step of TOKENS tokens packed from sequences of --seq-len tokens (one agent turn's prompt
and reply), then the optimizer step. Prints one JSON line per size: the RSS after loading, after
the forward+backward, and the peak, in MiB. The engine a rank also holds (a second copy of the
weights plus KV caches) is not in it.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def probe(checkpoint: str, tokens: int, seq_len: int, seed: int = 0) -> dict:
    import torch

    from gyre.backends.actors.cpu_actor import CpuActor
    from gyre.backends.models.hf import load_model
    from gyre.trajectory.microstep import MicroStep

    torch.set_num_threads(1)
    model = load_model(checkpoint, dtype=torch.float32)
    actor = CpuActor(model, is_core=True)
    loaded = _rss_mib()
    g = torch.Generator().manual_seed(seed)
    lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    n, vocab = sum(lens), model.config.vocab_size
    ids = torch.randint(0, vocab, (n,), generator=g)
    pos = torch.cat([torch.arange(k) for k in lens])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    mask = torch.ones(n, dtype=torch.bool)
    mask[cu[1:] - 1] = False  # the last token of a sequence has no target
    ex = torch.where(mask, torch.zeros(n, dtype=torch.long), torch.full((n,), -1))
    ms = MicroStep(input_ids=ids, position_ids=pos, cu_seqlens=cu, targets=torch.roll(ids, -1), target_mask=mask,
                   behavior_logprobs=torch.where(mask, torch.full((n,), -10.0), torch.zeros(n)), exec_index=ex,
                   token_weight=torch.where(mask, torch.full((n,), -1.0 / int(mask.sum()), dtype=torch.float64),
                                            torch.zeros(n, dtype=torch.float64)),
                   advantages=torch.ones(1, dtype=torch.float64), exec_lengths=mask.sum().reshape(1), num_executions=1)
    t0 = time.perf_counter()
    actor.forward_backward(ms)
    fb_s = time.perf_counter() - t0
    after_fb = _rss_mib()
    actor.optimizer_step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"tokens": n, "seq_len": seq_len, "params": sum(p.numel() for p in model.parameters()),
            "rss_loaded_mib": round(loaded), "rss_after_fb_mib": round(after_fb), "peak_rss_mib": round(peak),
            "forward_backward_s": round(fb_s, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child of one size
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(probe(a.checkpoint, a.tokens[0], a.seq_len)))
        return 0
    for t in a.tokens:  # a process each: ru_maxrss never goes down
        out = subprocess.run([sys.executable, "-m", "examples.smollm2.rss_probe", a.checkpoint, "--one", "--tokens",
                              str(t), "--seq-len", str(a.seq_len)], capture_output=True, text=True)
        print(out.stdout.strip() or out.stderr[-2000:], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
