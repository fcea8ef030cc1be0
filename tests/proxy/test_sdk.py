"""The proxy through the official `openai` and `anthropic` SDKs: plain, streaming, tool-call round
trips with re-serialized history (TITO splicing checked on the records), roles, and the store."""

import json
import random

import anthropic
import openai
import pytest

from gyre.backends.models.tokenizer import load_tokenizer
from gyre.proxy import ProxyConfig, StoreSink
from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.trajectory.record import Role

from .conftest import TOOL_ARGS, TOOLS_ANTHROPIC, TOOLS_OPENAI, scripted_engine


def _visible_text(ids):
    tok = load_tokenizer()
    return tok.decode([i for i in ids if i not in (0, 2)])


def _assert_chain(records):
    """Record k+1's input starts with record k's input followed by its output, token for token."""
    for prev, nxt in zip(records, records[1:]):
        prefix = list(prev.input_ids) + list(prev.output_ids)
        assert list(nxt.input_ids[: len(prefix)]) == prefix


def test_openai_plain_stream_and_logprobs(make_server):
    proxy, h = make_server([(DeterministicEngine("e", eos_prob=0.05, salt=3), "cell", 0)])
    key = proxy.issue_key("ex-plain")
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0)
    r = c.chat.completions.create(model="any", messages=[{"role": "user", "content": "hello"}], max_tokens=30, logprobs=True, top_logprobs=0)
    rec = proxy.sink.records[-1]
    assert rec.execution_id == "ex-plain" and rec.role is Role.MAIN
    assert r.choices[0].message.content == _visible_text(rec.output_ids)
    assert r.usage.completion_tokens == len(rec.output_ids) and r.usage.prompt_tokens == len(rec.input_ids)
    visible = [lp for t, lp in zip(rec.output_ids, rec.output_logprobs) if t not in (0, 2)]
    assert [e.logprob for e in r.choices[0].logprobs.content] == pytest.approx(list(visible))
    assert r.choices[0].finish_reason == ("length" if len(rec.output_ids) == 30 else "stop")

    chunks = list(c.chat.completions.create(model="any", messages=[{"role": "user", "content": "hello"}], max_tokens=30, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content  # same prompt, same deterministic engine
    assert chunks[-1].usage.completion_tokens == len(rec.output_ids) and not chunks[-1].choices
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [r.choices[0].finish_reason]

    comp = c.completions.create(model="any", prompt="def f(x):", max_tokens=8, stop=["\n\n"])
    assert proxy.sink.records[-1].input_ids.tolist() == load_tokenizer().encode("def f(x):", add_special_tokens=False)
    assert comp.choices[0].text == _visible_text(proxy.sink.records[-1].output_ids).split("\n\n")[0]
    assert [m.id for m in c.models.list().data] == ["gyre-policy"]


def test_stop_string_truncates_text_and_record_keeps_tokens(make_server):
    proxy, h = make_server([(DeterministicEngine("e", salt=11), "cell", 0)])
    key = proxy.issue_key("ex-stop")
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0)
    full = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=40).choices[0].message.content
    stop = full[10:13]
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=40, stop=[stop])
    assert r.choices[0].message.content == full[: full.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    rec = proxy.sink.records[-1]
    assert stop in _visible_text(rec.output_ids) and len(rec.output_ids) < 40
    assert rec.payload_ref["stop_string"] == stop


def _reserialize_openai(message, new_id):
    calls = []
    for tc in message.tool_calls:
        args = json.loads(tc.function.arguments)
        items = list(args.items())[::-1]  # other key order
        calls.append({"type": "function", "id": new_id, "function": {"arguments": json.dumps(dict(items), indent=3), "name": tc.function.name}})
    return {"tool_calls": calls, "content": "  " + (message.content or "") + "\n\n", "role": "assistant"}


@pytest.mark.parametrize("stream", [False, True])
def test_openai_tool_round_trip_with_splicing(make_server, stream):
    proxy, h = make_server([(scripted_engine(), "cell", 0)])
    key = proxy.issue_key("ex-tools")
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0)
    msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "How many files?"}]

    def ask(messages):
        if not stream:
            return c.chat.completions.create(model="m", messages=messages, tools=TOOLS_OPENAI, max_tokens=300).choices[0]
        with c.chat.completions.stream(model="m", messages=messages, tools=TOOLS_OPENAI, max_tokens=300) as s:
            return s.get_final_completion().choices[0]

    first = ask(msgs)
    assert first.finish_reason == "tool_calls"
    assert first.message.content == "Step 0: I will run a command."
    assert first.message.tool_calls[0].function.name == "bash"
    assert json.loads(first.message.tool_calls[0].function.arguments) == TOOL_ARGS[0]
    # the client re-serializes the turn (key order, whitespace, ids) and sends the tool result
    msgs += [_reserialize_openai(first.message, "rewritten-0"), {"role": "tool", "tool_call_id": "rewritten-0", "content": "a.py\nb.py"}]
    second = ask(msgs)
    assert json.loads(second.message.tool_calls[0].function.arguments) == TOOL_ARGS[1]
    # this time the SDK's own message object goes back
    msgs += [second.message, {"role": "tool", "tool_call_id": second.message.tool_calls[0].id, "content": "print(1)"}]
    third = ask(msgs)
    assert third.finish_reason == "stop" and third.message.content == "All done: found 2 files." and not third.message.tool_calls

    recs = proxy.sink.for_execution("ex-tools")
    assert len(recs) == 3
    _assert_chain(recs)
    assert [r.payload_ref["spliced_turns"] for r in recs] == [0, 1, 2]
    stats = proxy.execution_stats("ex-tools")
    assert stats.spliced_turns == 3 and stats.unmatched_turns == 0
    # splicing mattered: the byte-spelled sampled ids are not what re-tokenizing the text gives
    tok = load_tokenizer()
    naive = tok.encode(
        tok.apply_chat_template(
            [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "How many files?"},
             {"role": "assistant", "content": "Step 0: I will run a command.", "tool_calls": [{"name": "bash", "arguments": TOOL_ARGS[0]}]}],
            tools=TOOLS_OPENAI, tokenize=False),
        add_special_tokens=False,
    )
    assert list(recs[1].input_ids[: len(naive)]) != naive


