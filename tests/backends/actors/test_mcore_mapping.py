"""HF ⇄ Megatron-core name and shape mapping per family (pure: no megatron import here, except
the one spawned rank that builds megatron's own local-spec models to derive the TE names).

Transformer Engine cannot be installed on this machine (no CUDA): the TE layout is checked by
name only, against what megatron's own TE spec (`get_gpt_layer_with_transformer_engine_spec`,
walked with TE's classes stubbed) and local spec (`sharded_state_dict_keys_map`) say."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from gyre.backends.actors import mcore_mapping as mm
from gyre.backends.actors.mcore_mapping import (LazyCheckpoint, NameLayout, check_layout, family_of, hf_to_mcore, iter_hf_to_mcore,
                                         mcore_shapes, mcore_to_hf, num_experts, shard, unshard_ep, unshard_tp)
from tests.realmodels import build_model, model_config

VOCAB = 128
FAMILIES = ("qwen2.5", "qwen3", "qwen3-moe", "llama3.1")
LAYOUTS = [NameLayout("local", "sequential"), NameLayout("te", "sequential"), NameLayout("te", "grouped")]


@pytest.fixture(scope="module")
def models():
    return {f: build_model(f, VOCAB, seed=2) for f in FAMILIES}


def test_importing_the_mapping_does_not_import_megatron():
    import subprocess

    code = "import sys, gyre.backends.actors.mcore_mapping; print(any(m.startswith('megatron') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("names", LAYOUTS, ids=lambda n: f"{n.spec}-{n.experts}")
def test_round_trip_is_exact_for_every_family_and_layout(models, family, names):
    hf = models[family]
    sd = hf.state_dict()
    full = hf_to_mcore(sd, hf.config, names)
    back = mcore_to_hf(full, hf.config, names)
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    assert len(full) == len(set(full))  # no two HF tensors land on one name
    if names.spec == "te":
        assert not any(k.endswith(("input_layernorm.weight",)) for k in full)
        assert any(k.endswith("self_attention.linear_qkv.layer_norm_weight") for k in full)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_specific_tensors(models, family):
    hf = models[family]
    full = hf_to_mcore(hf.state_dict(), hf.config, NameLayout("te", "grouped"))
    fam = family_of(hf.config)
    assert any(k.endswith("linear_qkv.bias") for k in full) == (family == "qwen2.5")
    assert any(k.endswith("q_layernorm.weight") for k in full) == (family in ("qwen3", "qwen3-moe"))
    assert ("output_layer.weight" in full) == (not hf.config.tie_word_embeddings)
    if fam.moe:
        E, inter, h = hf.config.num_experts, hf.config.moe_intermediate_size, hf.config.hidden_size
        m = "decoder.layers.0."
        assert full[m + "mlp.router.weight"].shape == (E, h)
        assert full[m + "pre_mlp_layernorm.weight"].shape == (h,)  # TE: an MoE layer keeps its own norm
        assert m + "mlp.linear_fc1.layer_norm_weight" not in full
        assert full[m + f"mlp.experts.linear_fc1.weight{E - 1}"].shape == (2 * inter, h)
        assert full[m + f"mlp.experts.linear_fc2.weight{E - 1}"].shape == (h, inter)
        # expert e's fc1 is HF expert e's [gate; up] (transformers' fused gate_up_proj[e])
        gu = hf.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
        assert torch.equal(full[m + "mlp.experts.linear_fc1.weight1"], gu[1])
    if family == "qwen3":
        hd = hf.config.head_dim
        assert hd * hf.config.num_attention_heads != hf.config.hidden_size  # an explicit head_dim is exercised
        assert full["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (
            (hf.config.num_attention_heads + 2 * hf.config.num_key_value_heads) * hd, hf.config.hidden_size)
        assert full["decoder.layers.0.self_attention.q_layernorm.weight"].shape == (hd,)


def test_moe_layer_pattern_follows_mlp_only_layers_and_sparse_step():
    hf = build_model("qwen3-moe", VOCAB, num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=1)
    assert mm.moe_layers(hf.config) == [False, True, True, True]
    full = hf_to_mcore(hf.state_dict(), hf.config, NameLayout("te", "grouped"))
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in full  # the dense layer fuses its norm under TE
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in full
    back = mcore_to_hf(full, hf.config, NameLayout("te", "grouped"))
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items()) and set(back) == set(hf.state_dict())
    cfg = model_config("qwen3-moe", VOCAB, num_hidden_layers=4, decoder_sparse_step=2)
    assert mm.moe_layers(cfg) == [False, True, False, True]


@pytest.mark.parametrize("family,tp,ep", [("qwen2.5", 2, 1), ("qwen3", 2, 1), ("llama3.1", 2, 1), ("qwen3-moe", 2, 1),
                                          ("qwen3-moe", 1, 2), ("qwen3-moe", 2, 2), ("qwen3-moe", 1, 4)])
def test_tp_ep_shards_reassemble_and_match_the_meta_shapes(models, family, tp, ep):
    hf = models[family]
    names = NameLayout("te", "grouped")
    full = hf_to_mcore(hf.state_dict(), hf.config, names)
    E = num_experts(hf.config)
    grid = [[shard(full, tp_rank=t, tp=tp, ep_rank=e, ep=ep, num_experts=E) for t in range(tp)] for e in range(ep)]
    joined = unshard_ep([unshard_tp(row) for row in grid])
    assert set(joined) == set(full) and all(torch.equal(joined[k], full[k]) for k in full)
    for e in range(ep):
        for t in range(tp):
            mine = grid[e][t]
            assert mcore_shapes(hf.config, names, tp_rank=t, tp=tp, ep_rank=e, ep=ep) == {k: tuple(v.shape) for k, v in mine.items()}
            if E:  # each EP rank holds E/EP experts, renumbered from 0, and they are its own slice
                local = [k for k in mine if k.startswith("decoder.layers.0.mlp.experts.linear_fc2.weight")]
                assert len(local) == E // ep
                g = e * (E // ep) + 1 if E // ep > 1 else e * (E // ep)
                j = g - e * (E // ep)
                want = full[f"decoder.layers.0.mlp.experts.linear_fc2.weight{g}"].chunk(tp, dim=1)[t]
                assert torch.equal(mine[f"decoder.layers.0.mlp.experts.linear_fc2.weight{j}"], want)
            # replicated over TP: norms (the fused TE ones too), q/k norms, the router
            for k, v in mine.items():
                if "norm" in k or k.endswith("router.weight"):
                    assert torch.equal(v, full[k] if "experts" not in k else v)


def test_expert_fc1_shards_split_gate_and_up_separately():
    """A TP rank's expert fc1 slice is [gate_r; up_r], what its SwiGLU chunks in two."""
    t = torch.arange(8.0)[:, None].expand(8, 2)  # gate rows 0..3, up rows 4..7
    name = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    assert mm.shard_tensor(name, t, 1, 2)[:, 0].tolist() == [2, 3, 6, 7]
    assert mm.shard_tensor(name.replace("fc1", "fc2"), torch.arange(8.0)[None], 1, 2).tolist() == [[4, 5, 6, 7]]


