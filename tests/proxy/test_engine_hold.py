"""Held tokens (`SamplingParams.hold_s`, `ProxyConfig.engine_hold_s`): a call that needs its text
only at the end gets its tokens from the engine's server in a few frames, not one per token, and
loses none of them, a drain included; the proxy asks for it only for such calls. A call that
streams or has stop strings is held only with `ProxyConfig.stream_interval_s`, and then streams
a chunk per frame, the same text, and stops at the same place."""

import asyncio
import time

import anthropic
import openai
import pytest

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.engines.engine_http import HttpEngine, serve_engine
from gyre.backends.protocols import SamplingParams
from gyre.proxy import MemorySink, ProxyConfig

PROMPT = [5, 6, 7, 8]


def _rows(events):
    return [(e.token_id, e.logprob, e.version, e.finish_reason) for e in events]


async def _timed(client, rid, sp):
    """(events, the monotonic time each reached us, the time we asked)."""
    t0, events, arrivals = time.monotonic(), [], []
    async for ev in client.generate(rid, PROMPT, sp):
        events.append(ev)
        arrivals.append(time.monotonic())
    return events, arrivals, t0


def _groups(arrivals, gap=0.005):
    """How many bursts the events came in (a new one after a gap of more than `gap` s)."""
    return 1 + sum(b - a > gap for a, b in zip(arrivals, arrivals[1:]))


@pytest.fixture
def remote():
    engine = DeterministicEngine("remote", salt=3, token_delay=0.02)
    handle = serve_engine(engine)
    try:
        yield engine, HttpEngine(handle.url, transport="ws")
    finally:
        handle.stop()


def test_held_tokens_come_at_the_end_and_the_first_at_once(remote):
    engine, client = remote
    n, delay = 12, engine.token_delay

    async def main():
        await client.start()
        ref = [ev async for ev in DeterministicEngine("ref", salt=3).generate("r", PROMPT, SamplingParams(max_tokens=n))]
        each, each_at, t0 = await _timed(client, "each", SamplingParams(max_tokens=n))
        held, held_at, t1 = await _timed(client, "held", SamplingParams(max_tokens=n, hold_s=30.0))
        await client.close()
        return ref, each, each_at, t0, held, held_at, t1

    ref, each, each_at, t0, held, held_at, t1 = asyncio.run(main())
    assert _rows(each) == _rows(held) == _rows(ref)  # the same tokens, however they travel
    # Without a hold the second token is here long before the last is made ...
    assert each_at[1] < t0 + n * delay / 2 and _groups(each_at) > n / 2
    # ... with one, the first still is (time to first token), the rest only once the last exists.
    assert held_at[0] < t1 + n * delay / 2
    assert min(held_at[1:]) >= t1 + n * delay and _groups(held_at) == 2


def test_a_held_stream_is_let_go_every_hold_s(remote):
    engine, client = remote
    n, hold = 40, 0.1  # 0.8 s of tokens: about 8 releases

    async def main():
        await client.start()
        got = await _timed(client, "r", SamplingParams(max_tokens=n, hold_s=hold))
        await client.close()
        return got

    events, arrivals, t0 = asyncio.run(main())
    assert len(events) == n and events[-1].finish_reason == "length"
    assert 3 <= _groups(arrivals) <= n / 3
    assert arrivals[1] < t0 + n * engine.token_delay - 0.2  # not all kept to the end


def test_abort_returns_the_held_tokens_too(remote):
    engine, client = remote

    async def main():
        await client.start()
        seen = []
        stream = client.generate("long", PROMPT, SamplingParams(max_tokens=500, hold_s=30.0))
        async for ev in stream:
            seen.append(ev)
            if len(seen) == 1:
                await asyncio.sleep(0.2)  # ~10 more made and held
                aborted = await client.abort("long")
        await stream.aclose()
        await client.close()
        return seen, aborted

    seen, aborted = asyncio.run(main())
    # What the stream delivered is a prefix of what the abort returned, and the abort returned
    # the held tokens as well: a router continuing the call from both loses and repeats nothing.
    assert len(aborted) > 5 and _rows(seen) == _rows(aborted[: len(seen)])


class _Unfinished(DeterministicEngine):
    """Ends its streams after 5 tokens, none of them marked as the last."""

    async def generate(self, request_id, input_ids, sampling):
        async for ev in super().generate(request_id, input_ids, sampling):
            if len(self._requests[request_id].generated) > 5:
                return
            yield ev


def test_a_stream_that_ends_unmarked_still_brings_its_held_tokens():
    handle = serve_engine(_Unfinished("u", salt=3, token_delay=0.01))
    try:
        client = HttpEngine(handle.url, transport="ws")

        async def main():
            await client.start()
            events = []
            with pytest.raises(ConnectionError, match="unfinished"):  # an unfinished end is a death to the router
                async for ev in client.generate("r", PROMPT, SamplingParams(max_tokens=50, hold_s=30.0)):
                    events.append(ev)
            await client.close()
            return events

        events = asyncio.run(main())
        assert len(events) == 5 and all(e.finish_reason is None for e in events)
    finally:
        handle.stop()


