"""Per chat format, through the official SDKs (openai chat + Responses, anthropic), streamed and
not: a scripted model that thinks (formats with reasoning) and calls tools in its family's own
syntax, driven by the family's own tokenizer and template (tests/realmodels.py). The client sees
structured tool calls and reasoning as reasoning; the records splice exactly. Test ids name the
family; chatml (no tool calls of its own) runs as --proxy.tool-format hermes serves it."""

import functools
import json

import anthropic
import openai
import pytest

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.models.tokenizer import byte_token_ids
from gyre.proxy import Proxy, ProxyConfig, serve_proxy
from gyre.proxy.formats import FORMATS

from .conftest import TOOL_ARGS, TOOLS_ANTHROPIC, TOOLS_OPENAI
from .test_formats_parsers import TOOL_FORMAT, family_tokenizer, fmt_of, render_calls

FAMILIES = list(FORMATS)
SYSTEM = "You are an agent."
FINAL = "All done: found 2 files."


@functools.lru_cache(maxsize=None)
def tokenizer(family):
    return family_tokenizer(family)


def step_text(k):
    return f"Step {k}: I will run a command."


def thought(k):
    return f"I should look, step {k}."


def script_for(family):
    tok = tokenizer(family)
    fmt = fmt_of(family)

    def script(input_ids):
        prompt = tok.decode(input_ids)
        k = prompt.count("ipython<|end_header_id|>") if family == "llama3.1" else prompt.count("<tool_response>")
        opening = fmt.tool_call_opening("bash")
        if prompt.endswith(opening):  # a forced call: the model continues the opening
            return render_calls(family, "", [("bash", TOOL_ARGS[0])])[len(opening):]
        if k < len(TOOL_ARGS):
            text = render_calls(family, "" if family == "llama3.1" else step_text(k), [("bash", TOOL_ARGS[k])])
        else:
            text = FINAL
        if prompt.endswith("<think>\n"):  # the prompt opened thinking (Qwen3.5): the model continues it
            text = f"{thought(k)}\n</think>\n\n" + text
        elif fmt.reasoning is not None and not prompt.endswith("</think>\n\n"):  # the prompt did not turn thinking off
            text = f"<think>\n{thought(k)}\n</think>\n\n" + text
        return text

    return script


@pytest.fixture
def served():
    handles = []

    def make(family, **cfg):
        tok = tokenizer(family)
        eot = tok.backend_tokenizer.token_to_id(FORMATS[family].end_of_turn)
        proxy = Proxy(ProxyConfig(**{"tool_format": TOOL_FORMAT.get(family, "auto"), **cfg}), tokenizer=tok)
        assert proxy.format.name == family  # chosen from the checkpoint's own template
        proxy.router.add_engine(DeterministicEngine("e", script=script_for(family), byte_ids=byte_token_ids(tok), eos_token_id=eot), kind="cell", index=0)
        h = serve_proxy(proxy)
        handles.append(h)
        return proxy, h

    yield make
    for h in handles:
        h.stop()


def assert_records_splice(proxy, execution, family, n=3):
    recs = proxy.sink.for_execution(execution)
    assert len(recs) == n
    for prev, nxt in zip(recs, recs[1:]):
        prefix = list(prev.input_ids) + list(prev.output_ids)
        assert list(nxt.input_ids[: len(prefix)]) == prefix
    assert [r.payload_ref["spliced_turns"] for r in recs] == list(range(n))
    assert all(r.payload_ref["unmatched_turns"] == 0 and r.payload_ref["chat_format"] == family for r in recs)
    tok = tokenizer(family)
    assert FINAL in tok.decode(list(recs[-1].output_ids))  # ids decode with the checkpoint's tokenizer
    return recs


def has_reasoning(family):
    return FORMATS[family].reasoning is not None


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("family", FAMILIES)
def test_openai_chat(served, family, stream):
    proxy, h = served(family)
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex"), max_retries=0)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How many files?"}]

    def ask():
        if not stream:
            return c.chat.completions.create(model="m", messages=msgs, tools=TOOLS_OPENAI, max_tokens=400).choices[0]
        chunks = list(c.chat.completions.create(model="m", messages=msgs, tools=TOOLS_OPENAI, max_tokens=400, stream=True))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        calls = [tc for d in deltas for tc in d.tool_calls or ()]
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        msg = openai.types.chat.ChatCompletionMessage(role="assistant", content=content or None, tool_calls=[
            {"id": tc.id, "type": "function", "function": {"name": tc.function.name, "arguments": tc.function.arguments}} for tc in calls] or None)
        msg.reasoning_content = reasoning or None
        return type("Choice", (), {"message": msg, "finish_reason": finish[-1]})

    for k in range(3):
        ch = ask()
        m = ch.message
        assert (getattr(m, "reasoning_content", None) or None) == (thought(k) if has_reasoning(family) else None)
        if k < 2:
            assert ch.finish_reason == "tool_calls"
            assert (m.content or "") == ("" if family == "llama3.1" else step_text(k))
            assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [("bash", TOOL_ARGS[k])]
            resent = {"role": "assistant", "content": m.content, "tool_calls": [
                {"id": f"id{k}", "type": "function", "function": {"name": "bash", "arguments": json.dumps(dict(reversed(TOOL_ARGS[k].items())))}}]}
            msgs += [resent, {"role": "tool", "tool_call_id": f"id{k}", "content": f"out {k}"}]
        else:
            assert ch.finish_reason == "stop" and m.content == FINAL and not m.tool_calls
    assert_records_splice(proxy, "ex", family)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("family", FAMILIES)
