"""The memory planner: does a model fit a cell's GPUs, per GPU, before a long job finds out?

    python -m gyre.plan --memory --model qwen3-8b --gpu h100 --tp 8 --cell-size 8
    python -m gyre.plan --memory --model /ckpt/Qwen3-30B-A3B --gpu-gb 141 --ep 8 --json

Pure arithmetic on the config's parameter counts (`gyre.backends.models.sizes`), per GPU of the
worst pipeline stage: the core's actor (weights, grads, masters, Adam, step temporaries,
activations), the engine (weights, the KV pool SGLang sizes from free memory, the update's
staging) and the host memory an offload moves. The formulas and their sources are in
docs/gpu-sglang.md, "The planner's arithmetic"; `advice.py` suggests flag changes when a plan does
not fit; `__main__.py` prints the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gyre.backends.config import SglangOptions, TransferConfig
from gyre.backends.models.sizes import ModelDims, model_dims, read_config

GIB = 1 << 30
GPUS = {"h100": 80.0, "h200": 141.0}
"""Nominal GPU memory in GiB (H100 SXM 80 GB, H200 141 GB)."""
MICRO_STEP_TOKENS = 4096
"""--train.max-tokens' default (gyre.config.TrainConfig, tested equal)."""


@dataclass(kw_only=True)
class MemPlanConfig:
    """`python -m gyre.plan --memory`: per-GPU memory of a model on a cell layout."""

    model: str
    """A checkpoint directory (its config.json), a config.json path, or a known model: qwen3-8b,
    qwen3-14b, qwen3-32b, qwen3-30b-a3b."""
    gpu: str = "h100"
    """GPU type: h100 (80 GB) or h200 (141 GB); --gpu-gb overrides."""
    gpu_gb: float = 0.0
    """GPU memory in GiB (0: from --gpu)."""
    cell_size: int = 0
    """GPUs per cell (--parallel.cell-size; 0: tp·pp·ep). SGLang serves at TP = the cell size."""
    tp: int = 1
    """Actor tensor parallelism (--parallel.tp)."""
    pp: int = 1
    """Actor pipeline parallelism (--parallel.pp)."""
    ep: int = 1
    """Actor expert parallelism (--parallel.ep, MoE only)."""
    micro_step_tokens: int = MICRO_STEP_TOKENS
    """Tokens per packed micro-step (--train.max-tokens)."""
    mem_fraction: float = SglangOptions().mem_fraction_static
    """SGLang's mem_fraction_static (--sglang.mem-fraction-static)."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Model dtype (--model.dtype): actor weights, engine weights and KV cache."""
    actor: Literal["megatron", "cpu"] = "megatron"
    """Training actor (--backend.actor); cpu: the built-in actor on host memory (fp32, cell size 1)."""
    recompute: bool = False
    """Judge the fit with full activation recompute (both figures are printed either way)."""
    offload_actor: bool = True
    """--backend.offload-actor: the engine sizes its KV with the actor off the GPU."""
    reserve_gb: float = 1.0
    """GiB outside both pools on every GPU: CUDA context, NCCL buffers."""
    context: int = 32768
    """KV tokens the engine must hold at least (one request this long)."""
    bucket_mb: float = 0.0
    """Extra engine memory a weight update stages, in MiB (0: the whole model, today's update)."""
    keep: int = TransferConfig().keep
    """--transfer.keep: snapshots the core keeps in host memory (plus the newest published)."""
    json: bool = False
    """Print one JSON object instead of the table."""


def _divides(d: int, n: int, flag: str, what: str) -> None:
    if n % d:
        raise ValueError(f"{flag} {d} must divide {what} ({n})")


