"""Defaults for a pretrained checkpoint (gyre/sized_defaults.py): hand-computed rule values, the
parameter count against a built model's, and which values the command line or preset keep."""

from __future__ import annotations

import json
import math

import pytest

from gyre import sized_defaults as sd
from gyre.sized_defaults import ModelSize, checkpoint_defaults

GIB = 1 << 30
M = ModelSize(params=100_000_000, layers=10, hidden=100, intermediate=300, vocab=1000)


@pytest.mark.parametrize("params, lr", [(1e9, 1e-6), (1e8, 1e-6 * math.sqrt(10)), (4e8, 1e-6 * math.sqrt(2.5)),
                                        (1e11, 1e-6), (1e7, 1e-5), (2e6, 1e-5)])
def test_pretrained_lr(params, lr):
    assert sd.pretrained_lr(int(params)) == pytest.approx(lr, rel=1e-12)


def test_max_tokens_by_hand():
    # per token 5·4·(10·(100+300)+1000) = 100,000 B; fixed 5·4·1e8 + 2^30 = 3,073,741,824 B
    assert sd.activation_bytes_per_token(M, 4) == 100_000
    assert sd.fixed_bytes(M, 4) == 3_073_741_824
    # 8 GiB over 2 ranks: 0.8·4 GiB − fixed = 362,232,012.8 B → 3,622 tokens → 3,584 (a multiple of 256)
    assert sd.max_tokens_for(M, 8 * GIB, 2, 4) == 3584
    # bf16 halves both: 0.8·4 GiB − (1e9 + 2^30) = 1,287,232,012.8 B / 50,000 → 25,744 → capped at 16,384
    assert sd.max_tokens_for(M, 8 * GIB, 2, 2) == 16384
    assert sd.max_tokens_for(M, 4 * GIB, 2, 4) == 512  # short of memory: the floor


def test_checkpoint_defaults_choose_only_what_is_asked_and_say_why():
    out = checkpoint_defaults(M, memory_bytes=8 * GIB, ranks=2, dtype_bytes=4, size_lr=True, size_tokens=True)
    assert out.lr == pytest.approx(1e-6 * math.sqrt(10)) and out.max_tokens == 3584
    assert out.notes[0].startswith("--actor.lr 3.16e-06: a pretrained checkpoint of 100 M parameters")
    assert out.notes[1].startswith("--train.max-tokens 3584: 8.0 GiB available for 2 rank(s) here, 2.9 GiB a rank")
    only = checkpoint_defaults(M, memory_bytes=8 * GIB, ranks=2, dtype_bytes=4, size_lr=False, size_tokens=True)
    assert only.lr is None and only.max_tokens == 3584 and len(only.notes) == 1
    short = checkpoint_defaults(M, memory_bytes=4 * GIB, ranks=2, dtype_bytes=4, size_lr=False, size_tokens=True)
    assert short.max_tokens == 512 and "memory is short" in short.notes[-1]
    toy = ModelSize(params=19_999_999, layers=4, hidden=256, intermediate=704, vocab=1024)
    assert checkpoint_defaults(toy, memory_bytes=GIB, ranks=1, dtype_bytes=4, size_lr=True, size_tokens=True) == sd.Sized()


LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=512,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=80_000,
             tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=512)


def _checkpoint(path, **over):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**LLAMA, **over}))
    return path


@pytest.mark.parametrize("tied", [True, False])
def test_model_size_counts_what_transformers_builds(tmp_path, tied):
    from transformers import AutoConfig, LlamaForCausalLM

    d = _checkpoint(tmp_path / "m", tie_word_embeddings=tied, vocab_size=300)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(str(d)))
    got = sd.model_size(d)
    assert got.params == sum(p.numel() for p in model.parameters())  # parameters() counts a tied tensor once
    assert (got.layers, got.hidden, got.intermediate, got.vocab) == (4, 256, 512, 300)


def _apply(cfg, argv):
    return sd.apply_checkpoint_defaults(argv, cfg.preset, cfg.model, cfg.backend, cfg.actor, cfg.train)


def test_apply_respects_the_command_line_and_the_preset(tmp_path, monkeypatch):
    from gyre.config import parse_config

    monkeypatch.setattr(sd, "available_memory", lambda: 8 * GIB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ck = _checkpoint(tmp_path / "ck")
    size = sd.model_size(ck)  # 80,000·256 embedding alone: 20.5 M, over the pretrained threshold
    assert size.params >= sd.PRETRAINED_MIN_PARAMS
    want = checkpoint_defaults(size, memory_bytes=8 * GIB, ranks=2, dtype_bytes=4, size_lr=True, size_tokens=True)

    def applied(argv):
        cfg = parse_config(argv)
        notes = _apply(cfg, argv)
        checkpointing = any(n.startswith("--actor.activation-checkpointing") for n in notes)
        assert cfg.actor.activation_checkpointing or not checkpointing
        return cfg.actor.lr, cfg.train.max_tokens, len(notes) - checkpointing

    base = ["--job", "train"]
    assert applied([*base, "--model.checkpoint", str(ck)]) == (want.lr, want.max_tokens, 2)
    assert applied([*base, "--model.checkpoint", str(ck), "--actor.lr", "1e-4"]) == (1e-4, want.max_tokens, 1)
    assert applied([*base, f"--model.checkpoint={ck}", "--actor.lr=0.0001", "--train.max-tokens", "4096"]) == (1e-4, 4096, 0)
    # cpu-demo's lr 1e-3 was chosen for its own warm start, not for a checkpoint given on the command line
    assert applied(["--preset", "cpu-demo", "--model.checkpoint", str(ck)]) == (want.lr, want.max_tokens, 2)
    # smollm2's own checkpoint: its lr and max_tokens were chosen for it and stay
    monkeypatch.chdir(tmp_path)
    _checkpoint(tmp_path / "runs" / "smollm2" / "data" / "model")
    assert applied(["--preset", "smollm2"]) == (1e-5, 2048, 0)
    assert applied([*base, "--model.checkpoint", str(tmp_path / "missing")])[2] == 0  # not there yet: nothing sized
    # activation checkpointing: on for a pretrained checkpoint unless the command line or the preset chose
    on = parse_config([*base, "--model.checkpoint", str(ck)])
    _apply(on, [*base, "--model.checkpoint", str(ck)])
    off_argv = [*base, "--model.checkpoint", str(ck), "--actor.no-activation-checkpointing"]
    off = parse_config(off_argv)
    _apply(off, off_argv)
    assert on.actor.activation_checkpointing and not off.actor.activation_checkpointing
