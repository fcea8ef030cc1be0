"""Exact TITO per chat format (gyre/proxy/render.py): over random conversations, the prompt of
call k+1 begins with call k's exact prompt + sampled ids whenever the harness re-sends the turn
(re-serialized: whitespace around the text, argument key order). The sampled ids are a
non-canonical tokenization (random cuts), as a model may sample. Qwen3 with
enable_thinking on and off, and past_reasoning keep / strip. Test ids name the family."""

import functools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.proxy.formats import FORMATS, split_output
from gyre.proxy.render import ChatRenderer, StoredTurn, TurnStore, turn_fingerprint

from gyre.proxy.formats.choice import chat_setup

from .test_formats_parsers import TOOL_FORMAT, family_tokenizer, fmt_of, TOOLS, _calls, _plain, _reasoning_text, render_calls


@functools.lru_cache(maxsize=None)
def tokenizer(family):
    return family_tokenizer(family)


def sampled_ids(tok, text, rng):
    """`text` as ids a model could sample: cut at random points, each piece encoded alone."""
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
    ids = []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        ids += tok.backend_tokenizer.encode(text[a:b], add_special_tokens=False).ids
    return ids


def run_conversation(family, data, past_reasoning="keep", turns_n=4):
    tok = tokenizer(family)
    setup = chat_setup(tok, tool_format=TOOL_FORMAT.get(family, "auto"))  # as the proxy builds it
    fmt = setup.format
    assert fmt.tool_syntax == fmt_of(family).tool_syntax
    r = ChatRenderer(tok, splice="exact", fmt=fmt, past_reasoning=past_reasoning, tools=setup.tools)
    eot = tok.backend_tokenizer.token_to_id(fmt.end_of_turn)
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    tools = TOOLS if data.draw(st.booleans()) else None
    kw = {}
    if fmt.thinking_switch and data.draw(st.booleans()):
        kw[fmt.thinking_switch] = data.draw(st.booleans())
    thinking = fmt.reasoning is not None and kw.get(fmt.thinking_switch, True)
    messages = ([{"role": "system", "content": data.draw(_plain)}] if data.draw(st.booleans()) else []) + [{"role": "user", "content": data.draw(_plain)}]
    store = TurnStore()
    prev = None
    log = []
    for k in range(turns_n):
        out = r.render(messages, tools, store, template_kwargs=kw)
        plain = r.render(messages, tools, None, template_kwargs=kw)  # the template's own rendering
        log.append((out, plain, prev))
        # the model's turn, in the format's syntax
        calls = data.draw(_calls) if tools else []
        if family == "llama3.1":
            calls = calls[:1]  # one call a turn (the Llama 3.1 template refuses more)
        content = "" if (family == "llama3.1" and calls) else data.draw(st.one_of(st.just(""), _plain) if calls else _plain)
        text = render_calls(family, content, calls)
        if out.gen_prefix.endswith("<think>\n"):  # the prompt opened thinking (Qwen3.5): the model closes it
            text = data.draw(_reasoning_text).strip("\n") + "\n</think>\n\n" + text
        elif thinking and data.draw(st.booleans()):
            text = "<think>\n" + data.draw(_reasoning_text).strip("\n") + "\n</think>\n\n" + text
        out_ids = sampled_ids(tok, text, rng) + [eot]
        reasoning, content_p, tcs = split_output(fmt, text, tools, prefix=out.gen_prefix)
        got = [{"name": t.name, "arguments": t.arguments} for t in tcs]
        assert [(c["name"], c["arguments"]) for c in got] == calls and content_p == content
        n_ctx = len(out.ids) - out.gen_prefix_ids  # as gyre.proxy.core stores a turn
        store.add(turn_fingerprint(content_p, got), StoredTurn.of(k, out.ids[:n_ctx], out.ids[n_ctx:] + out_ids, content_p, got))
        prev = out.ids + out_ids
        # the harness re-sends it, re-serialized, and answers
        resent = [{"name": c["name"], "arguments": dict(reversed(list(c["arguments"].items())))} for c in got]
        msg = {"role": "assistant", "content": ("  " + content_p + "\n") if content_p else ""}
        if reasoning and data.draw(st.booleans()):
            msg["reasoning_content"] = reasoning  # a harness that sends the thinking back
        if resent:
            msg["tool_calls"] = resent
        messages.append(msg)
        if got:
            messages += [{"role": "tool", "content": data.draw(_plain)} for _ in got]
        else:
            messages.append({"role": "user", "content": data.draw(_plain)})
    return log, thinking


