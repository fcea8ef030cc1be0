"""Prompt rendering with exact TITO splicing (docs/design.md §4).

The prompt is the tokenizer's own chat template (jinja, through transformers) applied to the
request's messages. Per execution the proxy keeps every assistant turn it produced: the text and
tool calls it returned and the exact sampled ids. When a request carries such a turn again —
possibly re-serialized (JSON key order or whitespace of tool arguments, tool-call ids rewritten,
surrounding whitespace) — that message is rendered as a placeholder, the rendered text is cut at
the placeholders, the pieces are tokenized, and the original sampled ids go in between. The
result is the token sequence the model actually conditioned on, so every output token is trained
in exactly the context it was sampled in. Assistant turns that match nothing are tokenized from
text and counted as unmatched (context, never targets).

Why the splice is exact for every chat format, and why message text cannot forge a turn (it is
encoded as ordinary text even where it spells a special token): docs/proxy_harnesses.md, "Why
splicing is exact"; tests/proxy/test_formats_render.py checks the splice per format with
hypothesis. Past reasoning (`past_reasoning` keep / strip) and the diagnosis of unmatched turns
(`split`, `text_dropped`, `reordered`, `edited`, `unknown`; what `splice="tolerant"` splices):
docs/proxy_harnesses.md. Tokenization is cached per chat turn, so a long history re-sent on every
call is encoded once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gyre.proxy.formats import ChatFormat, format_for

logger = logging.getLogger(__name__)


def _canon_args(args: Any) -> str:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return args.strip()
    return json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def turn_fingerprint(content: str | None, tool_calls: list[dict] | None) -> tuple:
    """Identity of an assistant turn that survives re-serialization: stripped text, and each tool
    call's name + canonical JSON of its arguments (ids ignored)."""
    calls = tuple((tc.get("name", ""), _canon_args(tc.get("arguments", {}))) for tc in (tool_calls or ()))
    return ((content or "").strip(), calls)


def ids_digest(ids: list[int], chunk: int = 1 << 16) -> bytes:
    """Digest of a token sequence (the context a stored turn was sampled in). Hashed `chunk` ids
    at a time (the same digest as all at once): each conversion is a short GIL hold, so a 1M-id
    context hashed on a render thread never holds the event loop for long."""
    h = hashlib.blake2b(digest_size=16)
    for i in range(0, len(ids), chunk):
        h.update(np.asarray(ids[i : i + chunk], dtype="<i4").tobytes())
    return h.digest()


@dataclass
class StoredTurn:
    """An assistant turn the proxy produced: its exact sampled ids and the raw payload it returned.

    The context is kept as length + digest, not as ids: a long execution re-sends ~1M-token
    prompts hundreds of times, and only outputs need to be held. They are held packed (`array`
    of C ints, 4 bytes an id): in a list each id would be its own int object, ~36 bytes, for
    every turn of every open execution, and more objects for the garbage collector to walk.
    """

    call_id: int
    input_len: int
    input_digest: bytes
    output_ids: array
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    claims: int = 0  # renders that chose this turn among twins (`ChatRenderer._twin`)

    @classmethod
    def of(cls, call_id: int, input_ids: list[int], output_ids: list[int], content: str = "", tool_calls: list[dict] | None = None,
           digest: bytes | None = None) -> "StoredTurn":
        """`digest`: ids_digest(input_ids), when already computed (off the event loop, `Proxy._build`)."""
        return cls(call_id, len(input_ids), digest or ids_digest(input_ids), array("i", output_ids), content, list(tool_calls or []))


class TurnStore(dict):
    """An execution's stored turns: fingerprint -> [StoredTurn] (a plain dict works too), plus an
    index by tool calls alone for diagnosing and tolerating re-sent turns that lost their text."""

    def __init__(self) -> None:
        super().__init__()
        self.by_calls: dict[tuple, list[StoredTurn]] = {}

    def add(self, fp: tuple, turn: StoredTurn) -> None:
        self.setdefault(fp, []).append(turn)
        if fp[1]:
            self.by_calls.setdefault(fp[1], []).append(turn)


def _calls_index(turns: dict) -> dict[tuple, list[StoredTurn]]:
    by = getattr(turns, "by_calls", None)
    if by is None:
        by = {}
        for fp, ts in turns.items():
            if fp[1]:
                by.setdefault(fp[1], []).extend(ts)
    return by


