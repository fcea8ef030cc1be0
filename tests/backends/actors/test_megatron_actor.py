"""Megatron adapter on CPU: HF ⇄ megatron weight mapping by hand, and (slow) the actor on gloo
(the config translation and GPTModel construction: tests/backends/actors/test_megatron_config.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from gyre.backends.config import MegatronConfig
from gyre.backends.actors.mcore_mapping import hf_to_mcore, mcore_to_hf, shard_for_tp, unshard_tp
from gyre.backends.models.hf import ModelPreset, model_config
from tests.backends.helpers import check_backends_of, tiny_model
from tests.distributed import run_ranks


def test_importing_the_adapter_does_not_import_megatron():
    """In a fresh interpreter (this worker may have imported megatron for another test)."""
    code = "import sys, gyre.backends.actors.megatron_actor; print('megatron.core.models' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", (out.stdout, out.stderr[-2000:])


def test_qkv_is_interleaved_per_query_group_by_hand():
    """4 query heads, 2 KV heads, head dim 1, hidden 2: linear_qkv rows must be
    [q0, q1, k0, v0, q2, q3, k1, v1] (megatron's GQA layout)."""
    cfg = model_config(ModelPreset(hidden_size=4, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=3), 5)
    hd, h = 1, 4
    rows = lambda base, n: torch.tensor([[base + i] * h for i in range(n)], dtype=torch.float32)
    p = "model.layers.0."
    full = {
        "model.embed_tokens.weight": torch.zeros(5, h), "model.norm.weight": torch.ones(h), "lm_head.weight": torch.zeros(5, h),
        p + "self_attn.q_proj.weight": rows(0, 4), p + "self_attn.k_proj.weight": rows(10, 2), p + "self_attn.v_proj.weight": rows(20, 2),
        p + "self_attn.q_proj.bias": torch.tensor([0.0, 1, 2, 3]), p + "self_attn.k_proj.bias": torch.tensor([10.0, 11]),
        p + "self_attn.v_proj.bias": torch.tensor([20.0, 21]), p + "self_attn.o_proj.weight": torch.zeros(h, 4 * hd),
        p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
        p + "mlp.gate_proj.weight": rows(100, 3), p + "mlp.up_proj.weight": rows(200, 3), p + "mlp.down_proj.weight": torch.zeros(h, 3),
    }
    m = hf_to_mcore(full, cfg)
    assert m["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert m["decoder.layers.0.self_attention.linear_qkv.bias"].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert m["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist() == [100, 101, 102, 200, 201, 202]
    # TP=2: rank 1 holds query group 1, and the second half of gate and of up
    s1 = shard_for_tp(m, 1, 2)
    assert s1["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist() == [2, 3, 11, 21]


def test_hf_megatron_round_trip_is_exact_and_shards_reassemble():
    hf = tiny_model(seed=3)
    sd = hf.state_dict()
    back = mcore_to_hf(hf_to_mcore(sd, hf.config), hf.config)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    full = hf_to_mcore(sd, hf.config)
    shards = [shard_for_tp(full, r, 2) for r in range(2)]
    for k, t in full.items():
        if k.endswith("linear_fc1.weight"):
            gate = torch.cat([s[k].chunk(2)[0] for s in shards])
            up = torch.cat([s[k].chunk(2)[1] for s in shards])
            assert torch.equal(torch.cat([gate, up]), t)
        elif k.endswith(("linear_proj.weight", "linear_fc2.weight")):
            assert torch.equal(torch.cat([s[k] for s in shards], dim=1), t)
        elif shards[0][k].shape != t.shape:
            assert torch.equal(torch.cat([s[k] for s in shards]), t)
        else:
            assert torch.equal(shards[0][k], t) and torch.equal(shards[1][k], t)
    for size in (1, 2):
        joined = unshard_tp([shard_for_tp(full, r, size) for r in range(size)])
        assert set(joined) == set(full) and all(torch.equal(joined[k], full[k]) for k in full)



# ---------------------------------------------------------------------------- fp32 main grads (pure)
def test_main_grads_are_fp32_for_bf16_params_and_prefer_the_reduced_ones():
    from gyre.backends.actors.megatron_actor import main_grads_fp32

    a, b, c = (torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)) for _ in range(3))
    a.grad = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    b.grad = torch.full((3,), 9.0, dtype=torch.bfloat16)
    b.main_grad = torch.tensor([0.5, 0.25, 1 / 3], dtype=torch.float32)  # reduced in fp32: wins
    g = main_grads_fp32([a, b, c], grad_scale=2.0)
    assert all(x.dtype == torch.float32 for x in g)
    assert g[0].tolist() == [2.0, 4.0, 6.0] and torch.equal(g[1], b.main_grad * 2) and g[2].tolist() == [0.0] * 3
    assert a.grad.tolist() == [1.0, 2.0, 3.0]  # untouched


def test_grad_norm_and_clip_by_hand():
    from gyre.backends.actors.megatron_actor import clip_by_total_norm_, grad_norm_fp32

    g = [torch.tensor([3.0]), torch.tensor([0.0, 4.0])]
    assert grad_norm_fp32(g) == 5.0
    clip_by_total_norm_(g, 1.0, 5.0)
    assert torch.allclose(g[0], torch.tensor([0.6]), atol=1e-6) and torch.allclose(g[1], torch.tensor([0.0, 0.8]), atol=1e-6)
    clip_by_total_norm_(g, 10.0, 1.0)  # under the limit: unchanged
    assert torch.allclose(g[0], torch.tensor([0.6]), atol=1e-6)


def test_fp32_master_keeps_updates_that_bf16_rounds_away():
    """lr 1e-4 on weights near 1: one AdamW step moves a weight by ~1e-4, below bf16's resolution
    there (2^-7). The fp32 master steps exactly like fp32 AdamW; the bf16 params are its rounding."""
    from gyre.backends.config import OptimizerConfig
    from gyre.backends.actors.megatron_actor import Fp32Master

    opt = OptimizerConfig(lr=1e-4)
    init = torch.linspace(0.9, 1.1, 8)
    p = torch.nn.Parameter(init.to(torch.bfloat16))
    ref = torch.nn.Parameter(init.to(torch.bfloat16).float())
    ref_opt = torch.optim.AdamW([ref], lr=1e-4, betas=opt.betas, eps=opt.eps, weight_decay=0.0)
    master = Fp32Master([p], opt)
    assert master.separate and master.masters[0].dtype == torch.float32
    for i in range(10):
        grad = torch.linspace(-1, 1, 8) + i
        master.step([grad.clone()], 1e-4)
        ref.grad = grad.clone()
        ref_opt.step()
    assert torch.equal(master.masters[0], ref.detach())
    assert torch.equal(p.detach(), ref.detach().to(torch.bfloat16))
    moved = (master.masters[0] - init.to(torch.bfloat16).float()).abs()
    assert moved.max() > 5e-4  # ten steps of ~1e-4 each, kept in fp32
    # fp32 params: no copy, the optimizer runs on the parameters themselves
    q = torch.nn.Parameter(torch.ones(2))
    assert Fp32Master([q], opt).masters[0] is q


# ---------------------------------------------------------------------------- the factory
def _layout(cfg) -> None:
    from gyre.config_checks import check_megatron_layout

    check_megatron_layout(cfg.model, cfg.backend, cfg.parallel)


def _cfg(*flags: str):
    from gyre.config import parse_config

    return parse_config(list(flags))


def test_megatron_is_refused_without_cuda_naming_the_flag(monkeypatch):
    from gyre.backends import factory
    from gyre.config import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--backend.actor megatron: needs CUDA.*use --backend.actor cpu"):
        check_backends_of(_cfg("--backend.actor", "megatron"))
    with pytest.raises(ConfigError, match="--backend.engine sglang: needs CUDA and the sglang package"):
        check_backends_of(_cfg("--backend.engine", "sglang"))
    assert factory.runnable(factory.ACTORS) == ["cpu"]


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed (test extra)")
def test_megatron_with_cuda_takes_cells_laid_out_by_the_parallel_flags(monkeypatch):
    from gyre.backends import factory
    from gyre.config import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = _cfg("--backend.actor", "megatron", "--parallel.cell-size", "4", "--parallel.tp", "2", "--parallel.pp", "2",
               "--model.dtype", "bfloat16")
    check_backends_of(cfg)  # cell_size > 1 is fine with megatron
    assert factory.megatron_config_of(cfg.parallel, cfg.model) == MegatronConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                                             params_dtype="bfloat16")
    assert factory.runnable(factory.ACTORS, cuda=True) == ["cpu", "megatron"]
    with pytest.raises(ConfigError, match="--backend.engine sglang: needs CUDA and the sglang package"):
        check_backends_of(_cfg("--backend.engine", "sglang"))
    with pytest.raises(ConfigError, match="parallel.cell_size = 2: the built-in CPU actor"):
        check_backends_of(_cfg("--parallel.cell-size", "2", "--parallel.tp", "2"))
    with pytest.raises(ConfigError, match="--model.dtype float64"):
        check_backends_of(_cfg("--backend.actor", "megatron", "--model.dtype", "float64"))
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "megatron" else real(name, *a))
    with pytest.raises(ConfigError, match="--backend.actor megatron: megatron-core is not installed"):
        check_backends_of(cfg)


