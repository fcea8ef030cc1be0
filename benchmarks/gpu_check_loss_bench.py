"""The device check's loss bench (benchmarks/gpu_check.py, stage loss_bench), in its own process:
the fused token log-prob kernel on CUDA at T × V (bf16) against eager torch and the memory floor.

    python benchmarks/gpu_check_loss_bench.py 16384 151936     # prints one JSON line of figures
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def loss_bench(t: int, v: int) -> dict[str, Any]:
    """The fused token log-prob kernel on CUDA at [t, v], bf16."""
    import torch

    import gyre.loss as L

    L.extension_available()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(t, v, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    y = torch.randint(0, v, (t,), device="cuda", generator=gen)
    g = torch.randn(t, device="cuda", generator=gen)
    nbytes = x.numel() * x.element_size()

    def timed(fn, reps=3) -> float:
        fn()  # warm-up (allocator, kernels)
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3)
        return best

    def eager():
        xr = x.detach().requires_grad_()
        torch.log_softmax(xr, -1).gather(-1, y[:, None]).squeeze(-1).backward(g)

    def fused():
        xr = x.detach().requires_grad_()
        L.token_logprobs(xr, y).backward(g)

    k = 64  # correctness on the benchmarked data: float64 reference on the first rows
    ref = torch.log_softmax(x[:k].double(), -1).gather(-1, y[:k, None]).squeeze(-1)
    err = float((L.token_logprobs(x[:k], y[:k]).double() - ref).abs().max())
    res = {"T": t, "V": v, "dtype": "bfloat16", "logits_gib": nbytes / (1 << 30), "max_abs_err_vs_fp64": err,
           "fused_fwd_s": timed(lambda: L.token_logprobs(x, y)), "fused_fwd_bwd_s": timed(fused),
           "eager_fwd_bwd_s": timed(eager),
           "one_read_s": timed(lambda: torch.amax(x, dim=-1)),  # a reduction that reads the logits once
           "copy_s": timed(lambda: torch.empty_like(x).copy_(x))}  # one read + one write
    res["read_bandwidth_gbs"] = nbytes / res["one_read_s"] / 1e9
    # fwd+bwd moves at least: the forward's read, the backward's read of x and write of dx
    res["fwd_bwd_traffic_floor_s"] = res["one_read_s"] + res["copy_s"]
    res["speedup_vs_eager"] = res["eager_fwd_bwd_s"] / res["fused_fwd_bwd_s"]
    res["fused_fwd_over_one_read"] = res["fused_fwd_s"] / res["one_read_s"]
    res["fused_fwd_bwd_over_one_read"] = res["fused_fwd_bwd_s"] / res["one_read_s"]
    res["fused_fwd_bwd_over_traffic_floor"] = res["fused_fwd_bwd_s"] / res["fwd_bwd_traffic_floor_s"]
    res["goals"] = {"speedup_vs_eager >= 3": res["speedup_vs_eager"] >= 3,
                    "fused_fwd_over_one_read <= 1.3": res["fused_fwd_over_one_read"] <= 1.3,
                    "fused_fwd_bwd_over_traffic_floor <= 1.3": res["fused_fwd_bwd_over_traffic_floor"] <= 1.3}
    res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / (1 << 30)
    return res


if __name__ == "__main__":
    print(json.dumps(loss_bench(int(sys.argv[1]), int(sys.argv[2]))))