UNMATCHED_KINDS = ("split", "text_dropped", "reordered", "edited", "unknown")  # most telling first
# The likely harness behaviour behind each kind (the once-per-execution warning, gyre.proxy.core).
UNMATCHED_WHY = {
    "split": "the harness sends an assistant turn's text and its tool calls as separate messages",
    "text_dropped": "the harness drops the assistant's text from turns that have tool calls",
    "reordered": "the harness reorders a turn's parallel tool calls",
    "edited": "the harness edits the text of turns (same tool calls, other text)",
    "unknown": "the harness edits turns' text or tool arguments, or sends turns this policy did not produce",
}
# An assistant message may name the call whose output it is (Responses: a `previous_response_id`
# chain; chat: tool-call ids, gyre.proxy.tool_ids): among stored turns with its text, that call's ids
# are spliced, even where forks sampled the same text with other ids. Never shown to the template.
SPLICE_CALL = "_gyre_call_id"


@dataclass
class Rendered:
    ids: list[int]
    spliced: int = 0
    unmatched: int = 0
    spliced_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) in ids
    spliced_calls: list[int] = field(default_factory=list)  # call ids whose outputs went in
    message_starts: list[int] = field(default_factory=list)
    tolerated: int = 0  # of `spliced`: turns spliced by the tolerant rules (split / text dropped)
    unmatched_kinds: list[str] = field(default_factory=list)  # one of UNMATCHED_KINDS per unmatched message
    stripped: int = 0  # stored turns rendered without their reasoning (past_reasoning="strip")
    gen_prefix: str = ""  # template text after the generation prompt (e.g. an empty think block): input
    gen_prefix_ids: int = 0  # its ids: the last ones of `ids` (the stored turn's start, gyre.proxy.core)
    ctx_digest: bytes | None = None  # ids_digest of the stored turn's context, computed where the ids are packed (a render thread for long prompts)
    prefill_ids: int = 0  # of gen_prefix_ids: the client's prefill (the last ones), see `ChatRenderer.render`


class PromptTooLong(ValueError):
    """The rendered text alone holds more tokens than the context can (checked before tokenizing)."""

    def __init__(self, chars: int, min_tokens: int) -> None:
        super().__init__(f"the prompt's {chars} characters are at least {min_tokens} tokens")
        self.chars = chars
        self.min_tokens = min_tokens


class _Ambiguous(Exception):
    """A tolerant splice found several stored turns and none sampled in this exact context."""

    def __init__(self, index: int) -> None:
        self.index = index


