"""`/v1/responses` through the official `openai` SDK: plain, streamed (event order, deltas), function
and custom tools, multi-turn with re-sent output items (TITO splicing checked on the records),
previous_response_id / store, usage against the records, and the 4xx cases."""

import json

import httpx
import openai
import pytest

from gyre.backends.models.tokenizer import byte_token_ids, load_tokenizer
from gyre.backends.engines.det_engine import DeterministicEngine

from .conftest import TOOL_ARGS, TOOLS_OPENAI, scripted_engine

TOOLS = [{"type": "function", **t["function"]} for t in TOOLS_OPENAI]  # Responses shape
SYSTEM = "You are an agent."
PATCH = "*** Begin Patch\n*** Add File: a.py\n+print(1)\n*** End Patch"
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files", "format": {"type": "grammar", "syntax": "lark", "definition": "start: /(.|\\n)+/"}}


def _visible(ids):
    return load_tokenizer().decode([i for i in ids if i not in (0, 2)])


def _client(h, key):
    return openai.OpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0)


def _assert_spliced(records):
    """Call k+1's prompt holds call k's sampled ids verbatim, right after call k's prompt."""
    for prev, nxt in zip(records, records[1:]):
        prefix = list(prev.input_ids) + list(prev.output_ids)
        assert list(nxt.input_ids[: len(prefix)]) == prefix
        start, end = nxt.payload_ref["spliced_spans"][-1]
        assert list(nxt.input_ids[start:end]) == list(prev.output_ids)
        assert nxt.payload_ref["spliced_calls"][-1] == prev.call_id


