"""Megatron adapter on CPU: config translation, HF ⇄ megatron weight mapping, and (slow)
parallel_state + GPTModel construction on gloo with the mapped weights loaded."""

from __future__ import annotations

import sys

import pytest
import torch

from gyre.backends.config import MegatronConfig
from gyre.backends.megatron_actor import (gpt_model_kwargs, hf_to_mcore, mcore_to_hf, shard_for_tp, transformer_config_kwargs,
                                          unshard_tp)
from gyre.backends.models import ModelPreset, model_config
from tests.backends.helpers import tiny_model
from tests.distributed import run_ranks


def test_importing_the_adapter_does_not_import_megatron():
    assert "megatron" not in sys.modules or "megatron.core.models" not in sys.modules


def test_transformer_config_translation():
    cfg = model_config("small", 1024)
    kw = transformer_config_kwargs(cfg, MegatronConfig(tensor_model_parallel_size=2, params_dtype="bfloat16"))
    assert (kw["num_layers"], kw["hidden_size"], kw["num_attention_heads"], kw["num_query_groups"]) == (4, 256, 8, 4)
    assert kw["ffn_hidden_size"] == 704 and kw["kv_channels"] == 32
    assert kw["normalization"] == "RMSNorm" and kw["gated_linear_unit"] and kw["add_qkv_bias"] and not kw["add_bias_linear"]
    assert kw["activation_func"] is torch.nn.functional.silu
    assert kw["params_dtype"] is torch.bfloat16 and kw["bf16"] and kw["tensor_model_parallel_size"] == 2
    g = gpt_model_kwargs(cfg)
    assert g == dict(vocab_size=1024, max_sequence_length=8192, position_embedding_type="rope", rotary_base=10000,
                     share_embeddings_and_output_weights=False, parallel_output=True)
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        transformer_config_kwargs(cfg, MegatronConfig(tensor_model_parallel_size=3))
    with pytest.raises(ValueError, match="pipeline_model_parallel_size"):
        transformer_config_kwargs(cfg, MegatronConfig(pipeline_model_parallel_size=3))


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


def _construct(tp: int):
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    from gyre.backends.megatron_actor import build_gpt_model, initialize_parallel_state

    mc = MegatronConfig(tensor_model_parallel_size=tp, params_dtype="float32")
    initialize_parallel_state(mc)
    hf = tiny_model(seed=0)
    model = build_gpt_model(hf.config, mc, use_cpu_initialization=True)
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    mine = shard_for_tp(hf_to_mcore(hf.state_dict(), hf.config), ps.get_tensor_model_parallel_rank(), tp)
    same_layout = {k: tuple(v.shape) for k, v in own.items()} == {k: tuple(v.shape) for k, v in mine.items()}
    with torch.no_grad():
        for k, t in own.items():
            t.copy_(mine[k])
    loaded = all(torch.equal(model.state_dict()[k], mine[k]) for k in own)
    # what MegatronActor.export_hf does: gather the TP slices of the live model, map back to HF
    import torch.distributed as dist

    slices = [None] * tp
    dist.all_gather_object(slices, {k: v.detach().clone() for k, v in own.items()}, group=ps.get_tensor_model_parallel_group())
    back = mcore_to_hf(unshard_tp(slices), hf.config)
    exported = set(back) == set(hf.state_dict()) and all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
    out = (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(), same_layout, loaded and exported)
    ps.destroy_model_parallel()
    return out


@pytest.mark.slow
@pytest.mark.multirank
def test_parallel_state_and_gpt_model_on_gloo_take_the_mapped_weights():
    """TP=2 over 2 gloo ranks: megatron's own GPTModel has exactly the names and shapes our
    mapping produces for each TP rank, takes the weights, and gathering its TP slices back gives
    the HF weights bit for bit (importing megatron costs ~15 s)."""
    pytest.importorskip("megatron.core")
    assert run_ranks(_construct, 2, 2, timeout=300) == [(2, 0, True, True), (2, 1, True, True)]
