"""The project's small byte-level BPE tokenizer with a Qwen2.5-style chat template.

No model hub at run time (docs/design.md §1, CPU path): the tokenizer is trained once, deterministically,
with `tokenizers` from `gyre/assets/tokenizer/corpus.txt` and committed as `tokenizer.json` +
`tokenizer_config.json` next to it. `load_tokenizer()` reads those files; `build_tokenizer()`
regenerates them (tests check that a rebuild is byte-identical). The corpus is a few modules of
CPython's standard library (PSF License: code and English docstrings) followed by generated
chat / tool-call / tool-response samples.

Vocabulary (VOCAB_SIZE = 1024): ids 0..6 are the special tokens below, ids 7..262 the 256 byte
symbols of the byte-level alphabet, the rest BPE merges. Every byte string is encodable, and
`token_bytes()` gives the exact bytes of each id, so a stream of sampled ids can be turned into
text incrementally without re-decoding (the proxy's streaming path).

Chat format (Qwen2.5 / Hermes): `<|im_start|>{role}\\n{content}<|im_end|>\\n`, tools listed in
the system turn inside `<tools></tools>`, the model calls a tool with
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, tool results come back in a
user turn as `<tool_response>\\n...\\n</tool_response>`. `<|im_end|>` ends an assistant turn.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import TYPE_CHECKING

from gyre.backends.models.bytetable import VocabError, byte_table, load_fast_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

_GYRE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASSET_DIR = os.path.join(_GYRE_DIR, "assets", "tokenizer")   # gyre/assets/tokenizer
CORPUS_FILE = "corpus.txt"

VOCAB_SIZE = 1024
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END]
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Qwen2's pre-tokenizer split (letters, single digits, punctuation runs, newlines, spaces).
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2.5's template, with this project's default system prompt.
CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- '" + DEFAULT_SYSTEM_PROMPT + "' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def vocab_size() -> int:
    """Number of token ids (embedding rows a model needs)."""
    return VOCAB_SIZE


def train_single_threaded(tok, chunks: list[str], trainer) -> None:
    """`tok.train_from_iterator(chunks)` with one rayon thread: merge ties are then broken in a
    fixed order, so the same corpus always gives byte-identical tokenizer files."""
    prev = os.environ.get("RAYON_NUM_THREADS")
    os.environ["RAYON_NUM_THREADS"] = "1"
    try:
        tok.train_from_iterator(chunks, trainer=trainer, length=len(chunks))
    finally:
        if prev is None:
            os.environ.pop("RAYON_NUM_THREADS", None)
        else:
            os.environ["RAYON_NUM_THREADS"] = prev


def build_tokenizer(out_dir: str = ASSET_DIR, corpus_path: str | None = None) -> "PreTrainedTokenizerFast":
    """Train the BPE from the shipped corpus and write tokenizer.json + tokenizer_config.json.

    Deterministic: same corpus → byte-identical files (single-threaded training, fixed order).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    corpus_path = corpus_path or os.path.join(ASSET_DIR, CORPUS_FILE)
    with open(corpus_path, encoding="utf-8") as f:
        text = f.read()
    # Paragraph-sized chunks; the trainer counts words, so chunking only bounds memory.
    chunks = [text[i : i + 4096] for i in range(0, len(text), 4096)]

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    train_single_threaded(tok, chunks, trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer: trained vocab has {tok.get_vocab_size()} ids, expected {VOCAB_SIZE}")

    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"), pretty=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": SPECIAL_TOKENS[3:],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    logger.info("tokenizer: wrote %s (%d ids)", out_dir, VOCAB_SIZE)
    return _load(out_dir)


def _load(path: str) -> "PreTrainedTokenizerFast":
    """The project tokenizer at `path` (the asset, or a rebuild of it): exactly VOCAB_SIZE ids."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(path)
    if len(tok) != VOCAB_SIZE:
        raise RuntimeError(f"project tokenizer at {path}: {len(tok)} ids, expected {VOCAB_SIZE}")
    return tok


@functools.lru_cache(maxsize=4)
def _cached(path: str) -> "PreTrainedTokenizerFast":
    return _load(path)


def load_tokenizer(path: str | None = None) -> "PreTrainedTokenizerFast":
    """The committed project tokenizer (None), or any `tokenizers`-backed tokenizer directory (a
    checkpoint's: `gyre.backends.models.bytetable.load_fast_tokenizer`). Cached per path; treat it
    as read-only. Only the project's is held to VOCAB_SIZE ids."""
    if path is None or os.path.abspath(path) == os.path.abspath(ASSET_DIR):
        return _cached(os.path.abspath(ASSET_DIR))
    if not os.path.isdir(path):
        raise VocabError(f"tokenizer path {path}: no such directory")
    return load_fast_tokenizer(os.path.abspath(path))


def token_bytes(tokenizer: "PreTrainedTokenizerFast") -> list[bytes]:
    """bytes of each token id: `b"".join(table[i] for i in ids)` is the exact UTF-8 of the text.

    Special tokens map to their literal text (e.g. b"<|im_end|>"). Any fast tokenizer: the table
    is `gyre.backends.models.bytetable.byte_table` (a list; ids without bytes read b"")."""
    return byte_table(tokenizer)


def byte_token_ids(tokenizer: "PreTrainedTokenizerFast") -> list[int]:
    """id of the single-byte token for each byte value 0..255 (a non-canonical but valid spelling
    of any text: the test engine uses it to emit ids that re-tokenizing would not reproduce)."""
    table = token_bytes(tokenizer)
    special_ids = set(tokenizer.all_special_ids) | {i for i in tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)
                                                    if isinstance(i, int)}
    out = [-1] * 256
    for idx, b in enumerate(table):
        if len(b) == 1 and idx not in special_ids:
            out[b[0]] = idx
    if min(out) < 0:
        raise RuntimeError("tokenizer: some byte has no single-byte token")
    return out
