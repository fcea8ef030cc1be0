"""TITO splicing: re-serialized assistant turns are rendered with their original sampled ids."""

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.backends.models.tokenizer import byte_token_ids, load_tokenizer
from gyre.proxy.render import ChatRenderer, StoredTurn, turn_fingerprint


def _renderer():
    return ChatRenderer(load_tokenizer())


def _spell(text, tok):
    """A valid, non-canonical spelling: one byte-token per byte, then <|im_end|>."""
    b = byte_token_ids(tok)
    return [b[x] for x in text.encode()] + [tok.convert_tokens_to_ids("<|im_end|>")]


def test_encode_cache_matches_plain_tokenizer():
    r = _renderer()
    tok = r.tokenizer
    text = "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\nhi<tool_call>x</tool_call><|im_end|>\n"
    starts = []
    assert r.encode(text, starts) == tok.encode(text, add_special_tokens=False)
    assert r.encode(text) == tok.encode(text, add_special_tokens=False)  # cached path
    ids = tok.encode(text, add_special_tokens=False)
    assert starts == [i for i, t in enumerate(ids) if t == tok.convert_tokens_to_ids("<|im_start|>")]


def test_render_without_turns_is_the_chat_template():
    r = _renderer()
    tok = r.tokenizer
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    out = r.render(msgs, tools, None)
    ref = tok.apply_chat_template(msgs, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False)
    ref = ref["input_ids"] if isinstance(ref, dict) else ref
    assert out.ids == list(ref)
    assert out.spliced == 0 and out.unmatched == 0


def _conversation(r, turns_text, reserialize):
    """Simulate a harness: turn k's prompt is rendered, the 'model' answers with a byte-spelled
    text and tool call, the harness re-sends the history (re-serialized) for turn k+1."""
    tok = r.tokenizer
    store: dict = {}
    msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "start"}]
    prompts = []
    for k, (content, args) in enumerate(turns_text):
        out = r.render(msgs, None, store)
        prompts.append(out)
        calls = [{"name": "bash", "arguments": args}]
        text = content + '\n<tool_call>\n{"name": "bash", "arguments": ' + json.dumps(args) + "}\n</tool_call>"
        sampled = _spell(text, tok)
        store.setdefault(turn_fingerprint(content, calls), []).append(StoredTurn.of(k, out.ids, sampled))
        prompts[-1].sampled = sampled
        sent_args = reserialize(args)
        msgs = msgs + [
            {"role": "assistant", "content": "  " + content + "\n", "tool_calls": [{"name": "bash", "arguments": sent_args}]},
            {"role": "tool", "content": f"result {k}"},
        ]
    return prompts


def _shuffle_json(args):
    items = list(args.items())
    random.Random(len(items)).shuffle(items)
    return json.dumps(dict(items), indent=2)  # other key order, other whitespace, a string


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.text(alphabet="abc xyzé\n", max_size=20), st.dictionaries(st.sampled_from(["cmd", "path", "n"]), st.integers() | st.text(max_size=5), max_size=3)), min_size=1, max_size=4))
def test_turn_k_plus_1_contains_turn_k_verbatim(turns):
    r = _renderer()
    prompts = _conversation(r, turns, _shuffle_json)
    for k in range(len(prompts) - 1):
        prev, nxt = prompts[k], prompts[k + 1]
        prefix = prev.ids + prev.sampled
        assert nxt.ids[: len(prefix)] == prefix  # exact token prefix: input of k, then its output
        assert nxt.spliced == k + 1 and nxt.unmatched == 0
        s, e = nxt.spliced_spans[k]
        assert nxt.ids[s:e] == prev.sampled


def test_unmatched_turn_is_plain_text_and_counted():
    r = _renderer()
    tok = r.tokenizer
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "never produced by us"}, {"role": "user", "content": "q2"}]
    out = r.render(msgs, None, {("something else", ()): [StoredTurn.of(0, [], [1, 2])]})
    assert out.spliced == 0 and out.unmatched == 1
    assert out.ids == tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False)


def test_duplicate_turn_text_prefers_exact_context():
    r = _renderer()
    tok = r.tokenizer
    msgs = [{"role": "user", "content": "q"}]
    p0 = r.render(msgs, None, None).ids
    a = StoredTurn.of(0, p0, _spell("same", tok))
    b_ids = _spell("same", tok)[:-1] + [tok.convert_tokens_to_ids("<|endoftext|>")]
    b = StoredTurn.of(1, [5] * len(p0), b_ids)  # same length, other context
    c = StoredTurn.of(2, [5, 6, 7], b_ids)
    store = {turn_fingerprint("same", []): [c, a, b]}
    out = r.render(msgs + [{"role": "assistant", "content": "same"}, {"role": "user", "content": "again"}], None, store)
    assert out.spliced_calls == [0]
    store = {turn_fingerprint("same", []): [a, b, c]}  # no exact context: the most recent
    out = r.render([{"role": "user", "content": "other"}, {"role": "assistant", "content": "same"}], None, store)
    assert out.spliced_calls == [2]
    # b (no <|im_end|> at the end) would keep the template's <|im_end|> after its ids
    store = {turn_fingerprint("same", []): [b]}
    out = r.render(msgs + [{"role": "assistant", "content": "same"}], None, store)
    s, e = out.spliced_spans[0]
    assert list(out.ids[s:e]) == list(b.output_ids) and out.ids[e] == tok.convert_tokens_to_ids("<|im_end|>")


def test_a_stored_turn_holds_its_ids_packed():
    """Every turn of every open execution is kept: its output ids cost 4 bytes each, not an int
    object (~28 bytes) plus a list slot (8). The ids are made inside the measurement, as the
    engine's stream makes them, and only the turn is left holding them."""
    import tracemalloc

    import numpy as np

    n = 50_000
    rng = np.random.default_rng(0)
    rng.integers(300, 150_000, 8)  # numpy's lazy imports, before the measurement
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        sampled = rng.integers(300, 150_000, n).tolist()  # fresh ints, as parsed
        expect = sampled[::997]
        turn = StoredTurn.of(0, [1, 2, 3], sampled)
        del sampled
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held <= 4 * n + 4096, f"{held / n:.1f} bytes an id"
    assert list(turn.output_ids[::997]) == expect and len(turn.output_ids) == n
