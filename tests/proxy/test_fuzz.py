"""Fuzzed request bodies never make the proxy answer 5xx (and it keeps serving)."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.proxy import ProxyConfig
from gyre.backends.engines.det_engine import DeterministicEngine

scalars = st.none() | st.booleans() | st.integers(-5, 3000) | st.floats(allow_nan=False, allow_infinity=False, width=32) | st.text(max_size=12)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)

ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"])
BLOCK_TYPES = st.sampled_from(["text", "tool_use", "tool_result", "image", "thinking", "input_text", None])
block = st.fixed_dictionaries(
    {"type": BLOCK_TYPES},
    optional={
        "text": st.text(max_size=20) | json_values,
        "id": st.text(max_size=5) | json_values,
        "name": st.text(max_size=5) | json_values,
        "input": st.dictionaries(st.text(max_size=4), json_values, max_size=2) | json_values,
        "tool_use_id": st.text(max_size=4) | json_values,
        "content": st.text(max_size=10) | json_values,
    },
)
tool_call = st.fixed_dictionaries({"id": st.text(max_size=4), "type": st.just("function"), "function": st.fixed_dictionaries({"name": st.text(max_size=6) | json_values, "arguments": st.text(max_size=30) | json_values})})
message = st.fixed_dictionaries(
    {"role": ROLES},
    optional={"content": st.text(max_size=30) | st.lists(block, max_size=3) | json_values, "tool_calls": st.lists(tool_call, max_size=2) | json_values, "tool_call_id": json_values},
)
tool = st.fixed_dictionaries({}, optional={"type": st.just("function") | json_values, "function": st.fixed_dictionaries({"name": st.text(max_size=5) | json_values}, optional={"parameters": json_values}), "name": st.text(max_size=5), "input_schema": json_values})
KEYS = {
    "model": st.text(max_size=5) | json_values,
    "messages": st.lists(message, max_size=4) | json_values,
    "max_tokens": st.integers(-2, 40) | json_values,
    "max_completion_tokens": st.integers(-2, 40) | json_values,
    "temperature": st.floats(-1, 3) | json_values,
    "top_p": st.floats(-1, 2) | json_values,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3) | json_values,
    "stop_sequences": st.lists(st.text(max_size=3), max_size=3) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | json_values}) | json_values,
    "tools": st.lists(tool, max_size=2) | json_values,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_values,
    "n": st.integers(0, 3) | json_values,
    "logprobs": st.booleans() | st.integers(0, 6) | json_values,
    "top_logprobs": st.integers(-1, 30) | json_values,
    "seed": json_values,
    "system": st.text(max_size=20) | st.lists(block, max_size=2) | json_values,
    "prompt": st.text(max_size=20) | st.lists(st.integers(-3, 2000), max_size=5) | json_values,
}
bodies = st.fixed_dictionaries({}, optional=KEYS)
PATHS = ["/v1/chat/completions", "/v1/messages", "/v1/completions", "/v1/messages/count_tokens"]


@pytest.fixture(scope="module")
def fuzz_server():
    from gyre.proxy import Proxy, serve_proxy

    proxy = Proxy(ProxyConfig(max_context_tokens=1024, max_body_bytes=1 << 16))
    proxy.router.add_engine(DeterministicEngine("e", eos_prob=0.1), kind="cell", index=0)
    key = proxy.issue_key("fuzz")
    h = serve_proxy(proxy)
    client = httpx.Client(base_url=h.url, headers={"Authorization": f"Bearer {key}", "x-api-key": key}, timeout=30)
    yield proxy, client
    client.close()
    h.stop()


BASES = {
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], "max_tokens": 8},
    "/v1/messages": {"model": "m", "system": "s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
    "/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 8},
    "/v1/messages/count_tokens": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
}


def _check(client, path, body):
    r = client.post(path, content=json.dumps(body))
    assert r.status_code < 500, (path, body, r.text)
    if r.status_code >= 400:
        data = r.json()
        assert ("error" in data) if not path.startswith("/v1/messages") else (data["type"] == "error")
    return r.status_code


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(PATHS), data=st.data())
def test_mutated_valid_bodies_never_5xx(fuzz_server, path, data):
    """A valid body with one to three fields replaced by fuzzed values (reaches the deep paths)."""
    proxy, client = fuzz_server
    keys = data.draw(st.lists(st.sampled_from(sorted(KEYS)), min_size=1, max_size=3, unique=True))
    body = dict(BASES[path])
    for k in keys:
        body[k] = data.draw(KEYS[k], label=k)
    _check(client, path, body)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies, path=st.sampled_from(PATHS))
def test_fuzzed_bodies_never_5xx(fuzz_server, body, path):
    _check(fuzz_server[1], path, body)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()), path=st.sampled_from(PATHS))
def test_fuzzed_raw_bytes_never_5xx(fuzz_server, raw, path):
    proxy, client = fuzz_server
    r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (path, raw, r.text)
    assert client.get("/v1/models").status_code == 200
