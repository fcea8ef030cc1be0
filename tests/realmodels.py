"""Tiny random-init checkpoints of the real model families, written locally (no hub).

Each family gets what a user's checkpoint directory holds: `config.json` naming the HF
architecture, `model.safetensors`, a `tokenizer.json` trained here with `tokenizers` on the
project's corpus and carrying the family's own special tokens, and a `tokenizer_config.json`
with the family's chat template (`tests/chat_templates/<template>.jinja`, written to the
family's documented format).

    path = write_checkpoint(tmp_path / "qwen3", "qwen3")              # a Qwen3 directory
    path = write_checkpoint(tmp, "qwen2.5", pad_vocab=64)             # embedding > tokenizer
    tok = build_tokenizer("llama3.1")                                 # just the tokenizer

Families: qwen2.5 (Qwen2ForCausalLM), qwen3 (Qwen3ForCausalLM), qwen3-coder (Qwen3-style
model, XML tool calls), qwen3-moe (Qwen3MoeForCausalLM), llama3.1 (LlamaForCausalLM), chatml
(LlamaForCausalLM with SmolLM2-Instruct's kind of template: plain ChatML, a default system prompt).
Everything is deterministic in `seed`; tokenizers are cached per (family, size, byte_fallback).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

TEMPLATE_DIR = Path(__file__).parent / "chat_templates"
CORPUS = Path(__file__).resolve().parent.parent / "gyre" / "assets" / "tokenizer" / "corpus.txt"

_QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_QWEN_TOOLS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
_THINK = ["<think>", "</think>"]
_LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"]


@dataclass(frozen=True)
class Family:
    """How a family's checkpoint directory looks (tokenizer side and model side)."""

    name: str
    architecture: str  # config.json "architectures"[0]
    model_type: str
    template: str  # tests/chat_templates/<template>.jinja
    special_tokens: list[str]
    bos: str | None
    eos: str  # the token that ends an assistant turn (generation_config eos)
    pad: str
    config: dict = field(default_factory=dict)  # extra config fields of the family


FAMILIES: dict[str, Family] = {
    "qwen2.5": Family("qwen2.5", "Qwen2ForCausalLM", "qwen2", "qwen2.5", _QWEN_SPECIAL + _QWEN_TOOLS,
                      None, "<|im_end|>", "<|endoftext|>",
                      dict(rope_theta=1_000_000.0, tie_word_embeddings=True, use_sliding_window=False)),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", "qwen3", "qwen3", _QWEN_SPECIAL + _QWEN_TOOLS + _THINK,
                    None, "<|im_end|>", "<|endoftext|>",
                    dict(rope_theta=1_000_000.0, tie_word_embeddings=True, head_dim=32, attention_bias=False)),
    "qwen3-coder": Family("qwen3-coder", "Qwen3ForCausalLM", "qwen3", "qwen3-coder",
                          _QWEN_SPECIAL + _QWEN_TOOLS + _THINK, None, "<|im_end|>", "<|endoftext|>",
                          dict(rope_theta=1_000_000.0, tie_word_embeddings=False, head_dim=32, attention_bias=False)),
    "qwen3-moe": Family("qwen3-moe", "Qwen3MoeForCausalLM", "qwen3_moe", "qwen3", _QWEN_SPECIAL + _QWEN_TOOLS + _THINK,
                        None, "<|im_end|>", "<|endoftext|>",
                        dict(rope_theta=1_000_000.0, tie_word_embeddings=False, head_dim=32, attention_bias=False,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                             decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[])),
    "llama3.1": Family("llama3.1", "LlamaForCausalLM", "llama", "llama3.1", _LLAMA_SPECIAL,
                       "<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>",
                       dict(rope_theta=500_000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 1024})),
    # SmolLM2-Instruct's kind: a Llama model with a plain ChatML template and a default system prompt
    "chatml": Family("chatml", "LlamaForCausalLM", "llama", "chatml", _QWEN_SPECIAL, "<|im_start|>", "<|im_end|>",
                     "<|im_end|>", dict(rope_theta=100_000.0, tie_word_embeddings=True, attention_bias=False, mlp_bias=False)),
}

# Sizes: small enough for a forward in about a millisecond, big enough that GQA, a head_dim
# other than hidden/heads (Qwen3) and several experts are all exercised.
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=4096, rms_norm_eps=1e-6, hidden_act="silu")


