"""Chat-format parsers against SGLang 0.5.23's own (tests/proxy/_formats_ref.py loads them from the
unpacked wheel; those tests skip without it), and streaming == one-shot for every chunking.
Test ids name the family (qwen2.5, qwen3, qwen3-coder, llama3.1)."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.proxy.formats import FORMATS, OutputParser, Reasoning, ReasoningParser, format_for, split_output
from gyre.proxy.formats.hermes_prompt import hermes_tools
from gyre.proxy.formats.qwen3_coder import XmlToolParser
from gyre.proxy.textstream import ToolCall

from . import _formats_ref as ref

needs_sglang = pytest.mark.skipif(not ref.available(), reason="sglang 0.5.23 wheel not unpacked in /tmp/sg (see _formats_ref)")

TOOLS = [
    {"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {
        "cmd": {"type": "string"}, "timeout": {"type": "integer"}, "ratio": {"type": "number"}, "force": {"type": "boolean"},
        "env": {"type": "object"}, "paths": {"type": "array", "items": {"type": "string"}}}}}},
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
]
SGLANG_PARSER = {"qwen2.5": "qwen25", "qwen3": "qwen25", "qwen3-coder": "qwen3_coder", "qwen3.5": "qwen3_coder", "llama3.1": "llama3",
                 "chatml": "qwen25"}
# Formats with no tool calls of their own are tested as --proxy.tool-format hermes serves them.
TOOL_FORMAT = {"chatml": "hermes"}


def fmt_of(family):
    """The format a run of `family` parses with: chatml with Hermes tool calls (--proxy.tool-format hermes)."""
    return hermes_tools(FORMATS[family]) if family in TOOL_FORMAT else FORMATS[family]

# Text the model writes around calls: no markup characters, no leading/trailing whitespace.
_plain = st.text(st.characters(blacklist_characters="<>{}\r", blacklist_categories=("Cs", "Cc")), min_size=1, max_size=30).map(str.strip).filter(bool)
_str_value = st.text(st.characters(blacklist_characters="<>\r", blacklist_categories=("Cs",)), max_size=20).filter(lambda s: s.lower() != "null")


@st.composite
def _args(draw, name):
    if name == "read_file":
        return {"path": draw(_str_value)}
    out = {"cmd": draw(_str_value)}
    if draw(st.booleans()):
        out["timeout"] = draw(st.integers(-10**6, 10**6))
    if draw(st.booleans()):
        out["ratio"] = draw(st.floats(-1e6, 1e6, allow_nan=False).filter(lambda f: not f.is_integer()))
    if draw(st.booleans()):
        out["force"] = draw(st.booleans())
    if draw(st.booleans()):
        out["env"] = draw(st.dictionaries(st.sampled_from("ABC"), st.integers(0, 9), max_size=2))
    if draw(st.booleans()):
        out["paths"] = draw(st.lists(_str_value, max_size=2))
    return out


_calls = st.lists(st.sampled_from(["bash", "read_file"]).flatmap(lambda n: _args(n).map(lambda a: (n, a))), min_size=0, max_size=3)


def render_calls(family: str, content: str, calls: list[tuple[str, dict]]) -> str:
    """The assistant text for `content` + `calls` as the family's template writes it."""
    if family in ("qwen2.5", "qwen3", "chatml"):  # chatml: as --proxy.tool-format hermes declares them
        blocks = ["<tool_call>\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + "\n</tool_call>" for n, a in calls]
        return "\n".join(([content] if content else []) + blocks)
    if family in ("qwen3-coder", "qwen3.5"):  # tests/chat_templates/qwen3-coder.jinja (qwen3.5 renders the same): value | tojson for objects / arrays, | string else
        def val(v):
            return json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else str(v)
        blocks = ["\n<tool_call>\n<function=" + n + ">\n" + "".join(f"<parameter={k}>\n{val(v)}\n</parameter>\n" for k, v in a.items())
                  + "</function>\n</tool_call>" for n, a in calls]
        if not calls:
            return content
        return content + "\n" + "".join(blocks) if content else "".join(blocks).lstrip("\n")
    # llama3.1: a call is the whole message; several are `;`-separated (sglang llama32_detector.py:33-38)
    if calls:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)
    return content