def test_lazy_checkpoint_maps_the_hub_layout_like_the_in_memory_model(models, tmp_path):
    """save_pretrained writes MoE experts one tensor each (the hub layout); read lazily, they map
    to the same megatron tensors as transformers' fused in-memory ones, and mcore_to_hf's hub
    layout gives back exactly the file's tensors."""
    from safetensors import safe_open

    for family in ("qwen3-moe", "qwen2.5"):
        hf = models[family]
        path = tmp_path / family
        hf.save_pretrained(str(path))
        lazy = LazyCheckpoint(str(path))
        names = NameLayout("local", "sequential")
        want = hf_to_mcore(hf.state_dict(), hf.config, names)
        got = dict(iter_hf_to_mcore(lazy, hf.config, names))
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
        hub = mcore_to_hf(got, hf.config, names, fused_experts=False)
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            on_disk = {k: f.get_tensor(k) for k in f.keys()}
        if hf.config.tie_word_embeddings:
            hub.pop("lm_head.weight")
        assert set(hub) == set(on_disk) and all(torch.equal(hub[k], on_disk[k]) for k in on_disk)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        LazyCheckpoint(str(tmp_path))


def test_unknown_architectures_and_variants_are_refused_by_name():
    with pytest.raises(ValueError, match=r"model_type 'mistral' is not supported; supported: \['llama', 'qwen2', 'qwen3', 'qwen3_moe'\]"):
        family_of(SimpleNamespace(model_type="mistral"))
    with pytest.raises(ValueError, match="attention_bias=True"):
        family_of(model_config("qwen3", VOCAB, attention_bias=True))
    with pytest.raises(ValueError, match="mlp_bias=True"):
        family_of(model_config("llama3.1", VOCAB, mlp_bias=True))
    with pytest.raises(ValueError, match="layer spec layout 'fused'"):
        NameLayout("fused")
    with pytest.raises(ValueError, match="grouped experts .* TE layer spec"):
        NameLayout("local", "grouped")