def chat_template(template: str) -> str:
    path = TEMPLATE_DIR / f"{template}.jinja"
    return path.read_text(encoding="utf-8")


@functools.lru_cache(maxsize=16)
def _tokenizer_json(family: str, vocab_size: int, byte_fallback: bool) -> str:
    """A trained tokenizer.json (as text): byte-level BPE (Qwen, Llama 3 are byte-level BPE), or a
    SentencePiece-style BPE with byte fallback (`▁` for spaces, `<0xNN>` byte pieces)."""
    from gyre.backends.models.tokenizer import _SPLIT_PATTERN, train_single_threaded
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    fam = FAMILIES[family]
    text = CORPUS.read_text(encoding="utf-8")
    chunks = [text[i : i + 4096] for i in range(0, len(text), 4096)]
    n_regular = vocab_size - len(fam.special_tokens)
    if byte_fallback:
        tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
        trainer = trainers.BpeTrainer(vocab_size=n_regular, min_frequency=2, special_tokens=["<unk>"] + byte_pieces,
                                      show_progress=False)
    else:
        split = _SPLIT_PATTERN  # Qwen2's pre-tokenizer split, as the project tokenizer's
        tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=n_regular, min_frequency=2,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    train_single_threaded(tok, chunks, trainer)  # deterministic merges
    # The family's control tokens come after the trained vocabulary, as in the real checkpoints.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in fam.special_tokens])
    return tok.to_str()


def write_tokenizer(path: str | os.PathLike, family: str, *, vocab_size: int = 1536, byte_fallback: bool = False,
                    template: str | None = None) -> Path:
    """tokenizer.json + tokenizer_config.json (+ the chat template) of `family` under `path`."""
    fam = FAMILIES[family]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(_tokenizer_json(family, vocab_size, byte_fallback), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        "bos_token": fam.bos,
        "eos_token": fam.eos,
        "pad_token": fam.pad,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": chat_template(template or fam.template),
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return path


def build_tokenizer(family: str, *, vocab_size: int = 1536, byte_fallback: bool = False, template: str | None = None):
    """The `PreTrainedTokenizerFast` of `family` (through a temporary directory, as a user loads it)."""
    import tempfile

    from transformers import PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as d:
        write_tokenizer(d, family, vocab_size=vocab_size, byte_fallback=byte_fallback, template=template)
        return PreTrainedTokenizerFast.from_pretrained(d)


def model_config(family: str, vocab_size: int, **overrides):
    """The HF config of a tiny `family` model with `vocab_size` embedding rows."""
    from transformers import AutoConfig

    fam = FAMILIES[family]
    kwargs = dict(TINY, **fam.config)
    kwargs.update(overrides)
    config = AutoConfig.for_model(fam.model_type, vocab_size=vocab_size, **kwargs)
    config.architectures = [fam.architecture]
    return config


def build_model(family: str, vocab_size: int, *, seed: int = 0, **overrides):
    """A random-init HF model of `family` (fp32, eval mode), deterministic in `seed`."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(family, vocab_size, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        # HF initialises norms to 1; perturb them so a dropped or misplaced norm shows in the logits.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(0.1 * torch.randn_like(p))
    return model.float().eval()


def write_checkpoint(path: str | os.PathLike, family: str, *, vocab_size: int = 1536, pad_vocab: int = 0,
                     byte_fallback: bool = False, seed: int = 0, dtype: str = "float32",
                     template: str | None = None, **overrides) -> Path:
    """A checkpoint directory of `family`: tokenizer of `vocab_size` ids (special tokens included)
    and a model with `vocab_size + pad_vocab` embedding rows (real Qwen pads its embedding)."""
    import torch

    fam = FAMILIES[family]
    path = write_tokenizer(path, family, vocab_size=vocab_size, byte_fallback=byte_fallback, template=template)
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    ids = {t: tok.convert_tokens_to_ids(t) for t in (fam.eos, fam.pad) + ((fam.bos,) if fam.bos else ())}
    model = build_model(family, len(tok) + pad_vocab, seed=seed, eos_token_id=ids[fam.eos],
                        pad_token_id=ids[fam.pad], bos_token_id=ids.get(fam.bos), **overrides)
    model.to(getattr(torch, dtype))
    model.save_pretrained(str(path), safe_serialization=True)
    return path
