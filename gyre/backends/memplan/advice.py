"""Concrete flag changes that make a memory plan fit (`gyre.backends.memplan`), the cheapest first:
activation recompute, a smaller micro-step, a higher SGLang memory fraction, bucketed weight
updates, and the smallest larger Megatron layout whose whole plan fits."""

from __future__ import annotations

import math
from dataclasses import replace

from gyre.backends.memplan import GIB, MemPlan, MemPlanConfig, plan
from gyre.backends.models.sizes import ModelDims


def _layouts(dims: ModelDims, max_cell: int = 64):
    """(tp, 1, ep) a Megatron cell can take, smallest cell first. No PP: the Megatron actor cannot
    export weights from PP > 1 yet (`MegatronActor.export_hf`), and the core exports every step."""
    divisors = lambda n: [d for d in range(1, min(n, max_cell) + 1) if n % d == 0]  # noqa: E731
    tps = [1] if dims.num_experts else [t for t in divisors(dims.kv_heads) if dims.heads % t == 0]
    eps = divisors(dims.num_experts) if dims.num_experts else [1]
    cands = [(t, p, e) for t in tps for p in (1,) for e in eps if t * p * e <= max_cell]
    return sorted(cands, key=lambda c: (c[0] * c[1] * c[2], c[1]))


def suggestions(cfg: MemPlanConfig, dims: ModelDims, p: MemPlan) -> list[str]:
    """Concrete flag changes that make `p` (= plan(cfg, dims)) fit; [] when it fits."""
    if p.fits:
        return []
    out, a = [], p.actor
    limit = int(p.gpu_gb * GIB) - int(cfg.reserve_gb * GIB)
    if not p.actor_fits:
        if not cfg.recompute and a.peak_recompute <= limit:
            out.append(f"activation recompute: actor peak {a.peak_recompute / GIB:.1f} GB (megatron "
                       f"recompute_granularity='full'; not wired into Gyre's Megatron actor yet)")
        # the backward's state: bf16 .grad on the Megatron actor (as large as the weights), fp32 on the CPU one
        base = a.weights + (a.weights if cfg.actor == "megatron" else a.grads) + a.masters + a.adam
        per_tok = (a.activations_recompute if cfg.recompute else a.activations) / cfg.micro_step_tokens
        if a.weights + a.grads + a.masters + a.adam + a.step_temps <= limit and base + per_tok <= limit:
            out.append(f"--train.max-tokens {int((limit - base) // per_tok)} (the largest micro-step that fits)")
    if p.engine is not None and not p.engine_fits:
        e = p.engine
        need = (e.weights + cfg.context * e.kv_bytes_per_token) / e.free_at_start
        if need < 0.95 and (1 - need) * e.free_at_start >= e.update_staging:
            out.append(f"--sglang.mem-fraction-static {math.ceil(need * 100) / 100:.2f} ({cfg.context} KV tokens)")
        if not cfg.offload_actor:
            out.append("--backend.offload-actor (KV sized with the actor off the GPU)")
    if p.engine is not None and not p.update_fits:
        out.append(f"bucketed weight updates (--bucket-mb 512: a {p.engine.update_staging / GIB:.1f} GB staging copy "
                   f"does not fit the {p.engine.slack / GIB:.1f} GB left outside the fraction)")
    if cfg.actor == "megatron" and not (p.actor_fits and p.engine_fits):
        for tp, pp, ep in _layouts(dims):
            if tp * pp * ep < p.cell_size or (tp, pp, ep) == (cfg.tp, cfg.pp, cfg.ep):
                continue
            try:  # SGLang's TP is the cell size: cells the heads do not divide are refused here
                q = plan(replace(cfg, tp=tp, pp=pp, ep=ep, cell_size=0, bucket_mb=cfg.bucket_mb or 512), dims)
            except ValueError:
                continue
            if q.fits:
                out.append(f"--parallel.tp {tp} --parallel.pp {pp} --parallel.ep {ep} --parallel.cell-size {tp * pp * ep}: "
                           f"actor peak {q.actor.peak / GIB:.1f} GB, {q.engine.kv_tokens} KV tokens"
                           + ("" if cfg.bucket_mb or p.update_fits else ", with bucketed updates"))
                break
        else:
            out.append("no Megatron layout of up to 64 GPUs a cell fits")
    return out