def test_layouts_are_refused_up_front():
    dense, moe = model_config("qwen3", VOCAB), model_config("qwen3-moe", VOCAB)
    with pytest.raises(ValueError, match="--parallel.ep 2: expert parallelism needs an MoE model; this qwen3 model is dense"):
        check_layout(dense, ep=2, te=True)
    with pytest.raises(ValueError, match="--parallel.pp 2: pipeline parallelism needs Transformer Engine"):
        check_layout(dense, pp=2, te=False)
    check_layout(dense, pp=2, te=True)
    with pytest.raises(ValueError, match="--parallel.cp 2: .* context parallelism"):
        check_layout(dense, cp=2, te=True)
    with pytest.raises(ValueError, match=r"--parallel.tp 4 must divide .* KV heads \(2\)"):
        check_layout(dense, tp=4)
    with pytest.raises(ValueError, match="--parallel.ep 3 must divide the 4 experts"):
        check_layout(moe, ep=3)
    with pytest.raises(ValueError, match="--parallel.tp 2 with an MoE model"):
        check_layout(moe, tp=2)
    check_layout(moe, tp=2, training=False)
    check_layout(moe, ep=4)
    with pytest.raises(ValueError, match="--parallel.tp 2 must divide the vocabulary"):
        check_layout(dense, tp=2, vocab_size=129)
    yarn = model_config("llama3.1", VOCAB, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 1024})
    with pytest.raises(ValueError, match=r"rope_type 'yarn' \(llama\) is not supported; supported: \['default', 'llama3'\]"):
        check_layout(yarn)


