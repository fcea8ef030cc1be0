"""Forced tool calls (`tool_choice` required / a named function; Anthropic any / tool) through the
official SDKs, plain and streamed, in the three APIs: the proxy appends the template's tool-call
opening to the prompt and the engine continues from it (gyre/proxy/core.py).

The engine is a scripted deterministic engine that writes a tool call's *continuation* only when
the prompt ends with the forced opening, and plain text otherwise, so an unforced call comes back
as text. Checked on the records: the forced prefix ends the input and is not in the output; a
follow-up call re-sending the turn splices it (input = call 1's input + output, verbatim); and in
the micro-steps materialized from the records no forced-prefix token is a training target while
every sampled token is."""

import json

import anthropic
import numpy as np
import openai
import pytest

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.models.tokenizer import byte_token_ids, load_tokenizer
from gyre.proxy.textstream import tool_call_opening
from gyre.trajectory.advantages import Outcome
from gyre.trajectory.materialize import ScoredExecution, ScoredGroup, materialize_step

TOK = load_tokenizer()
SCHEMAS = {"bash": {"cmd": {"type": "string"}}, "read": {"path": {"type": "string"}}}
ARGS = {"bash": {"cmd": "ls -la"}, "read": {"path": "a.py"}}
TOOLS_CHAT = [{"type": "function", "function": {"name": n, "description": f"the {n} tool", "parameters": {"type": "object", "properties": p}}}
              for n, p in SCHEMAS.items()]
TOOLS_ANTHROPIC = [{"name": n, "description": f"the {n} tool", "input_schema": {"type": "object", "properties": p}} for n, p in SCHEMAS.items()]
TOOLS_RESPONSES = [{"type": "function", "name": n, "description": f"the {n} tool", "parameters": {"type": "object", "properties": p}}
                   for n, p in SCHEMAS.items()]


def script(input_ids):
    """The 'model': continues a forced opening with a call's rest; answers text otherwise. Under
    `required` (the opening ends at the name) it writes the name the user asked for."""
    text = TOK.decode(list(input_ids))
    for name, args in ARGS.items():
        if text.endswith(tool_call_opening(name)):
            return " " + json.dumps(args) + "}\n</tool_call>"
    if text.endswith(tool_call_opening(None)):
        user = text.rsplit("<|im_start|>user\n", 1)[1]
        name = "nope" if "unknown" in user else "read"
        return name + '", "arguments": ' + json.dumps(ARGS["read"]) + "}\n</tool_call>"
    return "I would rather not call a tool."


@pytest.fixture
def served(make_server):
    proxy, h = make_server([(DeterministicEngine("forcer", script=script, byte_ids=byte_token_ids(TOK)), "cell", 0)])
    return proxy, h


def forced_ids(name):
    return TOK.encode(tool_call_opening(name), add_special_tokens=False)


def check_forced_record(rec, name):
    """Call 1: input ends with the forced opening, output is the sampled continuation only."""
    f = forced_ids(name)
    assert list(rec.input_ids[-len(f):]) == f
    assert rec.payload_ref["forced_prefix"] == len(f)
    out_text = TOK.decode([t for t in rec.output_ids if t != TOK.convert_tokens_to_ids("<|im_end|>")])
    assert "<tool_call>" not in out_text and '"name"' not in out_text
    assert out_text.startswith(" {") or out_text.startswith("read")


def check_follow_up(rec1, rec2):
    assert rec2.payload_ref["spliced_turns"] == 1 and rec2.payload_ref["unmatched_turns"] == 0
    head = list(rec1.input_ids) + list(rec1.output_ids)
    assert list(rec2.input_ids[: len(head)]) == head


