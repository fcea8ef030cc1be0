"""From sampled token ids to what the client sees: incremental detokenization, stop strings,
and the tool-call parser (Qwen / Hermes `<tool_call>{json}</tool_call>`), all streaming.

    ids --Detokenizer--> text --StopMatcher--> text --ToolCallParser--> TextPiece | ToolCall

Each stage holds back only what it must (a partial UTF-8 character, a possible start of a stop
string or of `<tool_call>`), so a stream and a one-shot response produce the same content.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from typing import Any

TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"


def tool_call_opening(name: str | None) -> str:
    """The text a forced tool call starts with: the template's `<tool_call>\\n{"name": "NAME",
    "arguments":` for a named function, `<tool_call>\\n{"name": "` for any (the model writes the
    name). It stops before the space that follows in the template's rendering: a BPE tokenizer
    attaches that space to the next token (` {"`), so a prefix ending in it would leave the model
    an unnatural tokenization to continue from."""
    if name is None:
        return TOOL_START + '\n{"name": "'
    return TOOL_START + '\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments":'


class Detokenizer:
    """Exact bytes of each token (`gyre.backends.models.vocab.byte_table`), UTF-8 decoded incrementally.

    Any id is accepted: one the tokenizer has no token for (a hole, a padding row of an embedding
    larger than the tokenizer, anything out of range) shows nothing and is counted in
    `undecodable`; the record keeps the id itself. The bytes are continuation bytes: no
    SentencePiece leading-space strip, since an output continues its prompt (gyre/backends/models/vocab.py)."""

    def __init__(self, table: list[bytes], hidden_ids: frozenset[int]) -> None:
        self.table = table
        self.n = len(table)
        self.hidden = hidden_ids
        self.bad = getattr(table, "undecodable", frozenset())
        self.undecodable = 0
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id: int) -> str:
        if token_id in self.hidden:
            return ""
        if not 0 <= token_id < self.n or token_id in self.bad:
            self.undecodable += 1
            return ""
        return self._dec.decode(list.__getitem__(self.table, token_id))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class StopMatcher:
    """Finds the first stop string to complete; text from its start on is never shown."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        self.buf += text
        # The first stop string to *complete* wins (earliest end, then earliest start): what a
        # token-by-token check sees, so the result does not depend on how text was chunked.
        best, best_end = -1, -1
        for s in self.stops:
            i = self.buf.find(s)
            if i >= 0 and (best < 0 or (i + len(s), i) < (best_end, best)):
                best, best_end, self.matched = i, i + len(s), s
        if best >= 0:
            out, self.buf = self.buf[:best], ""
            return out
        cut = max(0, len(self.buf) - self.hold)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


@dataclass
class ToolCall:
    name: str
    arguments: Any  # parsed JSON (usually a dict)
    index: int = 0

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def _parse_block(block: str) -> ToolCall | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(name=obj["name"], arguments=args)


def _prefix_overlap(text: str, token: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `token`."""
    if text.rfind(token[0], -(len(token) - 1)) < 0:
        return 0  # fast path: the token's first character is not in the tail
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0


class ToolCallParser:
    """Hermes/Qwen tool calls out of streamed text. `push`/`flush` return a list of str | ToolCall.

    Content is the text before the first `<tool_call>` with its trailing whitespace removed (the
    chat template puts a newline between content and the first call); a block that turns out not
    to be a call keeps the whitespace before it. Blocks that are not valid
    JSON `{"name": ..., "arguments": {...}}` come back as text, never dropped. With
    `enabled=False` all text passes through.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.buf = ""
        self.ws = ""  # whitespace held back before a `<tool_call>` block: dropped if it is a call, kept if not
        self.in_tools = False
        self.ncalls = 0

    def _call(self, tc: ToolCall) -> ToolCall:
        tc.index = self.ncalls
        self.ncalls += 1
        return tc

    def push(self, text: str) -> list:
        if not self.enabled:
            return [text] if text else []
        self.buf += text
        out: list = []
        if not self.in_tools:
            i = self.buf.find(TOOL_START)
            if i < 0:
                keep = _prefix_overlap(self.buf, TOOL_START)
                head = self.buf[: len(self.buf) - keep]
                stripped = head.rstrip()
                emit = stripped
                self.buf = self.buf[len(emit) :]
                if emit:
                    out.append(emit)
                return out
            head = self.buf[:i].rstrip()
            if head:
                out.append(head)
            self.ws = self.buf[len(head) : i]
            self.buf = self.buf[i:]
            self.in_tools = True
        while self.buf:
            body = self.buf.lstrip()
            if not body:
                break  # whitespace: dropped if a call follows, kept if text follows
            if body.startswith(TOOL_START):
                lead = self.buf[: len(self.buf) - len(body)]
                j = body.find(TOOL_END)
                if j < 0:
                    self.ws += lead
                    self.buf = body
                    break
                raw = body[: j + len(TOOL_END)]
                tc = _parse_block(body[len(TOOL_START) : j].strip())
                out.append(self._call(tc) if tc is not None else self.ws + lead + raw)  # not a call: its text, as written
                self.ws = ""
                self.buf = body[j + len(TOOL_END) :]
                continue
            if TOOL_START.startswith(body):
                break  # maybe the start of another call
            k = self.buf.find(TOOL_START)
            if k < 0:
                keep = _prefix_overlap(self.buf, TOOL_START)
                emit = self.buf[: len(self.buf) - keep].rstrip()
                out.append(emit)
                self.buf = self.buf[len(emit) :]
                break
            head = self.buf[:k].rstrip()
            out.append(head)
            self.ws = self.buf[len(head) : k]
            self.buf = self.buf[k:]
        return [x for x in out if not (isinstance(x, str) and not x)]

    def flush(self) -> list:
        out, self.buf = self.buf, ""
        ws, self.ws = self.ws, ""
        if not out:
            return []
        if self.in_tools and not out.strip() and self.ncalls:
            return []  # whitespace after the last call: the template's
        return [ws + out]
