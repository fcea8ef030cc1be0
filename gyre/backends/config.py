"""Backend configuration: the tyro dataclasses of `--model.*`, `--backend.*`, `--engine.*`,
`--actor.*`, `--transfer.*`, `--sglang.*`, `--megatron.*`, the rule that resolves
`--model.dtype auto`, and `Resume` (what the factory reads of `--train.resume*`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class ModelConfig:
    """The model: a size preset built from a config, or your own HF checkpoint directory."""

    preset: Literal["tiny", "small"] = "small"
    """Size preset of the Qwen2-style decoder built from a config (no download)."""
    checkpoint: str | None = None
    """Load this HF checkpoint directory instead of building from the preset. Its own tokenizer
    (tokenizer.json or tekken.json there) and chat template become the proxy's, its
    generation_config.json / config.json eos ids end a turn, and a tokenizer larger than its
    embedding is refused (gyre/backends/models/vocab.py)."""
    seed: int = 0
    """Seed of the initial weights (same on every rank)."""
    dtype: Literal["auto", "float32", "float64", "bfloat16"] = "auto"
    """Parameter dtype of the actor and the engine. auto: bfloat16 wherever a CUDA backend is chosen
    (--backend.engine sglang or --backend.actor megatron), else float32 (the CPU backends).
    SGLang serves bfloat16 or float16 only (its Hopper attention and sgl-kernel norms), so
    float32/float64 with --backend.engine sglang are refused up front."""


@dataclass(kw_only=True)
class CpuEngineConfig:
    """The built-in rollout engine (`--backend.engine cpu`): batching, context, log-probs."""

    max_batch: int = 32
    """Most requests decoded together in one step; the rest wait (continuous batching)."""
    max_prefill_tokens: int = 4096
    """Most prompt tokens admitted (prefilled) in one step, so decoding is never starved."""
    max_model_len: int = 32768
    """Longest prompt + output; a request that reaches it finishes with reason 'length'."""
    recompute_kv_on_update: bool = True
    """After a weight update, recompute running requests' KV caches under the new weights, so
    every later log-prob is exactly that of the new weights (False: keep old keys/values, as
    SGLang does; later log-probs then mix versions)."""
    logprobs: Literal["policy", "sampling"] = "policy"
    """Which log-prob is reported per token. 'policy': log-softmax of the raw logits (temperature
    1, no top-p) — the trainer's ℓ_t for the same weights, whatever temperature sampled it.
    'sampling': the log-prob under the distribution actually sampled from (logits / T,
    renormalised over the top-p nucleus)."""
    min_decode_step_s: float = 0.0
    """Emulated accelerator (benchmarks on shared CPUs; 0 = off): every decode step lasts at least
    this long — the engine sleeps the rest of the floor after the step's compute, before its tokens
    are emitted. One engine then yields at most max_batch tokens per min_decode_step_s, like a
    GPU engine whose step time barely depends on the batch, and a cell's rollout throughput no
    longer depends on how many ranks share the CPU cores. Only meaningful while the compute of a
    step stays below the floor (steps that overran it are counted in health()["slow_steps"] and
    logged)."""


@dataclass(kw_only=True)
class OptimizerConfig:
    """`--actor.*`: the core's AdamW, clip and learning-rate schedule, for the CPU and the Megatron
    actor alike, and the CPU actor's pacing (the loss's ε and C are `gyre.loss.LossConfig`)."""

    lr: float = 1e-4
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Global grad-norm clip applied by the core before its update."""
    lr_decay_steps: int = 0
    """Linear learning-rate decay over this many optimizer steps, from `lr` down to
    `lr × min_lr_ratio` (then flat); 0 keeps `lr` constant. Counted in versions, so a resumed run
    continues the schedule where it stopped."""
    min_lr_ratio: float = 0.0
    """Where the linear decay ends, as a fraction of `lr` (0..1)."""
    activation_checkpointing: bool = False
    """CPU actor: keep only each decoder layer's input in the forward and recompute the layer in
    the backward (torch.utils.checkpoint, non-reentrant). A micro-step of T tokens then holds about
    layers·T·hidden floats instead of layers·T·(8·hidden + 4·intermediate + ...): for a 135M Llama
    at 4096 tokens, 0.6 GB of activations instead of 5.4 GB (peak RSS 2.7 GB measured), for one
    more forward (docs/backends.md has the measured table). Pays for real models at micro-steps of thousands of tokens."""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """CPU actor: dtype of the decoder's matmuls. bfloat16 runs them under CPU autocast from the
    float32 parameters (AdamW, gradients and the LM head stay float32); it halves the activations
    but is slower on a CPU without native bf16 (docs/backends.md)."""
    min_s_per_ktok: float = 0.0
    """Emulated accelerator (benchmarks on shared CPUs; 0 = off): forward_backward of a micro-step
    lasts at least (its packed tokens / 1000) × this many seconds — the actor sleeps the rest after
    the compute. Training time is then set by tokens, as on a GPU, and k cells training a step's
    micro-steps in parallel take 1/k of the wall time even when all ranks share two CPU cores.
    Only meaningful while the compute stays below the floor (overruns are counted in
    `CpuActor.pace_overruns` and logged)."""

    def __post_init__(self) -> None:
        if self.lr_decay_steps < 0:
            raise ValueError(f"actor.lr_decay_steps must be >= 0 (0 = constant lr), got {self.lr_decay_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"actor.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    def lr_at(self, version: int) -> float:
        """Learning rate of the optimizer step that turns version `version` into `version + 1`."""
        if self.lr_decay_steps == 0:
            return self.lr
        frac = min(version, self.lr_decay_steps) / self.lr_decay_steps
        return self.lr * (1.0 - (1.0 - self.min_lr_ratio) * frac)


@dataclass(kw_only=True)
class BackendConfig:
    """Which rollout engine and training actor every rank builds (`gyre.backends.factory`)."""

    engine: Literal["cpu", "sglang"] = "cpu"
    """Rollout engine. cpu: the built-in torch engine (continuous batching over per-request KV
    caches), options under --engine.*. sglang: embedded SGLang (GPU, needs CUDA and sglang 0.5.23;
    refused up front without them), one engine per cell on its first rank, tp = the cell size
    (docs/gpu-sglang.md)."""
    actor: Literal["cpu", "megatron"] = "cpu"
    """Training actor. cpu: the built-in torch actor (one whole model per rank, so
    parallel.cell_size = 1), options under --actor.*. megatron: Megatron-core on the rank's GPU
    (needs CUDA; refused up front without it), cells laid out by --parallel.tp/pp/cp/ep, the
    optimizer options under --actor.* as for cpu."""
    offload_actor: bool = True
    """Memory hand-over in a cell (docs/design.md §3): entering rollout the actor's parameters,
    gradients and optimizer state move to host memory (pinned on CUDA) and the device's cached
    blocks are freed for the engine; entering training they move back. --backend.no-offload-actor
    keeps the actor resident when the device holds both actor and engine (no copy, no latency)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the built-in engine (--backend.engine cpu: weights, KV caches, the forward). auto:
    this rank's GPU (cuda:LOCAL_RANK, bound by gyre.run) when CUDA is available, else cpu; cuda
    without CUDA is refused up front. So a GPU machine without SGLang runs the whole loop, cells
    flipping between this engine and --backend.actor megatron. (The built-in actor stays on CPU.)"""


@dataclass(kw_only=True)
class TransferConfig:
    """How the core's parameter snapshots reach the other ranks (docs/design.md §3)."""

    transport: Literal["store", "torch", "mooncake"] = "torch"
    """store: snapshots (every byte) in torchrun's TCPStore; one server process carries all of
    it, so only for tiny CPU models and tests. torch (default): the core keeps its snapshots in
    memory and a server thread sends them to readers point-to-point over a gloo group of their
    own; the store carries only version pointers and read requests; CPU clusters and any
    model a rank can hold, bounded by the core's TCP bandwidth (one copy per reader). mooncake:
    the core registers its snapshots with Mooncake Transfer Engine and readers pull them
    one-sidedly (TCP, or RDMA on GPU clusters: the choice for large models); needs the
    mooncake-transfer-engine package. Parameter broadcasts over a prefix group are gloo/NCCL
    broadcasts for store and torch, Mooncake reads for mooncake."""
    keep: int = 2
    """Snapshot versions the core keeps readable: the newest `keep` plus the newest published one
    (a rank asked for an evicted published version loads the newest published one)."""
    timeout_s: float = 600.0
    """torch: timeout of the transport's gloo group (a reader waiting for a core that stopped
    answering fails after this long instead of hanging). A read that fails outright (a peer
    that is unreachable, a connection refused) is an error at once, whatever this says; mooncake
    broadcasts tell every member of the group about a failed reader at once too."""
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    """Mooncake transport protocol (TCP on CPU machines, RDMA on clusters)."""
    mooncake_device: str = ""
    """RDMA device names for Mooncake ('' lets it choose / TCP)."""
    host: str = "auto"
    """Address this rank's Mooncake engine advertises to readers (weights and KV migration). auto:
    $GYRE_TRANSFER_HOST when set (per node: set it in each node's environment), else 127.0.0.1 on a
    single-node job, else this node's address on the interface that routes to MASTER_ADDR; each
    rank logs what it advertises. An explicit address is used by every rank, so only for one
    node. (The engine listens on every interface whatever this says: on a shared machine run it
    inside a private network namespace.)"""
    verify: bool = True
    """Check a CRC32 of the flat bytes of every snapshot read or broadcast against the sender's
    (all transports), and read a sample of parameters back from the engine after every weight
    update (one per layer, rotating; every parameter after the first update, which is read back
    whatever this says) against the weights sent (gyre.backends.transfer.readback: SGLang skips
    names it does not know, so a naming slip would otherwise serve stale weights); a mismatch
    stops the run naming the parameter. SGLang 0.5.23 reads Llama-style classes back, not Qwen:
    those get --transfer.coverage-check at start instead."""
    coverage_check: Literal["auto", "always", "off"] = "auto"
    """SGLang engines: once at start, before serving, check that the weight-update path writes every
    parameter of the served model (gyre.backends.transfer.coverage: SGLang's check_weights
    snapshot, random reset, the starting weights sent as a normal bucketed update at the same
    version, bitwise compare); a tensor left unwritten (a name SGLang's load_weights skipped)
    stops the run naming it. auto: for model classes SGLang cannot read back by name (sglang
    0.5.23: Qwen2, Qwen3, Qwen3-MoE; Llama-style ones get the read-back above instead); always:
    every SGLang engine; off: never. Cost, once per engine start: a host-memory copy of the served
    model while it runs (each TP rank its shard: the model's size in host memory per engine) and
    one extra full update."""
    bucket_mb: float = 512.0
    """Most MiB of weights an engine update stages at once on each engine GPU (plus one tensor
    larger than that, which travels alone): SGLang gets one update_weights_from_tensor (or
    _from_distributed) call per bucket inside one update session, the built-in engine copies bucket
    by bucket. Every TP rank of an SGLang engine gets the bucket's full tensors (its weight loaders
    cut their shards), so this is per GPU. One version however many buckets: it changes with the
    last. Smaller: less memory next to the engine's weights and KV cache, more calls."""

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise ValueError(f"transfer.keep must be >= 1, got {self.keep}")
        if not self.bucket_mb > 0:
            raise ValueError(f"--transfer.bucket-mb must be > 0, got {self.bucket_mb}")


# GYRE_SGLANG_API="module:attribute" names a stand-in for the sglang package (an `SglangApi`) and
# makes the SGLang engine runnable anywhere: for tests only (tests/backends/sglang_fake.py:API).
SGLANG_API_ENV = "GYRE_SGLANG_API"


@dataclass(kw_only=True)
class SglangOptions:
    """--backend.engine sglang: the server arguments users tune. Every other `--sglang.<name> VALUE`
    (or `--sglang.<name>=VALUE`; a bare `--sglang.<name>` is `true`) passes straight through to
    SGLang 0.5.23's `ServerArgs` field <name> (dashes become underscores; values parse as bool,
    int, float, else string) and lands in `extra`; names ServerArgs lacks are refused, with the
    closest ones, before the engine starts. E.g. --sglang.attention-backend triton,
    --sglang.chunked-prefill-size 4096, --sglang.disable-cuda-graph, --sglang.cuda-graph-max-bs-decode
    64, --sglang.max-running-requests 128, --sglang.context-length 32768. Gyre sets model_path,
    tp_size (= --parallel.cell-size), base_gpu_id (this rank's GPU), dtype (= --model.dtype),
    skip_tokenizer_init and weight_version itself: passing those is refused."""

    mem_fraction_static: float = 0.7
    """Fraction of GPU memory for SGLang's weights + KV cache (measured when the engine starts)."""
    enable_memory_saver: bool = True
    """Needed for release_memory_occupation / resume_memory_occupation on role switches."""
    max_shard_size: str = "5GB"
    """Shard size of the safetensors files Gyre writes for SGLang when it cannot hand it the
    --model.checkpoint directory itself (a preset model, a resumed or later version)."""
    extra: dict[str, str] = field(default_factory=dict)
    """Pass-through ServerArgs fields (filled by `--sglang.<name> VALUE`)."""


@dataclass(kw_only=True)
class SglangConfig:
    model_path: str = ""
    """HF checkpoint directory the engine serves (the actor writes it)."""
    tp_size: int = 1
    """Tensor-parallel size of the engine (the cell size on GPU)."""
    mem_fraction_static: float = 0.7
    """Fraction of GPU memory for weights + KV cache."""
    base_gpu_id: int = 0
    """First GPU of this cell's engine."""
    dtype: str = "bfloat16"
    """Serving dtype (ServerArgs.dtype: auto, float16, bfloat16, float32; SGLang's default kernels
    take float16 / bfloat16 only)."""
    enable_memory_saver: bool = True
    """Needed for release_memory_occupation / resume_memory_occupation on role switches."""
    extra: dict[str, str] = field(default_factory=dict)
    """Pass-through `ServerArgs` fields (gyre.run: `--sglang.<name> VALUE`), applied last; names are checked
    against ServerArgs at start, Gyre-owned ones refused (sglang_wire.GYRE_OWNED_SERVER_ARGS)."""


@dataclass(kw_only=True)
class MegatronConfig:
    tensor_model_parallel_size: int = 1
    """TP inside a cell."""
    pipeline_model_parallel_size: int = 1
    """PP inside a cell."""
    context_parallel_size: int = 1
    """CP inside a cell."""
    expert_model_parallel_size: int = 1
    """EP inside a cell (MoE models)."""
    params_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Parameter dtype of the GPTModel (gyre.run takes it from --model.dtype). bfloat16 trains
    with fp32 main gradients and an fp32 master copy on the core (`megatron_actor.Fp32Master`)."""


def resolve_model_dtype(model: ModelConfig, backend: BackendConfig) -> str:
    """`--model.dtype`, with auto resolved: bfloat16 wherever a CUDA backend is chosen (the SGLang
    engine, the Megatron actor), float32 on the CPU backends."""
    if model.dtype != "auto":
        return model.dtype
    return "bfloat16" if backend.engine == "sglang" or backend.actor == "megatron" else "float32"


@dataclass(frozen=True)
class Resume:
    """The `--train.resume*` flags, as the core's actor and the run directory read them."""

    on: bool = False  # start from a checkpoint (--train.resume, or --train.resume-from)
    path: str = ""  # --train.resume-from (rank 0's choice, once made); "": the newest complete one
    weights_only: bool = False  # --train.resume-weights-only
    steps: int = 0  # --train.steps: a checkpoint at or past it has nothing left to train
