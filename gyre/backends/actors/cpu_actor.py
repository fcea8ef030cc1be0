"""Built-in CPU training actor (docs/design.md §3, §6): one model replica in one cell.

Every training cell runs forward/backward on the micro-steps it claims and accumulates
gradients; `reduce_gradients(group)` sums them over the prefix group of the cells in the step;
only the core (`is_core=True`) owns an optimizer and applies the one clipped AdamW update, then
sends its parameters to the satellites (`gyre.backends.transfer.snapshots`).

    actor = CpuActor(build_model(model_config("tiny", 1024)), is_core=rank == 0, loss=LossConfig())
    for ms in my_micro_steps:
        actor.forward_backward(ms)
    actor.reduce_gradients(prefix_group)          # None when the core trains alone
    if actor.is_core:
        actor.optimizer_step(max_grad_norm=1.0, grad_scale=1.0)   # grad_scale: |E| rescale, below

With `OptimizerConfig.min_s_per_ktok` > 0 (emulated accelerator, benchmarks only) a micro-step's
forward_backward lasts at least tokens/1000 × that: the actor sleeps the rest after computing.

Memory (docs/backends.md, "The CPU actor's memory"). Log-probs come from the decoder's last hidden
states and the LM-head weight, `LOGPROB_CHUNK` rows of logits at a time (`gyre.loss.
token_logprobs_from_hidden`): a micro-step never holds its [T, V] logits (0.8 GB in float32 at
T = 4096, V = 49152, and as much again for their gradient). `--actor.activation-checkpointing`
recomputes each decoder layer in the backward instead of keeping its activations
(`gyre.backends.models.arch.checkpointing`); `gyre.backends.actors.accounting` says what a rank
should hold either way. On glibc, freed tensors' pages go back to the system (`release_freed_memory`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gyre.backends.config import OptimizerConfig
from gyre.backends.actors.memory import ActorMemory
from gyre.backends.models.hf import check_packing, packed_logits, save_checkpoint
from gyre.loss.config import LossConfig
from gyre.trajectory.microstep import MicroStep

logger = logging.getLogger(__name__)

# Rows of [rows, V] logits formed at a time by the log-prob op: 256 × 49152 float32 is 50 MB (the
# forward's and the backward's buffer), against 0.2 GB at 1024 rows, for no measurable speed.
LOGPROB_CHUNK = 256


def release_freed_memory(threshold: int = 64 << 10) -> bool:
    """glibc: serve every allocation of `threshold` bytes or more by its own mmap, given back at
    free (mallopt M_MMAP_THRESHOLD, process-wide, once). By default glibc raises that threshold up
    to 32 MiB after the first large free, so a backward's many mid-sized tensors (T·hidden,
    T·intermediate floats) come from the heap, which fragments and keeps its pages: measured on a
    135M Llama with activation checkpointing, peak RSS 3.65 GB at 2048 tokens and 4.96 GB at 4096
    against 2.71 GB with the threshold fixed (docs/backends.md). A MALLOC_MMAP_THRESHOLD_ set in the
    environment wins; other C libraries are left alone. Returns whether the threshold was set."""
    global _MALLOC_SET
    if _MALLOC_SET or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        ok = bool(libc.mallopt(-3, int(threshold)))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False
    _MALLOC_SET = ok
    return ok


_MALLOC_SET = False


def lm_head_weight(model) -> torch.Tensor | None:
    """The LM head's weight [V, H] when logits are exactly `hidden @ weightᵀ` (a bias-free Linear
    and no logit scaling or soft-capping in the config), else None (the actor then takes the
    model's own logits)."""
    head = model.get_output_embeddings()
    cfg = model.config
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    if any(getattr(cfg, k, None) not in (None, 1.0) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")):
        return None
    return head.weight


def packed_hidden(model, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states [N, H] of a pack of S sequences (final norm applied, no
    attention across sequences): what `packed_logits` multiplies by the LM head."""
    check_packing(input_ids, position_ids, cu_seqlens)
    cu = cu_seqlens.tolist()
    return torch.cat([model.model(input_ids=input_ids[a:b].unsqueeze(0), position_ids=position_ids[a:b].unsqueeze(0),
                                  use_cache=False).last_hidden_state[0] for a, b in zip(cu, cu[1:])], dim=0)


class CpuActor:
    """Actor over a `transformers` causal LM of a supported family (`models.build_model` /
    `models.load_model` pick the class from `gyre.backends.models.arch`)."""

    def __init__(self, model, *, is_core: bool, config: OptimizerConfig | None = None, loss: LossConfig | None = None,
                 version: int = 0):
        from gyre.backends.models.arch import family_of

        family = family_of(model.config)
        if type(model).__name__ != family.hf_class:  # e.g. a Qwen3 config under a Qwen2 class: wrong forward
            raise ValueError(f"CpuActor: model is {type(model).__name__} but its config's architecture is "
                             f"{family.hf_class}; build it with gyre.backends.models.hf.build_model/load_model")
        self.family = family
        self.model = model
        self.config = config or OptimizerConfig()
        self.loss = loss or LossConfig()
        self.is_core = is_core
        self.version = version  # optimizer steps applied (docs/design.md §2: versions count steps)
        self.model.train()
        self._params = [p for p in model.parameters() if p.requires_grad]
        if model.device.type == "cpu":
            release_freed_memory()
        self._head = lm_head_weight(model)  # None: the model's own [T, V] logits (an unusual head)
        self._bf16 = self.config.compute_dtype == "bfloat16" and model.dtype == torch.float32
        if self.config.activation_checkpointing:
            from gyre.backends.models.arch.checkpointing import checkpoint_decoder_layers

            n = checkpoint_decoder_layers(model)
            logger.info("activation checkpointing: %d decoder layers recompute their activations in the backward", n)
        self.optimizer: torch.optim.Optimizer | None = None
        self.paced_s = 0.0  # seconds slept to hold micro-steps at min_s_per_ktok
        self.pace_overruns = 0  # micro-steps whose compute alone exceeded their floor
        if is_core:
            c = self.config
            self.optimizer = torch.optim.AdamW(self._params, lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay)
        self.memory = ActorMemory.of([*model.parameters(), *model.buffers()], optimizers=[self.optimizer])

    @property
    def has_optimizer_state(self) -> bool:
        return self.optimizer is not None and len(self.optimizer.state) > 0

    # ------------------------------------------------------------------ forward
    def _logprobs(self, ms: MicroStep) -> torch.Tensor:
        from gyre.loss import token_logprobs, token_logprobs_from_hidden

        # bf16 compute (--actor.compute-dtype): the decoder's matmuls in bfloat16 from the float32
        # masters; the LM head and the log-softmax stay float32.
        run = packed_logits if self._head is None else packed_hidden
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self._bf16):
            out = run(self.model, ms.input_ids, ms.position_ids, ms.cu_seqlens)
        if self._head is None:
            return token_logprobs(out.float() if self._bf16 else out, ms.targets)
        return token_logprobs_from_hidden(out.to(self._head.dtype), self._head, ms.targets, chunk_size=LOGPROB_CHUNK)

    def forward_logprobs(self, micro_step: MicroStep) -> torch.Tensor:
        """ℓ_t [N] of `targets[t]` at every packed position (meaningful where target_mask)."""
        with torch.no_grad():
            return self._logprobs(micro_step).detach()

    def exec_logratio_partial_sums(self, micro_step: MicroStep) -> torch.Tensor:
        """Forward-only pre-pass: Σ_{t here} (ℓ_t − b_t) per execution, [E] float64."""
        from gyre.loss import exec_logratio_partial_sums

        ms = micro_step
        lp = self.forward_logprobs(ms)
        return exec_logratio_partial_sums(lp, ms.behavior_logprobs, ms.target_mask, ms.exec_index, ms.advantages.numel())

    def forward_backward(self, micro_step: MicroStep, exec_logratio_sum: torch.Tensor | None = None) -> dict[str, float]:
        """Accumulate ∂loss/∂θ of one micro-step (token weights carry 1/(|E|·L_i), so the sum
        over all micro-steps of a step is the step's loss gradient). Returns loss metrics."""
        from gyre.loss import gspo_loss

        ms = micro_step
        t0 = time.perf_counter()
        if ms.advantages.numel() > ms.num_executions:
            raise ValueError(f"micro-step {ms.step}/{ms.index}: its execution table has {ms.advantages.numel()} entries, "
                             f"more than |E| = num_executions = {ms.num_executions}")
        lp = self._logprobs(ms)
        lc = self.loss
        loss, metrics = gspo_loss(
            lp, ms.behavior_logprobs, ms.target_mask, ms.exec_index, ms.token_weight, ms.advantages, ms.exec_lengths,
            exec_logratio_sum=exec_logratio_sum, eps_low=lc.eps_low, eps_high=lc.eps_high, cap=lc.cap,
        )
        loss.backward()
        out = {k: float(v) for k, v in metrics.items()}
        out["loss"] = float(loss.detach())
        out["tokens"] = float(ms.num_tokens)
        self._pace(ms.num_tokens, time.perf_counter() - t0)
        return out

    def _pace(self, tokens: int, compute_s: float) -> None:
        """Emulated accelerator: hold the micro-step to tokens/1000 × min_s_per_ktok (off at 0)."""
        per_ktok = self.config.min_s_per_ktok
        if per_ktok <= 0:
            return
        floor = tokens / 1000.0 * per_ktok
        rest = floor - compute_s
        if rest <= 0:
            self.pace_overruns += 1
            logger.warning("micro-step of %d tokens computed in %.3fs, over its min_s_per_ktok floor %.3fs "
                           "(%d such micro-steps)", tokens, compute_s, floor, self.pace_overruns)
            return
        self.paced_s += rest
        time.sleep(rest)

    # ------------------------------------------------------------------ gradients and update
    def zero_grad(self) -> None:
        for p in self._params:
            p.grad = None

    def _flat_grads(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self._params])

    def reduce_gradients(self, group: Any) -> None:
        """Sum accumulated gradients over `group` (every member calls this); None: alone."""
        if group is None:
            return
        from gyre.backends.devices import collective_device

        flat = self._flat_grads()
        home = flat.device
        flat = flat.to(collective_device(group))  # the device the group's backend takes (no copy when same)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat = flat.to(home)
        offset = 0
        for p in self._params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def optimizer_step(self, max_grad_norm: float | None = None, *, grad_scale: float = 1.0) -> dict[str, float]:
        """Scale the (reduced) gradients by `grad_scale`, clip them to `max_grad_norm`, apply AdamW.
        Core only. grad_scale is the step's |E| correction (`gyre.loss.LossConfig.grad_scale`):
        it comes before the clip because the clip is not linear."""
        if self.optimizer is None:
            raise RuntimeError("optimizer_step on a satellite: only the core holds optimizer state")
        clip = self.config.max_grad_norm if max_grad_norm is None else max_grad_norm
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif grad_scale != 1.0:
                p.grad.mul_(grad_scale)
        grad_norm = torch.nn.utils.clip_grad_norm_(self._params, clip)
        lr = self.config.lr_at(self.version)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.zero_grad()
        self.version += 1
        return {"grad_norm": float(grad_norm), "lr": lr, "version": float(self.version)}

    # ------------------------------------------------------------------ memory hand-over
    def offload(self) -> int:
        """Parameters, grads and AdamW state to host memory (`gyre.backends.actors.memory`); bytes moved."""
        return self.memory.offload()

    def restore(self) -> int:
        """Back on the model's device; bytes moved."""
        return self.memory.restore()

    # ------------------------------------------------------------------ parameters
    def export_parameters(self) -> dict[str, torch.Tensor]:
        """A copy of every parameter, HF names (what engines and satellites load)."""
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}

    def import_parameters(self, params: dict[str, torch.Tensor]) -> None:
        """Overwrite every parameter from `params` (exactly the names `export_parameters` gives)."""
        own = dict(self.model.named_parameters())
        missing, unknown = sorted(set(own) - set(params)), sorted(set(params) - set(own))
        if missing or unknown:
            raise ValueError(f"import_parameters: missing {missing[:3]}, unexpected {unknown[:3]}")
        with torch.no_grad():
            for name, p in own.items():
                src = params[name]
                if src.shape != p.shape:
                    raise ValueError(f"import_parameters: {name} has shape {tuple(src.shape)}, expected {tuple(p.shape)}")
                p.copy_(src)

    def debug_state(self) -> dict[str, Any]:
        """Parameters, accumulated gradients and optimizer state (debug: `--train.audit-dir`)."""
        return {"params": self.export_parameters(),
                "grads": {n: (p.grad.clone() if p.grad is not None else None) for n, p in self.model.named_parameters()},
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "version": self.version}

    def save_checkpoint(self, path: str) -> None:
        """HF checkpoint (config.json + model.safetensors) plus, on the core, optimizer state."""
        save_checkpoint(self.model, path)
        if self.optimizer is not None:
            torch.save(self.optimizer.state_dict(), os.path.join(path, "optimizer.pt"))
        with open(os.path.join(path, "gyre_actor.json"), "w") as f:
            json.dump({"version": self.version, "is_core": self.is_core}, f)

    def load_checkpoint(self, path: str, *, weights_only: bool = False) -> None:
        """The inverse of `save_checkpoint`. The core needs optimizer.pt and gyre_actor.json (a
        missing one is an error, never a silent fresh optimizer or version 0) unless
        `weights_only` (`--train.resume-weights-only`): then a missing optimizer state starts a
        fresh optimizer, and a missing version is read from the checkpoint's marker or name."""
        from safetensors.torch import load_file

        from gyre import checkpoint

        opt, meta = os.path.join(path, "optimizer.pt"), os.path.join(path, "gyre_actor.json")
        for name, p, needed in (("optimizer state", opt, self.optimizer is not None), ("version", meta, True)):
            if needed and not os.path.exists(p):
                if not weights_only:
                    raise FileNotFoundError(f"{path}: {os.path.basename(p)} ({name}) is missing; pass "
                                            f"--train.resume-weights-only to resume from the weights alone")
                logger.warning("%s: %s (%s) is missing; --train.resume-weights-only: going on without it",
                               path, os.path.basename(p), name)
        state: dict[str, torch.Tensor] = {}
        for file in sorted(Path(path).glob("*.safetensors")):  # save_pretrained shards a large model
            state.update(load_file(str(file)))
        if not state:
            raise FileNotFoundError(f"{path}: no *.safetensors weights")
        # on-disk names → in-memory ones (Qwen3-MoE's per-expert tensors are fused in memory)
        state = self.family.to_model_names(state, self.family.shape(self.model.config))
        own = dict(self.model.named_parameters())
        self.import_parameters({k: v for k, v in state.items() if k in own})
        if self.optimizer is not None and os.path.exists(opt):
            self.optimizer.load_state_dict(torch.load(opt, weights_only=True))
        if os.path.exists(meta):
            with open(meta) as f:
                self.version = int(json.load(f)["version"])
        else:
            self.version = checkpoint.version_of(Path(path))