def test_anthropic_tool_round_trip_with_splicing(make_server):
    proxy, h = make_server([(scripted_engine(), "cell", 0)])
    key = proxy.issue_key("ex-anth")
    a = anthropic.Anthropic(base_url=h.url, api_key=key, max_retries=0)
    msgs = [{"role": "user", "content": "How many files?"}]
    kw = dict(model="m", max_tokens=300, system="You are an agent.", tools=TOOLS_ANTHROPIC)
    first = a.messages.create(messages=msgs, **kw)
    assert first.stop_reason == "tool_use"
    text, use = first.content
    assert text.text == "Step 0: I will run a command." and use.name == "bash" and use.input == TOOL_ARGS[0]
    shuffled = dict(reversed(list(use.input.items())))
    msgs += [
        {"role": "assistant", "content": [{"type": "text", "text": text.text + " "}, {"type": "tool_use", "id": "toolu_other", "name": "bash", "input": shuffled}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_other", "content": "a.py\nb.py"}]},
    ]
    with a.messages.stream(messages=msgs, **kw) as s:  # streamed: input_json_delta must parse
        second = s.get_final_message()
    assert second.stop_reason == "tool_use" and second.content[-1].input == TOOL_ARGS[1]
    msgs += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in second.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": second.content[-1].id, "content": [{"type": "text", "text": "print(1)"}]}]},
    ]
    third = a.messages.create(messages=msgs, **kw)
    assert third.stop_reason == "end_turn" and third.content[0].text == "All done: found 2 files."
    recs = proxy.sink.for_execution("ex-anth")
    _assert_chain(recs)
    assert [r.payload_ref["spliced_turns"] for r in recs] == [0, 1, 2]
    n = a.messages.count_tokens(model="m", messages=msgs, system="You are an agent.", tools=TOOLS_ANTHROPIC).input_tokens
    assert n == len(recs[2].input_ids)


def test_same_history_through_both_apis_renders_the_same_prompt(make_server):
    proxy, h = make_server([(DeterministicEngine("e", eos_prob=0.2), "cell", 0)])
    key = proxy.issue_key("ex-both")
    openai.OpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}], max_tokens=5)
    anthropic.Anthropic(base_url=h.url, api_key=key, max_retries=0).messages.create(
        model="m", system="S", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    r1, r2 = proxy.sink.for_execution("ex-both")
    assert r1.input_ids.tolist() == r2.input_ids.tolist()


def test_a_system_entry_inside_anthropic_messages_renders_as_in_the_openai_api(make_server):
    """Claude Code 2.1.x sends its environment block as {"role": "system"} inside `messages` (the
    real CLI's first request; tests/executions/test_claude_code_example.py runs it). It is a system
    turn at that place, the same prompt as the OpenAI API renders for the same history."""
    proxy, h = make_server([(DeterministicEngine("e", eos_prob=0.2), "cell", 0)])
    key = proxy.issue_key("ex-sys")
    openai.OpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0).chat.completions.create(
        model="m", max_tokens=5, messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                                           {"role": "system", "content": "env: /repo"}, {"role": "user", "content": "go"}])
    anthropic.Anthropic(base_url=h.url, api_key=key, max_retries=0).messages.create(
        model="m", system="S", max_tokens=5,
        messages=[{"role": "user", "content": "hi"}, {"role": "system", "content": [{"type": "text", "text": "env: /repo"}]},
                  {"role": "user", "content": "go"}])
    r1, r2 = proxy.sink.for_execution("ex-sys")
    assert r1.input_ids.tolist() == r2.input_ids.tolist()
    assert "<|im_start|>system\nenv: /repo<|im_end|>" in load_tokenizer().decode(r2.input_ids.tolist())
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.role"):
        anthropic.Anthropic(base_url=h.url, api_key=key, max_retries=0).messages.create(
            model="m", max_tokens=5, messages=[{"role": "moderator", "content": "hi"}])