class ChatRenderer:
    def __init__(self, tokenizer, cache_chars: int = 64 << 20, splice: str = "exact", fmt: ChatFormat | None = None,
                 past_reasoning: str = "keep", tools: Any = None) -> None:
        """`tools`: a `gyre.proxy.formats.choice.ToolSupport` (who renders a request's tools, or
        why they are refused); None hands them to the template as they are."""
        if splice not in ("exact", "tolerant"):
            raise ValueError(f"splice must be 'exact' or 'tolerant', got {splice!r}")
        if past_reasoning not in ("keep", "strip"):
            raise ValueError(f"past_reasoning must be 'keep' or 'strip', got {past_reasoning!r}")
        self.splice = splice
        self.past_reasoning = past_reasoning
        self.tokenizer = tokenizer
        self.format = fmt or format_for(tokenizer)
        self.tools = tools
        self.backend = tokenizer.backend_tokenizer
        self.turn_start = self.format.turn_start
        self.end_of_turn = self.format.end_of_turn
        self.end_of_turn_id = self.backend.token_to_id(self.end_of_turn)
        if self.end_of_turn_id is None:
            raise ValueError(f"chat format {self.format.name}: the tokenizer has no {self.end_of_turn!r} token; "
                             "is --proxy.chat-format right for this checkpoint?")
        # The template's special-token variables (bos_token, ...), as apply_chat_template passes them.
        self._special_vars = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
        self._template = None
        try:  # the same compiled jinja environment apply_chat_template uses, minus per-call overhead
            from transformers.utils.chat_template_utils import _compile_jinja_template

            self._template = _compile_jinja_template(tokenizer.chat_template)
        except Exception as e:  # private helper moved: fall back to the public call
            logger.info("render: using apply_chat_template (%r)", e)
        self._nonce = secrets.token_hex(6)
        self._placeholder = re.compile("\x00splice-" + self._nonce + r"-(\d+)\x00")
        # Ids as 4-byte C ints: a list of Python ints costs ~36 bytes a token, which made the
        # cache (64M chars by default) ~11 bytes a char, ~0.7 GB full; as arrays ~3 (scale_bench).
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._cache_chars = 0
        self.cache_limit = cache_chars
        self._lock = threading.Lock()  # the cache; rendering runs on a thread pool (gyre.proxy.core)
        # Special tokens in message text are escaped to `\ue000<nonce><k>\ue001` (private-use
        # characters survive the template's tojson) and encoded with special-token matching off.
        added = {t.content: i for i, t in self.backend.get_added_tokens_decoder().items()}
        self._specials = sorted(added, key=len, reverse=True)
        self._special_ids = added
        self._special_re = re.compile("|".join(re.escape(t) for t in self._specials))
        self._lit = "\ue000" + self._nonce
        self._lit_re = re.compile(re.escape(self._lit) + "(\\d+)\ue001")
        self._marks = {t: f"{self._lit}{k}\ue001" for k, t in enumerate(self._specials)}  # a 783k-token prompt has ~10k matches
        from tokenizers import Tokenizer

        self.plain = Tokenizer.from_str(self.backend.to_str())
        self.plain.encode_special_tokens = True
        # The most text one token stands for (byte-level: one alphabet symbol per byte, and a
        # character is at least one byte), so text longer than max_context x this cannot fit.
        specials = set(added.values())
        vocab = self.backend.get_vocab_size(with_added_tokens=True)
        self.max_token_chars = max((len(self.backend.id_to_token(i) or "") for i in range(vocab) if i not in specials), default=1) or 1

    # ---- escaping of special-token strings in message text ----------------------------------
    def escape(self, text: str) -> str:
        """`text` with every special-token string replaced by its marker (see the module docstring)."""
        if "<" not in text or not self._special_re.search(text):
            return text
        return self._special_re.sub(lambda m: self._marks[m.group()], text)

    def escape_obj(self, v: Any) -> Any:
        """`escape` applied to every string (keys too) in a JSON-like value."""
        if isinstance(v, str):
            return self.escape(v)
        if isinstance(v, dict):
            return {self.escape(k) if isinstance(k, str) else k: self.escape_obj(x) for k, x in v.items()}
        if isinstance(v, list):
            return [self.escape_obj(x) for x in v]
        return v

    def _escape_message(self, m: dict) -> dict:
        out = dict(m)
        out.pop(SPLICE_CALL, None)
        if isinstance(m.get("content"), str):
            out["content"] = self.escape(m["content"])
        if isinstance(m.get("reasoning_content"), str):
            out["reasoning_content"] = self.escape(m["reasoning_content"])
        if m.get("tool_calls"):
            # OpenAI's shape: every template reads it (Qwen's unwrap `function` if defined; Llama 3.1 needs it)
            out["tool_calls"] = [{"type": "function", "function": {"name": self.escape(tc.get("name", "")),
                                                                   "arguments": self.escape_obj(tc.get("arguments", {}))}}
                                 for tc in m["tool_calls"]]
        return out

    def _encode_escaped(self, chunk: str) -> list[int]:
        """Ids of a chunk holding escape markers: the template's special tokens as such, the text
        between them (markers back to their literal strings) with special-token matching off.
        Cutting at special tokens is what the tokenizer does itself (they never merge)."""
        parts: list[str | int] = []  # text to encode, or a special token's id
        pos = 0
        for m in self._special_re.finditer(chunk):
            parts.append(chunk[pos : m.start()])
            parts.append(self._special_ids[m.group()])
            pos = m.end()
        parts.append(chunk[pos:])
        texts = [self._lit_re.sub(lambda m: self._specials[int(m.group(1))], t) for t in parts if isinstance(t, str) and t]
        # encode_batch releases the GIL while it encodes (encode does not): a long message never
        # holds the event loop
        encoded = iter(self.plain.encode_batch(texts, add_special_tokens=False))
        out: list[int] = []
        for t in parts:
            if isinstance(t, int):
                out.append(t)
            elif t:
                out.extend(next(encoded).ids)
        return out

    # ---- text -> ids ------------------------------------------------------------------------
    def encode(self, text: str, starts: list[int] | None = None, offset: int = 0, packed: bool = False) -> list[int] | array:
        """Token ids of `text` (special tokens recognised), cached per chat turn. Appends to
        `starts` the positions (+ `offset`) where a turn (the format's `turn_start`) begins.
        `packed`: as an `array('i')` (see `render`)."""
        ids = self._encode(text, starts, offset)
        return ids if packed else ids.tolist()

    def _encode(self, text: str, starts: list[int] | None = None, offset: int = 0) -> array:
        """`encode` as 4-byte C ints: the cached turns are copied in whole (a memcpy each), not as
        ~1M Python ints for a long conversation."""
        out = array("i")
        if not text:
            return out
        ts = self.turn_start
        pieces = text.split(ts)
        chunks = [pieces[0]] + [ts + p for p in pieces[1:]] if len(pieces) > 1 else pieces
        have: dict[str, list[int] | array] = {}
        missing: list[str] = []
        cache = self._cache
        with self._lock:
            for c in dict.fromkeys(chunks):
                if not c:
                    continue
                ids = cache.get(c)
                if ids is None:
                    missing.append(c)
                else:
                    cache.move_to_end(c)
                    have[c] = ids
        if missing:
            lit = self._lit
            plain = [c for c in missing if lit not in c]
            if plain:
                for c, enc in zip(plain, self.backend.encode_batch(plain, add_special_tokens=False)):
                    have[c] = enc.ids
            for c in missing:
                if lit in c:
                    have[c] = self._encode_escaped(c)
            with self._lock:
                for c in missing:
                    self._put(c, have[c])
        for c in chunks:
            if c:
                if starts is not None and c.startswith(ts):
                    starts.append(offset + len(out))
                out.extend(have[c])
        return out

    def _put(self, chunk: str, ids: list[int]) -> None:
        if len(chunk) > self.cache_limit or chunk in self._cache:
            return
        self._cache[chunk] = array("i", ids)
        self._cache_chars += len(chunk)
        while self._cache_chars > self.cache_limit and self._cache:
            old, _ = self._cache.popitem(last=False)
            self._cache_chars -= len(old)

    def _render_text(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool = True,
                     template_kwargs: dict | None = None) -> str:
        kw = {**self._special_vars, **(template_kwargs or {})}
        if self._template is not None:
            return self._template.render(messages=messages, tools=tools or None, add_generation_prompt=generation_prompt, **kw)
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt, **kw)

    def _answer(self, content: str | None) -> str | None:
        """The answer part of an assistant message's content: a harness that puts the thinking back
        into the text (`<think>...</think>answer`) re-sends the same turn; the template reads it
        that way too (`content.split('</think>')[-1]`, tests/chat_templates/qwen3.jinja)."""
        tags = self.format.reasoning
        if tags is None or not content or tags.end not in content:
            return content
        return content.split(tags.end)[-1].lstrip("\n")

    def _lookup(self, turns: dict, m: dict) -> list[StoredTurn] | None:
        """The stored turns an assistant message is. Its content as sent first: a turn whose content
        holds the reasoning end tag as plain text (a `</think>` sampled where no thinking was open:
        the parser leaves it in the content) is re-sent exactly so, and only its whole text is its
        fingerprint; cutting it at the tag would miss it, or hit another turn whose content is the
        tail (an empty answer: another turn's ids spliced in). Then the answer part (`_answer`)."""
        calls = m.get("tool_calls")
        cands = turns.get(turn_fingerprint(m.get("content"), calls))
        if cands and SPLICE_CALL in m:  # the parent the client named: exactly its sample
            named = [c for c in cands if c.call_id == m[SPLICE_CALL]]
            return named or cands
        if cands:
            return cands
        answer = self._answer(m.get("content"))
        return turns.get(turn_fingerprint(answer, calls)) if answer != m.get("content") else None

    def last_query_index(self, messages: list[dict]) -> int:
        """Index of the last user query, as Qwen3's template finds it (a user message that is not a
        wrapped tool response); turns before it lose their reasoning there."""
        for i in range(len(messages) - 1, -1, -1):
            m = messages[i]
            c = m.get("content")
            if m["role"] == "user" and isinstance(c, str) and not (c.startswith("<tool_response>") and c.endswith("</tool_response>")):
                return i
        return len(messages) - 1

    def _gen_prefix(self, text: str, ids: array, out: Rendered) -> None:
        """Note what the template appended after the generation prompt (input the stored turn starts with)."""
        gp = self.format.generation_prompt
        k = text.rfind(gp)
        extra = text[k + len(gp):] if k >= 0 else ""
        if not extra:
            return
        extra_ids = self._encode(extra)
        if extra_ids and ids[-len(extra_ids):] == extra_ids:
            out.gen_prefix, out.gen_prefix_ids = extra, len(extra_ids)
        else:  # it merged with the header's tokens: the stored turn starts after the prefix instead
            logger.warning("render: the text after the generation prompt (%r) does not tokenize on its own; "
                           "turns sampled after it will not splice back", extra[:40])

    # ---- chat -> ids with splicing ----------------------------------------------------------
    def render(self, messages: list[dict], tools: list[dict] | None, turns: dict[tuple, list[StoredTurn]] | None,
               max_tokens: int | None = None, template_kwargs: dict | None = None, prefill: str = "", packed: bool = False) -> Rendered:
        """`messages` are normalized chat messages (role, content str, tool_calls [{name, arguments}]).
        `turns` maps a turn fingerprint to the stored turns of this execution (None: no splicing).
        With `max_tokens`, text that cannot fit in that many tokens raises `PromptTooLong` before
        it is tokenized (the slow part). `prefill`: the start of the answer, given by the client
        (Anthropic's trailing assistant message): appended after the generation prompt as input,
        and part of the turn the model continues (`Rendered.gen_prefix`, `prefill_ids`).
        `packed`: `Rendered.ids` as an `array('i')` (the proxy makes its `TokenIds` from it,
        without ever holding the prompt as a list of Python ints); else a list."""
        no_tolerate: set[int] = set()
        if self.tools is not None:
            self.tools.check(messages, tools)  # tools this run cannot render: a 400, never dropped
        tools = self.escape_obj(tools) if tools else tools
        while True:
            try:
                out = self._render(messages, tools, turns, no_tolerate, max_tokens, template_kwargs)
                break
            except _Ambiguous as e:  # rare: render again with that message as text
                no_tolerate.add(e.index)
        if prefill:  # plain text: special-token strings in it are never control tokens
            ids = self.plain.encode(prefill, add_special_tokens=False).ids
            out.ids.extend(ids)
            out.gen_prefix += prefill
            out.gen_prefix_ids += len(ids)
            out.prefill_ids = len(ids)
        if not packed:
            out.ids = out.ids.tolist()
        return out

    def _diagnose(self, messages: list[dict], i: int, turns: dict, by_calls: dict) -> tuple[str, int, list[StoredTurn] | None]:
        """Why assistant message i matched nothing: (kind, messages it covers, stored turns it is)."""
        j = i
        while j < len(messages) and messages[j]["role"] == "assistant":
            j += 1
        for k in range(j, i + 1, -1):  # the longest run of 2+ messages that is one stored turn
            run = messages[i:k]
            text = "\n".join(t for t in ((m.get("content") or "").strip() for m in run) if t)
            cands = turns.get(turn_fingerprint(text, [tc for m in run for tc in m.get("tool_calls") or ()]))
            if cands:
                return "split", k - i, cands
        m = messages[i]
        calls = turn_fingerprint("", m.get("tool_calls"))[1]
        stored = by_calls.get(calls) if calls else None
        if stored:
            return ("edited", 1, None) if (m.get("content") or "").strip() else ("text_dropped", 1, stored)
        if len(calls) > 1 and any(len(k) == len(calls) and sorted(k) == sorted(calls) for k in by_calls):
            return "reordered", 1, None  # a stored turn's parallel calls, in another order (never spliced)
        return "unknown", 1, None

    def _render(self, messages: list[dict], tools: list[dict] | None, turns: dict | None, no_tolerate: set[int], max_tokens: int | None,
                template_kwargs: dict | None = None) -> Rendered:
        tmpl: list[dict] = []
        # past_reasoning="strip": turns the template renders without their reasoning are not spliced.
        strip = bool(turns) and self.past_reasoning == "strip" and self.format.strips_past_reasoning
        last_query = self.last_query_index(messages) if strip else -1
        stripped = 0
        splices: list[tuple[list[StoredTurn], int]] = []  # (candidates, message index if tolerant else -1)
        kinds: list[str] = []
        by_calls = None
        i = 0
        while i < len(messages):
            m = messages[i]
            if m["role"] != "assistant":
                tmpl.append(self._escape_message(m))
                i += 1
                continue
            cands = self._lookup(turns, m) if turns else None
            drops = strip and (i < last_query or not (m.get("reasoning_content") or "").strip())
            if drops and (cands or self._diagnose(messages, i, turns, _calls_index(turns))[2]):
                stripped += 1  # a turn we produced, rendered as the template does (no reasoning): a new branch
                tmpl.append(self._escape_message(m))
                i += 1
                continue
            span, tolerant = 1, False
            if not cands:
                if not turns:
                    kind = "unknown"
                else:
                    by_calls = _calls_index(turns) if by_calls is None else by_calls
                    kind, span, cands = self._diagnose(messages, i, turns, by_calls)
                    tolerant = bool(cands) and self.splice == "tolerant" and i not in no_tolerate
                if not tolerant:
                    kinds += [kind] * span
                    tmpl += [self._escape_message(x) for x in messages[i : i + span]]
                    i += span
                    continue
            tmpl.append({"role": "assistant", "content": f"\x00splice-{self._nonce}-{len(splices)}\x00"})
            splices.append((cands, i if tolerant else -1))
            i += span
        if self.tools is not None:  # Hermes tools for a template without its own (gyre/proxy/formats/hermes_prompt.py)
            tmpl, tools = self.tools.rewrite(tmpl, tools)
        text = self._render_text(tmpl, tools, True, template_kwargs)
        if max_tokens is not None and len(text) > max_tokens * self.max_token_chars:
            raise PromptTooLong(len(text), -(-len(text) // self.max_token_chars))
        starts: list[int] = []
        if not splices:
            ids = self._encode(text, starts)
            out = Rendered(ids=ids, unmatched=len(kinds), message_starts=starts, unmatched_kinds=kinds, stripped=stripped)
            self._gen_prefix(text, ids, out)
            return out
        parts = self._placeholder.split(text)  # [text, k, text, k, ..., text]
        # A turn's content starts right after the generation prompt: what the template puts between
        # them for a re-rendered turn (Qwen3.5: an empty think block after the last query) is
        # replaced by the stored turn, which holds what the model saw there (its prefix ids).
        gp = self.format.generation_prompt
        for j in range(0, len(parts) - 1, 2):
            k = parts[j].rfind(gp)
            if k >= 0:
                parts[j] = parts[j][: k + len(gp)]
        ids = self._encode(parts[0], starts)
        out = Rendered(ids=ids, unmatched=len(kinds), message_starts=starts, unmatched_kinds=kinds, stripped=stripped)
        for j in range(1, len(parts), 2):
            cands, tol_index = splices[int(parts[j])]
            turn = cands[-1]
            if len(cands) > 1:  # the same text was produced more than once: prefer the exact context
                same_len = [c for c in cands if c.input_len == len(ids)]
                d = ids_digest(ids) if same_len else None
                exact = [c for c in reversed(same_len) if c.input_digest == d]
                if len({c.output_ids.tobytes() for c in exact}) > 1:  # twins: one context, one text, other ids
                    turn = self._twin(exact, ids, parts, splices, j)
                elif exact:
                    turn = exact[0]
                elif tol_index >= 0 and any(c.output_ids != turn.output_ids for c in cands):
                    raise _Ambiguous(tol_index)  # a tolerant splice never guesses between samples
            start = len(ids)
            ids.extend(turn.output_ids)
            out.spliced += 1
            out.tolerated += tol_index >= 0
            out.spliced_spans.append((start, len(ids)))
            out.spliced_calls.append(turn.call_id)
            drop = self._drop(turn, parts[j + 1])
            rest = self._encode(parts[j + 1], starts, offset=len(ids) - drop)
            ids.extend(rest[drop:])
        self._gen_prefix(parts[-1], ids, out)
        return out

    def _drop(self, turn: StoredTurn, after: str) -> int:
        """1 when the turn's sampled end-of-turn token stands for the template's that `after` starts with."""
        return int(bool(turn.output_ids) and turn.output_ids[-1] == self.end_of_turn_id and after.startswith(self.end_of_turn))

    def _twin(self, twins: list[StoredTurn], ids: array, parts: list[str], splices: list, j: int) -> StoredTurn:
        """Among turns sampled in the same context with the same text (identical parallel
        sub-agents; newest first): the one the next spliced turn was sampled after, when one is
        (its stored context ends with that twin's ids); else the one fewest renders chose, so
        twin continuations stay apart instead of all extending one."""
        if j + 2 < len(parts):
            later = splices[int(parts[j + 2])][0]
            rest = self._encode(parts[j + 1], [], offset=0)
            after = []
            for t in twins:
                drop = self._drop(t, parts[j + 1])
                n = len(ids) + len(t.output_ids) + len(rest) - drop
                if any(c.input_len == n for c in later):
                    ctx = array("i", ids)
                    ctx.extend(t.output_ids)
                    ctx.extend(rest[drop:])
                    d = ids_digest(ctx)
                    if any(c.input_len == n and c.input_digest == d for c in later):
                        after.append(t)
            twins = after or twins
        turn = min(twins, key=lambda t: t.claims)  # min keeps the first (newest) of equals
        turn.claims += 1
        return turn