@pytest.mark.parametrize("family", list(FORMATS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_splice_is_exact(family, data):
    log, _ = run_conversation(family, data)
    eot = tokenizer(family).backend_tokenizer.token_to_id(FORMATS[family].end_of_turn)
    for out, plain, prev in log:
        assert out.unmatched == 0
        # each sampled end-of-turn token stands for the template's (never both)
        assert out.ids.count(eot) == plain.ids.count(eot)
        if prev is not None:
            assert out.ids[: len(prev)] == prev
        if out.spliced == 0:
            assert out.ids == plain.ids  # nothing to splice: exactly the template's prompt


@pytest.mark.parametrize("family", [f for f in FORMATS if FORMATS[f].strips_past_reasoning])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_past_reasoning_strip(family, data):
    """strip: turns the template shows without thinking (before the last user query, or re-sent
    without reasoning_content) are rendered as the template does: with none spliced, the prompt
    is exactly the template's (a branch, exact); a tool-call chain whose turns come back with their
    reasoning still splices."""
    log, _ = run_conversation(family, data, past_reasoning="strip")
    for out, plain, prev in log:
        assert out.unmatched == 0
        if out.spliced == 0:
            assert out.ids == plain.ids
        elif not out.stripped:
            assert out.ids[: len(prev)] == prev


def test_qwen3_keep_differs_from_template_after_a_new_query():
    """keep really splices the thinking back (the template alone would drop it)."""
    tok = tokenizer("qwen3")
    r = ChatRenderer(tok, splice="exact", fmt=FORMATS["qwen3"])
    msgs = [{"role": "user", "content": "hi"}]
    out = r.render(msgs, None, TurnStore())
    text = "<think>\nponder\n</think>\n\nhello"
    ids = tok.backend_tokenizer.encode(text, add_special_tokens=False).ids + [tok.backend_tokenizer.token_to_id("<|im_end|>")]
    store = TurnStore()
    store.add(turn_fingerprint("hello", []), StoredTurn.of(0, out.ids, ids, "hello", []))
    msgs += [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    keep = r.render(msgs, None, store)
    plain = r.render(msgs, None, None)
    assert keep.ids[: len(out.ids) + len(ids)] == out.ids + ids and keep.ids != plain.ids
    assert "ponder" in tok.decode(keep.ids) and "ponder" not in tok.decode(plain.ids)
    strip = ChatRenderer(tok, splice="exact", fmt=FORMATS["qwen3"], past_reasoning="strip").render(msgs, None, store)
    assert strip.ids == plain.ids and strip.stripped == 1 and strip.unmatched == 0


def test_qwen3_disabled_thinking_prefix_is_part_of_the_turn():
    tok = tokenizer("qwen3")
    r = ChatRenderer(tok, splice="exact", fmt=FORMATS["qwen3"])
    out = r.render([{"role": "user", "content": "hi"}], None, TurnStore(), template_kwargs={"enable_thinking": False})
    assert out.gen_prefix == "<think>\n\n</think>\n\n" and out.gen_prefix_ids >= 2
    assert tok.decode(out.ids[-out.gen_prefix_ids:]) == "<think>\n\n</think>\n\n"


def test_thinking_sent_back_inside_the_content_still_splices():
    tok = tokenizer("qwen3")
    r = ChatRenderer(tok, splice="exact", fmt=FORMATS["qwen3"])
    out = r.render([{"role": "user", "content": "hi"}], None, TurnStore())
    ids = tok.backend_tokenizer.encode("<think>\nhm\n</think>\n\nhello", add_special_tokens=False).ids + [tok.convert_tokens_to_ids("<|im_end|>")]
    store = TurnStore()
    store.add(turn_fingerprint("hello", []), StoredTurn.of(0, out.ids, ids, "hello", []))
    nxt = r.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nhello"},
                    {"role": "user", "content": "more"}], None, store)
    assert nxt.spliced == 1 and nxt.ids[: len(out.ids) + len(ids)] == out.ids + ids
