"""Any fast (`tokenizers`-backed) tokenizer: loaded from a directory, and the exact bytes of every id.

    load_fast_tokenizer(path)  →  the tokenizer of a directory, refused unless `tokenizers` backs it
    byte_table(tokenizer)      →  ByteTable: bytes of every id, built once
    id_count(tokenizer)        →  one past the largest id (what sampleable_vocab is)

The proxy shows a stream of sampled ids incrementally (`gyre.proxy.textstream.Detokenizer`):
each id's bytes are appended and UTF-8 decoded as they complete, never re-decoding the whole
output. That needs, for every id, the bytes the tokenizer's *decoder* turns it into: the decoder
chain of `tokenizer.json` (ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace) is emulated
per token. The table holds continuation bytes (a model's output continues its prompt, so the
leading-space rules that apply where a decode starts do not apply; SGLang shows the same);
`ByteTable.decode` applies them, for comparisons with `tokenizer.decode`. The invariant
(tests/backends/models/test_vocab*.py, hypothesis over random ids):

    for ids whose joined bytes are valid UTF-8:
        backend.decode(ids, skip_special_tokens=False) == table.decode(ids)
    byte-level tokenizers, any ids (both replace invalid bytes by maximal subparts):
        backend.decode(ids) == table.join(ids).decode("utf-8", "replace")

Ids the tokenizer has no token for (holes, an embedding's padding rows) have no bytes: `table[i]`
is b"" and `i in table.undecodable`, as is any id past the end, so no sampled id can make the
proxy fail. How each decoder step is emulated: docs/backends.md, "The byte table".
"""

from __future__ import annotations

import functools
import json
import logging
import operator
import re
import time
from typing import Any, Iterable

logger = logging.getLogger(__name__)

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>\Z")


class VocabError(ValueError):
    """The tokenizer and the model do not fit together, or the tokenizer cannot be streamed; the
    message names both sizes, or the decoder that is not supported."""