def check_no_forced_target(proxy, execution_id, forced_call, n_forced):
    """Materialize a step from the execution's records: forced-prefix positions are context,
    every token the forced call sampled is a target."""
    recs = [r for r in proxy.sink.records if r.execution_id == execution_id]
    other = [r for r in proxy.sink.records if r.execution_id != execution_id][:1]
    group = ScoredGroup("q", 0, [ScoredExecution(execution_id, Outcome.scored(1.0), records=recs),
                                 ScoredExecution("other", Outcome.scored(0.0), records=other)])
    batch = materialize_step([group], max_tokens=1 << 14, rng=np.random.default_rng(0))
    rec = recs[forced_call]
    n_in, n_out = len(rec.input_ids), len(rec.output_ids)
    head = rec.input_ids.tolist()
    seen = 0
    for m in batch.micro_steps:
        cu = m.cu_seqlens.tolist()
        for a, b in zip(cu, cu[1:]):
            seq = m.input_ids[a:b].tolist()
            if seq[:n_in] != head:
                continue
            seen += 1
            targets = {j + 1 for j in range(b - a - 1) if m.target_mask[a + j]}  # sequence positions that are targets
            assert not targets & set(range(n_in - n_forced, n_in)), "a forced-prefix token is a training target"
            assert set(range(n_in, min(n_in + n_out, b - a))) <= targets, "a sampled token is not a target"
    assert seen >= 1


# ---- OpenAI chat ------------------------------------------------------------------------------
def _chat(c, stream, **kw):
    if not stream:
        m = c.chat.completions.create(model="m", max_tokens=64, **kw).choices[0]
        return m.message.content, [(t.function.name, json.loads(t.function.arguments)) for t in m.message.tool_calls or []], m.finish_reason
    text, calls, finish = "", {}, None
    for ch in c.chat.completions.create(model="m", max_tokens=64, stream=True, **kw):
        d = ch.choices[0].delta
        text += d.content or ""
        for t in d.tool_calls or []:
            calls.setdefault(t.index, ["", ""])
            calls[t.index][0] += t.function.name or ""
            calls[t.index][1] += t.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return text or None, [(n, json.loads(a)) for n, a in calls.values()], finish


@pytest.mark.parametrize("stream", [False, True])
def test_chat_named_function_is_forced_recorded_as_input_and_spliced(served, stream):
    proxy, h = served
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-chat"), max_retries=0)
    msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "List the files."}]
    # unforced, the 'model' answers text: forcing is what makes the call below a tool call
    assert _chat(c, stream, messages=msgs, tools=TOOLS_CHAT)[1] == []
    content, calls, finish = _chat(c, stream, messages=msgs, tools=TOOLS_CHAT, tool_choice={"type": "function", "function": {"name": "bash"}})
    assert calls == [("bash", ARGS["bash"])] and not content and finish == "tool_calls"
    rec1 = proxy.sink.records[-1]
    check_forced_record(rec1, "bash")
    assert rec1.payload_ref["forced_tool"] == "bash"
    resent = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_x", "type": "function",
              "function": {"name": "bash", "arguments": json.dumps(ARGS["bash"], indent=2)}}]}  # re-serialized
    _chat(c, stream, messages=msgs + [resent, {"role": "tool", "tool_call_id": "call_x", "content": "a.py"}], tools=TOOLS_CHAT)
    check_follow_up(rec1, proxy.sink.records[-1])
    check_no_forced_target(proxy, "ex-chat", 1, len(forced_ids("bash")))


def test_chat_required_lets_the_model_name_a_tool_and_flags_unknown_names(served):
    proxy, h = served
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-req"), max_retries=0)
    content, calls, finish = _chat(c, False, messages=[{"role": "user", "content": "Read it."}], tools=TOOLS_CHAT, tool_choice="required")
    assert calls == [("read", ARGS["read"])] and finish == "tool_calls"
    rec = proxy.sink.records[-1]
    check_forced_record(rec, None)
    assert rec.payload_ref["forced_tool"] == "*" and rec.payload_ref["forced_unknown_tool"] == []
    # a name that is none of the tools: returned as written, flagged on the record
    _, calls, _ = _chat(c, False, messages=[{"role": "user", "content": "Call an unknown tool."}], tools=TOOLS_CHAT, tool_choice="required")
    assert calls == [("nope", ARGS["read"])] and proxy.sink.records[-1].payload_ref["forced_unknown_tool"] == ["nope"]
    # `required` with a single tool forces that tool by name
    _, calls, _ = _chat(c, False, messages=[{"role": "user", "content": "Go."}], tools=TOOLS_CHAT[:1], tool_choice="required")
    assert calls == [("bash", ARGS["bash"])]
    check_forced_record(proxy.sink.records[-1], "bash")


