"""gyre.backends.actors.megatron_config on CPU: the TransformerConfig / GPTModel translation of an
HF config, and (slow) parallel_state + GPTModel construction on gloo taking the mapped weights."""

from __future__ import annotations

import pytest
import torch

from gyre.backends.actors.mcore_mapping import hf_to_mcore, mcore_to_hf, shard_for_tp, unshard_tp
from gyre.backends.actors.megatron_config import gpt_model_kwargs, transformer_config_kwargs
from gyre.backends.config import MegatronConfig
from gyre.backends.models.hf import model_config
from tests.backends.helpers import tiny_model
from tests.distributed import run_ranks


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


def test_transformer_config_translation_per_family():
    from gyre.backends.actors.mcore_mapping import NameLayout
    from tests.realmodels import model_config as family_config

    mc = MegatronConfig(params_dtype="float32")
    q3 = transformer_config_kwargs(family_config("qwen3", 128), mc)
    assert q3["qk_layernorm"] and not q3["add_qkv_bias"] and q3["kv_channels"] == 32  # head_dim, not 64 / 4
    assert "num_moe_experts" not in q3
    q25 = transformer_config_kwargs(family_config("qwen2.5", 128), mc)
    assert q25["add_qkv_bias"] and not q25["qk_layernorm"] and q25["kv_channels"] == 16
    moe_cfg = family_config("qwen3-moe", 128, num_hidden_layers=3, mlp_only_layers=[1])
    moe = transformer_config_kwargs(moe_cfg, mc, NameLayout("te", "grouped"))
    assert (moe["num_moe_experts"], moe["moe_ffn_hidden_size"], moe["moe_router_topk"]) == (4, 64, 2)
    assert moe["moe_router_pre_softmax"] is False  # norm_topk_prob: top-k logits, then softmax over them
    assert moe["moe_grouped_gemm"] and moe["moe_layer_freq"] == [1, 0, 1] and moe["ffn_hidden_size"] == 128
    assert moe["moe_router_load_balancing_type"] == "none" and moe["moe_token_dispatcher_type"] == "allgather"
    unnorm = transformer_config_kwargs(family_config("qwen3-moe", 128, norm_topk_prob=False), mc, NameLayout())
    assert unnorm["moe_router_pre_softmax"] is True and unnorm["moe_grouped_gemm"] is False
    llama = family_config("llama3.1", 128)
    g = gpt_model_kwargs(llama)
    assert g["rotary_base"] == 500000 and "rope_scaling" not in g  # original context 1024: inv_freq installed instead
    real = family_config("llama3.1", 128, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    g = gpt_model_kwargs(real)
    assert g["rope_scaling"] is True and g["rope_scaling_factor"] == 8.0
    assert gpt_model_kwargs(family_config("qwen2.5", 128))["share_embeddings_and_output_weights"] is True



def _construct(tp: int):
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    from gyre.backends.actors.megatron_config import build_gpt_model, initialize_parallel_state

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