def test_plain_usage_and_incomplete(make_server):
    proxy, h = make_server([(DeterministicEngine("e", eos_prob=0.05, salt=3), "cell", 0)])
    c = _client(h, proxy.issue_key("ex-plain"))
    r = c.responses.create(model="m", input="hello", instructions="Be brief.", max_output_tokens=200, metadata={"k": "v"}, user="u1", temperature=0.5)
    rec = proxy.sink.records[-1]
    assert r.object == "response" and r.status == "completed" and r.incomplete_details is None and r.model == "m"
    assert r.id.startswith("resp_") and r.instructions == "Be brief."
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed"
    assert r.output_text == msg.content[0].text == _visible(rec.output_ids)
    assert r.usage.input_tokens == len(rec.input_ids) and r.usage.output_tokens == len(rec.output_ids)
    assert r.usage.total_tokens == len(rec.input_ids) + len(rec.output_ids)
    assert rec.payload_ref["api"] == "responses"
    # the same conversation through chat renders the same prompt
    c.chat.completions.create(model="m", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}], max_tokens=3)
    assert proxy.sink.records[-1].input_ids.tolist() == rec.input_ids.tolist()

    lp = c.responses.create(model="m", input="hello", max_output_tokens=200, include=["message.output_text.logprobs"])
    rec = proxy.sink.records[-1]
    visible = [x for t, x in zip(rec.output_ids, rec.output_logprobs) if t not in (0, 2)]
    assert [e.logprob for e in lp.output[0].content[0].logprobs] == pytest.approx(visible)

    cut = c.responses.create(model="m", input=[{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}], max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == len(proxy.sink.records[-1].output_ids) == 2
    assert cut.output[0].status == "incomplete"


def test_stream_event_sequence(make_server):
    proxy, h = make_server([(DeterministicEngine("e", eos_prob=0.05, salt=3), "cell", 0)])
    c = _client(h, proxy.issue_key("ex-stream"))
    plain = c.responses.create(model="m", input="hello", max_output_tokens=200)
    events = list(c.responses.create(model="m", input="hello", max_output_tokens=200, stream=True))
    kinds = [e.type for e in events]
    n = kinds.count("response.output_text.delta")
    assert n > 1
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
                     + ["response.output_text.delta"] * n
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == events[-1].response.output_text == plain.output_text
    rec = proxy.sink.records[-1]
    assert events[-1].response.usage.output_tokens == len(rec.output_ids) and events[-1].response.usage.input_tokens == len(rec.input_ids)

    with c.responses.stream(model="m", input="hello", max_output_tokens=200) as s:
        final = s.get_final_response()
    assert final.output_text == plain.output_text
    cut = list(c.responses.create(model="m", input="hello", max_output_tokens=3, stream=True))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.incomplete_details.reason == "max_output_tokens"


def _reserialize(items):
    """What a client may send back: arguments re-encoded with other key order and spacing, no ids."""
    out = []
    for it in items:
        d = it.model_dump(exclude_none=True)
        d.pop("id", None)
        if d["type"] == "function_call":
            d["arguments"] = json.dumps(dict(reversed(list(json.loads(d["arguments"]).items()))), indent=2)
        if d["type"] == "message":
            d["content"] = [{"type": "output_text", "text": "  " + d["content"][0]["text"] + "\n"}]
        out.append(d)
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_function_tools_multi_turn_splices_sampled_tokens(make_server, stream):
    proxy, h = make_server([(scripted_engine(), "cell", 0)])
    c = _client(h, proxy.issue_key("ex-tools"))
    inp = [{"role": "user", "content": "How many files?"}]

    def ask(items):
        if not stream:
            return c.responses.create(model="m", instructions=SYSTEM, input=items, tools=TOOLS, max_output_tokens=300)
        with c.responses.stream(model="m", instructions=SYSTEM, input=items, tools=TOOLS, max_output_tokens=300) as s:
            return s.get_final_response()

    first = ask(inp)
    msg, fc = first.output
    assert msg.content[0].text == "Step 0: I will run a command."
    assert fc.type == "function_call" and fc.name == "bash" and json.loads(fc.arguments) == TOOL_ARGS[0] and fc.call_id.startswith("call_")
    inp += _reserialize(first.output) + [{"type": "function_call_output", "call_id": fc.call_id, "output": "a.py\nb.py"}]
    second = ask(inp)
    assert json.loads(second.output[-1].arguments) == TOOL_ARGS[1]
    # this time the SDK's own items go back, reasoning item included (dropped)
    inp += [{"type": "reasoning", "id": "rs_1", "summary": []}] + [o.model_dump(exclude_none=True) for o in second.output]
    inp += [{"type": "function_call_output", "call_id": second.output[-1].call_id, "output": [{"type": "input_text", "text": "print(1)"}]}]
    third = ask(inp)
    assert third.output_text == "All done: found 2 files." and [o.type for o in third.output] == ["message"]

    # kept (store defaults to true): the SDK's own items re-sent make call 3 a delta on call 2
    assert proxy.executions["ex-tools"].responses[third.id].parent == second.id
    recs = proxy.sink.for_execution("ex-tools")
    assert [r.payload_ref["spliced_turns"] for r in recs] == [0, 1, 2]
    _assert_spliced(recs)
    assert [third.usage.input_tokens, third.usage.output_tokens] == [len(recs[2].input_ids), len(recs[2].output_ids)]
    # splicing mattered: re-tokenizing the turn's text gives other ids than the sampled ones
    tok = load_tokenizer()
    start, end = recs[1].payload_ref["spliced_spans"][0]
    assert tok.encode(_visible(recs[1].input_ids[start:end]), add_special_tokens=False) != list(recs[0].output_ids)[:-1]


def _patch_script(input_ids):
    prompt = load_tokenizer().decode(input_ids)
    if "<tool_response>" not in prompt:
        return "Patching.\n<tool_call>\n" + json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}}) + "\n</tool_call>"
    return "Patched."


@pytest.mark.parametrize("stream", [False, True])
def test_custom_tool_round_trip(make_server, stream):
    engine = DeterministicEngine("p", script=_patch_script, byte_ids=byte_token_ids(load_tokenizer()))
    proxy, h = make_server([(engine, "cell", 0)])
    c = _client(h, proxy.issue_key("ex-custom"))
    tools = TOOLS + [APPLY_PATCH]
    if stream:
        events = list(c.responses.create(model="m", input="add a.py", tools=tools, stream=True))
        kinds = [e.type for e in events]
        i = kinds.index("response.custom_tool_call_input.delta")
        assert kinds[i - 1 : i + 3] == ["response.output_item.added", "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done", "response.output_item.done"]
        assert events[i].delta == events[i + 1].input == PATCH
        first = events[-1].response
    else:
        first = c.responses.create(model="m", input="add a.py", tools=tools)
    msg, call = first.output
    assert msg.content[0].text == "Patching."
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.input == PATCH
    rec0 = proxy.sink.records[-1]
    prompt = load_tokenizer().decode(rec0.input_ids)
    assert "lark grammar" in prompt and '"required": ["input"]' in prompt  # rendered as a one-string function
    items = [{"role": "user", "content": "add a.py"}] + [o.model_dump(exclude_none=True) for o in first.output]
    items += [{"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"}]
    second = c.responses.create(model="m", input=items, tools=tools)
    assert second.output_text == "Patched."
    recs = proxy.sink.for_execution("ex-custom")
    assert recs[1].payload_ref["spliced_turns"] == 1
    _assert_spliced(recs)


