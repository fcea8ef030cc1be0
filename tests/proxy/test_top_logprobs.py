"""`top_logprobs` through the official `openai` SDK: chat (plain and streamed), legacy completions
(`logprobs: n`) and Responses (`top_logprobs`), checked against the engine's own alternatives;
the CPU engine behind the HTTP engine against a float64 log-softmax; and a call drained and
continued on another engine keeps its alternatives."""

import copy

import openai
import pytest
import torch

from gyre.backends.engines.cpu_engine import CpuEngine
from gyre.backends.engines.det_engine import DeterministicEngine, sequence_hash
from gyre.backends.engines.engine_http import HttpEngine, serve_engine
from gyre.backends.models.tokenizer import VOCAB_SIZE, load_tokenizer, token_bytes
from tests.backends.helpers import tiny_model

from .test_cpu_engine_proxy import DrainAfter

SALT = 5
TABLE = token_bytes(load_tokenizer())
HIDDEN = {0, 2}  # <|endoftext|>, <|im_end|> are not shown


def _text(t):
    return TABLE[t].decode("utf-8", "replace")


def expected_top(rec, k):
    """The deterministic engine's alternatives at each visible output position of a record."""
    eng = DeterministicEngine("ref", salt=SALT)
    seq, out = list(rec.input_ids), []
    for t, lp in zip(rec.output_ids.tolist(), rec.output_logprobs.tolist()):
        ev = eng.token_after(seq)
        assert ev.token_id == t
        if t not in HIDDEN:
            out.append([(_text(a), b) for a, b in eng.top_tokens(sequence_hash(seq, SALT), ev, k)])
        seq.append(t)
    return out


@pytest.fixture
def served(make_server):
    return make_server([(DeterministicEngine("e", salt=SALT, eos_prob=0.05), "cell", 0)])


def _pairs(entries):
    return [[(t.token, t.logprob) for t in e.top_logprobs] for e in entries]


def test_chat_returns_the_engines_alternatives_plain_and_streamed(served):
    proxy, h = served
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-top"), max_retries=0)
    msgs = [{"role": "user", "content": "hello"}]
    r = c.chat.completions.create(model="m", messages=msgs, max_tokens=20, logprobs=True, top_logprobs=3)
    rec = proxy.sink.records[-1]
    want = expected_top(rec, 3)
    got = r.choices[0].logprobs.content
    assert len(got) == len(want) and all(len(e.top_logprobs) == 3 for e in got)
    assert _pairs(got) == [[(t, pytest.approx(v)) for t, v in w] for w in want]
    for e in got:  # the sampled token is among them (the engine always ranks it), bytes included
        assert (e.token, e.logprob) in [(t.token, t.logprob) for t in e.top_logprobs]
        assert all(bytes(t.bytes).decode("utf-8", "replace") == t.token for t in e.top_logprobs)
    stream = c.chat.completions.create(model="m", messages=msgs, max_tokens=20, logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for ch in stream if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert _pairs(streamed) == _pairs(got)


def test_completions_logprobs_n_and_responses_top_logprobs(served):
    proxy, h = served
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-top2"), max_retries=0)
    lp = c.completions.create(model="m", prompt="def f(x):", max_tokens=10, logprobs=2).choices[0].logprobs
    want = expected_top(proxy.sink.records[-1], 2)
    assert len(lp.top_logprobs) == len(lp.tokens) == len(want)
    for tok, tok_lp, top, w in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, want):
        assert top == {t: pytest.approx(v) for t, v in dict(reversed(w + [(tok, tok_lp)])).items()}  # up to n+1: the sampled one too
        assert list(top.values()) == sorted(top.values(), reverse=True)

    r = c.responses.create(model="m", input="hello", max_output_tokens=12, top_logprobs=4)
    part = r.output[0].content[0]
    want = expected_top(proxy.sink.records[-1], 4)
    assert [[(t.token, t.logprob) for t in e.top_logprobs] for e in part.logprobs] == [[(t, pytest.approx(v)) for t, v in w] for w in want]


def test_cpu_engine_over_http_returns_its_log_softmax_top_k(make_server):
    model = tiny_model(seed=0, vocab=VOCAB_SIZE)
    eng = CpuEngine.from_model(model)
    handle = serve_engine(eng)
    try:
        handle.call(eng.start())
        proxy, h = make_server([(HttpEngine(handle.url, "cpu-http"), "cell", 0)])
        c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-cpu-top"), max_retries=0)
        r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Count."}], max_tokens=6,
                                      temperature=0, logprobs=True, top_logprobs=5)
        rec = proxy.sink.records[-1]
        m = copy.deepcopy(model).double().eval()
        with torch.no_grad():
            ref = torch.log_softmax(m(input_ids=torch.tensor([rec.input_ids.tolist() + rec.output_ids.tolist()])).logits[0], -1)
        entries = iter(r.choices[0].logprobs.content)
        n_in = len(rec.input_ids)
        for i, t in enumerate(rec.output_ids.tolist()):
            if t in HIDDEN:
                continue
            e = next(entries)
            want = torch.topk(ref[n_in - 1 + i], 5)
            assert [x.token for x in e.top_logprobs] == [_text(j) for j in want.indices.tolist()]
            assert [x.logprob for x in e.top_logprobs] == pytest.approx(want.values.tolist(), abs=2e-5)
            assert e.top_logprobs[0].token == e.token  # greedy
    finally:
        handle.call(eng.stop())
        handle.stop()


def test_a_drained_and_continued_call_keeps_its_alternatives(make_server):
    proxy, h = make_server()
    a = DrainAfter(DeterministicEngine("det-a", salt=SALT, token_delay=0.003), "det-a", proxy.router, k=4)
    b = DeterministicEngine("det-b", salt=SALT)

    async def setup():
        proxy.router.add_engine(a, kind="cell", index=1)
        proxy.router.add_engine(b, kind="pool", index=0)
        proxy.router.slots["det-b"].served = 10**6  # first pick: A

    h.call(setup())
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-drain"), max_retries=0)
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=16, logprobs=True, top_logprobs=3)
    rec = proxy.sink.records[-1]
    assert a.fired and rec.payload_ref["engines"] == ["det-a", "det-b"]
    assert _pairs(r.choices[0].logprobs.content) == [[(t, pytest.approx(v)) for t, v in w] for w in expected_top(rec, 3)]