# ---------------------------------------------------------------------------- on gloo, every rank
def _ranks_of(group) -> list[int]:
    import torch.distributed as dist

    return dist.get_process_group_ranks(group)


def _layouts_and_actor():
    """4 gloo ranks. (a) 2 cells of 2, TP 2, bf16: Megatron's TP groups are the cells; every rank
    builds a MegatronActor on CPU; its export is the HF model by HF name; bf16 grads reduce over
    the prefix group in fp32; the core's step takes the norm over the TP group, each
    TP-duplicated weight once. (b) 1 cell of 2 + a pool engine of 2, PP 2: every rank (pool too)
    initialises parallel state; the pipeline groups are the cell and the pool engine."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from gyre.backends.actors.megatron_actor import MegatronActor
    from gyre.backends.actors.megatron_config import initialize_parallel_state
    from gyre.config import ParallelConfig
    from gyre.topology import Topology

    rank = dist.get_rank()
    out = {}
    topo = Topology.from_config(ParallelConfig(cell_size=2, tp=2), 4, rank)
    groups = topo.create_groups()
    mc = MegatronConfig(tensor_model_parallel_size=2, params_dtype="bfloat16")
    initialize_parallel_state(mc, seed=0)
    out["tp_is_cell"] = _ranks_of(ps.get_tensor_model_parallel_group()) == topo.cell_ranks(topo.cell)
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():  # unseeded: "cuda rng state model-parallel-rng is not added"
        out["rng_seeded"] = True
    hf = tiny_model(seed=0)
    actor = MegatronActor(hf.config, hf.state_dict(), is_core=topo.is_core, config=mc)
    hf_names = dict(hf.named_parameters())
    exported = actor.export_parameters()
    out["hf_names"] = set(exported) == set(hf_names) == set(hf.state_dict())
    out["hf_values"] = all(torch.equal(exported[k], v.detach().to(torch.bfloat16)) for k, v in hf_names.items())
    out["export_dtype"] = {str(v.dtype) for v in exported.values()}
    for p in actor._params:
        p.grad = torch.full_like(p, float(topo.cell + 1))  # bf16 grads: cell 0 → 1, cell 1 → 2
    actor.reduce_gradients(groups.prefix(2))
    out["main_grads"] = {(str(p.main_grad.dtype), float(p.main_grad.unique()[0])) for p in actor._params}
    if topo.is_core:
        before = [p.detach().float().clone() for p in actor._params]
        stats = actor.optimizer_step(max_grad_norm=1e9)
        numel = sum(v.numel() for v in hf_names.values())
        out["norm_ok"] = abs(stats["grad_norm"] - 3.0 * numel ** 0.5) < 1e-3 * stats["grad_norm"]
        # a first AdamW step moves each weight by lr = 1e-4: the fp32 masters keep it, and the
        # bf16 parameters are the masters rounded (mostly unchanged at this step size)
        masters = actor.master.masters
        out["moved"] = (all(not torch.equal(m, b) for m, b in zip(masters, before))
                        and all(torch.equal(p.detach(), m.to(p.dtype)) for p, m in zip(actor._params, masters)))
        out["version"] = actor.version
    ps.destroy_model_parallel()

    topo = Topology.from_config(ParallelConfig(cell_size=2, pp=2, standalone_ranks=2), 4, rank)
    topo.create_groups()
    initialize_parallel_state(MegatronConfig(pipeline_model_parallel_size=2), seed=0)
    mine = topo.cell_ranks(topo.cell) if not topo.is_pool else topo.pool_engine_ranks(0)
    out["pp_is_cell"] = _ranks_of(ps.get_pipeline_model_parallel_group()) == mine
    out["first_stage"] = ps.is_pipeline_first_stage() == (topo.position == 0)
    ps.destroy_model_parallel()

    # (c) 2 cells of 2, EP 2 (an MoE model's experts split over the cell): the EP groups are the cells
    topo = Topology.from_config(ParallelConfig(cell_size=2, ep=2), 4, rank)
    topo.create_groups()
    initialize_parallel_state(MegatronConfig(expert_model_parallel_size=2), seed=0)
    out["ep_is_cell"] = _ranks_of(ps.get_expert_model_parallel_group()) == topo.cell_ranks(topo.cell)
    ps.destroy_model_parallel()
    return out


@pytest.mark.slow
@pytest.mark.multirank
def test_every_rank_initialises_megatron_with_cells_contiguous_and_the_actor_trains_on_gloo():
    pytest.importorskip("megatron.core")
    out = run_ranks(_layouts_and_actor, 4, timeout=600)
    common = dict(tp_is_cell=True, rng_seeded=True, hf_names=True, hf_values=True, export_dtype={"torch.bfloat16"},
                  main_grads={("torch.float32", 3.0)}, pp_is_cell=True, first_stage=True, ep_is_cell=True)
    for r in range(4):
        assert {k: out[r][k] for k in common} == common, (r, out[r])
    for r in (0, 1):
        assert (out[r]["norm_ok"], out[r]["moved"], out[r]["version"]) == (True, True, 1), out[r]


def _forward_backward_matches_hf():
    """TP=2 on 2 gloo ranks: Megatron's GPTModel, built by MegatronActor from HF weights, gives
    the HF model's logits (its vocab shard) and, through vocab_parallel_cross_entropy, the HF
    gradients mapped by hf_to_mcore/shard_for_tp. Two CPU shims stand in for hard CUDA calls
    megatron 0.16.1 makes in the forward (rotary: torch.cuda.current_device(); the default causal
    mask: device='cuda'), which is why this calls the model directly instead of the actor's
    forward_backward (its pipeline schedule allocates on 'cuda' too)."""
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from gyre.backends.actors.megatron_actor import MegatronActor

    torch.cuda.current_device = lambda: "cpu"  # shim (this spawned rank only)
    mc = MegatronConfig(tensor_model_parallel_size=2, params_dtype="float32")
    hf = tiny_model(seed=0)
    actor = MegatronActor(hf.config, hf.state_dict(), is_core=True, config=mc)
    tp = ps.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(5)
    n = 12
    ids = torch.randint(0, hf.config.vocab_size, (1, n), generator=g)
    target = torch.randint(0, hf.config.vocab_size, (1, n), generator=g)
    mask = torch.triu(torch.ones(n, n), diagonal=1).bool()[None, None]
    logits = actor.model(ids, torch.arange(n)[None], mask)  # [1, n, V/2]
    ref = hf(ids).logits
    logits_err = float((logits - ref.chunk(2, dim=-1)[tp]).abs().max())  # before the CE: it works in place
    (-vocab_parallel_cross_entropy(logits.float(), target)).sum().backward()
    torch.log_softmax(ref.float(), -1).gather(-1, target[..., None]).sum().backward()
    want = shard_for_tp(hf_to_mcore({k: p.grad for k, p in hf.named_parameters()}, hf.config), tp, 2)
    got = {k: p.grad for k, p in actor.model.named_parameters()}
    grad_err = max(float((got[k] - want[k]).abs().max()) for k in got)
    ps.destroy_model_parallel()
    return logits_err < 1e-4, grad_err < 1e-4, sorted(got) == sorted(want)


@pytest.mark.slow
@pytest.mark.multirank
def test_megatron_forward_and_backward_match_hf_on_cpu_with_tp2():
    pytest.importorskip("megatron.core")
    assert run_ranks(_forward_backward_matches_hf, 2, timeout=300) == [(True, True, True)] * 2


# ---------------------------------------------------------------------------- memory hand-over on gloo
def _offload_restore_bit_exact():
    """One gloo rank, bf16 (so the fp32 masters and their AdamW state are separate tensors): an
    actor after a step, with fp32 main grads reduced, goes to host memory and back bit for bit,
    and its next step equals that of a twin that never left."""
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    from gyre.backends.actors.megatron_actor import MegatronActor

    mc = MegatronConfig(params_dtype="bfloat16")
    hf = tiny_model(seed=0)
    handed, twin = (MegatronActor(hf.config, hf.state_dict(), is_core=True, config=mc) for _ in range(2))

    def grads(actor, seed):
        g = torch.Generator().manual_seed(seed)
        for p in actor._params:
            p.main_grad = torch.randn(p.shape, generator=g)  # reduced fp32 main grads, as reduce_gradients leaves them

    def state(actor):
        opt = [v.clone() for s in actor.optimizer.state.values() for v in s.values()]
        return ([p.detach().clone() for p in actor._params] + [p.main_grad.clone() for p in actor._params]
                + [m.detach().clone() for m in actor.master.masters] + opt)

    for a in (handed, twin):
        grads(a, 1)
        a.optimizer_step(1.0)
        grads(a, 2)
    before = state(handed)
    ptrs = [m.data_ptr() for m in handed.master.masters]
    moved = handed.offload()
    really_moved = all(m.data_ptr() != q for m, q in zip(handed.master.masters, ptrs))
    same_offloaded = all(torch.equal(a, b) for a, b in zip(before, state(handed)))
    handed.restore()
    same_restored = len(before) == len(state(handed)) and all(torch.equal(a, b) for a, b in zip(before, state(handed)))
    for a in (handed, twin):
        a.optimizer_step(1.0)
    next_step_equal = all(torch.equal(a, b) for a, b in zip(handed._params, twin._params))
    masters_equal = all(torch.equal(a, b) for a, b in zip(handed.master.masters, twin.master.masters))
    # bf16 params + fp32 main grads + fp32 masters + 2 fp32 moments
    numel = sum(p.numel() for p in handed._params)
    ps.destroy_model_parallel()
    return moved >= numel * (2 + 4 + 4 + 8), really_moved, same_offloaded, same_restored, next_step_equal, masters_equal


@pytest.mark.slow
@pytest.mark.multirank
def test_megatron_offload_restore_is_bit_exact_on_gloo():
    pytest.importorskip("megatron.core")
    assert run_ranks(_offload_restore_bit_exact, 1, timeout=300) == [(True,) * 6]


# ---------------------------------------------------------------------------- real families on gloo
FAMILY_VOCAB = 128


def _family_import_matches_hf(cases, ckpt_root):
    """For each (family, tp, ep) over these gloo ranks: a MegatronActor built from the HF weights
    of a tiny random-init `family` model (tests/realmodels) gives HF's logits (this rank's vocab
    shard, fp32: ≤ 1e-5, tighter than the issue's 1e-4 because these tiny models' logits are small:
    measured ~1e-7, while a missing llama3 scaling gives 7.7e-5 and inverted MoE top-k
    normalisation 1.6e-2), and its export is the HF state dict bit for bit. Megatron's forward
    calls torch.cuda.current_device() (rotary) and allocates its default causal mask on 'cuda',
    so this calls the model directly with a CPU mask and a one-line shim. Then a satellite built
    with no weights takes the export, and a saved checkpoint reloads in transformers (same class,
    same tensors) and lazily into the satellite."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from gyre.backends.actors.mcore_mapping import LazyCheckpoint
    from gyre.backends.actors.megatron_actor import MegatronActor
    from tests.realmodels import build_model

    torch.cuda.current_device = lambda: "cpu"  # shim (this spawned rank only)
    out = []
    for family, tp, ep in cases:
        hf = build_model(family, FAMILY_VOCAB, seed=1)
        mc = MegatronConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep, params_dtype="float32")
        actor = MegatronActor(hf.config, hf.state_dict(), is_core=False, config=mc)
        g = torch.Generator().manual_seed(5)
        n = 12
        ids = torch.randint(0, FAMILY_VOCAB, (1, n), generator=g)
        mask = torch.triu(torch.ones(n, n), diagonal=1).bool()[None, None]
        # far positions: llama3's scaling changes only the low frequencies, which barely turn over
        # the first few positions (at 0..11 a missing scaling is within 1e-4; at 2000.. it is not)
        pos = 2000 + torch.arange(n)[None]
        actor.model.eval()  # megatron refuses MoE + TP in training without sequence parallelism (see check_layout)
        with torch.no_grad():
            logits = actor.model(ids, pos, mask)  # [1, n, V/tp]
            ref = hf(ids, position_ids=pos).logits
        err = float((logits - ref.chunk(tp, dim=-1)[ps.get_tensor_model_parallel_rank()]).abs().max())
        exported = actor.export_parameters()
        want = hf.state_dict()
        if hf.config.tie_word_embeddings:
            want.pop("lm_head.weight")
        exact = set(exported) == set(want) and all(torch.equal(exported[k], want[k]) for k in want)
        # megatron's TP tags (what the grad norm's duplicate test reads) on exactly the sharded weights
        from gyre.backends.actors.mcore_mapping import _kind

        if tp > 1:
            exact = exact and all(bool(getattr(p, "tensor_model_parallel", False)) == (_kind(k) != "replicated")
                                  for k, p in actor.model.named_parameters() if "router" not in k)
        # a satellite: shaped from the config alone, its weights from the core's export
        satellite = MegatronActor(hf.config, None, is_core=False, config=mc)
        satellite.import_parameters(exported)
        again = satellite.export_parameters()
        exact = exact and set(again) == set(want) and all(torch.equal(again[k], want[k]) for k in want)
        # a checkpoint (hub layout) reloads in transformers as the same class, same tensors, and
        # lazily into a fresh actor
        path = f"{ckpt_root}/{family}-tp{tp}-ep{ep}"
        actor.save_checkpoint(path)
        dist.barrier()
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(path)
        same_class = type(reloaded) is type(hf)
        exact = exact and same_class and all(torch.equal(v, hf.state_dict()[k]) for k, v in reloaded.state_dict().items())
        satellite.import_parameters(LazyCheckpoint(path))
        third = satellite.export_parameters()
        exact = exact and all(torch.equal(third[k], want[k]) for k in want)
        fourth = MegatronActor.from_checkpoint(path, is_core=False, config=mc).export_parameters()  # the core's lazy start
        exact = exact and set(fourth) == set(want) and all(torch.equal(fourth[k], want[k]) for k in want)
        dist.barrier()
        out.append((family, tp, ep, err < 1e-5, exact, err))
        ps.destroy_model_parallel()
    return out


