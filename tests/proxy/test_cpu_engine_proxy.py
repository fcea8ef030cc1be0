"""The proxy in front of the real built-in CPU engine: a greedy call drained mid-generation and
continued on a second engine gives exactly the tokens of an uninterrupted greedy call."""

import asyncio

import numpy as np
import openai

from gyre.backends.engines.cpu_engine import CpuEngine
from gyre.backends.models.tokenizer import VOCAB_SIZE
from tests.backends.helpers import tiny_model


class DrainAfter:
    """Delegates to an engine; after `k` tokens of its first request it asks the router to drain it
    (what the scheduler does when the cell leaves rollout), deterministically mid-stream."""

    def __init__(self, engine, name, router, k):
        self.inner, self.name, self.router, self.k = engine, name, router, k
        self.fired = False
        self.task = None

    def generate(self, request_id, input_ids, sampling):
        return self._gen(request_id, input_ids, sampling)

    async def _gen(self, request_id, input_ids, sampling):
        n = 0
        async for ev in self.inner.generate(request_id, input_ids, sampling):
            yield ev
            n += 1
            if n == self.k and not self.fired:
                self.fired = True
                self.task = asyncio.get_running_loop().create_task(self.router.drain(self.name))

    def __getattr__(self, item):
        return getattr(self.inner, item)


def test_greedy_call_rerouted_between_cpu_engines_matches_uninterrupted(make_server):
    model = tiny_model(seed=0, vocab=VOCAB_SIZE)
    proxy, h = make_server()
    a = DrainAfter(CpuEngine.from_model(model), "cpu-a", proxy.router, k=6)
    b = CpuEngine.from_model(model)
    b.name = "cpu-b"

    async def setup():
        await a.inner.start()
        await b.start()
        proxy.router.add_engine(a, kind="cell", index=1)
        proxy.router.add_engine(b, kind="pool", index=0)
        proxy.router.slots["cpu-b"].served = 10**6  # first pick: A (least served among idle)

    h.call(setup())
    key = proxy.issue_key("ex-cpu")
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0)
    msgs = [{"role": "user", "content": "Count to ten."}]
    text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(model="m", messages=msgs, max_tokens=24, temperature=0, stream=True) if ch.choices)
    rerouted = proxy.sink.records[-1]
    assert a.fired and h.call(_result(a.task)) == 1
    assert rerouted.payload_ref["engines"] == ["cpu-a", "cpu-b"]
    # the same call again, uninterrupted on B alone
    again = c.chat.completions.create(model="m", messages=msgs, max_tokens=24, temperature=0)
    plain = proxy.sink.records[-1]
    assert plain.payload_ref["engines"] == ["cpu-b"]
    assert rerouted.input_ids.tolist() == plain.input_ids.tolist()
    assert rerouted.output_ids.tolist() == plain.output_ids.tolist()
    assert len(rerouted.output_logprobs) == len(rerouted.output_ids) > 6
    np.testing.assert_allclose(rerouted.output_logprobs, plain.output_logprobs, atol=1e-4)
    assert text == again.choices[0].message.content


async def _result(task):
    return await task


def test_min_tokens_through_the_openai_sdk(make_server):
    """`min_tokens` (the SGLang/vLLM extension, sent as extra_body) reaches the engine: with EOS
    set to the greedy first token, a plain greedy call ends after one token, a call with
    min_tokens 10 does not end before 11; a negative value is a 400 naming the field."""
    model = tiny_model(seed=0, vocab=VOCAB_SIZE)
    proxy, h = make_server()
    probe = CpuEngine.from_model(model)
    probe.name = "probe"
    h.call(probe.start())
    proxy.router.add_engine(probe, kind="cell", index=0)
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-min"), max_retries=0)
    msgs = [{"role": "user", "content": "Say something."}]
    c.chat.completions.create(model="m", messages=msgs, max_tokens=1, temperature=0)
    first = int(proxy.sink.records[-1].output_ids[0])
    proxy.eos_ids = frozenset(proxy.eos_ids | {first})  # the proxy sends its EOS ids as stop ids
    plain = c.chat.completions.create(model="m", messages=msgs, max_tokens=30, temperature=0)
    held = c.chat.completions.create(model="m", messages=msgs, max_tokens=30, temperature=0, extra_body={"min_tokens": 10})
    assert plain.usage.completion_tokens == 1 and plain.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens > 10
    assert first not in [int(t) for t in proxy.sink.records[-1].output_ids[:10]]
    try:
        c.chat.completions.create(model="m", messages=msgs, max_tokens=5, extra_body={"min_tokens": -1})
        raise AssertionError("min_tokens -1 was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and "min_tokens" in str(e)