def test_previous_response_id_store_and_retrieve(make_server):
    proxy, h = make_server([(scripted_engine(), "cell", 0)])
    c = _client(h, proxy.issue_key("ex-prev"))
    kw = dict(model="m", instructions=SYSTEM, tools=TOOLS)
    first = c.responses.create(input="How many files?", **kw)
    assert first.store is True
    out = [{"type": "function_call_output", "call_id": first.output[-1].call_id, "output": "a.py\nb.py"}]
    second = c.responses.create(previous_response_id=first.id, input=out, **kw)
    assert json.loads(second.output[-1].arguments) == TOOL_ARGS[1] and second.previous_response_id == first.id
    r0, r1 = proxy.sink.for_execution("ex-prev")
    assert r1.payload_ref["spliced_turns"] == 1
    _assert_spliced([r0, r1])
    # the same turn sent as full history renders the same prompt
    full = [{"role": "user", "content": "How many files?"}] + [o.model_dump(exclude_none=True) for o in first.output] + out
    c.responses.create(input=full, store=False, **kw)
    assert proxy.sink.records[-1].input_ids.tolist() == r1.input_ids.tolist()
    # ... and is kept as a delta: the chain of the second response is the first one
    state = proxy.executions["ex-prev"]
    assert state.responses[second.id].parent == first.id and len(state.responses[second.id].messages) == 2
    assert c.responses.retrieve(second.id).output_text == second.output_text

    unstored = c.responses.create(input="hi", store=False, **kw)
    assert unstored.store is False
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(previous_response_id=unstored.id, input="more", **kw)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)
    # another execution cannot see this one's responses
    other = _client(h, proxy.issue_key("ex-other"))
    with pytest.raises(openai.BadRequestError):
        other.responses.create(previous_response_id=first.id, input="x", **kw)
    h.call_fn(proxy.close_execution, "ex-prev")
    assert "ex-prev" not in proxy.executions  # kept responses go with the execution


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"input": [{"type": "bogus"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "name": "bash", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "apply_patch"}]}, "input[0].input"),
        ({"input": [{"role": "user", "content": [{"type": "input_video", "video_url": "http://x"}]}]}, "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "detail": "auto"}]}]}, "input[0].content[0].image_url"),
        ({"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content[0].type"),
        ({"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": 3}, "input"),
        ({"previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}}, "text.format"),
        ({"tool_choice": "required"}, "tool_choice"),  # forcing a call with no tools
        ({"tool_choice": {"type": "function", "name": "bash"}}, "tool_choice"),
        ({"tool_choice": {"type": "web_search_preview"}, "tools": [{"type": "function", "name": "f"}]}, "tool_choice.type"),
        ({"tools": [{"type": "web_search"}, {"type": "local_shell"}]}, "tools[1].type"),
        ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "function"}]}]}, "tools[0].tools[0].name"),
        ({"tools": [{"type": "custom", "name": "bash"}, {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "bash"}]}]}, "tools[1].tools[0].name"),
        ({"tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
        ({"tools": [{"type": "custom", "name": "p", "format": {"type": "regexp"}}]}, "tools[0].format.type"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
    ],
)
def test_bad_requests_are_400_naming_the_field(make_server, extra, param):
    proxy, h = make_server([(DeterministicEngine("e", eos_prob=0.3), "cell", 0)])
    body = {"model": "m", "input": "hi", **extra}
    r = httpx.post(h.url + "/v1/responses", json=body, headers={"Authorization": "Bearer " + proxy.issue_key("ex-bad")})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and param in err["message"]
    assert not proxy.sink.records
    ok = httpx.post(h.url + "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 2}, headers={"Authorization": "Bearer " + proxy.issue_key("ex-ok")})
    assert ok.status_code == 200 and ok.json()["object"] == "response"  # the server keeps serving


def test_namespace_tools_and_hosted_tools(make_server):
    """Codex sends its sub-agent tools in a `namespace` and a hosted `web_search` tool."""
    proxy, h = make_server([(scripted_engine(), "cell", 0)])
    c = _client(h, proxy.issue_key("ex-ns"))
    tools = [{"type": "namespace", "name": "shell_ns", "description": "Shell tools", "tools": TOOLS}, {"type": "web_search", "external_web_access": True}]
    r = c.responses.create(model="m", input="How many files?", tools=tools, include=["reasoning.encrypted_content"], reasoning={"summary": "auto"}, store=False)
    fc = r.output[-1]
    assert fc.type == "function_call" and fc.name == "bash" and fc.namespace == "shell_ns"
    # the prompt lists the namespace's function as through chat, and no web_search
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": "How many files?"}], tools=TOOLS_OPENAI)
    first, chat = proxy.sink.for_execution("ex-ns")
    assert first.input_ids.tolist() == chat.input_ids.tolist()
    again = [{"role": "user", "content": "How many files?"}, *[o.model_dump(exclude_none=True) for o in r.output], {"type": "function_call_output", "call_id": fc.call_id, "output": "a.py"}]
    c.responses.create(model="m", input=again, tools=tools)
    assert proxy.sink.records[-1].payload_ref["spliced_turns"] == 1


class _Refusing(DeterministicEngine):
    async def generate(self, request_id, input_ids, sampling):
        raise ValueError("over this engine's limit")
        yield  # an async generator


def test_error_after_the_stream_started_is_an_error_event_then_failed(make_server):
    proxy, h = make_server([(_Refusing("no"), "cell", 0)])
    c = _client(h, proxy.issue_key("ex-fail"))
    events = list(c.responses.create(model="m", input="hi", stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert "limit" in events[2].message and events[3].response.status == "failed" and "limit" in events[3].response.error.message
    with pytest.raises(openai.BadRequestError):  # not streamed: a plain 400
        c.responses.create(model="m", input="hi")
    assert not proxy.executions["ex-fail"].responses  # failed responses are not kept


def test_tool_choice_none_and_auth(make_server):
    proxy, h = make_server([(scripted_engine(), "cell", 0)])
    c = _client(h, proxy.issue_key("ex-none"))
    r = c.responses.create(model="m", input="How many files?", tools=TOOLS, tool_choice="none", parallel_tool_calls=False)
    assert [o.type for o in r.output] == ["message"] and "<tool_call>" in r.output_text  # not parsed, shown as text
    with pytest.raises(openai.AuthenticationError):
        _client(h, "gyre-unknown").responses.create(model="m", input="x")


@pytest.mark.parametrize("streamed", [False, True])
def test_openai_agents_sdk_tool_turn(make_server, streamed):
    """One Agent run with the SDK's default model class: two tool calls, then the answer."""
    agents = pytest.importorskip("agents", reason="openai-agents is not installed (the agents extra: pip install -e '.[test,agents]'; not next to sglang, setup.py)")
    import asyncio

    agents.set_tracing_disabled(True)  # no trace export to api.openai.com
    proxy, h = make_server([(scripted_engine(), "cell", 0)])
    ran = []

    @agents.function_tool
    def bash(cmd: str, timeout: int) -> str:
        """Run a shell command."""
        ran.append((cmd, timeout))
        return "a.py\nb.py" if len(ran) == 1 else "print(1)"

    client = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-agents"), max_retries=0)
    model = agents.OpenAIResponsesModel(model="gyre-policy", openai_client=client)
    agent = agents.Agent(name="a", instructions=SYSTEM, tools=[bash], model=model)

    async def run():
        if not streamed:
            return await agents.Runner.run(agent, "How many files?")
        result = agents.Runner.run_streamed(agent, "How many files?")
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert result.final_output == "All done: found 2 files."
    assert ran == [(a["cmd"], a["timeout"]) for a in TOOL_ARGS]
    recs = proxy.sink.for_execution("ex-agents")
    assert [r.payload_ref["spliced_turns"] for r in recs] == [0, 1, 2]
    _assert_spliced(recs)
