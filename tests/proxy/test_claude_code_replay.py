"""A recorded run of the real Claude Code CLI past a full context, replayed against the proxy.

tests/fixtures/claude_code_compaction.json is the request log of
tests/executions/test_claude_code_example.py::test_real_claude_code_compacts_at_the_default_context_and_goes_on
(Claude Code 2.1.337 set up by examples/claude_code/run_claude.py, the proxy's default context,
a scripted model): five main calls whose Bash outputs fill the context, Claude Code's own
compaction call, then the main calls that go on from its summary. Sent again, byte for byte,
with the same sampled texts, the proxy must answer each as it did, give each call its recorded
role and prompt length, and carry the conversation across the calls as one prefix.
"""

import json
from pathlib import Path

import httpx
import pytest

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.models.tokenizer import byte_token_ids, load_tokenizer
from gyre.proxy import ProxyConfig
from gyre.trajectory.record import Role

from .claude_code_log import unpack

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "claude_code_compaction.json"


def _sse(text: str) -> tuple[list[str], str, list[dict]]:
    """A streamed reply's event names, its text and its tool_use blocks (input parsed)."""
    events = [line[len("event: "):] for line in text.splitlines() if line.startswith("event: ")]
    data = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
    said, tools = "", []
    for d in data:
        if d["type"] == "content_block_start" and d["content_block"]["type"] == "tool_use":
            tools.append({"name": d["content_block"]["name"], "json": ""})
        elif d["type"] == "content_block_delta" and d["delta"]["type"] == "text_delta":
            said += d["delta"]["text"]
        elif d["type"] == "content_block_delta" and d["delta"]["type"] == "input_json_delta":
            tools[-1]["json"] += d["delta"]["partial_json"]
    return events, said, [{"name": t["name"], "input": json.loads(t["json"])} for t in tools]


@pytest.fixture(scope="module")
def recorded():
    packed = json.loads(FIXTURE.read_text())
    return packed, unpack(packed)


def test_the_recorded_sequence_is_a_compaction_between_main_calls(recorded):
    """What the recording holds, read without the proxy (so a re-recording that lost the
    compaction, or that Claude Code reached only through a refusal, is caught here)."""
    packed, calls = recorded
    assert packed["context_tokens"] == ProxyConfig().max_context_tokens  # recorded at the default
    roles = [c["role"] for c in calls if c["path"] == "/v1/messages"]
    k = roles.index("MAIN_SUMMARY")
    assert k >= 1 and set(roles[:k]) == {"MAIN"} and "MAIN" in roles[k + 1:], roles
    assert all(c["status"] == 200 for c in calls)  # no "prompt is too long" on the way
    ask = calls[k]["body"]["messages"][-1]["content"]
    ask = " ".join(b.get("text", "") for b in ask) if isinstance(ask, list) else ask
    assert "summary of the conversation" in ask.lower()
    # The compaction request is the last main request's conversation plus the instruction.
    before = calls[k - 1]["body"]["messages"]
    assert calls[k]["body"]["messages"][: len(before) - 1] == before[:-1]
    after = calls[k + 1]["body"]["messages"][0]["content"]
    after = " ".join(b.get("text", "") for b in after) if isinstance(after, list) else after
    summary = calls[k]["sampled"].removeprefix("<summary>").removesuffix("</summary>")  # Claude Code drops the tags
    assert "continued from a previous conversation" in after and summary in after


def test_the_proxy_serves_and_classifies_the_recorded_claude_code_run(make_server, recorded):
    packed, calls = recorded
    tok = load_tokenizer()
    sampled = iter([c["sampled"] for c in calls if c["path"] == "/v1/messages"])
    engine = DeterministicEngine("replay", script=lambda ids: next(sampled), byte_ids=byte_token_ids(tok))
    proxy, h = make_server([(engine, "cell", 0)], config=ProxyConfig(max_context_tokens=packed["context_tokens"]))
    key = proxy.issue_key("cc-replay")
    with httpx.Client(base_url=h.url, timeout=120) as client:
        for c in calls:
            r = client.post(c["path"], json=c["body"], headers=c["headers"] | {"x-api-key": key})
            assert r.status_code == c["status"], r.text[:500]
            if c["body"].get("stream"):
                events, said, tools = _sse(r.text)
                assert events[0] == "message_start" and events[-1] == "message_stop", events
                # The recorded sample went back as Claude Code read it: text, then its Bash call.
                text, _, call = c["sampled"].partition("<tool_call>")
                assert said.strip() == text.strip()
                want = json.loads(call.removesuffix("</tool_call>")) if call else None
                assert tools == ([{"name": want["name"], "input": want["arguments"]}] if want else [])

    recs = sorted(proxy.sink.for_execution("cc-replay"), key=lambda r: r.call_id)
    want = [c for c in calls if c["path"] == "/v1/messages"]
    assert [r.role.name for r in recs] == [c["role"] for c in want]
    assert [len(r.input_ids) for r in recs] == [c["prompt_tokens"] for c in want]
    k = [r.role for r in recs].index(Role.MAIN_SUMMARY)
    # Main calls before the compaction extend one another token for token: each turn the proxy
    # sampled comes back as it was sampled (spliced, not re-tokenized).
    for prev, cur in zip(recs[: k - 1], recs[1:k]):
        shared = list(prev.input_ids) + list(prev.output_ids)
        assert list(cur.input_ids[: len(shared)]) == shared, (prev.call_id, cur.call_id)
        assert cur.payload_ref["spliced_calls"] == list(range(cur.call_id))
    # Claude Code summarizes what the last main call was sent (its own turn stays verbatim for
    # after the summary): the compaction call is that prompt up to its last message, with every
    # earlier sample spliced, and the instruction after it.
    last = recs[k - 1]
    m = int(last.message_starts[-1])
    assert list(recs[k].input_ids[:m]) == list(last.input_ids[:m])
    assert recs[k].payload_ref["spliced_calls"] == list(range(k - 1))
    # After it the conversation restarts from the summary under the same system prompt, and the
    # turn kept verbatim is the last main call's own sample, spliced.
    n_sys = recs[0].message_starts[1]
    assert list(recs[k + 1].input_ids[:n_sys]) == list(recs[0].input_ids[:n_sys])
    assert recs[k + 1].payload_ref["spliced_calls"] == [last.call_id]
    assert max(len(r.input_ids) for r in recs) < packed["context_tokens"]
