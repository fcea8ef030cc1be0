"""examples/tool_agent: the evaluator, the tool and the episode loop against hand-worked cases; the
task generator deterministic with disjoint splits; base_rate.py's offline prompt rendering equal to
the Qwen2.5 template's (the Hermes convention the proxy follows) and its tool-call parsing equal to
the proxy's parser. The harness against a real proxy is in test_tool_agent_harness.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from examples.tool_agent import base_rate, evaluate, harness, make_tasks
from gyre.executions.tasks import Dataset
from gyre.proxy.textstream import ToolCall, ToolCallParser, tool_call_opening

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tool_agent"
QWEN25 = (ROOT / "tests" / "chat_templates" / "qwen2.5.jinja").read_text()


# -- evaluator ---------------------------------------------------------------------------------
@pytest.mark.parametrize("answer, ok", [
    ("42", True), ("$42", True), ("A mango costs 42 dollars.", True), ("42.00", True), ("42, thanks", True),
    ("It is 7 or 42", True), ("1,042 and 42", True),
    ("142", False), ("420", False), ("4.2", False), ("42.5", False), ("1,042", False), ("v1.42", False),
    ("forty-two", False), ("", False),
])
def test_passed_needs_the_price_as_a_whole_number(answer, ok):
    assert evaluate.passed(answer, 42) is ok


def test_numbers_reads_grouped_and_decimal_numbers():
    assert evaluate.numbers("3 apples at $42.50, 12,345 in stock; v1.2") == [3.0, 42.5, 12345.0, 1.2]


def test_evaluate_reads_answer_txt_and_scores_a_missing_one_zero(tmp_path):
    assert evaluate.evaluate(tmp_path, None, expected=42) == {"reward": 0.0, "answer": None}
    (tmp_path / "answer.txt").write_text("A pear costs 42 dollars.\n")
    assert evaluate.evaluate(tmp_path, None, expected=42) == {"reward": 1.0, "answer": "A pear costs 42 dollars."}
    assert evaluate.evaluate(tmp_path, None, expected=41)["reward"] == 0.0


# -- the tool and the episode --------------------------------------------------------------------
PRICES = {"apple": 12, "mango": 40, "glass": 5}


@pytest.mark.parametrize("name, arguments, result", [
    ("get_price", '{"item": "mango"}', "A mango costs 40 dollars."),
    ("get_price", '{"item": " Mangos "}', "A mango costs 40 dollars."),
    ("get_price", '{"item": "apple"}', "An apple costs 12 dollars."),
    ("get_price", '{"item": "glass"}', "A glass costs 5 dollars."),  # "ss" is not a plural
    ("get_price", '{"item": {"name": "MANGO"}}', "A mango costs 40 dollars."),  # forgiving: one item named
    ("get_price", '{"what": "apples please"}', "An apple costs 12 dollars."),
    ("get_price", '{"item": "teapot"}', 'error: name one item of the shop, like {"item": "mango"}'),
    ("get_price", '[1, 2]', 'error: name one item of the shop, like {"item": "mango"}'),
    ("get_price", '{"item": "apple and mango"}', "error: name one item, not 2 (apple, mango)"),
    ("get_price", '{"item": ', "error: the arguments are not JSON"),
    ("get_price", "", 'error: name one item of the shop, like {"item": "mango"}'),
    ("buy", '{"item": "mango"}', "error: unknown tool 'buy'; the only tool is get_price"),
])
def test_run_tool(name, arguments, result):
    assert harness.run_tool(name, arguments, PRICES) == result


def test_episode_forces_the_first_call_answers_tools_and_ends_on_a_plain_reply():
    ep = harness.Episode("How much does a mango cost?", PRICES)
    assert ep.request()["tool_choice"] == {"type": "function", "function": {"name": "get_price"}}
    assert ep.request()["tools"] == harness.TOOLS
    assert not ep.observe("", [harness.Call("c1", "get_price", '{"item": "mango"}')])
    assert ep.messages[-1] == {"role": "tool", "tool_call_id": "c1", "content": "A mango costs 40 dollars."}
    assert ep.request()["tool_choice"] == "auto"
    assert ep.observe("  It costs 40 dollars. ", [])
    assert (ep.answer, ep.calls, ep.tool_calls, ep.tool_errors) == ("It costs 40 dollars.", 2, 1, 0)
    assert [m["role"] for m in ep.messages] == ["system", "user", "assistant", "tool"]


def test_episode_is_bounded_and_counts_tool_errors():
    ep = harness.Episode("q", PRICES, max_calls=3)
    for k in range(3):
        done = ep.observe(None, [harness.Call(f"a{k}", "nope", "{"), harness.Call(f"b{k}", "get_price", "}")])
    assert done and ep.done and ep.answer == "" and (ep.calls, ep.tool_calls, ep.tool_errors) == (3, 6, 6)


# -- the task generator --------------------------------------------------------------------------
def _write(tmp_path: Path, name: str, *extra: str) -> Path:
    out = tmp_path / name
    subprocess.run([sys.executable, str(EXAMPLE / "make_tasks.py"), "--out", str(out), *extra], check=True,
                   capture_output=True)
    return out


def test_make_tasks_is_deterministic_and_loadable(tmp_path):
    a, b = _write(tmp_path, "a", "--train", "40", "--heldout", "20"), _write(tmp_path, "b", "--train", "40", "--heldout", "20")
    for split, n in (("train", 40), ("heldout", 20)):
        assert (a / f"{split}.jsonl").read_bytes() == (b / f"{split}.jsonl").read_bytes()
        ds = Dataset.from_jsonl(a / f"{split}.jsonl")
        assert len(ds) == n
        for t in ds.tasks:
            prices = json.loads(t.files["prices.json"])
            item = t.metadata["item"]
            assert item in t.instruction and str(prices[item]) not in t.instruction.split()
            assert t.evaluator.target == "examples.tool_agent.evaluate:evaluate"
            assert t.evaluator.kwargs == {"expected": prices[item]} and t.metadata["price"] == prices[item]
            assert sorted(prices) == sorted(make_tasks.ITEMS) and all(10 <= v <= 99 for v in prices.values())
    assert _write(tmp_path, "c", "--seed", "1").joinpath("train.jsonl").read_bytes() != (
        _write(tmp_path, "d").joinpath("train.jsonl").read_bytes())


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), n_train=st.integers(1, 80), n_held=st.integers(1, 40))
def test_splits_are_disjoint_and_reproducible(seed, n_train, n_held):
    train, held = make_tasks.make_split("train", n_train, seed), make_tasks.make_split("heldout", n_held, seed)
    assert make_tasks.make_split("train", n_train, seed) == train
    train_items, held_items = {t["metadata"]["item"] for t in train}, {t["metadata"]["item"] for t in held}
    assert not train_items & held_items  # no held-out question is about an item trained on
    assert len(held_items) == min(n_held, make_tasks.HELDOUT_ITEMS)  # every held-out item asked once first
    ids = [t["task_id"] for t in train + held]
    assert len(set(ids)) == len(ids)
    assert {t["metadata"]["split"] for t in held} == {"heldout"}


# -- base_rate.py: rendering and parsing as the proxy does ----------------------------------------
def _jinja(messages, forced=None):
    from transformers.utils.chat_template_utils import render_jinja_template

    text = render_jinja_template([messages], tools=harness.TOOLS, chat_template=QWEN25, add_generation_prompt=True)
    text = text[0] if isinstance(text, tuple) else text
    text = text[0] if isinstance(text, list) else text
    return text + (tool_call_opening(forced) if forced else "")


def test_render_equals_the_qwen25_template_with_tools():
    pytest.importorskip("transformers")
    ep = harness.Episode("How much does a mango cost?", PRICES)
    assert base_rate.render(ep.messages, harness.TOOLS, [], forced="get_price") == _jinja(ep.messages, "get_price")
    # A later turn: the reply re-sent as the template renders it (what the model sampled, when it
    # sampled the canonical form) and two tool results merged into one user turn.
    ep.observe("Let me check.", [harness.Call("c1", "get_price", '{"item": "mango"}'),
                                 harness.Call("c2", "get_price", '{"item": "apple"}')])
    reply = 'Let me check.\n<tool_call>\n{"name": "get_price", "arguments": {"item": "mango"}}\n</tool_call>' \
            '\n<tool_call>\n{"name": "get_price", "arguments": {"item": "apple"}}\n</tool_call>'
    msgs = [dict(m, tool_calls=[dict(c, function=dict(c["function"], arguments=json.loads(c["function"]["arguments"])))
                                for c in m["tool_calls"]]) if m.get("tool_calls") else m for m in ep.messages]
    assert base_rate.render(ep.messages, harness.TOOLS, [reply]) == _jinja(msgs)
    assert "<tool_response>\nA mango costs 40 dollars.\n</tool_response>\n<tool_response>\nAn apple" in _jinja(msgs)
    assert tool_call_opening("get_price") == base_rate.tool_call_opening("get_price")


def _proxy_calls(text: str) -> list[tuple[str, object]]:
    p = ToolCallParser()
    return [(x.name, x.arguments) for x in p.push(text) + p.flush() if isinstance(x, ToolCall)]


BLOCKS = st.sampled_from([
    '<tool_call>\n{"name": "get_price", "arguments": {"item": "mango"}}\n</tool_call>',
    '<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>',
    '<tool_call>\n{"name": "get_price", "arguments": "{\\"item\\": \\"pear\\"}"}\n</tool_call>',
    '<tool_call>{"name": "", "arguments": {}}</tool_call>', '<tool_call>{"name": 3}</tool_call>',
    '<tool_call>not json</tool_call>', '<tool_call>{"name": "x", "arguments": "bad"}</tool_call>',
    "<tool_call>\n{\"name\": \"unclosed\"", "</tool_call>", "The price is 12.", "\n", " ", "apple"])


@settings(max_examples=200, deadline=None)
@given(st.lists(BLOCKS, max_size=6))
def test_parse_tool_calls_agrees_with_the_proxy_parser(pieces):
    text = "".join(pieces)
    content, calls = base_rate.parse_tool_calls(text)
    want_calls = _proxy_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want_calls
    if not want_calls:  # no call: the whole reply is text (the harness's answer)
        assert content == text


@pytest.mark.parametrize("k, n, lo, hi", [
    # Wilson score intervals worked out by hand: centre (k + z²/2)/(n + z²), half-width
    # z·sqrt(k(n−k)/n + z²/4)/(n + z²), z = 1.96.
    (0, 64, 0.0, 0.0566), (32, 64, 0.3810, 0.6190), (8, 64, 0.0647, 0.2277), (64, 64, 0.9434, 1.0),
])
def test_wilson_interval(k, n, lo, hi):
    got = base_rate.wilson(k, n)
    assert got[0] == pytest.approx(lo, abs=1e-4) and got[1] == pytest.approx(hi, abs=1e-4)


def test_sampler_with_a_shared_prefix_cache_and_padding_decodes_as_each_prompt_alone():
    """base_rate.Sampler (prefix KV cache copied per row, ragged suffixes padded between prefix and
    suffix) against a plain loop: the argmax of a full forward of each prompt alone, no cache. At
    temperature 1e-4 sampling is the argmax, so the tokens must be the same."""
    torch = pytest.importorskip("torch")
    from tests.realmodels import build_model, build_tokenizer

    # initializer_range 0.2: logits varied enough that the argmax depends on the whole context
    tok, model = build_tokenizer("qwen2.5"), build_model("qwen2.5", 1536, seed=1, initializer_range=0.2)
    prefix = "<|im_start|>system\nYou are a shop assistant.<|im_end|>\n"
    prompts = [prefix + f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
               for q in ("hi", "How much does a mango cost, and an apple and a pear?", "x y")]
    got = base_rate.Sampler(tok, model, prefix, seed=0).sample(prompts, max_tokens=6, temperature=1e-4)
    stops = {tok.convert_tokens_to_ids(s) for s in base_rate.STOPS}
    for p, text in zip(prompts, got):
        ids, out = tok(p, add_special_tokens=False)["input_ids"], []
        with torch.no_grad():
            for _ in range(6):
                t = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
                if t in stops:
                    break
                out.append(t)
        assert text == tok.decode(out, skip_special_tokens=False)
