"""Splice diagnostics and `proxy.splice = tolerant` (gyre/proxy/render.py): hand-built re-sent
histories for each harness pattern (text dropped from a turn with tool calls, text and tool calls
split into two messages, edited text). Exact mode counts them unmatched, warns once per execution
naming the pattern, and reports them in the execution's stats and `worst_unmatched`; tolerant
mode splices the first two so the recorded prompt holds exactly the originally sampled ids."""

import json
import logging

import openai
import pytest

from gyre.proxy import ProxyConfig
from gyre.proxy.render import ChatRenderer, StoredTurn, TurnStore, turn_fingerprint

from .conftest import TOOL_ARGS, TOOLS_OPENAI, scripted_engine
from .test_render import _spell

SYSTEM = {"role": "system", "content": "You are an agent."}
USER = {"role": "user", "content": "start"}


def _call(k, tcid):
    return {"id": tcid, "type": "function", "function": {"name": "bash", "arguments": json.dumps(TOOL_ARGS[k])}}


def _resend(pattern, k, text):
    """Assistant turn k (text + one tool call) as a harness with `pattern` re-sends it, + its result."""
    tcid = f"call_{k}"
    if pattern == "text_dropped":
        turn = [{"role": "assistant", "content": None, "tool_calls": [_call(k, tcid)]}]
    elif pattern == "split":
        turn = [{"role": "assistant", "content": text}, {"role": "assistant", "content": None, "tool_calls": [_call(k, tcid)]}]
    elif pattern == "edited":
        turn = [{"role": "assistant", "content": "I'll look around first.", "tool_calls": [_call(k, tcid)]}]
    else:
        turn = [{"role": "assistant", "content": text, "tool_calls": [_call(k, tcid)]}]
    return turn + [{"role": "tool", "tool_call_id": tcid, "content": f"output {k}"}]


def _episode(make_server, splice, pattern):
    """Three calls: two tool-call turns re-sent with `pattern`, then the answer."""
    proxy, h = make_server([(scripted_engine(), "cell", 0)], config=ProxyConfig(splice=splice))
    key = proxy.issue_key("ex")
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0)
    msgs = [SYSTEM, USER]
    for k in range(3):
        r = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS_OPENAI, max_tokens=200)
        if k < 2:
            msgs = msgs + _resend(pattern, k, r.choices[0].message.content)
    return proxy, proxy.sink.records


def _chained(records):
    """Record k+1's prompt starts with record k's prompt and sampled ids, token for token."""
    return [list(b.input_ids[: len(a.input_ids) + len(a.output_ids)]) == list(a.input_ids) + list(a.output_ids)
            for a, b in zip(records, records[1:])]


@pytest.mark.parametrize("pattern", ["text_dropped", "split"])
def test_exact_counts_and_warns_tolerant_splices_the_sampled_ids(make_server, caplog, pattern):
    per_turn = 2 if pattern == "split" else 1  # messages a re-sent turn became
    with caplog.at_level(logging.WARNING, logger="gyre.proxy.core"):
        proxy, recs = _episode(make_server, "exact", pattern)
    assert [r.payload_ref["unmatched_turns"] for r in recs] == [0, per_turn, 2 * per_turn]
    assert recs[2].payload_ref["unmatched_kinds"] == [pattern] * (2 * per_turn)
    assert _chained(recs) == [False, False]  # the sampled ids are lost: the trajectory branches
    warned = [m for m in caplog.messages if "match no turn the policy sampled" in m]
    assert len(warned) == 1 and "execution ex" in warned[0] and "--proxy.splice tolerant" in warned[0]
    assert {"split": "separate messages", "text_dropped": "drops the assistant's text"}[pattern] in warned[0]
    stats = proxy.close_execution("ex")
    assert stats.unmatched_turns == 3 * per_turn and stats.unmatched_kinds == {pattern: 3 * per_turn}
    assert proxy.worst_unmatched() == [{"execution_id": "ex", "unmatched_turns": 3 * per_turn, "calls": 3,
                                        "unmatched_kinds": {pattern: 3 * per_turn}}]

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gyre.proxy.core"):
        proxy, recs = _episode(make_server, "tolerant", pattern)
    assert [r.payload_ref["unmatched_turns"] for r in recs] == [0, 0, 0]
    assert [r.payload_ref["tolerated_turns"] for r in recs] == [0, 1, 2]
    assert _chained(recs) == [True, True]  # prompts hold exactly the originally sampled ids
    for k in (1, 2):
        s, e = recs[2].payload_ref["spliced_spans"][k - 1]
        assert recs[2].input_ids[s:e].tolist() == recs[k - 1].output_ids.tolist()
    assert not [m for m in caplog.messages if "match no turn" in m]
    assert proxy.close_execution("ex").tolerated_turns == 3 and proxy.worst_unmatched() == []