def test_anthropic_messages(served, family, stream):
    proxy, h = served(family)
    a = anthropic.Anthropic(base_url=h.url, api_key=proxy.issue_key("ex"), max_retries=0)
    msgs = [{"role": "user", "content": "How many files?"}]
    kw = dict(model="m", max_tokens=400, system=SYSTEM, tools=TOOLS_ANTHROPIC)
    for k in range(3):
        if stream:
            with a.messages.stream(messages=msgs, **kw) as s:
                r = s.get_final_message()
        else:
            r = a.messages.create(messages=msgs, **kw)
        kinds = [b.type for b in r.content]
        thinking = [b.thinking for b in r.content if b.type == "thinking"]
        assert thinking == ([thought(k)] if has_reasoning(family) else [])
        if k < 2:
            assert r.stop_reason == "tool_use"
            want = (["thinking"] if has_reasoning(family) else []) + ([] if family == "llama3.1" else ["text"]) + ["tool_use"]
            assert kinds == want
            use = r.content[-1]
            assert use.name == "bash" and use.input == TOOL_ARGS[k]
            msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": f"out {k}"}]}]
        else:
            assert r.stop_reason == "end_turn" and r.content[-1].text == FINAL
    assert_records_splice(proxy, "ex", family)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("family", FAMILIES)
def test_openai_responses(served, family, stream):
    proxy, h = served(family)
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex"), max_retries=0)
    tools = [{"type": "function", "name": "bash", "description": "Run a shell command", "parameters": TOOLS_OPENAI[0]["function"]["parameters"]}]
    items = [{"role": "user", "content": "How many files?"}]
    for k in range(3):
        if stream:
            events = list(c.responses.create(model="m", instructions=SYSTEM, input=items, tools=tools, max_output_tokens=400, stream=True))
            r = events[-1].response
            deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
            assert deltas == (thought(k) if has_reasoning(family) else "")
        else:
            r = c.responses.create(model="m", instructions=SYSTEM, input=items, tools=tools, max_output_tokens=400)
        reasoning = [o for o in r.output if o.type == "reasoning"]
        assert [o.content[0].text for o in reasoning] == ([thought(k)] if has_reasoning(family) else [])
        calls = [o for o in r.output if o.type == "function_call"]
        if k < 2:
            assert [(o.name, json.loads(o.arguments)) for o in calls] == [("bash", TOOL_ARGS[k])]
            assert r.output_text == ("" if family == "llama3.1" else step_text(k))
            items += [o.model_dump(exclude_none=True) for o in r.output]
            items.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": f"out {k}"})
        else:
            assert not calls and r.output_text == FINAL
    assert_records_splice(proxy, "ex", family)


def test_qwen3_enable_thinking_off(served):
    """chat_template_kwargs enable_thinking=false: the prompt closes an empty think block (input),
    the model answers without thinking, and the re-sent turn still splices (the block is part of
    the stored turn)."""
    proxy, h = served("qwen3")
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex"), max_retries=0)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How many files?"}]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    for k in range(3):
        m = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS_OPENAI, max_tokens=400, extra_body=off).choices[0].message
        assert getattr(m, "reasoning_content", None) is None
        if k < 2:
            assert m.content == step_text(k)
            msgs += [m, {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": f"out {k}"}]
    recs = assert_records_splice(proxy, "ex", "qwen3")
    tok = tokenizer("qwen3")
    assert all(tok.decode(list(r.input_ids)).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for r in recs)
    assert all(r.payload_ref["reasoning_prefix"] > 0 for r in recs)
    # Anthropic's `thinking` switch reaches the template too
    a = anthropic.Anthropic(base_url=h.url, api_key=proxy.issue_key("ex2"), max_retries=0)
    r = a.messages.create(model="m", max_tokens=50, messages=[{"role": "user", "content": "hi"}], thinking={"type": "disabled"})
    assert [b.type for b in r.content] == ["text"]
    assert tokenizer("qwen3").decode(list(proxy.sink.records[-1].input_ids)).endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("family", ["qwen3-coder", "llama3.1", "chatml"])
def test_forced_tool_call_in_the_family_syntax(served, family):
    """tool_choice naming a function: the format's own call opening is forced."""
    proxy, h = served(family)
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex"), max_retries=0)
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}], tools=TOOLS_OPENAI, max_tokens=400,
                                  tool_choice={"type": "function", "function": {"name": "bash"}})
    rec = proxy.sink.records[-1]
    opening = fmt_of(family).tool_call_opening("bash")
    assert tokenizer(family).decode(list(rec.input_ids)).endswith(opening)
    assert rec.payload_ref["forced_prefix"] > 0 and r.choices[0].message.tool_calls[0].function.name == "bash"


