"""Auth and bad input: each a 4xx with the API's own error body; the server keeps serving."""

import json

import anthropic
import httpx
import openai
import pytest

from gyre.proxy import ProxyConfig
from gyre.backends.engines.det_engine import DeterministicEngine

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
MSG = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def srv(make_server):
    proxy, h = make_server([(DeterministicEngine("e", eos_prob=0.2), "cell", 0)], config=ProxyConfig(max_context_tokens=300, max_body_bytes=64 * 1024))
    return proxy, h, proxy.issue_key("ex-a"), proxy.issue_key("ex-b")


def _oa_err(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def _an_err(r, status, kind):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]


def test_auth(srv):
    proxy, h, ka, kb = srv
    with httpx.Client(base_url=h.url) as c:
        _oa_err(c.post("/v1/chat/completions", json=CHAT), 401)
        _an_err(c.post("/v1/messages", json=MSG), 401, "authentication_error")
        _oa_err(c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer nope"}), 401)
        _an_err(c.post("/v1/messages", json=MSG, headers={"x-api-key": "nope"}), 401, "authentication_error")
        _oa_err(c.get("/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=h.url + "/v1", api_key="wrong", max_retries=0).chat.completions.create(**CHAT)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=h.url, api_key="wrong", max_retries=0).messages.create(**MSG)
    # revoked keys stop working
    k = proxy.issue_key("ex-c")
    oc = openai.OpenAI(base_url=h.url + "/v1", api_key=k, max_retries=0)
    oc.chat.completions.create(**CHAT)
    h.call(_revoke(proxy, "ex-c"))
    with pytest.raises(openai.AuthenticationError):
        oc.chat.completions.create(**CHAT)


async def _revoke(proxy, eid):
    proxy.revoke_execution(eid)


def test_one_execution_cannot_write_into_another(srv):
    proxy, h, ka, kb = srv
    a = openai.OpenAI(base_url=h.url + "/v1", api_key=ka, max_retries=0)
    b = openai.OpenAI(base_url=h.url + "/v1", api_key=kb, max_retries=0)
    r = a.chat.completions.create(**CHAT)
    history = CHAT["messages"] + [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "more"}]
    b.chat.completions.create(model="m", messages=history, max_tokens=4)
    ra = proxy.sink.for_execution("ex-a")
    rb = proxy.sink.for_execution("ex-b")
    assert len(ra) == 1 and len(rb) == 1
    # B's request carried A's turn: never spliced from A's state, counted unmatched for B
    assert rb[0].payload_ref["spliced_turns"] == 0 and rb[0].payload_ref["unmatched_turns"] == 1
    assert proxy.execution_stats("ex-a").calls == 1
    # the same history from A splices its own turn
    a.chat.completions.create(model="m", messages=history, max_tokens=4)
    assert proxy.sink.for_execution("ex-a")[1].payload_ref["spliced_turns"] == 1


def test_bad_inputs_openai(srv):
    proxy, h, ka, kb = srv
    auth = {"Authorization": f"Bearer {ka}"}
    with httpx.Client(base_url=h.url, headers=auth) as c:
        _oa_err(c.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"}), 400)
        _oa_err(c.post("/v1/chat/completions", json=[1, 2]), 400)
        _oa_err(c.post("/v1/chat/completions", json={**CHAT, "temperature": "hot"}), 400, "temperature")
        _oa_err(c.post("/v1/chat/completions", json={**CHAT, "max_tokens": -1}), 400, "max_tokens")
        _oa_err(c.post("/v1/chat/completions", json={**CHAT, "messages": "hi"}), 400, "messages")
        _oa_err(c.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "wizard", "content": "x"}]}), 400, "messages[0].role")
        _oa_err(c.post("/v1/chat/completions", json={**CHAT, "stream": "yes"}), 400, "stream")
        _oa_err(c.post("/v1/chat/completions", json={**CHAT, "tools": [{"type": "function"}]}), 400, "tools[0].function")
        _oa_err(c.post("/v1/chat/completions", json={**CHAT, "n": 2}), 400, "n")
        err = _oa_err(c.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "word " * 400}]}), 400)
        assert err["code"] == "context_length_exceeded"
        _oa_err(c.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "x" * 70000}]}), 413)
        _oa_err(c.post("/v1/completions", json={"model": "m", "prompt": [1, 99999]}), 400, "prompt")
        _oa_err(c.post("/v1/nothing", json={}), 404)
        # unknown fields are ignored; the server still serves
        assert c.post("/v1/chat/completions", json={**CHAT, "reasoning_effort": "low"}).status_code == 200


