"""The built-in decoder against transformers, per family of the architecture registry.

Tiny random-init models of the real architectures (tests/realmodels.py; norms perturbed off 1,
so a dropped or misplaced q/k norm shows). For each family: full prefill, token-by-token decode
through a growing KV cache, and one continuous-batching step mixing requests of different
lengths (decodes and prefills together), all within 1e-4 of the family's HF class in fp32.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.backends.models.arch import family_of, shape_of
from gyre.backends.engines.decoder import DecoderWeights, KVCache, extend
from tests.realmodels import build_model

FAMILIES = ["qwen2.5", "qwen3", "qwen3-coder", "qwen3-moe", "llama3.1"]  # qwen3-coder: Qwen3, untied head
VOCAB = 300
TOL = 1e-4


@functools.lru_cache(maxsize=None)
def _model(family: str):
    return build_model(family, VOCAB, seed=7)


def _seqs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("family", FAMILIES)
def test_registry_names_the_model_class(family):
    model = _model(family)
    assert type(model).__name__ == family_of(model.config).hf_class


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_matches_hf_prefill_decode_and_continuous_batching(family):
    model = _model(family)
    w = DecoderWeights.from_state_dict(model.state_dict(), model.config)
    seqs = _seqs([37, 12, 5, 23], seed=1)
    with torch.no_grad():
        refs = [model(input_ids=s[None]).logits[0] for s in seqs]
        # 1. prefill of part of seq 0, then token-by-token decode through a cache that regrows
        s0, r0 = seqs[0], refs[0]
        cache = KVCache.empty(w, capacity=2)
        pre = extend(w, s0[:9], torch.arange(9), [9], [cache], all_logits=True)
        steps = torch.cat([extend(w, s0[j : j + 1], torch.tensor([j]), [1], [cache]) for j in range(9, len(s0))])
        assert (pre - r0[:9]).abs().max() <= TOL
        assert (steps - r0[9:]).abs().max() <= TOL
        # 2. continuous batching: requests of different lengths at different stages in one step
        caches = [KVCache.empty(w) for _ in seqs]
        extend(w, seqs[0][:20], torch.arange(20), [20], [caches[0]])       # request 0 running
        extend(w, seqs[1][:11], torch.arange(11), [11], [caches[1]])       # request 1 running
        feeds = [(seqs[0][20:21], 20), (seqs[1][11:12], 11), (seqs[2], 0), (seqs[3][:17], 0)]
        ids = torch.cat([f for f, _ in feeds])
        pos = torch.cat([torch.arange(a, a + len(f)) for f, a in feeds])
        out = extend(w, ids, pos, [len(f) for f, _ in feeds], caches)
        want = torch.stack([refs[0][20], refs[1][11], refs[2][-1], refs[3][16]])
        assert (out - want).abs().max() <= TOL
        # 3. a chunk of several tokens onto a running cache (the re-prefill after an update)
        more = extend(w, seqs[3][17:23], torch.arange(17, 23), [6], [caches[3]], all_logits=True)
        assert (more - refs[3][17:23]).abs().max() <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_matches_hf_in_float64(family):
    """In float64 the forward is the same arithmetic as HF's to ~1e-12: a tolerance of 1e-4 in
    fp32 hides no systematic difference. (HF's eager attention takes its softmax in float32
    whatever the dtype, SDPA does not: the reference here is SDPA.)"""
    from gyre.backends.models.hf import fit_kernels

    model = fit_kernels(_model(family).double())
    model.set_attn_implementation("sdpa")
    try:
        w = DecoderWeights.from_state_dict(model.state_dict(), model.config)
        ids = _seqs([29], seed=5)[0]
        with torch.no_grad():
            ref = model(input_ids=ids[None]).logits[0]
            got = extend(w, ids, torch.arange(29), [29], [KVCache.empty(w)], all_logits=True)
        assert (got - ref).abs().max() <= 1e-10
    finally:
        model.float()
        model.set_attn_implementation("eager")


@settings(max_examples=12, deadline=None)
@given(cuts=st.lists(st.integers(1, 30), min_size=1, max_size=5, unique=True), other=st.integers(1, 12),
       family=st.sampled_from(["qwen3-moe", "llama3.1"]))
def test_any_chunking_of_a_sequence_gives_the_same_logits(cuts, other, family):
    """Feeding a sequence through its cache in arbitrary chunks, each step batched with another
    request's prefill, gives the one-shot logits (fp32, 1e-4)."""
    model = _model(family)
    w = DecoderWeights.from_state_dict(model.state_dict(), model.config, copy=False)
    seq, filler = _seqs([31, other], seed=len(cuts) + other)
    with torch.no_grad():
        ref = model(input_ids=seq[None]).logits[0]
        cache = KVCache.empty(w, capacity=1)
        bounds = [0, *sorted(cuts), 31]
        for a, b in zip(bounds, bounds[1:]):
            out = extend(w, torch.cat([seq[a:b], filler]), torch.cat([torch.arange(a, b), torch.arange(other)]),
                         [b - a, other], [cache, KVCache.empty(w)], all_logits=True)
            assert (out[: b - a] - ref[a:b]).abs().max() <= TOL