def _check_families(cases, world, tmp_path):
    pytest.importorskip("megatron.core")
    results = run_ranks(_family_import_matches_hf, world, cases, str(tmp_path), timeout=600)
    for rank, res in enumerate(results):
        for family, tp, ep, close, exact, err in res:
            assert close and exact, (rank, family, tp, ep, err, exact)


@pytest.mark.multirank
def test_qwen3_imports_into_megatron_at_tp2_with_hf_logits(tmp_path):
    """Default tier: Qwen3 (qk layernorm, head_dim 32 ≠ hidden / heads, no qkv bias) at TP 2."""
    _check_families([("qwen3", 2, 1)], 2, tmp_path)


@pytest.mark.slow
@pytest.mark.multirank
def test_every_family_imports_into_megatron_at_tp1_tp2_and_ep2_with_hf_logits(tmp_path):
    """Qwen2.5 (tied, qkv bias), Qwen3, Qwen3-MoE (router, SequentialMLP experts; EP 2: two
    experts per rank) and Llama 3.1 (llama3 RoPE with original_max_position_embeddings 1024,
    which megatron's rope_scaling cannot express: inv_freq installed) on 2 gloo ranks."""
    cases = [(f, tp, 1) for f in ("qwen2.5", "qwen3", "qwen3-moe", "llama3.1") for tp in (1, 2)] + [("qwen3-moe", 1, 2)]
    _check_families(cases, 2, tmp_path)


