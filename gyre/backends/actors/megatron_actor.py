"""Megatron-core training actor (GPU; `pip install gyre[gpu]`).

A cell of S ranks holds one replica laid out by megatron's `parallel_state` (TP × PP × CP × EP
= S). Gyre, not megatron, decides who reduces gradients with whom: megatron's own data-parallel
groups are not used; gradients are summed over the Gyre prefix group of this intra-cell position
(docs/design.md §3) by `reduce_gradients(group)`, and only the core owns the optimizer.

The model is built from the HF config alone (gyre.backends.actors.megatron_config): a satellite
passes no weights (`MegatronActor(hf_config, None, ...)`), the core may read a checkpoint one
tensor at a time (`MegatronActor.from_checkpoint(dir, ...)`); weights map HF ⇄ megatron in
gyre.backends.actors.mcore_mapping. The fp32 main-grad arithmetic (`main_grads_fp32`,
`grad_norm_fp32`, `clip_by_total_norm_`, `Fp32Master`) is pure and CPU-tested. A training step
needs CUDA (megatron's rotary embedding and buffers call torch.cuda); parallel state and building
the actor are tested on gloo.

Not built: MoE with TP > 1 in training (megatron needs sequence parallelism there), PP export,
context parallelism (refused up front by `mcore_mapping.check_layout`, except PP export). The
megatron-core 0.16.1 APIs used, and what is tested where: docs/backends.md, "GPU adapters".
"""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping

import torch
import torch.distributed as dist

from gyre.backends.actors import mcore_mapping as _mapping
from gyre.backends.actors.mcore_mapping import (LazyCheckpoint, NameLayout, check_layout, family_of, has_transformer_engine,
                                                num_experts, shard_experts, shard_tensor, unshard_ep, unshard_tp)
from gyre.backends.actors.megatron_config import build_gpt_model, initialize_parallel_state, transformer_config_kwargs
from gyre.backends.actors.memory import ActorMemory
from gyre.backends.config import MegatronConfig, OptimizerConfig
from gyre.loss.config import LossConfig

logger = logging.getLogger(__name__)

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


# ---------------------------------------------------------------------------- fp32 main grads
# bf16 parameters train with fp32 *main* gradients and an fp32 master copy held by the actor
# (not Megatron's DDP + mixed-precision optimizer: Gyre reduces gradients over its own prefix
# groups and only the core owns an optimizer, neither of which Megatron's optimizer models).
# Reduced gradients are summed in fp32 (`reduce_gradients` stores them as `p.main_grad`, the
# name Megatron uses); the norm, clip and AdamW run on fp32; the bf16 parameters are rounded
# from the fp32 masters after every step. Megatron's clip_grads helpers allocate on 'cuda' and
# assert fp32 CUDA grads, so the norm and clip are these few lines instead.
def main_grads_fp32(params: list[torch.Tensor], grad_scale: float = 1.0) -> list[torch.Tensor]:
    """fp32 gradient of each parameter × grad_scale: `main_grad` when reduced, else `.grad`
    (zeros when it got none). New tensors; the parameters are untouched."""
    out = []
    for p in params:
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        g = torch.zeros(p.shape, dtype=torch.float32, device=p.device) if g is None else g.float().clone()
        out.append(g.mul_(grad_scale) if grad_scale != 1.0 else g)
    return out


def grad_norm_fp32(grads: list[torch.Tensor], group: Any = None) -> float:
    """Global L2 norm of fp32 `grads` whose squares are summed over `group` (the model-parallel
    group: each rank passes only the grads it owns, TP-duplicated ones once). e.g. [3], [4] on
    two ranks → 5."""
    device = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros(1, dtype=torch.float32, device=device)
    for g in grads:
        sq += g.float().pow(2).sum()
    if group is not None and dist.get_world_size(group) > 1:
        from gyre.backends.devices import collective_device

        sq = sq.to(collective_device(group))
        dist.all_reduce(sq, group=group)
    return float(sq.sqrt())