def check_layout(cfg: MemPlanConfig, dims: ModelDims) -> tuple[float, int]:
    """(GPU GiB, cell size) after refusing a bad input by its flag."""
    gpu = cfg.gpu_gb or GPUS.get(cfg.gpu.lower(), 0.0)
    if cfg.gpu_gb < 0 or not gpu:
        raise ValueError(f"--gpu {cfg.gpu!r} is not a known GPU ({', '.join(GPUS)}); or give --gpu-gb N (> 0)")
    for flag, v in (("--tp", cfg.tp), ("--pp", cfg.pp), ("--ep", cfg.ep), ("--micro-step-tokens", cfg.micro_step_tokens),
                    ("--context", cfg.context)):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    if not 0.0 < cfg.mem_fraction < 1.0:
        raise ValueError(f"--mem-fraction must be in (0, 1), got {cfg.mem_fraction}")
    if cfg.reserve_gb < 0 or cfg.bucket_mb < 0 or cfg.keep < 1:
        raise ValueError(f"--reserve-gb {cfg.reserve_gb} and --bucket-mb {cfg.bucket_mb} must be >= 0, --keep {cfg.keep} >= 1")
    cell = cfg.cell_size or cfg.tp * cfg.pp * cfg.ep
    if cell != cfg.tp * cfg.pp * cfg.ep:
        raise ValueError(f"--cell-size {cell} must equal --tp × --pp × --ep = {cfg.tp * cfg.pp * cfg.ep}")
    if cfg.actor == "cpu" and (cell != 1 or cfg.dtype != "float32"):
        raise ValueError("--actor cpu: the built-in actor holds one fp32 model per rank: --cell-size 1, --dtype float32")
    for n, what in ((dims.heads, "the attention heads"), (dims.kv_heads, "the KV heads"), (dims.vocab, "the vocabulary")):
        _divides(cfg.tp, n, "--tp", what)
    _divides(cfg.pp, dims.num_layers, "--pp", "the layers")
    if not all(l.moe for l in dims.layers):
        _divides(cfg.tp, dims.intermediate, "--tp", "intermediate_size")
    if cfg.ep > 1 and not dims.num_experts:
        raise ValueError(f"--ep {cfg.ep}: expert parallelism needs an MoE model; {dims.name} is dense")
    if dims.num_experts:
        _divides(cfg.ep, dims.num_experts, "--ep", "the experts")
        _divides(cfg.tp, dims.moe_intermediate, "--tp", "moe_intermediate_size")
        if cfg.tp > 1 and cfg.actor == "megatron":
            raise ValueError(f"--tp {cfg.tp} with an MoE model: the Megatron actor trains MoE at TP 1 only "
                             f"(sequence parallelism is not built); split the experts with --ep")
    _divides(cell, dims.heads, "--cell-size (SGLang's TP)", "the attention heads")
    if cell > dims.kv_heads:
        _divides(dims.kv_heads, cell, "KV heads", "--cell-size (SGLang replicates them over TP)")
    else:
        _divides(cell, dims.kv_heads, "--cell-size (SGLang's TP)", "the KV heads")
    return gpu, cell