# ---------------------------------------------------------------------------- layouts refused at start-up
def test_megatron_layouts_are_refused_before_anything_is_built(tmp_path):
    """gyre.config_checks.check_megatron_layout (run by check_train_config on every rank, before
    Megatron's parallel state): the layout against the model's own config.json."""
    from gyre.config import ConfigError
    from tests.realmodels import model_config as family_config

    cell = ("--backend.actor", "megatron", "--parallel.cell-size", "2")
    with pytest.raises(ConfigError, match="--parallel.ep 2: expert parallelism needs an MoE model; this qwen2 model is dense"):
        _layout(_cfg(*cell, "--parallel.ep", "2"))  # the preset: a dense Qwen2
    with pytest.raises(ConfigError, match="--parallel.pp 2: pipeline parallelism needs Transformer Engine"):
        _layout(_cfg(*cell, "--parallel.pp", "2"))
    with pytest.raises(ConfigError, match="--parallel.cp 2: the Megatron actor does not support context parallelism"):
        _layout(_cfg(*cell, "--parallel.cp", "2"))
    _layout(_cfg(*cell, "--parallel.tp", "2"))
    _layout(_cfg("--parallel.cell-size", "2", "--parallel.ep", "2"))  # the CPU actor: not this check's
    moe, dense = tmp_path / "moe", tmp_path / "dense"
    family_config("qwen3-moe", 128).save_pretrained(moe)
    family_config("qwen3", 128).save_pretrained(dense)
    _layout(_cfg(*cell, "--parallel.ep", "2", "--model.checkpoint", str(moe)))
    with pytest.raises(ConfigError, match="--parallel.tp 2 with an MoE model"):
        _layout(_cfg(*cell, "--parallel.tp", "2", "--model.checkpoint", str(moe)))
    with pytest.raises(ConfigError, match="this qwen3 model is dense"):
        _layout(_cfg(*cell, "--parallel.ep", "2", "--model.checkpoint", str(dense)))
    bad = tmp_path / "mistral"
    from transformers import MistralConfig

    MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128).save_pretrained(bad)
    with pytest.raises(ConfigError, match=r"model_type 'mistral' is not supported; supported: \['llama', 'qwen2'"):
        _layout(_cfg("--backend.actor", "megatron", "--model.checkpoint", str(bad)))
    with pytest.raises(ConfigError, match="--model.checkpoint .*: no readable config.json"):
        _layout(_cfg("--backend.actor", "megatron", "--model.checkpoint", str(tmp_path / "none")))