def test_llama3_rope_uses_megatrons_option_or_the_exact_inv_freq():
    """Llama 3.1's own constants (original context 8192) are megatron's fixed ones: its
    rope_scaling option; others (the tiny checkpoint's 1024) get inv_freq computed here, equal to
    transformers' own llama3 rope init."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    real = model_config("llama3.1", VOCAB, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    kw, inv = mm.rope_settings(real)
    assert kw == dict(rotary_base=500000, rope_scaling=True, rope_scaling_factor=8.0) and inv is None
    for cfg in (real, model_config("llama3.1", VOCAB)):
        want, scale = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        p = mm.rope_parameters(cfg)
        got = mm.llama3_inv_freq(p["rope_theta"], mm.head_dim(cfg), p["factor"], p["low_freq_factor"],
                                 p["high_freq_factor"], p["original_max_position_embeddings"])
        assert scale == 1.0 and torch.allclose(got, want.float(), rtol=1e-6, atol=0)
    kw, inv = mm.rope_settings(model_config("llama3.1", VOCAB))
    assert kw == dict(rotary_base=500000) and inv is not None
    assert mm.rope_settings(model_config("qwen3", VOCAB)) == (dict(rotary_base=1_000_000), None)


# ---------------------------------------------------------------------------- TE names from megatron's specs
def _te_names_from_megatron_specs():
    """One gloo rank: megatron's own local-spec GPTModel per family (its state-dict names), then
    the TE layout derived from megatron's specs, not by hand: where the TE spec
    (`get_gpt_layer_with_transformer_engine_spec`, TE classes stubbed: TE is not installed) puts
    an IdentityOp in place of one of the local spec's norms, that norm's weight moves where the
    local spec's `sharded_state_dict_keys_map` says (into the fused linear's `layer_norm_`),
    and the fused linear must be TE's column-parallel layer-norm linear. Returns, per family,
    whether our local and TE layouts are exactly those names, plus megatron's llama3 scaling
    vs ours."""
    import warnings

    warnings.filterwarnings("ignore")
    import megatron.core.extensions.transformer_engine_spec_provider as tsp
    import megatron.core.models.gpt.gpt_layer_specs as specs
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.identity_op import IdentityOp

    from gyre.backends.config import MegatronConfig
    from gyre.backends.actors.megatron_config import build_gpt_model, initialize_parallel_state, transformer_config_kwargs

    tsp.is_te_min_version = lambda *a, **k: True  # TE is not installed: its version check would fail
    specs.TESpecProvider = tsp.TESpecProvider
    backend = tsp.TESpecProvider()
    fused = backend.column_parallel_layer_norm_linear()
    mc = MegatronConfig(params_dtype="float32")
    initialize_parallel_state(mc)
    out = {}
    for family in FAMILIES:
        hf = build_model(family, VOCAB, num_hidden_layers=3, mlp_only_layers=[1]) if family == "qwen3-moe" \
            else build_model(family, VOCAB)
        cfg = hf.config
        model = build_gpt_model(cfg, mc, use_cpu_initialization=True, init_weights=False,
                                names=NameLayout("local", "sequential"))
        local_names = {k for k in model.state_dict() if not k.endswith("_extra_state")}
        ours_local = set(hf_to_mcore(hf.state_dict(), cfg, NameLayout("local", "sequential")))
        kw = transformer_config_kwargs(cfg, mc, NameLayout("local", "sequential"))
        te_names = set()
        for name in local_names:
            m = name.split(".")
            if m[0] != "decoder" or m[1] != "layers":
                te_names.add(name)
                continue
            i, rest = int(m[2]), ".".join(m[3:])
            moe = mm.moe_layers(cfg)[i]
            te_spec = specs.get_gpt_layer_with_transformer_engine_spec(
                num_experts=kw.get("num_moe_experts") if moe else None, qk_layernorm=kw["qk_layernorm"])
            local_spec = specs.get_gpt_layer_local_spec(num_experts=kw.get("num_moe_experts") if moe else None,
                                                        qk_layernorm=kw["qk_layernorm"], normalization="RMSNorm")
            renamed = rest
            for prefix, target in local_spec.submodules.sharded_state_dict_keys_map.items():
                module = prefix.rstrip(".")
                if rest.startswith(prefix) and getattr(te_spec.submodules, module) is IdentityOp:
                    owner = target.rsplit(".", 1)[0]  # e.g. self_attention.linear_qkv
                    sub = te_spec.submodules
                    for part in owner.split("."):
                        sub = getattr(sub.submodules if hasattr(sub, "submodules") else sub, part)
                    assert sub is fused, (family, owner, sub)
                    renamed = target + rest[len(prefix):]
            te_names.add(f"decoder.layers.{i}.{renamed}")
        ours_te = set(hf_to_mcore(hf.state_dict(), cfg, NameLayout("te", "sequential")))
        out[family] = (local_names == ours_local, te_names == ours_te, sorted(te_names ^ ours_te)[:4])
    ps.destroy_model_parallel()
    freqs = 1.0 / (500000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    megatron_llama3 = RotaryEmbedding._apply_scaling(None, freqs, factor=8.0)
    ours = mm.llama3_inv_freq(500000, 64, 8.0, 1.0, 4.0, 8192)
    out["llama3"] = bool(torch.allclose(megatron_llama3, ours, rtol=1e-6, atol=0))
    # TEGroupedMLP names its per-expert parameters `{fc}.weight{i}` (TE GroupedLinear), as megatron's
    # own sharded_state_dict for it spells them (experts.py:795)
    import inspect

    from megatron.core.transformer.moe.experts import TEGroupedMLP

    out["grouped"] = "f'{name}.weight{i}'" in inspect.getsource(TEGroupedMLP)
    return out


@pytest.mark.slow
@pytest.mark.multirank
def test_te_layout_names_are_what_megatrons_te_spec_builds():
    """(slow: importing megatron in a spawned rank, ~40 s on a loaded 2-core machine)"""
    pytest.importorskip("megatron.core")
    from tests.distributed import run_ranks

    [out] = run_ranks(_te_names_from_megatron_specs, 1, timeout=300)
    for family in FAMILIES:
        assert out[family][:2] == (True, True), (family, out[family])
    assert out["llama3"] and out["grouped"]


def test_default_layout_is_what_is_installed(models, monkeypatch):
    """No layout given: TE names (and TE grouped experts) where Transformer Engine is installed,
    local ones elsewhere, so hf_to_mcore(sd, cfg) matches the model built here."""
    hf = models["qwen3-moe"]
    monkeypatch.setattr(mm, "has_transformer_engine", lambda: True)
    assert NameLayout.of() == NameLayout("te", "grouped")
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in hf_to_mcore(hf.state_dict(), hf.config)
    monkeypatch.setattr(mm, "has_transformer_engine", lambda: False)
    assert NameLayout.of() == NameLayout("local", "sequential")
    assert "decoder.layers.0.input_layernorm.weight" in hf_to_mcore(hf.state_dict(), hf.config)


def test_hf_tensors_the_mapping_does_not_read_are_refused(models):
    """A Qwen3 state dict that also carries q/k/v biases (a variant the mapping has no megatron
    name for) is refused by name, not imported without them."""
    hf = models["qwen3"]
    sd = dict(hf.state_dict(), **{"model.layers.0.self_attn.q_proj.bias": torch.zeros(128)})
    with pytest.raises(ValueError, match=r"qwen3: 1 HF tensors have no megatron parameter, e.g. \['model.layers.0.self_attn.q_proj.bias'\]"):
        hf_to_mcore(sd, hf.config)
    sd = dict(hf.state_dict(), **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(16)})
    hf_to_mcore(sd, hf.config)  # a saved RoPE table is not a weight


def test_an_ep_rank_reads_only_its_own_experts(models, tmp_path):
    """keep= skips another EP rank's experts without reading them (a LazyCheckpoint counts reads)."""
    hf = models["qwen3-moe"]
    hf.save_pretrained(str(tmp_path))
    lazy = LazyCheckpoint(str(tmp_path))
    seen = []
    real = LazyCheckpoint.__getitem__
    lazy.__class__ = type("Counting", (LazyCheckpoint,), {"__getitem__": lambda self, k: seen.append(k) or real(self, k)})
    names = NameLayout("local", "sequential")
    keep = lambda n: mm.shard_experts(n, 1, 2, 4) is not None  # EP rank 1 of 2: experts 2, 3
    got = dict(iter_hf_to_mcore(lazy, hf.config, names, keep=keep))
    assert not any(".experts.0." in k or ".experts.1." in k for k in seen)
    assert any(".experts.3." in k for k in seen)
    full = hf_to_mcore(hf.state_dict(), hf.config, names)
    assert {k for k in full if keep(k)} == set(got) and all(torch.equal(got[k], full[k]) for k in got)
