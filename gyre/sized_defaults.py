"""Defaults that fit a pretrained checkpoint: its learning rate and micro-step size.

The class defaults (`--actor.lr` 1e-4, `--train.max-tokens` 4096) and the presets' own values are
sized for the small models Gyre builds; a pretrained model is wrecked by such a learning rate, and
4,096-token micro-steps take one rank of a 135 M model to ~8.6 GB peak RSS. So when
`--model.checkpoint` names a model of 20 M parameters or more and a value was not chosen for it
(not on the command line, and not a preset's value for the preset's own model), the run takes
the value `checkpoint_defaults` computes, and logs which and why:

    lr = 1e-6 · sqrt(1e9 / N), clamped to [1e-6, 1e-5]     N parameters
        verl trains Qwen2.5-0.5B-Instruct at 1e-6, prime-rl Qwen3-0.6B at 3e-6; the square root
        leans smaller models toward the upper end: 135 M → 2.7e-6, 0.5 B → 1.4e-6, ≥ 1 B → 1e-6.
    max_tokens = (0.8 · memory / ranks − fixed) / per_token, down to a multiple of 256, in [512, 16384]
        memory: MemAvailable (and a cgroup limit below it), shared by the node's ranks
        fixed = 5 · b · N + 1 GiB: actor weights, grads and AdamW's two moments, the engine's
                copy (b bytes a parameter in --model.dtype), the rest of the process
        per_token = 5 · b · (layers · (hidden + intermediate) + vocab): the activations a
                forward keeps for its backward, plus the logits and their log-softmax (the
                factor 5 fits the SmolLM2-135M peaks)

`checkpoint_defaults` is pure; `apply_checkpoint_defaults` reads the checkpoint's config.json,
the memory and argv, and sets the sections it is given.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gyre.backends.config import BackendConfig, ModelConfig, OptimizerConfig
    from gyre.config import TrainConfig

logger = logging.getLogger(__name__)

PRETRAINED_MIN_PARAMS = 20_000_000
GIB = 1 << 30
OVERHEAD_BYTES = GIB
MEMORY_FRACTION = 0.8
ACTIVATION_FACTOR = 5
MIN_TOKENS, MAX_TOKENS, TOKEN_STEP = 512, 16384, 256


@dataclass(frozen=True)
class ModelSize:
    """What the rules read from a checkpoint's config.json."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int


@dataclass
class Sized:
    """What `checkpoint_defaults` chose: None where the configured value stays; `notes` says why."""

    lr: float | None = None
    max_tokens: int | None = None
    notes: list[str] = field(default_factory=list)


def pretrained_lr(params: int) -> float:
    return min(1e-5, max(1e-6, 1e-6 * math.sqrt(1e9 / params)))


def activation_bytes_per_token(m: ModelSize, dtype_bytes: int) -> int:
    return ACTIVATION_FACTOR * dtype_bytes * (m.layers * (m.hidden + m.intermediate) + m.vocab)


def fixed_bytes(m: ModelSize, dtype_bytes: int) -> int:
    return 5 * dtype_bytes * m.params + OVERHEAD_BYTES