def test_import_names_slice_pipeline_stages_and_expert_ranks():
    """MegatronActor._local_name (pure): PP stage 1 of 2 holds HF layers 2..3 as its layers 0..1,
    no embedding; EP rank 1 of 2 holds experts 2..3 as 0..1. (PP needs TE to run: not here.)"""
    from types import SimpleNamespace

    from gyre.backends.actors.megatron_actor import MegatronActor
    from tests.realmodels import model_config as family_config

    cfg = family_config("qwen3-moe", 128, num_hidden_layers=4)
    me = SimpleNamespace(mc=MegatronConfig(pipeline_model_parallel_size=2, expert_model_parallel_size=2), hf_config=cfg,
                         pp_rank=1, ep_rank=1)
    own = {"decoder.final_layernorm.weight": None, "output_layer.weight": None}
    name = lambda n: MegatronActor._local_name(me, n, own)
    assert name("decoder.layers.3.mlp.router.weight") == "decoder.layers.1.mlp.router.weight"
    assert name("decoder.layers.1.mlp.router.weight") is None
    assert name("embedding.word_embeddings.weight") is None
    assert name("decoder.final_layernorm.weight") == "decoder.final_layernorm.weight"
    assert name("decoder.layers.2.mlp.experts.linear_fc1.weight3") == "decoder.layers.0.mlp.experts.linear_fc1.weight1"
    assert name("decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight") is None  # EP rank 0's