# ----------------------------------------------------------------------------- the byte table
def _gpt2_alphabet() -> dict[int, int]:
    """GPT-2's printable stand-ins for bytes: {ord(symbol): byte} (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(cs, bs))


@functools.lru_cache(maxsize=1)
def _byte_level_translation() -> dict[int, str]:
    """A str.translate table turning a byte-level token into latin-1 (one char per byte): each
    alphabet symbol → chr(byte); every other character below 256 → U+FFFF, which latin-1 cannot
    encode, so a token with a symbol outside the alphabet fails the encode and falls back to its
    UTF-8, as the decoder does (characters >= 256 outside the alphabet fail the encode anyway)."""
    alphabet = _gpt2_alphabet()
    table = {c: "\uffff" for c in range(256) if c not in alphabet}
    table.update({sym: chr(b) for sym, b in alphabet.items()})
    return table


class ByteTable(list):
    """bytes of each token id: `table.join(ids)` is the exact UTF-8 of the sampled text.

    A list (index it, `len` it); an id it has no bytes for, out of range included, reads b"".
    `undecodable`: the ids in range with no token. `lead`: the leading-space rule of a decode
    that starts at this table's first id ("" none, "strip:N" the first N spaces of the text,
    "metaspace" the spaces of the first token that came from `▁`).
    """

    def __init__(self, pieces: list[bytes], undecodable: frozenset[int], lead: str = "", kind: str = "byte-level",
                 metaspace_first: list[bytes] | None = None, build_s: float = 0.0) -> None:
        super().__init__(pieces)
        self.undecodable = undecodable
        self.lead = lead
        self.kind = kind
        self.build_s = build_s
        self._metaspace_first = metaspace_first  # a first token's bytes under the Metaspace rule

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return list.__getitem__(self, i)
        i = operator.index(i)  # numpy ints too (records hold int32 arrays)
        return list.__getitem__(self, i) if 0 <= i < len(self) else b""

    def join(self, ids: Iterable[int]) -> bytes:
        n, get = len(self), list.__getitem__
        return b"".join(get(self, i) for i in ids if 0 <= i < n)

    def decode(self, ids: list[int]) -> str:
        """The text of `ids` as a decode that starts at ids[0] gives it (the leading-space rule
        applied; invalid UTF-8 replaced)."""
        ids = [i for i in ids if 0 <= i < len(self) and i not in self.undecodable]
        if self.lead == "metaspace" and ids and self._metaspace_first is not None:
            return (self._metaspace_first[ids[0]] + self.join(ids[1:])).decode("utf-8", "replace")
        text = self.join(ids).decode("utf-8", "replace")
        if self.lead.startswith("strip:"):
            n = int(self.lead.split(":")[1])
            k = len(text) - len(text.lstrip(" "))
            text = text[min(n, k):]
        return text


def _decoder_steps(decoder: dict | None) -> list[dict]:
    if decoder is None:
        return []
    if decoder.get("type") == "Sequence":
        return [s for d in decoder["decoders"] for s in _decoder_steps(d)]
    return [decoder]


def _plan(decoder: dict | None) -> tuple[str, list[dict], str]:
    """(kind, the per-token steps, the leading rule) of a tokenizer.json decoder; refuses what
    cannot be streamed token by token."""
    steps = _decoder_steps(decoder)
    if not steps:
        raise VocabError("tokenizer has no decoder (tokenizers joins such tokens with spaces); only byte-level "
                         "BPE and SentencePiece-style (Metaspace / Replace + ByteFallback) tokenizers are supported")
    per_token, lead, fused = [], "", False
    for s in steps:
        t = s.get("type")
        if t == "Fuse":
            fused = True
        elif t == "Strip":
            if s.get("stop", 0):
                raise VocabError(f"tokenizer decoder Strip with stop={s['stop']} strips the end of the text, "
                                 "which a stream cannot know; not supported")
            if fused:
                if s.get("content") != " ":
                    raise VocabError(f"tokenizer decoder Strip of {s.get('content')!r} after Fuse: not supported")
                lead = f"strip:{int(s.get('start', 0))}"
            else:
                per_token.append(s)
        elif t == "Replace":
            pat = s.get("pattern", {})
            if "String" not in pat or len(pat["String"]) != 1:
                raise VocabError(f"tokenizer decoder Replace of {pat!r}: only a one-character string is supported")
            per_token.append(s)
        elif t in ("ByteLevel", "ByteFallback"):
            per_token.append(s)
        elif t == "Metaspace":
            per_token.append(s)
            if s.get("prepend_scheme", "always") != "never" and s.get("add_prefix_space", True):
                lead = "metaspace"
        else:
            raise VocabError(f"tokenizer decoder {t!r} is not supported for streaming (supported: ByteLevel, "
                             f"Metaspace, Replace, ByteFallback, Fuse, Strip)")
    kind = "byte-level" if any(s["type"] == "ByteLevel" for s in per_token) else "sentencepiece"
    return kind, per_token, lead


def _token_bytes(piece: str, steps: list[dict], first: bool = False) -> bytes:
    """One token through the per-token decoder steps (tokenizers 0.23's decode_chain of each)."""
    out: str | bytes = piece
    for s in steps:
        if isinstance(out, bytes):
            break  # a byte piece is final (ByteFallback/ByteLevel produced bytes)
        t = s["type"]
        if t == "ByteLevel":
            try:
                out = out.translate(_byte_level_translation()).encode("latin-1")
            except UnicodeEncodeError:
                out = out.encode("utf-8")  # a symbol outside the alphabet: the token's own text
        elif t == "ByteFallback":
            m = _BYTE_PIECE.match(out)
            if m and len(out) == 6:
                out = bytes([int(m.group(1), 16)])
        elif t == "Replace":
            out = out.replace(s["pattern"]["String"], s["content"])
        elif t == "Metaspace":
            rep = s.get("replacement", "▁")
            out = out.replace(rep, "") if first else out.replace(rep, " ")
        elif t == "Strip":
            c, start = s.get("content", " "), int(s.get("start", 0))
            k = 0
            while k < start and k < len(out) and out[k] == c:
                k += 1
            out = out[k:]
    return out if isinstance(out, bytes) else out.encode("utf-8")


def id_count(tokenizer: Any) -> int:
    """One past the largest token id: the ids a model driven by `tokenizer` must have rows for.
    `len(tokenizer)` counts tokens: the same for a dense vocabulary, too small for one with holes
    (ids past the count exist then). Exact, from the whole vocabulary (0.2 s for 131k ids)."""
    backend = tokenizer.backend_tokenizer
    top = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    return max(len(tokenizer), top)


def byte_table(tokenizer: Any) -> ByteTable:
    """The ByteTable of a `tokenizers`-backed (fast) tokenizer, built once: about 0.1 s for 131k
    ids (benchmarks/proxy_bench.py reports it). Cached on the tokenizer object."""
    cached = getattr(tokenizer, "_gyre_byte_table", None)
    if cached is not None:
        return cached
    t0 = time.perf_counter()
    backend = tokenizer.backend_tokenizer
    # The decoder's own JSON (its __getstate__), not backend.to_str(): serialising a 131k-id
    # tokenizer's merges costs 0.36 s, the decoder alone microseconds.
    dec = backend.decoder
    kind, steps, lead = _plan(json.loads(dec.__getstate__()) if dec is not None else None)
    n = max(len(tokenizer), backend.get_vocab_size(with_added_tokens=True))
    # id_to_token per id (0.06 s for 131k) beats get_vocab (0.19 s, a dict built across the FFI)
    # and finds the holes as it goes.
    tokens = [backend.id_to_token(i) for i in range(n)]
    if None in tokens:  # n tokens with a hole below n: some ids lie past n
        top = id_count(tokenizer)
        tokens += [backend.id_to_token(i) for i in range(n, top)]
        n = top
    undecodable = frozenset(i for i, p in enumerate(tokens) if p is None)
    if kind == "byte-level" and [s["type"] for s in steps] == ["ByteLevel"]:
        tr = _byte_level_translation()  # the common case inlined: ~2x faster than _token_bytes
        pieces: list[bytes] = []
        for p in tokens:
            if p is None:
                pieces.append(b"")
                continue
            try:
                pieces.append(p.translate(tr).encode("latin-1"))
            except UnicodeEncodeError:
                pieces.append(p.encode("utf-8"))
    else:
        pieces = [b"" if p is None else _token_bytes(p, steps) for p in tokens]
    first = None
    if lead == "metaspace":
        first = [b"" if p is None else _token_bytes(p, steps, first=True) for p in tokens]
    table = ByteTable(pieces, undecodable, lead=lead, kind=kind, metaspace_first=first,
                      build_s=time.perf_counter() - t0)
    if undecodable:
        logger.info("tokenizer: %d of %d ids have no token (holes); they are never shown", len(undecodable), n)
    try:
        tokenizer._gyre_byte_table = table
    except AttributeError:  # a tokenizer object that takes no attributes: built again next time
        pass
    return table


@functools.lru_cache(maxsize=4)
def load_fast_tokenizer(path: str) -> Any:
    """The `tokenizers`-backed tokenizer of directory `path` (AutoTokenizer), refused with a
    VocabError when it is not one (its bytes could not be streamed). Cached per path; read-only."""
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(path)
    if not getattr(tok, "is_fast", False) or getattr(tok, "backend_tokenizer", None) is None:
        raise VocabError(f"tokenizer at {path}: {type(tok).__name__} is not backed by `tokenizers` (a fast "
                         f"tokenizer with a tokenizer.json is needed to stream exact bytes)")
    logger.info("tokenizer: loaded %s (%d ids) in %.2fs", path, len(tok), time.perf_counter() - t0)
    return tok
