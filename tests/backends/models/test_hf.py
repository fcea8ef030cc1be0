"""Model factory, packed forward, and the engine's functional decoder against transformers."""

from __future__ import annotations

import pytest
import torch

from gyre.backends.engines.decoder import DecoderWeights, KVCache, extend
from gyre.backends.models.hf import (PRESETS, build_model, load_model, model_config, num_parameters, packed_logits,
                                  preset_of, save_checkpoint)
from tests.backends.helpers import tiny_model


def test_presets_build_real_qwen2_with_expected_sizes():
    from transformers import Qwen2ForCausalLM

    for name, p in PRESETS.items():
        cfg = model_config(name, vocab_size=1024)
        assert preset_of(cfg) == p
        assert cfg.architectures == ["Qwen2ForCausalLM"]  # SGLang's ModelConfig needs it
        h, f, L, v = p.hidden_size, p.intermediate_size, p.num_layers, 1024
        kv = p.num_kv_heads * h // p.num_heads
        per_layer = (h * h + h) + 2 * (kv * h + kv) + h * h + 3 * h * f + 2 * h
        expect = v * h * (1 if p.tie_word_embeddings else 2) + L * per_layer + h
        if name == "tiny":  # building 'small' costs seconds; its arithmetic is the same
            m = build_model(cfg, seed=0)
            assert isinstance(m, Qwen2ForCausalLM) and num_parameters(m) == expect
    with pytest.raises(ValueError, match="preset"):
        model_config("huge", 10)
    with pytest.raises(ValueError, match="vocab_size"):
        model_config("tiny", 0)


def test_same_seed_same_weights_and_rng_untouched():
    state = torch.random.get_rng_state()
    a, b = build_model(model_config("tiny", 64), seed=3), build_model(model_config("tiny", 64), seed=3)
    c = build_model(model_config("tiny", 64), seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_packed_sequences_do_not_attend_to_each_other():
    """Each sequence's logits in a pack equal that sequence run alone; run as one unpacked
    sequence instead, the second sequence's logits change (so isolation is what we test)."""
    model = tiny_model(seed=0)
    g = torch.Generator().manual_seed(0)
    lens = [5, 9, 3]
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in lens]
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0, 5, 14, 17])
    with torch.no_grad():
        packed = packed_logits(model, ids, pos, cu)
        alone = [model(input_ids=s[None]).logits[0] for s in seqs]
        joint = model(input_ids=ids[None]).logits[0]
    assert torch.allclose(packed, torch.cat(alone), atol=1e-6)
    assert (joint[5:14] - alone[1]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="position_ids"):
        packed_logits(model, ids, torch.arange(17), cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        packed_logits(model, ids, pos, torch.tensor([0, 5, 20]))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float64, 1e-10)])
def test_decoder_matches_transformers_prefill_decode_and_mixed_batches(dtype, tol):
    """The engine's functional forward = Qwen2ForCausalLM: full prefill, token-by-token
    decode through a growing cache, and a step mixing a decode with another request's prefill."""
    model = tiny_model(seed=1, dtype=dtype)
    w = DecoderWeights.from_state_dict(model.state_dict(), model.config)
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids[None]).logits[0]
        cache = KVCache.empty(w, capacity=2)  # forces several regrowths
        pre = extend(w, ids[:11], torch.arange(11), [11], [cache], all_logits=True)
        steps = [extend(w, ids[j : j + 1], torch.tensor([j]), [1], [cache]) for j in range(11, 30)]
        assert (pre - ref[:11]).abs().max() <= tol
        assert (torch.cat(steps) - ref[11:]).abs().max() <= tol
        c1, c2 = KVCache.empty(w), KVCache.empty(w)
        extend(w, ids[:6], torch.arange(6), [6], [c1])
        mixed = extend(w, torch.cat([ids[6:7], ids[:20]]), torch.cat([torch.tensor([6]), torch.arange(20)]), [1, 20], [c1, c2])
        assert (mixed[0] - ref[6]).abs().max() <= tol and (mixed[1] - ref[19]).abs().max() <= tol
        # extend a cache by a chunk of several tokens (re-prefill after an update does this)
        more = extend(w, ids[20:25], torch.arange(20, 25), [5], [c2], all_logits=True)
        assert (more - ref[20:25]).abs().max() <= tol


def test_decoder_validates_state_dict():
    model = tiny_model()
    sd = dict(model.state_dict())
    sd["extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="unexpected"):
        DecoderWeights.from_state_dict(sd, model.config)


def test_tied_embeddings_preset_round_trips(tmp_path):
    from gyre.backends.models.hf import ModelPreset

    cfg = model_config(ModelPreset(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, tie_word_embeddings=True), 100)
    model = build_model(cfg, seed=0)
    w = DecoderWeights.from_state_dict({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, cfg)
    ids = torch.tensor([1, 2, 3])
    with torch.no_grad():
        assert torch.allclose(extend(w, ids, torch.arange(3), [3], [KVCache.empty(w)]), model(input_ids=ids[None]).logits[0, -1:], atol=1e-5)
    save_checkpoint(model, str(tmp_path))
    again = load_model(str(tmp_path))
    assert type(again) is type(model)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
