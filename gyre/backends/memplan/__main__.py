"""`python -m gyre.backends.memplan` (= `python -m gyre.plan --memory`): the plan as a table or JSON."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from gyre.backends.memplan import GIB, MemPlan, MemPlanConfig, __doc__ as ABOUT, plan
from gyre.backends.memplan.advice import suggestions
from gyre.backends.models.sizes import model_dims, read_config


def _gb(n: int) -> str:
    return f"{n / GIB:8.2f}"


def format_table(cfg: MemPlanConfig, p: MemPlan) -> str:
    a, e = p.actor, p.engine
    yes = {True: "fits", False: "DOES NOT FIT"}.__getitem__
    rows = [f"{p.model}: {p.params_total / 1e9:.2f}B parameters ({p.params_active / 1e9:.2f}B active), {cfg.dtype}; "
            f"{p.gpu_gb:g} GB GPUs, cell of {p.cell_size} (tp {cfg.tp}, pp {cfg.pp}, ep {cfg.ep}), "
            f"micro-step {cfg.micro_step_tokens} tokens",
            f"{'per GPU':46s} {'GB':>8s}",
            f"actor ({cfg.actor}, the core, last stage: {a.params / 1e9:.3f}B params)"]
    for label, v in (("weights", a.weights), ("grads (fp32 main grads)" if cfg.actor == "megatron" else "grads", a.grads),
                     ("fp32 masters", a.masters), ("Adam m, v", a.adam), ("optimizer-step temporaries", a.step_temps),
                     ("activations, no recompute", a.activations), ("activations, full recompute", a.activations_recompute),
                     ("peak, no recompute", a.peak), ("peak, full recompute", a.peak_recompute)):
        rows.append(f"  {label:44s} {_gb(v)}")
    rows.append(f"  {'-> ' + yes(p.actor_fits) + (' (recompute)' if cfg.recompute else ''):44s}")
    if e is not None:
        rows.append(f"engine (SGLang, TP {e.tp}, mem fraction {cfg.mem_fraction:g})")
        for label, v in (("weights (one TP shard)", e.weights), ("free when it starts", e.free_at_start),
                         ("KV pool", e.kv_bytes), ("slack outside the fraction", e.slack),
                         ("weight-update staging", e.update_staging)):
            rows.append(f"  {label:44s} {_gb(v)}")
        rows += [f"  {'KV per token (KB)':44s} {e.kv_bytes_per_token / 1024:8.1f}",
                 f"  {'KV capacity (tokens)':44s} {e.kv_tokens:8d}   ({e.kv_tokens_actor_resident} with the actor resident)",
                 f"  -> KV {yes(p.engine_fits)} (>= {cfg.context} tokens); update staging {yes(p.update_fits)}"]
    rows.append("host")
    if e is not None:
        rows += [f"  {'offload, per GPU':44s} {_gb(p.host_offload_per_gpu)}",
                 f"  {'offload, the core cell':44s} {_gb(p.host_offload_per_cell)}"]
    rows.append(f"  {'weight snapshots on the core (keep + 1)':44s} {_gb(p.host_snapshots)}")
    if cfg.pp > 1:
        rows.append("note: --pp > 1 fits the arithmetic, but the Megatron actor cannot export weights from PP > 1 yet")
    rows.append(f"overall: {yes(p.fits)}")
    rows += [f"suggest: {s}" for s in p.suggestions]
    return "\n".join(rows)


def to_json(p: MemPlan) -> str:
    return json.dumps({**asdict(p), "fits": p.fits}, sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    import tyro

    about = ABOUT.split("\n\nActor")[0] + "\n\nThe formulas: gyre/backends/memplan.py's docstring, docs/gpu-sglang.md."
    cfg = tyro.cli(MemPlanConfig, args=argv, prog="python -m gyre.plan --memory", description=about)
    try:
        dims = model_dims(read_config(cfg.model))
        p = plan(cfg, dims)
        p.suggestions = suggestions(cfg, dims, p)
    except (ValueError, FileNotFoundError) as e:
        print(f"gyre.plan --memory: error: {e}", file=sys.stderr)
        return 2
    print(to_json(p) if cfg.json else format_table(cfg, p))
    return 0 if p.fits else 1


if __name__ == "__main__":
    sys.exit(main())