def _split_points(draw, text):
    cuts = sorted(set(draw(st.lists(st.integers(0, len(text)), max_size=8))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def _ours(family, text, chunks=None):
    p = OutputParser(fmt_of(family), TOOLS)
    items = []
    for c in chunks or [text]:
        items += p.push(c)
    items += p.flush()
    return ("".join(i.text for i in items if isinstance(i, Reasoning)), "".join(i for i in items if isinstance(i, str)),
            [(i.name, i.arguments) for i in items if isinstance(i, ToolCall)])


@needs_sglang
@pytest.mark.parametrize("family", list(FORMATS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_tool_calls_agree_with_sglang(family, data):
    content = data.draw(st.one_of(st.just(""), _plain))
    calls = data.draw(_calls)
    if family == "llama3.1" and calls:
        content = ""  # a Llama call is the whole message
    text = render_calls(family, content, calls)
    sg_text, sg_calls = ref.sglang_calls(SGLANG_PARSER[family], text, TOOLS)
    _, ours_text, ours_calls = _ours(family, text, _split_points(data.draw, text))
    assert ours_calls == sg_calls
    assert ours_calls == [(n, a) for n, a in calls]  # and both read back what the template wrote
    assert ours_text.strip() == sg_text.strip()


_reasoning_text = st.text(st.characters(blacklist_characters="<\r", blacklist_categories=("Cs",)), max_size=25)


@needs_sglang
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_qwen3_reasoning_agrees_with_sglang(data):
    """Raw split (reasoning, rest) as sglang's `--reasoning-parser qwen3` one-shot, for outputs that
    open with <think> or none, closed or not, a call after or inside, the prompt having opened it."""
    force = data.draw(st.booleans())
    opening = "" if force and data.draw(st.booleans()) else data.draw(st.sampled_from(["<think>", "<think>\n", "<think><think>", ""]))
    body = data.draw(_reasoning_text)
    close = data.draw(st.sampled_from(["</think>", "\n</think>\n\n", ""]))
    tail = data.draw(st.sampled_from(["", "answer", "\n\nanswer", '<tool_call>\n{"name": "bash", "arguments": {}}\n</tool_call>']))
    mid = data.draw(st.sampled_from(["", '<tool_call>\n{"name": "x"}\n</tool_call>\n']))
    text = opening + body + mid + close + tail
    sg_r, sg_n = ref.sglang_reasoning(text, force=force)
    for chunks in ([text], _split_points(data.draw, text)):
        p = ReasoningParser(FORMATS["qwen3"].reasoning, force=force)
        items = [x for c in chunks for x in p.push(c)] + p.flush()
        r = "".join(i.text for i in items if isinstance(i, Reasoning))
        n = "".join(i for i in items if isinstance(i, str))
        assert (r, n) == (sg_r, sg_n), (text, chunks)


@pytest.mark.parametrize("family", list(FORMATS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_stream_equals_one_shot(family, data):
    """However the sampled text is cut into pieces, the client gets the same reasoning, text and calls."""
    content = data.draw(st.one_of(st.just(""), _plain))
    calls = data.draw(_calls)
    if family == "llama3.1" and calls:
        content = ""
    text = render_calls(family, content, calls)
    if FORMATS[family].reasoning is not None and data.draw(st.booleans()):
        text = "<think>\n" + data.draw(_reasoning_text) + "\n</think>\n\n" + text
    assert _ours(family, text, _split_points(data.draw, text)) == _ours(family, text)


def test_qwen3_template_inverse():
    """Reasoning and answer as the template's `<think>\\nR\\n</think>\\n\\nC` renders them back."""
    r, c, calls = split_output(FORMATS["qwen3"], "<think>\nLet me see.\n\nOk.\n</think>\n\nThe answer.")
    assert (r, c, calls) == ("Let me see.\n\nOk.", "The answer.", [])
    # the generation prompt opened / closed thinking (enable_thinking=False): its text is the prefix
    assert split_output(FORMATS["qwen3"], "Hi there", prefix="<think>\n\n</think>\n\n") == ("", "Hi there", [])
    assert split_output(FORMATS["qwen3"], "hmm\n</think>\n\nHi", prefix="<think>\n") == ("hmm", "Hi", [])
    # truncated thinking is all reasoning; a call that ends unfinished thinking is a call
    assert split_output(FORMATS["qwen3"], "<think>\nstill going")[:2] == ("still going", "")
    r, c, calls = split_output(FORMATS["qwen3"], '<think>\nuse a tool\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>')
    assert (r, c) == ("use a tool", "") and calls[0].name == "bash"


def test_coder_values_typed_by_schema():
    text = ("<tool_call>\n<function=bash>\n<parameter=cmd>\nls -la\n</parameter>\n<parameter=timeout>\n5\n</parameter>\n"
            "<parameter=force>\nTrue\n</parameter>\n<parameter=env>\n{\"A\": 1}\n</parameter>\n<parameter=extra>\n7\n</parameter>\n"
            "</function>\n</tool_call>")
    _, content, calls = split_output(FORMATS["qwen3-coder"], text, TOOLS)
    assert content == "" and calls[0].arguments == {"cmd": "ls -la", "timeout": 5, "force": True, "env": {"A": 1}, "extra": "7"}
    # malformed and unclosed blocks come back as text, never dropped
    p = XmlToolParser(TOOLS)
    out = p.push("before\n<tool_call>\nnot a function\n</tool_call>\n<tool_call>\n<function=bash>\n") + p.flush()
    assert "".join(x for x in out if isinstance(x, str)).count("<tool_call>") == 2


def test_llama_non_call_json_is_text():
    assert split_output(FORMATS["llama3.1"], '{"answer": 42}') == ("", '{"answer": 42}', [])
    r, c, calls = split_output(FORMATS["llama3.1"], 'Let me check.<|python_tag|>{"name": "bash", "parameters": {"cmd": "ls"}}')
    assert c == "Let me check." and [(x.name, x.arguments) for x in calls] == [("bash", {"cmd": "ls"})]


@pytest.mark.parametrize("family", list(FORMATS))
def test_format_for_checkpoint_template(family):
    from tests.realmodels import chat_template

    assert format_for(template=chat_template(family)).name == family


def family_tokenizer(family):
    """The family's tokenizer with its template (qwen3.5: Qwen3's vocabulary, Qwen3.5's template)."""
    from tests.realmodels import build_tokenizer

    return build_tokenizer("qwen3", template="qwen3.5") if family == "qwen3.5" else build_tokenizer(family)


def test_coder_text_without_calls_comes_back_exactly():
    """Issue 34 item 8: a `<tool_call>` block that is not a call keeps the whitespace before it
    (qwen3-coder / qwen3.5 syntax), chunked or not; a real call's is still the template's."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}]
    for text in ["See:\n<tool_call>not a function</tool_call>\n", "x \n<tool_call>\n<function=f>\n"]:
        for chunks in ([text], list(text)):
            p = XmlToolParser(tools)
            out = [x for c in chunks for x in p.push(c)] + p.flush()
            assert "".join(out) == text, (chunks[:3], out)
    p = XmlToolParser(tools)
    out = p.push("ok\n<tool_call>\n<function=f>\n<parameter=a>\nv\n</parameter>\n</function>\n</tool_call>") + p.flush()
    assert out[0] == "ok" and out[1].name == "f" and len(out) == 2
