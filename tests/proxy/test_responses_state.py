"""Stored Responses over a long execution (issue 34, items 4 and 5): forks that sampled the same
text with different ids continue from the fork `previous_response_id` names; items re-sent after
`previous_response_id` are taken once; the store is bounded (LRU), and an evicted parent is
OpenAI's 400 `previous_response_not_found`. Plus the `reordered` diagnosis of re-sent turns."""

import json
import tracemalloc

import openai
import pytest

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.models.tokenizer import byte_token_ids, load_tokenizer
from gyre.proxy import ProxyConfig
from gyre.proxy.state import ExecutionState
from gyre.proxy.render import ChatRenderer, StoredTurn, TurnStore, turn_fingerprint
from gyre.proxy.responses_api import _keep, store_of

TEXT = "same text"


class TwoSpellings(DeterministicEngine):
    """Answers TEXT every time, spelled alternately as byte ids and as the tokenizer's merges:
    the same text, different sampled ids (as two forks of a real policy can be)."""

    def __init__(self):
        tok = load_tokenizer()
        super().__init__("forks", script=lambda ids: TEXT, byte_ids=byte_token_ids(tok))
        self.merged = tok.encode(TEXT, add_special_tokens=False)
        self.n = 0

    def _scripted(self, input_ids, max_tokens):
        self.n += 1
        ids = self.merged if self.n % 2 == 0 else [self.byte_ids[b] for b in TEXT.encode()]
        return (list(ids) + [self.eos_token_id])[:max_tokens]


def _client(h, key):
    return openai.OpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0)


def test_a_fork_continues_with_the_ids_of_the_response_it_names(make_server):
    proxy, h = make_server([(TwoSpellings(), "cell", 0)])
    c = _client(h, proxy.issue_key("ex-forks"))
    root = c.responses.create(model="m", input="start", max_output_tokens=40)
    a = c.responses.create(model="m", previous_response_id=root.id, input="go on", max_output_tokens=40)
    b = c.responses.create(model="m", previous_response_id=root.id, input="go on", max_output_tokens=40)
    assert a.output_text == b.output_text == TEXT
    recs = proxy.sink.for_execution("ex-forks")
    assert recs[1].input_ids.tolist() == recs[2].input_ids.tolist()  # the same context...
    assert recs[1].output_ids.tolist() != recs[2].output_ids.tolist()  # ...two spellings of one text
    for fork, rec in ((a, recs[1]), (b, recs[2])):
        c.responses.create(model="m", previous_response_id=fork.id, input="next", max_output_tokens=40)
        cont = proxy.sink.records[-1]
        start, end = cont.payload_ref["spliced_spans"][-1]
        assert cont.input_ids[start:end].tolist() == rec.output_ids.tolist()
        assert cont.payload_ref["spliced_calls"][-1] == rec.call_id


def test_items_re_sent_after_previous_response_id_are_taken_once(make_server):
    proxy, h = make_server([(DeterministicEngine("e", eos_prob=0.2, salt=5), "cell", 0)])
    c = _client(h, proxy.issue_key("ex-twice"))
    first = c.responses.create(model="m", input=[{"role": "user", "content": "hi"}], max_output_tokens=20)
    c.responses.create(model="m", previous_response_id=first.id, input=[{"role": "user", "content": "next"}], max_output_tokens=20)
    proper = proxy.sink.records[-1]
    echoed = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "next"}]
    c.responses.create(model="m", previous_response_id=first.id, input=echoed, max_output_tokens=20)
    again = proxy.sink.records[-1]
    assert again.payload_ref["spliced_turns"] == 1
    assert again.input_ids.tolist() == proper.input_ids.tolist()


def test_a_looping_harness_holds_at_most_the_configured_bytes():
    """10,000 stored calls of ~6 KB each (60 MB, about sixty times what the bound holds) into one
    execution's store (the function the endpoint calls), bound 1 MiB: the store's own count, the
    JSON size of what it holds and the memory traced while it ran all stay within the bound (the
    last with slack for Python objects, a twentieth of what an unbounded store would grow by)."""
    n = 10_000  # issue 34: a harness making 10,000 calls in one execution
    bound = 1 << 20
    state = ExecutionState(execution_id="loop")
    store = store_of(state, bound)
    filler = "x" * 3000
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(n):
        msgs = [{"role": "user", "content": f"call {i} {filler}"}, {"role": "assistant", "content": filler, "_gyre_call_id": i}]
        _keep(store, f"resp_{i}", None, msgs, {"id": f"resp_{i}", "output": [{"type": "message", "text": "ok"}]})
    grown = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    held = sum(len(json.dumps(k.messages)) + len(json.dumps(k.body)) for k in store.items.values())
    assert store.nbytes == held <= bound
    assert 100 < len(store) < n and store.evicted == n - len(store)
    assert grown < 3 * bound, grown
    assert f"resp_{n - 1}" in store and "resp_0" not in store


def test_an_evicted_parent_is_previous_response_not_found(make_server):
    proxy, h = make_server([(DeterministicEngine("e", eos_prob=0.3, salt=9), "cell", 0)],
                           config=ProxyConfig(responses_store_bytes=8000))
    c = _client(h, proxy.issue_key("ex-evict"))
    ids = [c.responses.create(model="m", input=f"task {i} " + "y" * 1500, max_output_tokens=8).id for i in range(8)]
    store = proxy.executions["ex-evict"].responses
    assert store.nbytes <= 8000 and ids[-1] in store and ids[0] not in store
    c.responses.create(model="m", previous_response_id=ids[-1], input="more", max_output_tokens=8)  # a live parent works
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(model="m", previous_response_id=ids[0], input="more", max_output_tokens=8)
    e = err.value.body
    assert err.value.status_code == 400 and e["code"] == "previous_response_not_found" and e["param"] == "previous_response_id"
    assert f"Previous response with id '{ids[0]}' not found" in e["message"] and "responses_store_bytes" in e["message"]


def test_reordered_parallel_tool_calls_are_diagnosed_reordered():
    r = ChatRenderer(load_tokenizer())
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    calls = [{"name": "bash", "arguments": {"cmd": "ls"}}, {"name": "bash", "arguments": {"cmd": "pwd"}}]
    store = TurnStore()
    turn = StoredTurn.of(0, r.render(msgs, None, None).ids, [5, 6, 7], "Two at once.", calls)
    store.add(turn_fingerprint(turn.content, calls), turn)
    swapped = {"role": "assistant", "content": "Two at once.", "tool_calls": calls[::-1]}
    out = r.render(msgs + [swapped, {"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}], None, store)
    assert out.spliced == 0 and out.unmatched_kinds == ["reordered"]