def test_roles_by_system_prompt_marker_header_and_key_hint(make_server):
    proxy, h = make_server([(DeterministicEngine("e", eos_prob=0.3), "cell", 0)])
    key = proxy.issue_key("ex-roles")
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0)

    def call(system, user, headers=None, client=c):
        client.chat.completions.create(model="m", messages=[{"role": "system", "content": system}, {"role": "user", "content": user}], max_tokens=3, extra_headers=headers)
        return proxy.sink.records[-1].role

    assert call("Main agent prompt.", "do it") is Role.MAIN
    assert call("Main agent prompt.", "Your task is to create a detailed summary of the conversation so far.") is Role.MAIN_SUMMARY
    assert call("You are a file-search sub-agent.", "find x") is Role.SUB
    assert call("You are a file-search sub-agent.", "Please summarize the conversation so far") is Role.SUB_SUMMARY
    assert call("Main agent prompt.", "do it", {"x-gyre-role": "sub_summary"}) is Role.SUB_SUMMARY
    sub_key = proxy.issue_key("ex-roles", role_hint="sub")
    c2 = openai.OpenAI(base_url=h.url + "/v1", api_key=sub_key, max_retries=0)
    assert call("Main agent prompt.", "do it", client=c2) is Role.SUB
    with pytest.raises(openai.BadRequestError) as e:
        call("Main agent prompt.", "x", {"x-gyre-role": "boss"})
    assert e.value.body["param"] == "x-gyre-role"
    assert proxy.execution_stats("ex-roles").roles == {"MAIN": 1, "MAIN_SUMMARY": 1, "SUB": 2, "SUB_SUMMARY": 2}


def test_records_go_to_the_store(make_server, tmp_path):
    from gyre.trajectory.store import TitoStore

    store = TitoStore(tmp_path)
    sink = StoreSink(store)
    proxy, h = make_server([(DeterministicEngine("e", eos_prob=0.1, salt=random.Random(0).randint(0, 99)), "cell", 0)], sink=sink)
    key = proxy.issue_key("ex-store")
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0)
    for q in ("a", "b"):
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": q}], max_tokens=10, logprobs=True)
    stats = h.call_fn(proxy.close_execution, "ex-store")
    assert stats.calls == 2
    loaded = store.load("ex-store")
    assert [r.call_id for r in loaded] == [0, 1]
    assert all(len(r.output_logprobs) == len(r.output_ids) > 0 for r in loaded)
    with pytest.raises(openai.AuthenticationError):  # closing the execution revoked its key
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "c"}], max_tokens=3)


def test_proxy_config_is_tyro_friendly():
    import dataclasses

    cfg = ProxyConfig(max_context_tokens=100)
    assert dataclasses.replace(cfg, port=5).port == 5 and cfg.roles.header == "x-gyre-role"