def _moe_ep_grads_match_hf():
    """Qwen3-MoE at EP 2 on 2 gloo ranks, both running the same tokens (as a Gyre cell does):
    after megatron's backward, `grads_fp32` equals HF's gradient mapped to this rank's experts
    (expert grads divided by EP: each expert saw both ranks' identical tokens), and `grad_norm`
    is HF's total gradient norm. CPU shims as in `_forward_backward_matches_hf`."""
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from gyre.backends.actors.mcore_mapping import NameLayout, shard
    from gyre.backends.actors.megatron_actor import MegatronActor
    from tests.realmodels import build_model

    torch.cuda.current_device = lambda: "cpu"  # shim (this spawned rank only)
    hf = build_model("qwen3-moe", FAMILY_VOCAB, seed=3)
    actor = MegatronActor(hf.config, hf.state_dict(), is_core=True, config=MegatronConfig(expert_model_parallel_size=2,
                                                                                       params_dtype="float32"))
    g = torch.Generator().manual_seed(7)
    n = 16
    ids = torch.randint(0, FAMILY_VOCAB, (1, n), generator=g)
    target = torch.randint(0, FAMILY_VOCAB, (1, n), generator=g)
    mask = torch.triu(torch.ones(n, n), diagonal=1).bool()[None, None]
    logits = actor.model(ids, torch.arange(n)[None], mask)
    (-vocab_parallel_cross_entropy(logits.float(), target)).sum().backward()
    torch.log_softmax(hf(ids).logits.float(), -1).gather(-1, target[..., None]).sum().backward()
    hf_grads = {k: p.grad for k, p in hf.named_parameters()}
    want = shard(hf_to_mcore(hf_grads, hf.config, NameLayout()), ep_rank=ps.get_expert_model_parallel_rank(), ep=2,
                 num_experts=4)
    names = [k for k, p in actor.model.named_parameters() if p.requires_grad]
    grads = dict(zip(names, actor.grads_fp32()))
    err = max(float((grads[k] - want[k]).abs().max()) for k in names)
    scale = max(float(want[k].abs().max()) for k in names)
    hf_norm = float(torch.sqrt(sum(v.double().pow(2).sum() for v in hf_grads.values())))
    norm = actor.grad_norm(list(grads.values()))
    ps.destroy_model_parallel()
    return err < 1e-5 * max(scale, 1.0), abs(norm - hf_norm) < 1e-5 * hf_norm, sorted(grads) == sorted(want), err, norm, hf_norm


@pytest.mark.slow
@pytest.mark.multirank
def test_moe_expert_parallel_gradients_and_norm_match_hf():
    pytest.importorskip("megatron.core")
    for res in run_ranks(_moe_ep_grads_match_hf, 2, timeout=300):
        assert res[:3] == (True, True, True), res
