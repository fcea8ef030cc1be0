"""The SGLang adapter starts on every real family's checkpoint, through the conformance fake
upgraded to SGLang 0.5.23's ModelConfig checks (tests/backends/sglang_fake.py:
`model_config_checks`): the --model.checkpoint directory itself at version 0, a directory Gyre
writes (config.json with architectures and dtype, sharded safetensors) for a preset or a later
version; the old preset config (no architectures) is refused as SGLang refuses it; padded
embedding rows are never sampled."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch

from gyre.backends.protocols import SamplingParams
from gyre.backends.engines.sglang_engine import SglangEngine
from gyre.config import parse_config
from tests.backends import sglang_fake
from tests.realmodels import FAMILIES, build_model, write_checkpoint

FAMILY_NAMES = ["qwen2.5", "qwen3", "qwen3-moe", "llama3.1"]
VOCAB = 1536


def _template(family: str) -> str:
    """The family's own chat template where it exists yet, else qwen2.5's (weights are what matter here)."""
    from tests.realmodels import TEMPLATE_DIR

    t = FAMILIES[family].template
    return t if (TEMPLATE_DIR / f"{t}.jinja").exists() else "qwen2.5"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: str(write_checkpoint(root / f, f, vocab_size=VOCAB, template=_template(f))) for f in FAMILY_NAMES}


@pytest.fixture(autouse=True)
def _fake(monkeypatch):
    monkeypatch.setenv("GYRE_SGLANG_API", "tests.backends.sglang_fake:API")
    monkeypatch.setattr(sglang_fake.FakeEngine, "step_s", 0.0)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)


def _cfg(tmp_path, *flags):
    return parse_config(["--backend.engine", "sglang", "--run-dir", str(tmp_path / "run"), *flags])


def _build(cfg, model_config, params, *, version=0, **kw):
    from gyre.backends.factory import build_sglang_engine

    return build_sglang_engine(cfg.model, cfg.backend, model_config, params, version=version, eos_token_ids=[], name="r0",
                               transfer=cfg.transfer, sglang=cfg.sglang, cell_size=cfg.parallel.cell_size,
                               run_dir=cfg.run_dir, **kw)


async def _serve(eng: SglangEngine, prompt, n=6, **sp):
    await eng.start()
    try:
        return [ev async for ev in eng.generate("a", prompt, SamplingParams(max_tokens=n, **sp))]
    finally:
        await eng.stop()


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _ref_logprobs(model, prompt, tokens) -> torch.Tensor:
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        lp = torch.log_softmax(model(seq).logits[0].double(), -1)
    return torch.stack([lp[len(prompt) - 1 + i, t] for i, t in enumerate(tokens)])


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_starts_on_the_checkpoint_directory_itself_at_version_0(family, ckpts, tmp_path):
    """--model.checkpoint DIR at version 0: SGLang gets DIR (nothing written), in bfloat16 (auto with
    the sglang engine), and the served architecture is the checkpoint's own."""
    path = ckpts[family]
    cfg = _cfg(tmp_path, "--model.checkpoint", path)
    assert cfg.model.dtype == "bfloat16"
    model = _hf(path)
    eng = _build(cfg, model.config, model.state_dict())
    assert eng.config.model_path == path and eng.config.dtype == "bfloat16"
    assert not (tmp_path / "run" / "sglang").exists()  # no copy
    out = asyncio.run(_serve(eng, [5, 6, 7, 8], min_tokens=6))  # a random model may sample its EOS
    assert len(out) == 6 and all(0 <= e.token_id < VOCAB for e in out)
    served = sglang_fake.FakeEngine.instances[-1]
    assert served.model_config.architectures == [FAMILIES[family].architecture] and served.dtype == torch.bfloat16


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_later_version_is_written_sharded_and_serves_its_weights(family, ckpts, tmp_path):
    """Version 3 (weights that differ from DIR): Gyre writes a directory whose config.json names the
    architecture and dtype, weights in shards of at most --sglang.max-shard-size with an index; the
    fake serves exactly those weights (float32 on triton, log-probs = HF's on the same weights)."""
    path = ckpts[family]
    cfg = _cfg(tmp_path, "--model.checkpoint", path, "--model.dtype", "float32", "--sglang.max-shard-size", "100KB")
    # float32 on triton: exact log-probs (gyre.run refuses float32 with sglang up front: check_model_dtype)
    cfg.sglang.extra["attention_backend"] = "triton"
    new = build_model(family, VOCAB, seed=5)
    eng = _build(cfg, _hf(path).config, new.state_dict(), version=3)
    d = eng.config.model_path
    assert d == str(tmp_path / "run" / "sglang" / "r0")
    config = json.loads(open(os.path.join(d, "config.json")).read())
    assert config["architectures"] == [FAMILIES[family].architecture]
    assert config["dtype"] == config["torch_dtype"] == "float32"
    index = json.loads(open(os.path.join(d, "model.safetensors.index.json")).read())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and set(os.listdir(d)) == {"config.json", "model.safetensors.index.json", *shards}
    from safetensors import safe_open

    for shard in shards:  # at most 100 kB, unless one tensor alone is larger
        with safe_open(os.path.join(d, shard), "pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]
        nbytes = [4 * int(torch.tensor(s).prod()) for s in sizes]
        assert len(nbytes) == 1 or sum(nbytes) <= 100_000, (shard, nbytes)
    prompt = [5, 6, 7, 8]
    out = asyncio.run(_serve(eng, prompt, n=8))
    ref = _ref_logprobs(new, prompt, [e.token_id for e in out])
    assert (torch.tensor([e.logprob for e in out], dtype=torch.float64) - ref).abs().max() < 1e-4
    assert all(e.version == 3 for e in out)


def test_a_preset_gets_a_config_naming_its_architecture(tmp_path):
    """--model.preset (no checkpoint): config.json gets architectures=[Qwen2ForCausalLM] and dtype."""
    from gyre.backends.models.hf import build_model as build_preset, model_config

    cfg = _cfg(tmp_path, "--model.preset", "tiny")
    mc = model_config("tiny", 256)
    mc.architectures = None  # as the old preset configs were: the written config must name it anyway
    eng = _build(cfg, mc, build_preset(mc, seed=0).state_dict())
    assert len(asyncio.run(_serve(eng, [1, 2, 3], min_tokens=6))) == 6  # the fake's ModelConfig checks passed
    config = json.loads(open(os.path.join(eng.config.model_path, "config.json")).read())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["dtype"] == "bfloat16"


def test_the_fake_refuses_the_old_preset_config_as_sglang_does(tmp_path):
    """What the factory wrote before (hf_config.to_json_file of a preset config: no architectures)
    fails in SGLang's ModelConfig at `"LlamaEmbeddingModel" in None` (model_config.py:2366)."""
    from safetensors.torch import save_file

    from gyre.backends.config import SglangConfig
    from gyre.backends.models.hf import build_model as build_preset, model_config

    mc = model_config("tiny", 256)
    mc.architectures = None  # the preset configs before the architecture registry named none
    mc.to_json_file(str(tmp_path / "config.json"))  # the old factory's config.json
    assert "architectures" not in json.loads((tmp_path / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in build_preset(mc).state_dict().items() if k != "lm_head.weight"},
              str(tmp_path / "model.safetensors"))
    eng = SglangEngine(SglangConfig(model_path=str(tmp_path), dtype="bfloat16"), api=sglang_fake.API)
    with pytest.raises(TypeError, match="argument of type 'NoneType' is not iterable"):
        asyncio.run(eng.start())


def test_the_fake_applies_sglangs_dtype_rules(ckpts, tmp_path):
    """auto serves the config's dtype, float32 as float16 (model_config.py:2303-2322); float32
    explicitly is refused with the Hopper default attention (fa3) and served on triton; an unknown
    name is a ValueError; an architecture outside the registry is refused."""
    from gyre.backends.config import SglangConfig

    path = ckpts["qwen2.5"]  # written in float32

    def start(dtype, **extra):
        eng = SglangEngine(SglangConfig(model_path=path, dtype=dtype, extra=extra), api=sglang_fake.API)
        asyncio.run(eng.start())
        served = eng._engine.dtype
        asyncio.run(eng.stop())
        return served

    assert start("auto") == torch.float16
    assert start("bfloat16") == torch.bfloat16
    assert start("float32", attention_backend="triton") == torch.float32
    with pytest.raises(RuntimeError, match="float32 with attention backend fa3"):
        start("float32")
    with pytest.raises(ValueError, match="Unknown dtype: float64"):
        start("float64")
    odd = tmp_path / "odd"
    odd.mkdir()
    config = json.loads(open(os.path.join(path, "config.json")).read())
    (odd / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2ForSequenceClassification"]}))
    eng = SglangEngine(SglangConfig(model_path=str(odd), dtype="bfloat16"), api=sglang_fake.API)
    with pytest.raises(ValueError, match="not one the fake serves"):
        asyncio.run(eng.start())


def test_padded_vocabulary_is_never_sampled(tmp_path):
    """A checkpoint with 64 padded embedding rows whose logits dominate (lm_head rows scaled up):
    without sampleable_vocab the fake samples padded ids (the test can fail), with it never; the
    bias reaches SGLang as logit_bias on exactly the padded ids."""
    from transformers import AutoModelForCausalLM

    path = write_checkpoint(tmp_path / "padded", "qwen3", vocab_size=VOCAB, pad_vocab=64, template="qwen2.5",
                            tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(str(path))
    rows = model.config.vocab_size
    with torch.no_grad():
        model.lm_head.weight[VOCAB:] *= 50.0  # the padded rows win the softmax
    model.save_pretrained(str(path))
    tok_count = VOCAB  # the tokenizer's ids: write_checkpoint's model has len(tok) + 64 rows
    assert rows == tok_count + 64
    cfg = _cfg(tmp_path, "--model.checkpoint", str(path))

    def sample(sampleable):
        eng = _build(cfg, model.config, model.state_dict(), sampleable_vocab=sampleable)
        return eng, asyncio.run(_serve(eng, [5, 6, 7], n=40, temperature=1.0))

    _, free = sample(None)
    assert any(e.token_id >= tok_count for e in free), "padded rows were never sampled: the test shows nothing"
    eng, masked = sample(tok_count)
    assert all(e.token_id < tok_count for e in masked)
    assert sorted(int(k) for k in eng._bias) == list(range(tok_count, rows))
    with pytest.raises(ValueError, match="sampleable_vocab 9999 > the model's vocab_size"):
        asyncio.run(_build(cfg, model.config, model.state_dict(), sampleable_vocab=9999).start())


def test_a_moe_update_sends_per_expert_checkpoint_names(ckpts, tmp_path):
    """The actor's state_dict has transformers 5's fused expert tensors; SGLang's load_weights
    takes one tensor per expert. The adapter converts (the fake refuses fused names), and later
    tokens carry the new weights' log-probs."""
    path = ckpts["qwen3-moe"]
    cfg = _cfg(tmp_path, "--model.checkpoint", path)
    cfg.model.dtype = "float32"
    cfg.sglang.extra["attention_backend"] = "triton"
    old, new = _hf(path), build_model("qwen3-moe", VOCAB, seed=9)
    assert any(k.endswith("experts.gate_up_proj") for k in new.state_dict())  # fused in memory
    eng = _build(cfg, old.config, old.state_dict())
    prompt = [5, 6, 7, 8]

    async def go():
        await eng.start()
        await eng.update_weights(new.state_dict(), 1)
        out = [ev async for ev in eng.generate("u", prompt, SamplingParams(max_tokens=6))]
        await eng.stop()
        return out

    out = asyncio.run(go())
    ref = _ref_logprobs(new, prompt, [e.token_id for e in out])
    assert (torch.tensor([e.logprob for e in out], dtype=torch.float64) - ref).abs().max() < 1e-4
    assert {e.version for e in out} == {1}


def test_a_checkpoint_sglang_cannot_start_on_is_copied_not_served(ckpts, tmp_path, caplog):
    """--model.checkpoint whose config.json lacks `architectures` (hand-written configs do): at
    version 0 Gyre writes a startable copy and says why, instead of handing SGLang a config its
    ModelConfig fails on."""
    import logging
    import shutil

    from gyre.backends.engines.sglang_checkpoint import parse_size, startable_checkpoint

    src = tmp_path / "bare"
    shutil.copytree(ckpts["llama3.1"], src)
    config = json.loads((src / "config.json").read_text())
    del config["architectures"]
    (src / "config.json").write_text(json.dumps(config))
    assert "architectures None" in startable_checkpoint(src) and startable_checkpoint(ckpts["llama3.1"]) is None
    cfg = _cfg(tmp_path, "--model.checkpoint", str(src))
    model = _hf(ckpts["llama3.1"])
    with caplog.at_level(logging.WARNING, logger="gyre.backends.engines.sglang_checkpoint"):
        eng = _build(cfg, model.config, model.state_dict())
    assert eng.config.model_path != str(src) and "cannot be served as it is" in caplog.text
    assert len(asyncio.run(_serve(eng, [1, 2, 3], min_tokens=6))) == 6
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("100KB") == 100_000