def max_tokens_for(m: ModelSize, memory_bytes: int, ranks: int, dtype_bytes: int) -> int:
    budget = MEMORY_FRACTION * memory_bytes / max(1, ranks) - fixed_bytes(m, dtype_bytes)
    tokens = int(budget // activation_bytes_per_token(m, dtype_bytes)) // TOKEN_STEP * TOKEN_STEP
    return min(MAX_TOKENS, max(MIN_TOKENS, tokens))


def checkpoint_defaults(m: ModelSize, *, memory_bytes: int, ranks: int, dtype_bytes: int, size_lr: bool,
                        size_tokens: bool) -> Sized:
    """The pretrained-scale lr (when `size_lr`) and micro-step tokens (when `size_tokens`) for a
    model of size `m` on `ranks` ranks sharing `memory_bytes`. Pure."""
    out = Sized()
    if m.params < PRETRAINED_MIN_PARAMS:
        return out
    millions = m.params / 1e6
    if size_lr:
        out.lr = pretrained_lr(m.params)
        out.notes.append(f"--actor.lr {out.lr:.3g}: a pretrained checkpoint of {millions:.0f} M parameters "
                         f"(1e-6·sqrt(1e9/N) in [1e-6, 1e-5]; the toy default would wreck it); give --actor.lr to choose")
    if size_tokens:
        out.max_tokens = max_tokens_for(m, memory_bytes, ranks, dtype_bytes)
        per_tok = activation_bytes_per_token(m, dtype_bytes) / (1 << 20)
        out.notes.append(
            f"--train.max-tokens {out.max_tokens}: {memory_bytes / GIB:.1f} GiB available for {ranks} rank(s) here, "
            f"{fixed_bytes(m, dtype_bytes) / GIB:.1f} GiB a rank for weights, grads, AdamW and the engine, "
            f"~{per_tok:.2f} MiB of activations a token; give --train.max-tokens to choose")
        if out.max_tokens == MIN_TOKENS:
            out.notes.append(f"memory is short for this model: {MIN_TOKENS} tokens a micro-step may not fit")
    return out


# ----------------------------------------------------------------------------- the impure side
def model_size(checkpoint: str | os.PathLike) -> ModelSize:
    """From config.json alone (the registry's shapes; no weights read). A tied head counts once."""
    from transformers import AutoConfig

    from gyre.backends.models.arch import expected_shapes, family_of

    config = AutoConfig.from_pretrained(str(checkpoint))
    shape = family_of(config).shape(config)
    shapes = expected_shapes(shape)
    if shape.tied:
        shapes.pop("lm_head.weight", None)
    params = sum(math.prod(s) for s in shapes.values())
    inter = shape.moe.intermediate_size * shape.moe.top_k if shape.moe else shape.intermediate_size
    return ModelSize(params=params, layers=shape.num_layers, hidden=shape.hidden_size, intermediate=inter,
                     vocab=shape.vocab_size)


def available_memory() -> int:
    """MemAvailable (/proc/meminfo), or the cgroup's limit minus its usage when that is lower."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        import psutil

        avail = int(psutil.virtual_memory().available)
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def _given(argv: list[str], flag: str) -> bool:
    alt = flag.replace("_", "-")
    return any(a in (flag, alt) or a.startswith((flag + "=", alt + "=")) for a in argv)


def apply_checkpoint_defaults(argv: list[str], preset_name: str, model: ModelConfig, backend: BackendConfig,
                              actor: OptimizerConfig, train: TrainConfig) -> list[str]:
    """Set `actor.lr`, `actor.activation_checkpointing` and `train.max_tokens` for a pretrained
    `model.checkpoint` where neither the command line (`argv`) nor the preset chose them for it;
    returns the notes (logged)."""
    from gyre.backends.config import OptimizerConfig
    from gyre.config import PRESETS, TrainConfig

    ckpt = model.checkpoint
    if not ckpt or not (Path(ckpt) / "config.json").is_file():
        return []  # no checkpoint, or one --train.prepare has still to write: the configured values stay
    preset = PRESETS[preset_name]()
    own_model = not _given(argv, "--model.checkpoint")  # the preset's checkpoint: its values were chosen for it
    size_lr = not _given(argv, "--actor.lr") and not (own_model and preset.actor.lr != OptimizerConfig.lr)
    size_tokens = not _given(argv, "--train.max-tokens") and \
        not (own_model and preset.train.max_tokens != TrainConfig.max_tokens)
    ckpt_flags = ("--actor.activation-checkpointing", "--actor.no-activation-checkpointing")
    size_memory = not any(_given(argv, f) for f in ckpt_flags) and \
        not (own_model and preset.actor.activation_checkpointing)
    if not (size_lr or size_tokens or size_memory):
        return []
    from gyre.backends.models.hf import dtype_of

    dtype_bytes = dtype_of(model.dtype).itemsize if model.dtype != "auto" else 4
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    try:
        size = model_size(ckpt)
    except (OSError, ValueError):  # unreadable or unsupported: the checkpoint's own check refuses it by name later
        return []
    out = checkpoint_defaults(size, memory_bytes=available_memory(), ranks=ranks, dtype_bytes=dtype_bytes,
                              size_lr=size_lr, size_tokens=size_tokens)
    if size_memory and size.params >= PRETRAINED_MIN_PARAMS and backend.actor == "cpu":
        # A real model's activations dwarf its weights at a useful micro-step (SmolLM2-135M: 5.3 GB
        # a rank at 2048 tokens without, 2.7 GB flat to 4096 with; docs/backends.md): recompute them.
        actor.activation_checkpointing = True
        out.notes.append("--actor.activation-checkpointing: a pretrained checkpoint's activations are recomputed in "
                         "the backward (peak memory flat in the micro-step size, ~1.3x the compute); give "
                         "--actor.no-activation-checkpointing to keep them")
    if out.lr is not None:
        actor.lr = out.lr
    if out.max_tokens is not None:
        train.max_tokens = out.max_tokens
    return out.notes