@pytest.mark.parametrize("splice", ["exact", "tolerant"])
def test_edited_text_stays_unmatched_in_both_modes(make_server, caplog, splice):
    with caplog.at_level(logging.WARNING, logger="gyre.proxy.core"):
        proxy, recs = _episode(make_server, splice, "edited")
    assert recs[2].payload_ref["unmatched_kinds"] == ["edited", "edited"] and recs[2].payload_ref["tolerated_turns"] == 0
    assert _chained(recs) == [False, False]
    (warned,) = [m for m in caplog.messages if "match no turn" in m]
    assert "edits the text" in warned and "--proxy.splice tolerant" not in warned


def test_whole_turns_still_splice_and_count_nothing(make_server):
    proxy, recs = _episode(make_server, "exact", "whole")
    assert _chained(recs) == [True, True] and all(r.payload_ref["unmatched_turns"] == 0 for r in recs)


def test_tolerant_never_guesses_between_samples_with_the_same_tool_calls():
    """Two stored turns with the same tool call and different text: a dropped-text re-send is
    spliced only with the one sampled in exactly this context; otherwise it stays text."""
    r = ChatRenderer(__import__("gyre.backends.models.tokenizer", fromlist=["x"]).load_tokenizer(), splice="tolerant")
    tok = r.tokenizer
    calls = [{"name": "bash", "arguments": {"cmd": "pytest"}}]
    call_text = '\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "pytest"}}\n</tool_call>'
    msgs = [SYSTEM, USER]
    p0 = r.render(msgs, None, None).ids
    store = TurnStore()
    a = StoredTurn.of(0, p0, _spell("Run the tests." + call_text, tok), "Run the tests.", calls)
    b = StoredTurn.of(1, [7] * 5, _spell("Again." + call_text, tok), "Again.", calls)
    store.add(turn_fingerprint(a.content, calls), a)
    store.add(turn_fingerprint(b.content, calls), b)
    dropped = [{"role": "assistant", "content": "", "tool_calls": calls}, {"role": "tool", "content": "ok"}]
    out = r.render(msgs + dropped, None, store)
    assert out.spliced_calls == [0] and out.tolerated == 1 and out.unmatched == 0
    assert list(out.ids[: len(p0) + len(a.output_ids)]) == list(p0) + list(a.output_ids)
    other = [{"role": "user", "content": "elsewhere"}] + dropped  # context of neither
    out = r.render([SYSTEM] + other, None, store)
    assert out.spliced == 0 and out.unmatched_kinds == ["text_dropped"]
    assert ChatRenderer(tok).render(msgs + dropped, None, store).unmatched_kinds == ["text_dropped"]  # exact mode


def test_metrics_row_and_summary_carry_unmatched_turns(make_server):
    """The controller's per-step `unmatched_turns` is the sum over executions closed since the last
    row (GyreProxyAccess.take_unmatched over its totals); summary.json lists the worst executions
    (Proxy.worst_unmatched)."""
    from gyre.runtime.proxy_access import GyreProxyAccess

    proxy, h = make_server([(scripted_engine(), "cell", 0)], config=ProxyConfig(splice="exact"))
    access = GyreProxyAccess(proxy, h.url)
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=access.open_execution("ex-a", "g"), max_retries=0)
    r = c.chat.completions.create(model="m", messages=[SYSTEM, USER], tools=TOOLS_OPENAI, max_tokens=200)
    c.chat.completions.create(model="m", messages=[SYSTEM, USER] + _resend("split", 0, r.choices[0].message.content), tools=TOOLS_OPENAI, max_tokens=200)
    assert access.take_unmatched() == 0  # not closed yet
    access.close_execution("ex-a")
    access.close_execution("ex-empty")
    assert access.take_unmatched() == 2 and access.take_unmatched() == 0
    assert access.totals["tolerated_turns"] == 0
    assert [w["execution_id"] for w in proxy.worst_unmatched(10)] == ["ex-a"]
