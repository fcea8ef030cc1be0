"""Whatever a model samples, a harness that re-sends what it was given is spliced.

A random-init model (tests/realmodels.py checkpoints in the end-to-end job) samples any id
anywhere: `<think>` after text, a lone `</think>`, `<tool_call>` without its end, `<tool_response>`,
an end-of-text token, all cut by max_tokens. Here a scripted engine emits such id sequences
(hypothesis: special tokens of the family mixed with ordinary text and random ids, cut at random
lengths), through the official openai SDK against the proxy, and the harness re-sends each turn
the way examples/cpu_demo/harness.py does (content + tool calls, arguments as the string it got)
or the way an SDK harness re-sending the whole message does (content + tool calls +
reasoning_content). Every next call must splice the turn: 0 unmatched, and its prompt starts with
the previous prompt + the sampled ids. Test ids name the family.
"""

from __future__ import annotations

import functools
import os

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.models.tokenizer import byte_token_ids
from gyre.proxy import Proxy, ProxyConfig, serve_proxy
from gyre.proxy.formats import FORMATS

from .test_formats_parsers import family_tokenizer

FAMILIES = ["qwen2.5", "qwen3", "qwen3-coder", "llama3.1"]
TOOLS = [{"type": "function", "function": {"name": "write_next", "parameters": {
    "type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"]}}},
         {"type": "function", "function": {"name": "finish", "parameters": {"type": "object", "properties": {}}}}]
# Text a model of these families writes (tool-call syntax pieces among them), cut into ids anywhere.
WORDS = ["hello", " world", "\n", "\n\n", " ", '{"name": "write_next", "arguments": {"content": "3"}}',
         '{"name": "finish", "arguments": {}}', "<function=write_next>", "<parameter=content>", "3", "</parameter>",
         "</function>", '{"name": "finish", "parameters": {}}', "; ", "<think>", "</think>", "<tool_call>", "</tool_call>"]


@functools.lru_cache(maxsize=None)
def tokenizer(family):
    return family_tokenizer(family)


