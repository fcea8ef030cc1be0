"""Drain mid-generation through the whole stack: SDK client -> proxy -> engines over HTTP.

Engine A is drained while the client is reading a long stream; the call continues on B from A's
tokens. The client must get one complete, well-formed response; the record is one call whose
output is A's tokens followed by B's continuation of them, with one log-prob per token.
"""

import threading
import time

import anthropic
import numpy as np
import openai
import pytest

from gyre.backends.models.tokenizer import load_tokenizer
from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.engines.engine_http import HttpEngine, serve_engine

from .conftest import reference_tokens

MAX = 150


def _split_point(out, prompt, salt_a, salt_b):
    ref_a = reference_tokens(salt_a, prompt, len(out))
    k = 0
    while k < len(out) and out[k] == ref_a[k].token_id:
        k += 1
    ref_b = reference_tokens(salt_b, prompt + out[:k], len(out) - k)
    return k, [e.token_id for e in ref_b], [e.logprob for e in ref_a[:k]] + [e.logprob for e in ref_b]


def _setup(make_server, transport="ws"):
    a = DeterministicEngine("A", salt=1, token_delay=0.004)
    b = DeterministicEngine("B", salt=2, token_delay=0.001)
    ha, hb = serve_engine(a), serve_engine(b)
    proxy, h = make_server([(HttpEngine(ha.url, name="A", transport=transport), "cell", 1)])
    proxy.test_transport = transport
    return a, b, ha, hb, proxy, h


async def _add(proxy, url):
    proxy.router.add_engine(HttpEngine(url, name="B", transport=proxy.test_transport), kind="pool", index=0)


@pytest.mark.parametrize("transport", ["ws", "http"])
def test_openai_stream_survives_drain(make_server, transport):
    a, b, ha, hb, proxy, h = _setup(make_server, transport)
    try:
        key = proxy.issue_key("ex-reroute")
        c = openai.OpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0)
        stream = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "write a lot"}], max_tokens=MAX, stream=True, logprobs=True, stream_options={"include_usage": True})
        text, finishes, lps, usage, n = "", [], [], None, 0
        for ch in stream:
            n += 1
            # Mid-generation: the scheduler takes A out of rollout. Over "ws" the stream comes a
            # chunk per held frame (`stream_interval_s`, ~12 tokens here), over "http" per token.
            if n == 4:
                h.call(_add(proxy, hb.url))
                assert h.call(proxy.router.drain("A")) == 1
            if ch.usage:
                usage = ch.usage
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                if ch.choices[0].finish_reason:
                    finishes.append(ch.choices[0].finish_reason)
                if ch.choices[0].logprobs and ch.choices[0].logprobs.content:
                    lps += [e.logprob for e in ch.choices[0].logprobs.content]
        (rec,) = proxy.sink.for_execution("ex-reroute")
        out = rec.output_ids.tolist()
        assert finishes == ["length"] and usage.completion_tokens == MAX == len(out) == len(rec.output_logprobs)
        assert text == load_tokenizer().decode(out)
        assert rec.payload_ref["engines"] == ["A", "B"] and rec.payload_ref["reroutes"] == 1
        k, b_cont, ref_lps = _split_point(out, rec.input_ids.tolist(), 1, 2)
        assert 0 < k < MAX and out[k:] == b_cont
        assert rec.output_logprobs.tolist() == np.asarray(ref_lps, dtype=np.float32).tolist()
        assert len(lps) == MAX
        assert proxy.execution_stats("ex-reroute").aborted_calls == 0
        assert proxy.router.reroutes == 1 and a.load() == 0 and b.load() == 0
    finally:
        ha.stop()
        hb.stop()


def test_anthropic_non_streaming_call_survives_drain(make_server):
    a, b, ha, hb, proxy, h = _setup(make_server)
    try:
        key = proxy.issue_key("ex-reroute-2")
        cl = anthropic.Anthropic(base_url=h.url, api_key=key, max_retries=0)
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("m", cl.messages.create(model="m", max_tokens=MAX, messages=[{"role": "user", "content": "go"}])))
        t.start()
        while a.load() == 0:
            time.sleep(0.005)
        time.sleep(0.1)
        h.call(_add(proxy, hb.url))
        assert h.call(proxy.router.drain("A")) == 1
        t.join(30)
        msg = box["m"]
        (rec,) = proxy.sink.for_execution("ex-reroute-2")
        out = rec.output_ids.tolist()
        assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == MAX == len(out)
        assert msg.content[0].text == load_tokenizer().decode(out)
        k, b_cont, _ = _split_point(out, rec.input_ids.tolist(), 1, 2)
        assert 0 < k < MAX and out[k:] == b_cont
    finally:
        ha.stop()
        hb.stop()