class _Recording(DeterministicEngine):
    """Keeps each request's `hold_s`, as the proxy asked."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.holds: list[float] = []

    async def generate(self, request_id, input_ids, sampling):
        self.holds.append(sampling.hold_s)
        async for ev in super().generate(request_id, input_ids, sampling):
            yield ev


@pytest.mark.parametrize("config, want, want_stream", [
    (ProxyConfig(engine_hold_s=0.7, stream_interval_s=0.0), 0.7, 0.0),
    (ProxyConfig(), 1.0, 0.05),  # the defaults
    (ProxyConfig(engine_hold_s=5.0, engine_progress_timeout_s=8.0, stream_interval_s=3.0), 2.0, 2.0),  # a quarter of the progress limit
    (ProxyConfig(engine_hold_s=5.0, engine_progress_timeout_s=0.0, stream_interval_s=0.0), 5.0, 0.0),  # no progress limit
])
def test_the_proxy_asks_to_hold_only_when_it_needs_the_text_at_the_end(make_server, config, want, want_stream):
    engine = _Recording("e", salt=1)
    proxy, h = make_server([(engine, "cell", 0)], config=config)
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-hold"), max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    c.chat.completions.create(model="m", messages=msgs, max_tokens=4)
    for _ in c.chat.completions.create(model="m", messages=msgs, max_tokens=4, stream=True):
        pass
    c.chat.completions.create(model="m", messages=msgs, max_tokens=4, stop=["zz"])  # caught in the text
    assert engine.holds == [want, want_stream, want_stream]


def _stream(api: str, url: str, key: str, **kw) -> list[str]:
    """The text chunks of one streamed call, through the official SDK."""
    if api == "openai":
        c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        return [ch.choices[0].delta.content for ch in c.chat.completions.create(stream=True, **kw)
                if ch.choices and ch.choices[0].delta.content]
    c = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
    return [ev.delta.text for ev in c.messages.create(stream=True, **kw)
            if ev.type == "content_block_delta" and ev.delta.type == "text_delta" and ev.delta.text]


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_a_held_stream_comes_a_chunk_per_frame_with_the_same_text_and_ids(make_server, api):
    handle = serve_engine(DeterministicEngine("remote", salt=3, token_delay=0.02))
    try:
        got = {}
        for interval in (0.0, 0.1):  # 40 tokens at 20 ms: ~8 frames when held
            sink = MemorySink()
            proxy, h = make_server([(HttpEngine(handle.url, transport="ws"), "cell", 0)], config=ProxyConfig(stream_interval_s=interval), sink=sink)
            key = proxy.issue_key(f"ex-{interval}")
            chunks = _stream(api, h.url, key, model="m", max_tokens=40, messages=[{"role": "user", "content": "go"}])
            (rec,) = sink.for_execution(f"ex-{interval}")
            got[interval] = chunks, list(rec.output_ids)
        (each, each_ids), (held, held_ids) = got[0.0], got[0.1]
        assert "".join(each) == "".join(held) and each_ids == held_ids and len(each_ids) == 40
        assert len(each) >= 20  # a chunk per token (those that end a character)
        assert len(held) * 3 <= len(each)
    finally:
        handle.stop()


def test_a_stop_string_is_caught_as_well_when_tokens_come_held(make_server):
    handle = serve_engine(DeterministicEngine("remote", salt=5, token_delay=0.01))
    try:
        msgs = [{"role": "user", "content": "go"}]
        proxy, h = make_server([(HttpEngine(handle.url, transport="ws"), "cell", 0)])
        c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-full"), max_retries=0)
        full = c.chat.completions.create(model="m", messages=msgs, max_tokens=60).choices[0].message.content
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        want = full[: full.index(stop)]
        got = {}
        for interval in (0.0, 0.2):
            sink = MemorySink()
            proxy, h = make_server([(HttpEngine(handle.url, transport="ws"), "cell", 0)], config=ProxyConfig(stream_interval_s=interval), sink=sink)
            c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-stop"), max_retries=0)
            r = c.chat.completions.create(model="m", messages=msgs, max_tokens=60, stop=[stop])
            (rec,) = sink.for_execution("ex-stop")
            got[interval] = r.choices[0].message.content, r.choices[0].finish_reason, list(rec.output_ids)
        assert got[0.0][:2] == got[0.2][:2] == (want, "stop")
        ids = got[0.2][2]  # recorded up to the token that completed the stop string, none past it
        assert ids == got[0.0][2]
        assert stop in proxy.tokenizer.decode(ids) and stop not in proxy.tokenizer.decode(ids[:-1])
    finally:
        handle.stop()
