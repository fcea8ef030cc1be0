"""Detokenizer, stop strings and the Hermes tool-call parser: streamed == one-shot, hand cases."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.backends.models.tokenizer import load_tokenizer, token_bytes
from gyre.proxy.textstream import Detokenizer, StopMatcher, ToolCall, ToolCallParser


def _run_parser(chunks, enabled=True):
    p = ToolCallParser(enabled)
    out = []
    for c in chunks:
        out += p.push(c)
    out += p.flush()
    return _norm(out)


def _norm(items):
    """Merge adjacent text pieces; tool calls as (name, args)."""
    res = []
    for it in items:
        if isinstance(it, ToolCall):
            res.append((it.name, json.dumps(it.arguments, sort_keys=True)))
        elif res and isinstance(res[-1], str):
            res[-1] += it
        else:
            res.append(it)
    return res


def test_parser_hand_cases():
    t = 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>\n<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>'
    assert _run_parser([t]) == ["Let me look.", ("bash", '{"cmd": "ls"}'), ("x", "{}")]
    # invalid JSON stays text, nothing dropped
    bad = "<tool_call>\n{not json}\n</tool_call>"
    assert _run_parser([bad]) == [bad]
    # unterminated call (max_tokens hit) stays text, the whitespace before it included (issue 34)
    assert _run_parser(["ok <tool_call>\n{\"name\": "]) == ['ok <tool_call>\n{"name": ']
    # a literal tag that is not a call keeps the whitespace before it; a call's is the template's
    assert _run_parser(["Write the tag:\n<tool_call>not json</tool_call>\n"]) == ["Write the tag:\n<tool_call>not json</tool_call>\n"]
    assert _run_parser(['a\n<tool_call>x</tool_call> \n<tool_call>{"name": "f", "arguments": {}}</tool_call>']) == [
        "a\n<tool_call>x</tool_call>", ("f", "{}")]
    lit = "<tool_call></tool_call></tool_call>\n<tool_call>"  # text between blocks keeps its whitespace too
    assert _run_parser([lit]) == [lit]
    # no tool calls: text passes through exactly, trailing whitespace included
    assert _run_parser(["a <tool", "x> b \n"]) == ["a <toolx> b \n"]
    assert _run_parser([t], enabled=False) == [t]


pieces = st.sampled_from(["<tool_call>", "</tool_call>", "\n", " ", "hi", "<tool", "_call>", '{"name": "f", "arguments": {"a": 1}}', "{", "x"])


@settings(max_examples=150, deadline=None)
@given(st.lists(pieces, max_size=14), st.data())
def test_parser_chunking_invariant(parts, data):
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks, prev = [], 0
    for c in cuts + [len(text)]:
        chunks.append(text[prev:c])
        prev = c
    assert _run_parser(chunks) == _run_parser([text])
    assert _run_parser(list(text)) == _run_parser([text])


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abc\n", max_size=40), st.lists(st.text(alphabet="abc", min_size=1, max_size=3), max_size=3), st.data())
def test_stop_matcher_earliest_match(text, stops, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    m = StopMatcher(stops)
    shown, prev = "", 0
    for c in cuts + [len(text)]:
        shown += m.push(text[prev:c])
        prev = c
    if m.matched is None:
        shown += m.flush()
    # independent reference: the first stop string to complete (earliest end, then earliest start)
    hits = sorted((text.find(s) + len(s), text.find(s)) for s in stops if s in text)
    expected = text[: hits[0][1]] if hits else text
    assert shown == expected
    assert (m.matched is not None) == bool(hits)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=80))
def test_detokenizer_incremental_equals_decode(text):
    tok = load_tokenizer()
    table = token_bytes(tok)
    ids = tok.encode(text, add_special_tokens=False)
    d = Detokenizer(table, frozenset())
    out = "".join(d.push(i) for i in ids) + d.flush()
    assert out == text
    # byte-at-a-time spellings split UTF-8 characters across tokens; still exact
    byte_tok = {table[i][0]: i for i in range(len(table)) if len(table[i]) == 1 and i >= 7}
    d = Detokenizer(table, frozenset())
    out = "".join(d.push(byte_tok[b]) for b in text.encode()) + d.flush()
    assert out == text


def test_detokenizer_hides_eos():
    tok = load_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    d = Detokenizer(token_bytes(tok), frozenset([eos]))
    ids = tok.encode("ok", add_special_tokens=False) + [eos]
    assert "".join(d.push(i) for i in ids) + d.flush() == "ok"


@settings(max_examples=150, deadline=None)
@given(st.lists(pieces, max_size=14), st.data())
def test_text_without_calls_reaches_the_client_exactly(parts, data):
    """Issue 34 item 8: whatever the chunking, text in which no tool call is found (a literal
    `<tool_call>` tag, broken JSON, whitespace around them) comes back exactly as sampled."""
    text = "".join(parts)
    out = _run_parser([text])
    if not any(isinstance(x, tuple) for x in out):
        assert "".join(out) == text
