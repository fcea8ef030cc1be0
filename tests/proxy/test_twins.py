"""Identical parallel sub-agents (issue 53 item 11): two calls of one execution with the same
context that sample the same text in other token ids. Each twin's next call must carry its own
sampled ids, not one twin's ids spliced into both (the tree would then extend one sample twice and
leave the other a dead end). Through the official `openai` and `anthropic` SDKs."""

import json

import anthropic
import openai
import pytest

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.models.tokenizer import byte_token_ids, load_tokenizer
from gyre.proxy.tool_ids import named_call, tool_call_id

from .conftest import TOOLS_ANTHROPIC, TOOLS_OPENAI


class TwinEngine(DeterministicEngine):
    """Answers `script`'s text; every second request spells it in the tokenizer's own ids instead
    of one id per byte: the same text, other ids (as two samples of a real model can be)."""

    def __init__(self, script):
        super().__init__("twins", script=script, byte_ids=byte_token_ids(load_tokenizer()))
        self.requests = 0

    def _scripted(self, input_ids, max_tokens):
        ids = super()._scripted(input_ids, max_tokens)
        self.requests += 1
        if ids is None or self.requests % 2:
            return ids
        return (load_tokenizer().encode(self.script(list(input_ids)), add_special_tokens=False) + [self.eos_token_id])[:max_tokens]


def _tool_script(input_ids):
    if "<tool_response>" not in load_tokenizer().decode(input_ids):
        return 'Looking.\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>'
    return "Two files."


def _text_script(input_ids):
    return {1: "Thinking.", 2: "Still thinking."}.get(load_tokenizer().decode(input_ids).count("go on"), "Done.")


def _continues(rec, parent) -> bool:
    prefix = list(parent.input_ids) + list(parent.output_ids)
    return list(rec.input_ids[: len(prefix)]) == prefix


def test_tool_call_ids_name_their_call_and_nothing_else():
    assert named_call([tool_call_id("call_", 7), tool_call_id("call_", 7)]) == 7
    assert named_call([tool_call_id("toolu_", 12)]) == 12
    # mixed calls, foreign ids, a forged hex tail, no ids: nothing is named
    for ids in ([tool_call_id("call_", 1), tool_call_id("call_", 2)], ["call_abc"], [None], [],
                [tool_call_id("call_", 3), "call_0123456789abcdef"], ["call_0123456789abcdefg"]):
        assert named_call(ids) is None, ids


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_twin_sub_agents_with_tool_calls_each_get_their_own_ids(make_server, api):
    proxy, h = make_server([(TwinEngine(_tool_script), "cell", 0)])
    key = proxy.issue_key("ex-twins")
    system, ask = "You are a sub-agent.", "How many files?"
    if api == "openai":
        c = openai.OpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0)
        history = [{"role": "system", "content": system}, {"role": "user", "content": ask}]

        def call(messages):
            return c.chat.completions.create(model="m", messages=messages, tools=TOOLS_OPENAI, max_tokens=200).choices[0].message

        firsts = [call(history), call(history)]
        for m in firsts:
            assert m.content == "Looking." and json.loads(m.tool_calls[0].function.arguments) == {"cmd": "ls"}
        # each twin re-sends its own turn (the SDK's own objects) with its tool result, A first: with
        # nothing to tell them apart, A's call would take the newer twin (B's ids)
        for m in firsts:
            call(history + [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "a b"}])
    else:
        c = anthropic.Anthropic(base_url=h.url, api_key=key, max_retries=0)
        history = [{"role": "user", "content": ask}]

        def call(messages):
            return c.messages.create(model="m", system=system, messages=messages, tools=TOOLS_ANTHROPIC, max_tokens=200)

        firsts = [call(history), call(history)]
        for m in firsts:
            use = next(b for b in m.content if b.type == "tool_use")
            call(history + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "a b"}]}])
    a1, b1, a2, b2 = proxy.sink.for_execution("ex-twins")
    assert list(a1.input_ids) == list(b1.input_ids) and list(a1.output_ids) != list(b1.output_ids)  # twins
    assert _continues(a2, a1) and _continues(b2, b1)  # before: both continued b1 (the newer twin)
    assert a2.payload_ref["spliced_turns"] == b2.payload_ref["spliced_turns"] == 1


def test_text_twins_are_continued_apart_and_later_turns_follow_their_own_chain(make_server):
    """Text without tool calls names nothing: the proxy cannot tell the twins apart, so their
    next calls take one twin each (not both the same), and a later call follows the chain its
    last turn was sampled in."""
    proxy, h = make_server([(TwinEngine(_text_script), "cell", 0)])
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-text"), max_retries=0)

    def call(messages):
        return c.chat.completions.create(model="m", messages=messages, max_tokens=100).choices[0].message.content

    h0 = [{"role": "system", "content": "You are a sub-agent."}, {"role": "user", "content": "go on"}]
    assert call(h0) == call(h0) == "Thinking."
    h1 = h0 + [{"role": "assistant", "content": "Thinking."}, {"role": "user", "content": "go on"}]
    assert call(h1) == call(h1) == "Still thinking."
    h2 = h1 + [{"role": "assistant", "content": "Still thinking."}, {"role": "user", "content": "go on"}]
    assert call(h2) == call(h2) == "Done."
    r = proxy.sink.for_execution("ex-text")
    first, second, third = r[0:2], r[2:4], r[4:6]
    # each second call continues a different first-call twin
    parents = [next(i for i, p in enumerate(first) if _continues(s, p)) for s in second]
    assert sorted(parents) == [0, 1], parents
    # each third call continues a different second call (so each whole chain is one sub-agent's)
    parents = [next(i for i, p in enumerate(second) if _continues(t, p)) for t in third]
    assert sorted(parents) == [0, 1], parents