def clip_by_total_norm_(grads: list[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale `grads` in place by max_norm / (total_norm + 1e-6) when that is below 1 (as
    torch.nn.utils.clip_grad_norm_ and Megatron's clip_grad_by_total_norm_fp32)."""
    coeff = max_norm / (total_norm + 1e-6)
    if coeff < 1.0:
        torch._foreach_mul_(grads, coeff)


class Fp32Master:
    """fp32 master copies of (possibly bf16) parameters and AdamW over them (the core only).
    For fp32 parameters the masters are the parameters themselves."""

    def __init__(self, params: list[torch.Tensor], optim: OptimizerConfig):
        self.params = params
        self.separate = any(p.dtype != torch.float32 for p in params)
        self.masters = [p.detach().float().clone() for p in params] if self.separate else params
        self.optimizer = torch.optim.AdamW(self.masters, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                           weight_decay=optim.weight_decay)

    def step(self, grads: list[torch.Tensor], lr: float) -> None:
        """One AdamW step with fp32 `grads`, then the parameters take the (rounded) masters."""
        for m, g in zip(self.masters, grads):
            m.grad = g
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with torch.no_grad():
            self.optimizer.step()
            for m in self.masters:
                m.grad = None
            if self.separate:
                for p, m in zip(self.params, self.masters):
                    p.copy_(m)

    def reload(self) -> None:
        """The parameters were overwritten (import): the masters follow."""
        if self.separate:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    m.copy_(p)


class MegatronActor:
    """Actor over a megatron GPTModel; same contract as `CpuActor` (see its docstring)."""

    def __init__(self, hf_config, hf_state_dict: Mapping[str, torch.Tensor] | None, *, is_core: bool,
                 config: MegatronConfig | None = None, optim: OptimizerConfig | None = None,
                 loss: LossConfig | None = None, version: int = 0, seed: int = 0):
        """`hf_state_dict`: the HF weights (a dict, or `mcore_mapping.LazyCheckpoint(dir)`, read
        one tensor at a time), or None for a satellite whose weights come with its first import
        (nothing HF-sized is built: the GPTModel is shaped from `hf_config` alone)."""
        from megatron.core import parallel_state

        self.mc = config or MegatronConfig()
        self.names = NameLayout.of(hf_config)
        # refused before anything is built (gyre.config checks the same at start-up, every rank)
        check_layout(hf_config, tp=self.mc.tensor_model_parallel_size, pp=self.mc.pipeline_model_parallel_size,
                     cp=self.mc.context_parallel_size, ep=self.mc.expert_model_parallel_size,
                     te=self.names.spec == "te", vocab_size=hf_config.vocab_size, training=False)
        # (training=False: MoE + TP builds, imports and exports; its training step is refused in
        # _run, and gyre.config refuses the layout for a run up front)
        self.optim = optim or OptimizerConfig()  # AdamW, clip and lr schedule, as the CPU actor's
        self.loss = loss or LossConfig()
        self.hf_config, self.is_core, self.version = hf_config, is_core, version
        initialize_parallel_state(self.mc, seed=seed)  # no-op when gyre.run did it (every rank, at start-up)
        # the GPU gyre.run bound (torch.cuda.set_device(LOCAL_RANK)); CPU only in CPU tests
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        # every floating tensor in params_dtype, as Megatron's Float16Module casts the model (the
        # local spec's norms are built in fp32 whatever params_dtype says). No random init: the
        # import below (or a satellite's first snapshot) overwrites every parameter.
        dtype = transformer_config_kwargs(hf_config, self.mc, self.names)["params_dtype"]
        self.model = build_gpt_model(hf_config, self.mc, use_cpu_initialization=self.device.type == "cpu",
                                     init_weights=False, names=self.names).to(self.device, dtype)
        # packed 'thd' attention needs TE; the local spec runs the pack one sequence at a time
        self.packed = has_transformer_engine()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.ep_rank = parallel_state.get_expert_model_parallel_rank() if self.mc.expert_model_parallel_size > 1 else 0
        if family_of(hf_config).moe:
            # experts are split over megatron's expert-TP group; Gyre slices them with the TP rank,
            # so the two must be the same ranks (expert_tensor_parallel_size defaults to TP)
            etp = parallel_state.get_expert_tensor_parallel_rank()
            if etp != self.tp_rank:
                raise NotImplementedError(f"MegatronActor: expert TP rank {etp} != TP rank {self.tp_rank} "
                                          f"(expert_tensor_parallel_size other than TP is not supported)")
        if hf_state_dict is not None:
            self.import_parameters(hf_state_dict)
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self._params = [p for _, p in named]
        self._is_expert = [_mapping.expert_index(n) is not None for n, _ in named]
        self.master = Fp32Master(self._params, self.optim) if is_core else None
        masters = self.master.masters if self.master is not None else []
        self.memory = ActorMemory.of([*self.model.parameters(), *self.model.buffers(), *masters],
                                     optimizers=[self.optimizer])

    @classmethod
    def from_checkpoint(cls, path: str, *, is_core: bool, config: MegatronConfig | None = None,
                        optim: OptimizerConfig | None = None, loss: LossConfig | None = None, version: int = 0,
                        seed: int = 0) -> "MegatronActor":
        """An actor holding an HF checkpoint directory's weights, read lazily: its config.json
        shapes the model and each rank reads only the tensors it maps (`LazyCheckpoint`), never a
        whole HF model in host memory."""
        from transformers import AutoConfig

        return cls(AutoConfig.from_pretrained(path), LazyCheckpoint(path), is_core=is_core, config=config, optim=optim,
                   loss=loss, version=version, seed=seed)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return None if self.master is None else self.master.optimizer

    @property
    def has_optimizer_state(self) -> bool:
        return self.optimizer is not None and len(self.optimizer.state) > 0

    def _run(self, ms, *, forward_only: bool, exec_logratio_sum=None):
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        from gyre.loss import gspo_loss

        if not forward_only and family_of(self.hf_config).moe and self.mc.tensor_model_parallel_size > 1:
            raise NotImplementedError("MegatronActor: training an MoE model with TP > 1 needs sequence parallelism "
                                      "(megatron-core 0.16.1 moe_layer.py:379), not built yet; use EP")
        dev = self.device
        result: dict[str, Any] = {}
        lc = self.loss

        def loss_func(logits):
            lp = -vocab_parallel_cross_entropy(logits.float(), ms.targets.to(dev)[None])[0]
            result["logprobs"] = lp.detach()
            if forward_only:
                return lp.sum() * 0, {}
            loss, metrics = gspo_loss(lp, ms.behavior_logprobs.to(dev), ms.target_mask.to(dev), ms.exec_index.to(dev),
                                      ms.token_weight.to(dev), ms.advantages.to(dev), ms.exec_lengths.to(dev),
                                      exec_logratio_sum=None if exec_logratio_sum is None else exec_logratio_sum.to(dev),
                                      eps_low=lc.eps_low, eps_high=lc.eps_high, cap=lc.cap)
            result.update(metrics)
            result["loss"] = float(loss.detach())
            return loss.float(), {}

        def forward_step(data_iterator, model):
            from megatron.core.packed_seq_params import PackedSeqParams

            batch = next(data_iterator)
            ids, pos = batch.input_ids.to(dev)[None], batch.position_ids.to(dev)[None]
            if not self.packed:  # one causal sequence at a time: no attention across the pack
                cu = batch.cu_seqlens.tolist()
                out = torch.cat([model(ids[:, a:b], pos[:, a:b], None) for a, b in zip(cu, cu[1:])], dim=1)
                return out, loss_func
            cu = batch.cu_seqlens.to(dev, torch.int32)
            seqlen = int((batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).max())
            packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=seqlen, max_seqlen_kv=seqlen)
            return model(ids, pos, None, packed_seq_params=packed), loss_func

        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([ms]), model=[self.model],
                                    num_microbatches=1, seq_length=ms.num_tokens, micro_batch_size=1, forward_only=forward_only)
        return result

    def forward_logprobs(self, micro_step) -> torch.Tensor:
        with torch.no_grad():
            return self._run(micro_step, forward_only=True)["logprobs"].cpu()

    def exec_logratio_partial_sums(self, micro_step) -> torch.Tensor:
        """Forward-only pre-pass for a split execution (as `CpuActor`'s): Σ_{t here} δ_t, [E] float64."""
        from gyre.loss import exec_logratio_partial_sums

        ms = micro_step
        return exec_logratio_partial_sums(self.forward_logprobs(ms), ms.behavior_logprobs, ms.target_mask,
                                          ms.exec_index, ms.advantages.numel())

    def forward_backward(self, micro_step, exec_logratio_sum: torch.Tensor | None = None) -> dict[str, float]:
        res = self._run(micro_step, forward_only=False, exec_logratio_sum=exec_logratio_sum)
        return {k: float(v) for k, v in res.items() if k != "logprobs"}

    def zero_grad(self) -> None:
        for p in self._params:
            p.grad = None
            p.main_grad = None

    def reduce_gradients(self, group: Any) -> None:
        """Sum grads over Gyre's prefix group for this intra-cell position (None: alone), in
        fp32 whatever the parameter dtype: the sums land in `p.main_grad` (fp32)."""
        if group is None:
            return
        from gyre.backends.devices import collective_device

        flat = torch.cat([g.reshape(-1) for g in main_grads_fp32(self._params)])
        # CUDA tensor on "cpu:gloo,cuda:nccl" (NCCL); a gloo-only group (--parallel.backend gloo) gets a host copy
        flat = flat.to(collective_device(group))
        dist.all_reduce(flat, group=group)
        flat = flat.to(self.device)
        offset = 0
        for p in self._params:
            p.grad = None
            p.main_grad = flat[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()

    def grads_fp32(self, grad_scale: float = 1.0) -> list[torch.Tensor]:
        """fp32 gradients of `_params` × grad_scale (`main_grads_fp32`). With EP > 1 every rank of
        the cell runs the same micro-step, so each expert sees every EP rank's (identical) tokens
        and its gradient is EP × that of one copy; expert gradients are divided by EP (dense ones,
        router included, are each rank's full own gradient)."""
        grads = main_grads_fp32(self._params, grad_scale)
        ep = self.mc.expert_model_parallel_size
        if ep > 1:
            for g, expert in zip(grads, self._is_expert):
                if expert:
                    g.div_(ep)
        return grads

    def grad_norm(self, grads: list[torch.Tensor]) -> float:
        """Global L2 norm of `grads` (as `grads_fp32` gives them): dense weights over the TP × PP
        shards, each TP-duplicated one (norms, the router) once; experts over megatron's
        expert-TP × EP × PP group, where each rank holds its own experts' shards."""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

        dense = [g for p, g, e in zip(self._params, grads, self._is_expert)
                 if not e and param_is_not_tensor_parallel_duplicate(p)]
        norm = grad_norm_fp32(dense, parallel_state.get_model_parallel_group())
        if not any(self._is_expert):  # a dense model (the same on every rank: no collective skipped)
            return norm
        etp_rank = parallel_state.get_expert_tensor_parallel_rank()
        experts = [g for p, g, e in zip(self._params, grads, self._is_expert)
                   if e and (getattr(p, "tensor_model_parallel", False) or etp_rank == 0)]
        expert_norm = grad_norm_fp32(experts, parallel_state.get_expert_tensor_model_pipeline_parallel_group())
        return (norm ** 2 + expert_norm ** 2) ** 0.5

    def optimizer_step(self, max_grad_norm: float | None = None, *, grad_scale: float = 1.0) -> dict[str, float]:
        """As `CpuActor.optimizer_step`: grads × grad_scale (the |E| correction), clip, AdamW,
        all in fp32 (see `Fp32Master`); the norm is over the TP × PP shards (`grad_norm`)."""
        if self.master is None:
            raise RuntimeError("optimizer_step on a satellite: only the core holds optimizer state")
        clip = self.optim.max_grad_norm if max_grad_norm is None else max_grad_norm
        grads = self.grads_fp32(grad_scale)
        norm = self.grad_norm(grads)
        clip_by_total_norm_(grads, clip, norm)
        lr = self.optim.lr_at(self.version)
        self.master.step(grads, lr)
        self.zero_grad()
        self.version += 1
        return {"grad_norm": norm, "lr": lr, "version": float(self.version)}

    def offload(self) -> int:
        """Entering rollout: bf16/fp32 parameters, grads and fp32 main grads, the fp32 masters and
        their AdamW state to pinned host memory, then `torch.cuda.empty_cache()`
        (`gyre.backends.actors.memory`); bytes moved."""
        return self.memory.offload()

    def restore(self) -> int:
        """Entering training: everything back on this rank's GPU; bytes moved."""
        return self.memory.restore()

    def export_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter by HF name, full tensors on CPU (the `Actor` contract: what engines and
        satellites load) = `export_hf()`. Collective over this rank's TP group."""
        return self.export_hf()

    def export_shards(self) -> dict[str, torch.Tensor]:
        """This rank's megatron shards (megatron names), on CPU."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}

    def _own(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}

    def _local_name(self, name: str, own: Mapping[str, torch.Tensor]) -> str | None:
        """This rank's name of a full megatron tensor: its pipeline stage's layers renumbered from
        0, its EP rank's experts renumbered from 0; None when the tensor lives on another rank
        (another stage's layers, the embedding off the first stage, the head off the last)."""
        name = shard_experts(name, self.ep_rank, self.mc.expert_model_parallel_size, num_experts(self.hf_config))
        if name is None:
            return None
        pp = self.mc.pipeline_model_parallel_size
        if pp > 1:
            per = self.hf_config.num_hidden_layers // pp
            m = _LAYER_RE.match(name)
            if m is not None:
                i = int(m[1]) - self.pp_rank * per
                return f"decoder.layers.{i}.{m[2]}" if 0 <= i < per else None
            if name not in own and name.startswith(("embedding.", "decoder.final_layernorm.", "output_layer.")):
                return None
        return name

    def import_parameters(self, params: Mapping[str, torch.Tensor]) -> None:
        """Load either megatron-shard names (from `export_shards`) or HF names: a full HF state
        dict or a `LazyCheckpoint`, mapped one tensor at a time (`mcore_mapping.iter_hf_to_mcore`)
        and sliced to this rank's TP / EP / PP share. Every parameter must be given, with its shape."""
        own = self._own()
        if "model.embed_tokens.weight" in params:
            loaded: set[str] = set()
            embedding = None
            with torch.no_grad():
                keep = lambda n: self._local_name(n, own) is not None  # noqa: E731
                for name, full in _mapping.iter_hf_to_mcore(params, self.hf_config, self.names, keep=keep):
                    if name == "embedding.word_embeddings.weight":
                        embedding = full
                    local = self._local_name(name, own)
                    if local is None:
                        continue
                    if local not in own:
                        raise ValueError(f"MegatronActor.import_parameters: {local} (from the HF weights) is not a "
                                         f"parameter of this model ({self.names})")
                    self._copy(own, local, shard_tensor(name, full, self.tp_rank, self.mc.tensor_model_parallel_size))
                    loaded.add(local)
                # tied embeddings with PP > 1: the last stage holds its own copy of the embedding
                if "output_layer.weight" in own and "output_layer.weight" not in loaded and embedding is not None:
                    self._copy(own, "output_layer.weight", shard_tensor("output_layer.weight", embedding, self.tp_rank,
                                                                        self.mc.tensor_model_parallel_size))
                    loaded.add("output_layer.weight")
            missing = sorted(k for k in own if k not in loaded)
        else:
            missing = sorted(k for k in own if k not in params)
            if not missing:
                with torch.no_grad():
                    for k in own:
                        self._copy(own, k, params[k])
        if missing:
            raise ValueError(f"MegatronActor.import_parameters: missing {missing[:3]} ({len(missing)} in all)")
        if getattr(self, "master", None) is not None:
            self.master.reload()

    @staticmethod
    def _copy(own: dict[str, torch.Tensor], k: str, t: torch.Tensor) -> None:
        if t.shape != own[k].shape:
            raise ValueError(f"MegatronActor.import_parameters: {k} is {tuple(t.shape)}, expected {tuple(own[k].shape)}")
        own[k].copy_(t)

    def export_hf(self, *, fused_experts: bool = True) -> dict[str, torch.Tensor]:
        """Full HF-named tensors (what engines and checkpoints take): the TP slices are
        all-gathered over the tensor-parallel group, the experts over the expert-parallel group,
        and mapped back with `mcore_to_hf` (MoE experts in transformers' in-memory layout, or the
        hub layout with fused_experts=False). Collective over the TP and EP groups; PP > 1 also
        needs the other stages (not gathered here)."""
        from megatron.core import parallel_state

        if self.mc.pipeline_model_parallel_size > 1:
            raise NotImplementedError("MegatronActor.export_hf: gathering pipeline stages is not built yet")
        mine = self.export_shards()
        shards = [mine]
        if self.mc.tensor_model_parallel_size > 1:
            shards = [None] * self.mc.tensor_model_parallel_size
            dist.all_gather_object(shards, mine, group=parallel_state.get_tensor_model_parallel_group())
        full = unshard_tp(shards)
        if self.mc.expert_model_parallel_size > 1:
            experts = {k: v for k, v in full.items() if _mapping.expert_index(k) is not None}
            parts = [None] * self.mc.expert_model_parallel_size
            dist.all_gather_object(parts, experts, group=parallel_state.get_expert_model_parallel_group())
            rest = {k: v for k, v in full.items() if k not in experts}
            full = unshard_ep([{**rest, **parts[0]}] + parts[1:])
        out = _mapping.mcore_to_hf(full, self.hf_config, self.names, fused_experts=fused_experts)
        if self.hf_config.tie_word_embeddings:  # one tensor, as the HF model's named_parameters()
            out.pop("lm_head.weight", None)
        return out

    def save_checkpoint(self, path: str) -> None:
        """HF checkpoint (config.json + model.safetensors) written by TP rank 0; collective."""
        full = self.export_hf(fused_experts=False)  # the hub layout, as checkpoints on disk hold it
        if self.tp_rank == 0 and self.ep_rank == 0:
            import os

            from safetensors.torch import save_file

            os.makedirs(path, exist_ok=True)
            self.hf_config.save_pretrained(path)
            save_file({k: v.contiguous() for k, v in full.items()}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
            import json

            with open(os.path.join(path, "gyre_actor.json"), "w") as f:  # the version: checked on resume
                json.dump({"version": self.version, "is_core": self.optimizer is not None}, f)
            if self.optimizer is not None:
                logger.warning("MegatronActor.save_checkpoint: optimizer state is not saved (weights only)")

    def load_checkpoint(self, path: str, *, weights_only: bool = False) -> None:
        """Weights only (optimizer state is not saved yet): refused unless `weights_only`
        (`--train.resume-weights-only`); the version comes from the checkpoint's marker or name."""
        from pathlib import Path

        from gyre import checkpoint

        if self.optimizer is not None and not weights_only:
            raise FileNotFoundError(f"{path}: the Megatron actor's checkpoints hold no optimizer state; pass "
                                    f"--train.resume-weights-only to resume from the weights alone")
        self.import_parameters(LazyCheckpoint(path))  # one tensor at a time, sharded checkpoints too
        self.version = checkpoint.version_of(Path(path))

    def debug_state(self) -> dict:
        """Not available: parameters and optimizer state are sharded over the cell (the audit
        replay, `--train.audit-dir`, is a CPU debugging aid)."""
        raise NotImplementedError("MegatronActor.debug_state: --train.audit-dir needs the CPU actor")