@settings(max_examples=30, deadline=None)
@given(nkv=st.integers(1, 3), groups=st.integers(1, 3), hd=st.sampled_from([4, 16]), past=st.integers(0, 40),
       spare=st.integers(0, 5), dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_a_decode_row_attends_exactly_as_the_general_path(nkv, groups, hd, past, spare, dtype, seed):
    """extend's one-query path (_attend_one, every decode step) is _attend bit for bit: same
    scores, softmax dtype and output, for any GQA layout, cache fill and dtype."""
    from gyre.backends.engines.decoder import _attend, _attend_one

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, nkv * groups, hd, generator=g).to(dtype)
    kc, vc = (torch.randn(nkv, past + 1 + spare, hd, generator=g).to(dtype) for _ in range(2))
    ref = _attend(q, kc, vc, past, nkv, groups, hd, hd ** -0.5, dtype)[0]
    out = torch.full((nkv * groups, hd), float("nan"), dtype=dtype)
    _attend_one(q[0], kc, vc, past + 1, nkv, groups, hd, hd ** -0.5, out)
    assert torch.equal(out, ref)


def test_qwen3_q_k_norms_matter():
    """Dropping Qwen3's q/k norms (what loading as Qwen2 did) moves the logits far past the
    tolerance: the comparison above can fail."""
    model = _model("qwen3")
    w = DecoderWeights.from_state_dict(model.state_dict(), model.config)
    ids = _seqs([15], seed=3)[0]
    with torch.no_grad():
        ref = model(input_ids=ids[None]).logits[0, -1]
        for k in [k for k in w.tensors if k.endswith(("q_norm.weight", "k_norm.weight"))]:
            w.tensors[k] = torch.ones_like(w.tensors[k])
        wrong = extend(w, ids, torch.arange(15), [15], [KVCache.empty(w)])[0]
    assert (wrong - ref).abs().max() > 1e-2


def test_llama3_rope_scaling_matches_transformers_and_matters():
    """Llama 3.1's rewritten frequencies equal transformers' own, and differ from plain RoPE
    (the tiny config's original context of 1024 puts heads in all three bands)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = _model("llama3.1")
    shape = shape_of(model.config)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")
    ours = shape.rope.inv_freq()
    assert torch.equal(ours, ref)
    plain = 1.0 / (shape.rope.theta ** (torch.arange(0, shape.head_dim, 2).float() / shape.head_dim))
    changed = ~torch.isclose(ours, plain)
    assert changed.any() and not changed.all()
    # the band between the edges is interpolated, neither plain nor divided by the factor
    assert (changed & ~torch.isclose(ours, plain / 8.0)).any()


def test_moe_routes_per_token_and_renormalises():
    """The sparse MLP against a direct float64 per-token sum over every expert's SwiGLU."""
    from gyre.backends.models.arch.qwen3_moe import sparse_mlp

    model = _model("qwen3-moe")
    shape = shape_of(model.config)
    sd = model.state_dict()
    p = "model.layers.1.mlp."
    router, gate_up, down = sd[p + "gate.weight"], sd[p + "experts.gate_up_proj"], sd[p + "experts.down_proj"]
    x = torch.randn(9, shape.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = sparse_mlp(x, router, gate_up, down, shape.moe)
        ref = model.model.layers[1].mlp(x[None])[0]
    want = torch.zeros(9, shape.hidden_size, dtype=torch.float64)
    for n in range(9):
        probs = torch.softmax(router.double() @ x[n].double(), -1)
        top = torch.topk(probs, shape.moe.top_k)
        weights = top.values / top.values.sum()
        for wgt, e in zip(weights, top.indices.tolist()):
            g, u = (gate_up[e].double() @ x[n].double()).chunk(2)
            want[n] += wgt * (down[e].double() @ (torch.nn.functional.silu(g) * u))
    assert (out.double() - want).abs().max() < 1e-5
    assert (out - ref).abs().max() < 1e-6


@pytest.mark.parametrize("family,overrides", [
    ("llama3.1", dict(attention_bias=True, mlp_bias=True)),
    ("qwen3", dict(attention_bias=True)),
    ("qwen3-moe", dict(decoder_sparse_step=2, norm_topk_prob=False)),   # layer 0 dense, layer 1 sparse
    ("qwen3-moe", dict(mlp_only_layers=[1], num_experts_per_tok=3)),
    ("llama3.1", dict(rope_scaling=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      head_dim=32, tie_word_embeddings=True)),
])
def test_config_variants_match_hf(family, overrides):
    """The switches a family reads from its config (biases, sparse-layer placement, router
    renormalisation, plain RoPE, explicit head_dim, tied head): biases are moved off HF's zero
    init so a dropped one shows."""
    model = build_model(family, VOCAB, seed=3, **overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    shape = shape_of(model.config)
    w = DecoderWeights.from_state_dict(model.state_dict(), model.config)
    if "attention_bias" in overrides:
        assert shape.qkv_bias and shape.o_bias and w.tensors.get("model.layers.0.self_attn.o_proj.bias") is not None
    if "decoder_sparse_step" in overrides or "mlp_only_layers" in overrides:
        assert len(shape.moe_layers) == 1
    ids = _seqs([21], seed=4)[0]
    with torch.no_grad():
        ref = model(input_ids=ids[None]).logits[0]
        got = extend(w, ids, torch.arange(21), [21], [KVCache.empty(w)], all_logits=True)
    assert (got - ref).abs().max() <= TOL
