"""What the client is told (issue 34, item 8): an engine that ends a call early gives the client
an error, never `stop` / `end_turn`, as the record says `error`; a call in flight when its
execution is closed gets an error body or event, not a cut connection (gyre/proxy/endings.py)."""

import threading
import time

import anthropic
import httpx
import openai
import pytest

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.protocols import TokenEvent

MSG = [{"role": "user", "content": "hi"}]


class EarlyEnd(DeterministicEngine):
    """Ends its stream after 3 tokens with no finish reason (a crashed or buggy engine)."""

    async def generate(self, request_id, input_ids, sampling):
        for i in range(3):
            yield TokenEvent(token_id=100 + i, logprob=-1.0, version=0)


def test_an_early_engine_end_is_an_error_in_every_api(make_server):
    proxy, h = make_server([(EarlyEnd("e"), "cell", 0)])
    key = proxy.issue_key("ex-early")
    oa = openai.OpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0)
    an = anthropic.Anthropic(base_url=h.url, api_key=key, max_retries=0)
    with pytest.raises(openai.InternalServerError, match="ended this call early"):
        oa.chat.completions.create(model="m", messages=MSG, max_tokens=50)
    with pytest.raises(openai.APIError, match="ended this call early"):
        for ch in oa.chat.completions.create(model="m", messages=MSG, max_tokens=50, stream=True):
            assert not (ch.choices and ch.choices[0].finish_reason), ch  # never a finish reason
    with pytest.raises(anthropic.InternalServerError, match="ended this call early"):
        an.messages.create(model="m", messages=MSG, max_tokens=50)
    with pytest.raises(anthropic.APIStatusError, match="ended this call early"):
        with an.messages.stream(model="m", messages=MSG, max_tokens=50) as s:
            for ev in s:
                assert ev.type != "message_delta", ev  # no stop_reason is ever sent
    with pytest.raises(openai.InternalServerError, match="ended this call early"):
        oa.responses.create(model="m", input="hi", max_output_tokens=50)
    r = httpx.post(h.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 50}, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 500 and "ended this call early" in r.json()["error"]["message"]
    recs = proxy.sink.for_execution("ex-early")
    assert len(recs) == 6 and all(r.finish_reason == "error" and len(r.output_ids) == 3 for r in recs)


@pytest.mark.parametrize("api,how", [("anthropic", "close"), ("openai", "close"), ("openai", "aclose")])
def test_closing_an_execution_tells_its_streaming_clients(make_server, api, how):
    eng = DeterministicEngine("slow", token_delay=0.01)
    proxy, h = make_server([(eng, "cell", 0)])
    key = proxy.issue_key("ex-close")
    seen: list = []

    def run():
        try:
            if api == "anthropic":
                an = anthropic.Anthropic(base_url=h.url, api_key=key, max_retries=0)
                with an.messages.stream(model="m", messages=MSG, max_tokens=3000) as s:
                    for ev in s:
                        seen.append(ev)
            else:
                oa = openai.OpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0)
                for ch in oa.chat.completions.create(model="m", messages=MSG, max_tokens=3000, stream=True):
                    seen.append(ch)
        except Exception as e:
            seen.append(e)

    t = threading.Thread(target=run)
    t.start()
    end = time.time() + 10
    while len(seen) < 5 and time.time() < end:
        time.sleep(0.02)
    assert len(seen) >= 5, seen
    if how == "close":
        h.call_fn(proxy.close_execution, "ex-close")
    else:  # the admin DELETE's path: waits, then aborts (and records) the call
        h.call(proxy.aclose_execution("ex-close", wait_s=0.05))
        assert [r.finish_reason for r in proxy.sink.for_execution("ex-close")] == ["abort"]
    t.join(10)
    err = seen[-1]
    assert isinstance(err, (anthropic.APIStatusError, openai.APIError)), repr(err)  # not a cut connection
    assert not isinstance(err, (anthropic.APIConnectionError, openai.APIConnectionError)), repr(err)
    assert "execution was closed" in str(err)