def test_qwen3_past_reasoning_strip_through_the_api(served):
    """--proxy.past-reasoning strip: after a new user query the earlier turn is rendered as the
    template does (no thinking): that call's prompt is exactly the template's, a new branch."""
    proxy, h = served("qwen3", past_reasoning="strip")
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex"), max_retries=0)
    msgs = [{"role": "user", "content": "Hi"}]
    m = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS_OPENAI, max_tokens=400).choices[0].message
    assert m.reasoning_content == thought(0)
    calls = [{"id": "c0", "type": "function", "function": {"name": "bash", "arguments": m.tool_calls[0].function.arguments}}]
    msgs += [{"role": "assistant", "content": m.content, "tool_calls": calls}, {"role": "tool", "tool_call_id": "c0", "content": "x"},
             {"role": "user", "content": "And now?"}]
    c.chat.completions.create(model="m", messages=msgs, tools=TOOLS_OPENAI, max_tokens=400)
    first, second = proxy.sink.for_execution("ex")
    assert second.payload_ref["stripped_turns"] == 1 and second.payload_ref["spliced_turns"] == 0
    tok = tokenizer("qwen3")
    want = tok.apply_chat_template(msgs, tools=TOOLS_OPENAI, tokenize=False, add_generation_prompt=True)
    assert tok.decode(list(second.input_ids)) == want and thought(0) not in want


def test_reasoning_sent_back_reaches_the_template():
    """Re-sent reasoning (chat reasoning_content, Anthropic thinking blocks, Responses reasoning
    items) is the assistant message's reasoning_content, for the template to render or drop."""
    from gyre.proxy import anthropic_api, openai_api, responses_api

    chat = openai_api.parse_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r1"}])
    anth = anthropic_api.parse_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "r1", "signature": ""}, {"type": "text", "text": "a"}]}], None)
    resp = responses_api.parse_input([{"role": "user", "content": "q"},
                                      {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "r1"}]},
                                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]}])
    want = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r1"}]
    assert chat == anth == resp == want
    # an unmatched turn after the last query renders with its thinking, as the template does
    from gyre.proxy.render import ChatRenderer

    r = ChatRenderer(tokenizer("qwen3"), fmt=FORMATS["qwen3"])
    text = tokenizer("qwen3").decode(r.render(want + [{"role": "tool", "content": "x"}], None, None).ids)
    assert "<think>\nr1\n</think>\n\na" in text


def test_special_reasoning_tokens_decode_for_the_parser():
    """A real model samples <think> / </think> / <tool_call> as their special ids: the byte table
    gives their text, so the parser sees them."""
    from gyre.backends.models.tokenizer import token_bytes
    from gyre.proxy.formats import split_output

    tok = tokenizer("qwen3")
    text = '<think>\nhm\n</think>\n\nok\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>'
    ids = tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
    assert tok.convert_tokens_to_ids("<think>") in ids
    table = token_bytes(tok)
    decoded = b"".join(table[i] for i in ids).decode()
    assert decoded == text and split_output(FORMATS["qwen3"], decoded)[:2] == ("hm", "ok")


def test_template_refusal_is_a_400(served):
    """Llama 3.1's template allows one tool call per assistant turn: a turn with two (not one the
    model produced, so rendered from text) is a 400 naming the template's reason, not a 500."""
    proxy, h = served("llama3.1")
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex"), max_retries=0)
    two = [{"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": "{}"}} for i in range(2)]
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": two},
            {"role": "tool", "tool_call_id": "c0", "content": "x"}, {"role": "tool", "tool_call_id": "c1", "content": "y"}]
    with pytest.raises(openai.BadRequestError, match="single tool-calls"):
        c.chat.completions.create(model="m", messages=msgs, tools=TOOLS_OPENAI, max_tokens=5)
