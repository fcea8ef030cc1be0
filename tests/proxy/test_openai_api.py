"""Log-prob JSON of gyre/proxy/openai_api.py spliced from per-token fragments: on random token
tables (quotes, backslashes, control characters, invalid UTF-8, ids out of range) and random
log-probs (nan, +-inf, -0.0, ints) it is, byte for byte, what `json.dumps` writes of the entries
built as dicts (the reference below); a streamed chat frame is what `json.dumps` writes of its
own content; the alternatives are dropped once written (no full collection, collector.py)."""

import copy
import json
import math
from types import SimpleNamespace

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.models.bytetable import ByteTable
from gyre.backends.protocols import TokenEvent
from gyre.proxy import ProxyConfig
from gyre.proxy.openai_api import _lp_entries, _lp_json


def reference(table, hidden, k, events) -> list[dict]:
    """The entries as dicts (the builder the splice replaced)."""
    def entry(t, lp):
        b = table[t]
        return {"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b)}

    out = []
    for ev in events:
        if ev.token_id in hidden:
            continue
        e = entry(ev.token_id, ev.logprob)
        e["top_logprobs"] = [entry(t, lp) for t, lp in (ev.top or ())[:k]] if k else []
        out.append(e)
    return out


pieces = st.lists(st.one_of(st.binary(max_size=5), st.sampled_from([b'"', b"\\", b"\x00", b"\n\t", b"\xff\xfe", b"\xe2\x82",
                                                                    "€".encode(), b"\x7f", "\u2028".encode(), b"\\u0041"])),
                  min_size=1, max_size=12)
logprobs = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([-0.0, -math.inf, 0.0, -1e-300, -1e300]),
                     st.integers(-3, 0))


@st.composite
def calls(draw):
    table = ByteTable(draw(pieces), frozenset())
    ids = st.integers(-2, len(table) + 1)  # out of range reads b""
    k = draw(st.integers(0, 4))
    events = [TokenEvent(draw(ids), draw(logprobs), 0, None, draw(st.none() | st.lists(st.tuples(ids, logprobs), max_size=6)))
              for _ in range(draw(st.integers(0, 8)))]
    hidden = frozenset(draw(st.sets(ids, max_size=2)))
    charged = []
    proxy = SimpleNamespace(token_table=table, eos_ids=hidden, config=SimpleNamespace(body_values_per_call=8),
                            admission=SimpleNamespace(charge=lambda ex, units: charged.append(units)))
    call = SimpleNamespace(proxy=proxy, req=SimpleNamespace(top_logprobs=k), tokens=events, state=SimpleNamespace(execution_id="ex"))
    return call, charged


@settings(max_examples=100, deadline=None)
@given(calls(), st.data())
def test_spliced_log_prob_json_is_what_json_dumps_writes(c, data):
    call, charged = c
    p, k = call.proxy, call.req.top_logprobs
    want = reference(p.token_table, p.eos_ids, k, call.tokens)
    cut = data.draw(st.integers(0, len(call.tokens)))
    twin = copy.deepcopy(call.tokens)
    memo: dict = {}  # shared by both frames, as a stream's
    got = [_lp_json(call, 0, cut, memo), _lp_json(call, cut, len(call.tokens), memo)]
    n1 = sum(ev.token_id not in p.eos_ids for ev in call.tokens[:cut])
    assert got == [json.dumps(want[:n1], ensure_ascii=False), json.dumps(want[n1:], ensure_ascii=False)]
    assert all(ev.top is None for ev in call.tokens)  # written once, then let go
    assert sum(charged) == len(want) * (1 + k)  # ENTRY_VALUES (8) / body_values_per_call (8): one unit an entry
    call.tokens = twin
    assert json.dumps(_lp_entries(call, 0, len(twin))) == json.dumps(want)  # the dict form (non-streamed, Responses, legacy)


def test_a_streamed_frame_is_what_json_dumps_writes_of_it(make_server):
    """Each SSE frame of a streamed chat call with alternatives, re-parsed and dumped again,
    is the same bytes: the splice wrote JSON's own separators, escapes and numbers."""
    proxy, h = make_server([(DeterministicEngine("e", salt=4, eos_prob=0.0), "cell", 0)], ProxyConfig(calls_per_second_per_key=0))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "stream": True,
            "logprobs": True, "top_logprobs": 5, "stream_options": {"include_usage": True}}
    r = httpx.post(h.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {proxy.issue_key('ex-f')}"}, timeout=120)
    frames = [f[len("data: "):] for f in r.text.split("\n\n") if f.startswith("data: ") and f != "data: [DONE]"]
    parsed = [json.loads(f) for f in frames]
    assert frames == [json.dumps(d, ensure_ascii=False) for d in parsed]
    entries = [e for d in parsed if d["choices"] and d["choices"][0]["logprobs"] for e in d["choices"][0]["logprobs"]["content"]]
    assert len(entries) == 300 == parsed[-1]["usage"]["completion_tokens"]
    assert all(len(e["top_logprobs"]) == 5 for e in entries)
    assert [d["choices"][0]["finish_reason"] for d in parsed if d["choices"]][-1] == "length"