def stage_params(dims: ModelDims, tp: int, pp: int, ep: int, stage: int) -> int:
    """Parameters on one GPU of pipeline `stage` (module docstring)."""
    n_layers = dims.num_layers // pp
    layers = dims.layers[stage * n_layers:(stage + 1) * n_layers]
    n = sum(l.sharded // tp + l.replicated + l.experts // (ep * tp) for l in layers)
    if stage == 0:
        n += dims.embed // tp
    if stage == pp - 1:  # pp > 1: the last stage holds its own head, a copy of a tied embedding
        n += dims.final_norm + (dims.head if pp == 1 else dims.embed) // tp
    return n


def activation_bytes_per_token(dims: ModelDims, tp: int, pp: int, b: int, *, recompute: bool, last: bool = True) -> int:
    """Bytes one micro-step token keeps on a GPU of the last stage (module docstring)."""
    h, q, kv = dims.hidden, dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim

    def layer(moe: bool) -> int:
        attn = 2 * h + (2 * q + 2 * kv + (q + kv if dims.qk_norm else 0)) // tp
        if moe:
            return b * (attn + 2 * h + dims.top_k * (h + 3 * dims.moe_intermediate // tp)) + 8 * dims.num_experts
        return b * (attn + 2 * h + 3 * dims.intermediate // tp)

    n_layers = dims.num_layers // pp
    kinds = [l.moe for l in dims.layers[-n_layers:]]
    body = n_layers * b * h + max(layer(m) for m in kinds) if recompute else sum(layer(m) for m in kinds)
    logits = (b * 2 * h + ((b if b != 4 else 0) + 4) * dims.vocab // tp) if last else 0
    return body + logits


@dataclass
class Actor:
    """Bytes on the core's worst GPU (`params`: parameters there)."""

    params: int
    weights: int
    grads: int
    masters: int
    adam: int
    step_temps: int
    activations: int
    activations_recompute: int
    peak: int
    peak_recompute: int
    resident: int  # what stays between steps (and what offload moves): weights, masters, Adam


def plan_actor(cfg: MemPlanConfig, dims: ModelDims) -> Actor:
    """The core's worst GPU (the last stage)."""
    n = stage_params(dims, cfg.tp, cfg.pp, cfg.ep, cfg.pp - 1)
    t = cfg.micro_step_tokens
    if cfg.actor == "cpu":
        from gyre.backends.actors.accounting import memory_accounting

        inter = dims.intermediate if not dims.num_experts else dims.top_k * dims.moe_intermediate
        acts = [memory_accounting(n, t, dims.hidden, dims.num_layers, dims.vocab, intermediate=inter, heads=dims.heads,
                                  kv_heads=dims.kv_heads, checkpointing=c)["activations_bytes"] for c in (False, True)]
        w, g, m, a, temps, grad_bwd = 4 * n, 4 * n, 0, 8 * n, 0, 4 * n
    else:
        b = 2 if cfg.dtype == "bfloat16" else 4
        acts = [t * activation_bytes_per_token(dims, cfg.tp, cfg.pp, b, recompute=c) for c in (False, True)]
        w, g, m, a, temps, grad_bwd = b * n, 4 * n, (4 * n if b != 4 else 0), 8 * n, 8 * n, b * n
    step = w + g + m + a + temps
    return Actor(n, w, g, m, a, temps, acts[0], acts[1], max(w + grad_bwd + m + a + acts[0], step),
                 max(w + grad_bwd + m + a + acts[1], step), w + m + a)


@dataclass
class Engine:
    tp: int
    weights: int
    kv_bytes_per_token: int
    free_at_start: int
    kv_bytes: int
    kv_tokens: int
    kv_tokens_actor_resident: int
    slack: int
    update_staging: int


def plan_engine(cfg: MemPlanConfig, dims: ModelDims, gpu: float, cell: int, actor: Actor) -> Engine:
    b = 2 if cfg.dtype == "bfloat16" else 4
    n = sum(l.sharded // cell + l.replicated + l.experts // cell for l in dims.layers)
    weights = b * (n + (dims.embed + dims.head) // cell + dims.final_norm)
    per_token = 2 * dims.num_layers * max(1, dims.kv_heads // cell) * dims.head_dim * b

    def kv(resident: int) -> tuple[int, int]:
        free = int(gpu * GIB) - int(cfg.reserve_gb * GIB) - resident
        pool = int(cfg.mem_fraction * free) - weights
        return free, max(0, pool)

    free, pool = kv(0 if cfg.offload_actor else actor.resident)
    staging = int(cfg.bucket_mb * (1 << 20)) if cfg.bucket_mb else b * dims.total
    return Engine(cell, weights, per_token, free, pool, pool // per_token, kv(actor.resident)[1] // per_token,
                  free - int(cfg.mem_fraction * free), staging)


@dataclass
class MemPlan:
    model: str
    params_total: int
    params_active: int
    gpu_gb: float
    cell_size: int
    actor: Actor
    engine: Engine | None
    host_offload_per_gpu: int
    host_offload_per_cell: int
    host_snapshots: int
    actor_fits: bool
    engine_fits: bool
    update_fits: bool
    suggestions: list[str]

    @property
    def fits(self) -> bool:
        return self.actor_fits and self.engine_fits and self.update_fits


def plan(cfg: MemPlanConfig, dims: ModelDims | None = None) -> MemPlan:
    """The per-GPU plan of `cfg` (errors name the flag); `advice.suggestions` fills `suggestions`."""
    dims = dims or model_dims(read_config(cfg.model))
    gpu, cell = check_layout(cfg, dims)
    actor = plan_actor(cfg, dims)
    engine = plan_engine(cfg, dims, gpu, cell, actor) if cfg.actor == "megatron" else None
    limit = int(gpu * GIB) - int(cfg.reserve_gb * GIB)
    b = 2 if cfg.dtype == "bfloat16" else 4
    resident_per_param = b + (4 if b != 4 else 0) + 8  # weights, fp32 masters, Adam m and v
    per_cell = cfg.tp * cfg.ep * resident_per_param * sum(stage_params(dims, cfg.tp, cfg.pp, cfg.ep, s)
                                                         for s in range(cfg.pp))
    out = MemPlan(dims.name, dims.total, dims.active, gpu, cell, actor, engine,
                  actor.resident if engine else 0, per_cell if engine else 0, (cfg.keep + 1) * b * dims.total,
                  (actor.peak_recompute if cfg.recompute else actor.peak) <= limit,
                  engine is None or engine.kv_tokens >= cfg.context,
                  engine is None or engine.update_staging <= engine.slack, [])
    return out
