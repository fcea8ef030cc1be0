"""The committed tokenizer: deterministic rebuild, exact byte round trips, Qwen2.5 chat format."""

import filecmp
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.backends.models import tokenizer as T


def test_rebuild_is_byte_identical(tmp_path):
    T.build_tokenizer(out_dir=str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert filecmp.cmp(os.path.join(T.ASSET_DIR, name), os.path.join(tmp_path, name), shallow=False), name


def test_vocab_and_special_tokens():
    tok = T.load_tokenizer()
    assert len(tok) == T.VOCAB_SIZE == T.vocab_size() == 1024
    ids = tok.convert_tokens_to_ids(T.SPECIAL_TOKENS)
    assert len(set(ids)) == 7 and max(ids) < 1024
    # each special token is one id, never split into pieces
    for s, i in zip(T.SPECIAL_TOKENS, ids):
        assert tok.encode(f"a{s}b", add_special_tokens=False)[1] == i
    assert tok.eos_token == "<|im_end|>"


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=200))
def test_bytes_table_round_trip(text):
    tok = T.load_tokenizer()
    table = T.token_bytes(tok)
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(table[i] for i in ids) == text.encode("utf-8")
    assert tok.decode(ids) == text
    # the byte-level spelling decodes to the same text
    byte_ids = T.byte_token_ids(tok)
    spelled = [byte_ids[b] for b in text.encode("utf-8")]
    assert tok.decode(spelled) == text


def test_chat_template_qwen_format():
    tok = T.load_tokenizer()
    msgs = [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"cmd": "ls"}}}]},
        {"role": "tool", "content": "a.py"},
        {"role": "tool", "content": "b.py"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nlist files<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\na.py\n</tool_response>\n<tool_response>\nb.py\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text == expected
    tools = [{"type": "function", "function": {"name": "bash", "description": "run", "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "u"}], tools=tools, tokenize=False)
    assert text.startswith("<|im_start|>system\nS\n\n# Tools\n")
    assert '\n{"type": "function", "function": {"name": "bash", "description": "run", "parameters": {"type": "object"}}}\n</tools>' in text
    assert text.endswith("<|im_start|>user\nu<|im_end|>\n")