def test_bad_inputs_anthropic(srv):
    proxy, h, ka, kb = srv
    with httpx.Client(base_url=h.url, headers={"x-api-key": ka}) as c:
        _an_err(c.post("/v1/messages", content=b"\xff\xfe", headers={"Content-Type": "application/json"}), 400, "invalid_request_error")
        err = _an_err(c.post("/v1/messages", json={k: v for k, v in MSG.items() if k != "max_tokens"}), 400, "invalid_request_error")
        assert "max_tokens" in err["message"]
        _an_err(c.post("/v1/messages", json={**MSG, "max_tokens": "ten"}), 400, "invalid_request_error")
        _an_err(c.post("/v1/messages", json={**MSG, "messages": [{"role": "moderator", "content": "x"}]}), 400, "invalid_request_error")
        _an_err(c.post("/v1/messages", json={**MSG, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}), 400, "invalid_request_error")
        _an_err(c.post("/v1/messages", json={**MSG, "stop_sequences": "END"}), 400, "invalid_request_error")
        _an_err(c.post("/v1/messages", json={**MSG, "messages": [{"role": "user", "content": "word " * 400}]}), 400, "invalid_request_error")
        _an_err(c.post("/v1/messages", json={**MSG, "system": "y" * 70000}), 413, "request_too_large")
        _an_err(c.post("/v1/messages/nothing", json={}), 404, "not_found_error")
        assert c.post("/v1/messages", json=MSG).status_code == 200
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic.Anthropic(base_url=h.url, api_key=ka, max_retries=0).messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "word " * 400}])
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_client_disconnect_mid_stream_frees_engine_and_records_abort(make_server):
    slow = DeterministicEngine("slow", token_delay=0.01)
    proxy, h = make_server([(slow, "cell", 0)])
    key = proxy.issue_key("ex-gone")
    with httpx.Client(base_url=h.url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 500, "stream": True}) as r:
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data: ")
                if got == 5:
                    break
    import time

    for _ in range(300):
        if proxy.execution_stats("ex-gone").calls == 1 and slow.load() == 0:
            break
        time.sleep(0.01)
    (rec,) = proxy.sink.for_execution("ex-gone")
    assert rec.finish_reason == "abort" and 4 <= len(rec.output_ids) < 500
    assert proxy.execution_stats("ex-gone").aborted_calls == 1 and slow.load() == 0
    # the aborted turn is not offered for splicing (the client never saw it whole)
    assert not proxy.executions["ex-gone"].turns


class _Picky(DeterministicEngine):
    async def generate(self, request_id, input_ids, sampling):
        if len(input_ids) > 25:
            raise ValueError(f"prompt of {len(input_ids)} tokens is over this engine's limit")
        async for ev in super().generate(request_id, input_ids, sampling):
            yield ev


def test_engine_rejection_is_a_400_not_a_reroute_storm(make_server):
    proxy, h = make_server([(_Picky("picky"), "cell", 0), (_Picky("picky2"), "pool", 0)])
    key = proxy.issue_key("ex-picky")
    with httpx.Client(base_url=h.url, headers={"Authorization": f"Bearer {key}"}) as c:
        err = _oa_err(c.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "long " * 20}]}), 400)
        assert "limit" in err["message"]
    assert proxy.router.reroutes == 0 and proxy.router.engine_failures == 0