class IdsEngine(DeterministicEngine):
    """Emits the next scripted id list as sampled (cut by max_tokens, stopped by stop ids)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.queue: list[list[int]] = []

    def _scripted(self, input_ids, max_tokens):
        # a sequence that max_tokens does not cut ends in the end-of-turn token, as a model's would
        return ((self.queue.pop(0) if self.queue else []) + [self.eos_token_id])[:max_tokens]


@pytest.fixture(scope="module")
def servers():
    made = {}

    def get(family):
        if family not in made:
            tok = tokenizer(family)
            eot = tok.backend_tokenizer.token_to_id(FORMATS[family].end_of_turn)
            proxy = Proxy(ProxyConfig(), tokenizer=tok)
            eng = IdsEngine("e", script=lambda ids: "", byte_ids=byte_token_ids(tok), eos_token_id=eot,
                            vocab_size=tok.backend_tokenizer.get_vocab_size(with_added_tokens=True))
            proxy.router.add_engine(eng, kind="cell", index=0)
            made[family] = (proxy, eng, serve_proxy(proxy))
        return made[family]

    yield get
    for _, _, h in made.values():
        h.stop()


def special_ids(tok) -> list[int]:
    return sorted(i for i, t in tok.backend_tokenizer.get_added_tokens_decoder().items())


@st.composite
def outputs(draw, tok):
    """One sampled id sequence: the family's special ids, pieces of text and tool-call syntax
    (encoded), random ids, ids past the tokenizer (a padded vocabulary); max_tokens cuts it."""
    specials = special_ids(tok)
    vocab = tok.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    piece = st.one_of(
        st.sampled_from(specials).map(lambda i: [i]),
        st.sampled_from(WORDS).map(lambda w: tok.backend_tokenizer.encode(w, add_special_tokens=False).ids),
        st.integers(0, vocab - 1).map(lambda i: [i]),
        st.integers(vocab, vocab + 7).map(lambda i: [i]),  # a padded embedding's rows: no token, shown as nothing
    )
    ids = [i for p in draw(st.lists(piece, min_size=1, max_size=8)) for i in p]
    return ids


counter = iter(range(10**9))


def run_chat(family, servers, data, resend_reasoning: bool):
    proxy, eng, h = servers(family)
    tok = tokenizer(family)
    ex = f"ex{next(counter)}"
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key(ex), max_retries=0)
    msgs = [{"role": "system", "content": "You are the main agent."}, {"role": "user", "content": "Task: words red blue."}]
    sent = []
    for k in range(data.draw(st.integers(2, 4), label="calls")):
        ids = data.draw(outputs(tok), label=f"ids{k}")
        max_tokens = data.draw(st.integers(1, 16), label=f"max_tokens{k}")
        eng.queue.append(ids)
        resp = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=max_tokens)
        m = resp.choices[0].message
        sent.append((ids[:max_tokens], m))
        calls = [{"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments} for tc in m.tool_calls or ()]
        a = {"role": "assistant", "content": m.content or ""}  # as examples/cpu_demo/harness.py
        if calls:
            a["tool_calls"] = [{"id": x["id"], "type": "function", "function": {"name": x["name"], "arguments": x["arguments"]}} for x in calls]
        r = getattr(m, "reasoning_content", None)
        if resend_reasoning and r:
            a["reasoning_content"] = r
        msgs.append(a)
        if calls:
            msgs += [{"role": "tool", "tool_call_id": x["id"], "content": "error: bad. next: red.txt"} for x in calls]
        else:
            msgs.append({"role": "user", "content": "error: expected one tool call. next: red.txt"})
    eng.queue.clear()
    eng.queue.append([tok.backend_tokenizer.token_to_id(FORMATS[family].end_of_turn)])
    c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=4)
    recs = proxy.sink.for_execution(ex)
    for i, (prev, nxt) in enumerate(zip(recs, recs[1:])):
        note = f"call {i}: sampled {tok.decode(list(prev.output_ids), skip_special_tokens=False)!r} -> {sent[i][1]!r}"
        assert nxt.payload_ref["unmatched_turns"] == 0, (note, nxt.payload_ref["unmatched_kinds"])
        prefix = list(prev.input_ids) + list(prev.output_ids)
        assert list(nxt.input_ids[: len(prefix)]) == prefix, note


@pytest.mark.parametrize("resend_reasoning", [False, True], ids=["cpu_demo", "with_reasoning"])
@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=int(os.environ.get("GYRE_RANDOM_OUTPUT_EXAMPLES", 15)), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_outputs_splice(servers, family, resend_reasoning, data):
    run_chat(family, servers, data, resend_reasoning)


def test_think_end_in_content_is_the_turns_own_text():
    """The case the random model hit (1 end-to-end run in 3): a `</think>` sampled with no thinking
    open stays in the content. Re-sent as given, it is that turn, not the turn whose content is
    the part after the tag (here an empty answer sampled first: its ids must not stand in)."""
    from gyre.proxy.render import ChatRenderer, StoredTurn, TurnStore, turn_fingerprint

    tok = tokenizer("qwen3")
    enc = tok.backend_tokenizer
    eot, eos, end_think = (enc.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>", "</think>"))
    r = ChatRenderer(tok, fmt=FORMATS["qwen3"])
    store = TurnStore()
    msgs = [{"role": "user", "content": "go"}]
    first = r.render(msgs, None, store)
    store.add(turn_fingerprint("", []), StoredTurn.of(0, first.ids, [eos], "", []))
    msgs += [{"role": "assistant", "content": ""}, {"role": "user", "content": "again"}]
    second = r.render(msgs, None, store)
    assert second.spliced == 1 and second.ids[: len(first.ids) + 1] == first.ids + [eos]
    sampled = enc.encode("ok", add_special_tokens=False).ids + [end_think, eot]
    store.add(turn_fingerprint("ok</think>", []), StoredTurn.of(1, second.ids, sampled, "ok</think>", []))
    msgs += [{"role": "assistant", "content": "ok</think>"}, {"role": "user", "content": "more"}]
    third = r.render(msgs, None, store)
    assert third.unmatched == 0 and third.spliced == 2
    assert third.ids[: len(second.ids) + len(sampled)] == second.ids + sampled
    # thinking put back into the text still finds the turn by its answer
    store.add(turn_fingerprint("fine", []), StoredTurn.of(2, third.ids, enc.encode("<think>\nhm\n</think>\n\nfine", add_special_tokens=False).ids + [eot], "fine", []))
    msgs += [{"role": "assistant", "content": "<think>\nhm\n</think>\n\nfine"}, {"role": "user", "content": "end"}]
    assert r.render(msgs, None, store).spliced == 3