def test_chat_bad_tool_choices_and_response_format_are_400s(served):
    proxy, h = served
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-400"), max_retries=0)
    msgs = [{"role": "user", "content": "x"}]
    cases = [
        (dict(tools=TOOLS_CHAT, tool_choice={"type": "function", "function": {"name": "missing"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=TOOLS_CHAT, tool_choice="sometimes"), "tool_choice"),
        (dict(response_format={"type": "json_object"}), "response_format"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}), "response_format"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="m", max_tokens=4, messages=msgs, **kw)
        assert e.value.body["param"] == param, kw
    assert not proxy.sink.records
    c.chat.completions.create(model="m", max_tokens=4, messages=msgs, response_format={"type": "text"})


# ---- Anthropic --------------------------------------------------------------------------------
def _messages(a, stream, **kw):
    if not stream:
        return a.messages.create(model="m", max_tokens=64, **kw)
    with a.messages.stream(model="m", max_tokens=64, **kw) as s:
        return s.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice, name", [({"type": "tool", "name": "bash"}, "bash"), ({"type": "any"}, "read")])
def test_anthropic_tool_and_any_are_forced_and_spliced(served, stream, choice, name):
    proxy, h = served
    a = anthropic.Anthropic(base_url=h.url, api_key=proxy.issue_key("ex-ant"), max_retries=0)
    msgs = [{"role": "user", "content": "Do it."}]
    assert all(b.type == "text" for b in _messages(a, stream, messages=msgs, tools=TOOLS_ANTHROPIC).content)
    m = _messages(a, stream, messages=msgs, tools=TOOLS_ANTHROPIC, tool_choice=choice)
    assert [(b.type, b.name, b.input) for b in m.content] == [("tool_use", name, ARGS[name])] and m.stop_reason == "tool_use"
    rec1 = proxy.sink.records[-1]
    check_forced_record(rec1, "bash" if name == "bash" else None)
    follow = msgs + [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": name, "input": ARGS[name]}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]}]
    _messages(a, stream, messages=follow, tools=TOOLS_ANTHROPIC)
    check_follow_up(rec1, proxy.sink.records[-1])
    check_no_forced_target(proxy, "ex-ant", 1, rec1.payload_ref["forced_prefix"])


def test_anthropic_structured_output_is_a_400(served):
    proxy, h = served
    a = anthropic.Anthropic(base_url=h.url, api_key=proxy.issue_key("ex-a400"), max_retries=0)
    for extra, field in (({"output_format": {"type": "json_schema", "schema": {"type": "object"}}}, "output_format"),
                         ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config.format"),
                         ({"tool_choice": {"type": "tool", "name": "missing"}, "tools": TOOLS_ANTHROPIC}, "tool_choice")):
        with pytest.raises(anthropic.BadRequestError, match=field):
            a.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "x"}], extra_body=extra)
    a.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "x"}], extra_body={"output_config": {"effort": "low"}})


# ---- Responses --------------------------------------------------------------------------------
def _respond(c, stream, **kw):
    if not stream:
        return c.responses.create(model="m", max_output_tokens=64, **kw)
    done = [ev.response for ev in c.responses.create(model="m", max_output_tokens=64, stream=True, **kw) if ev.type == "response.completed"]
    return done[0]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice, name", [({"type": "function", "name": "bash"}, "bash"), ("required", "read")])
def test_responses_function_and_required_are_forced_and_spliced(served, stream, choice, name):
    proxy, h = served
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-resp"), max_retries=0)
    r = _respond(c, stream, input="Do it.", tools=TOOLS_RESPONSES, tool_choice=choice, store=False)
    calls = [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]
    assert calls == [(name, ARGS[name])] and all(o.type == "function_call" for o in r.output)
    rec1 = proxy.sink.records[-1]
    check_forced_record(rec1, "bash" if name == "bash" else None)
    fc = next(o for o in r.output if o.type == "function_call")
    items = [{"role": "user", "content": "Do it."},
             {"type": "function_call", "call_id": fc.call_id, "name": name, "arguments": json.dumps(ARGS[name])},
             {"type": "function_call_output", "call_id": fc.call_id, "output": "ok"}]
    _respond(c, stream, input=items, tools=TOOLS_RESPONSES, store=False)
    check_follow_up(rec1, proxy.sink.records[-1])
    check_no_forced_target(proxy, "ex-resp", 0, rec1.payload_ref["forced_prefix"])
