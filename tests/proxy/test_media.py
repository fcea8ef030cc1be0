"""Multimodal content for a text-only policy, through the official SDKs (gyre/proxy/validate.py
`media_text`): images, documents, audio and files become a line of text in the recorded prompt,
those tokens are never training targets, and `proxy.media = reject` answers a 400 naming the
field. Also: Anthropic `thinking` is accepted and never returned, `top_logprobs` without `logprobs` is refused,
and a Claude Code helper call is recorded as Role.HELPER."""

import base64

import anthropic
import numpy as np
import openai
import pytest

from gyre.backends.models.tokenizer import load_tokenizer
from gyre.proxy import ProxyConfig
from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.trajectory.record import Role
from gyre.trajectory.tree import build_tree

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 3).decode()  # 776 bytes
PNG_BYTES = 8 + 256 * 3
PDF = base64.b64encode(b"%PDF-1.4 tiny" + b"\x00" * 20).decode()  # 33 bytes
WAV = base64.b64encode(b"RIFF" + b"\x01" * 40).decode()  # 44 bytes


def _engine():
    return [(DeterministicEngine("e", eos_prob=0.2, salt=5), "cell", 0)]


def _context_only(proxy, *placeholders):
    """Each placeholder is in the last record's prompt, and no token of it is a tree target."""
    tok = load_tokenizer()
    rec = proxy.sink.records[-1]
    ids = rec.input_ids.tolist()
    text = tok.decode(ids)
    tree = build_tree(proxy.sink.records)
    leaf = next(k for k in range(tree.num_leaves) if tree.leaf_tokens(k)[: len(ids)].tolist() == ids)
    target = tree.path_array(tree.leaf_path(leaf), tree.is_target)[: len(ids)]
    for p in placeholders:
        assert p in text, (p, text)
        # the token span of the placeholder: first prefix whose text contains it, back to its start
        end = next(k for k in range(1, len(ids) + 1) if p in tok.decode(ids[:k]))
        start = max(k for k in range(end) if p not in tok.decode(ids[k:end])) - 1
        assert not target[start:end].any()
    assert rec.payload_ref["media_placeholders"]
    return rec


def test_anthropic_image_and_document_blocks_become_text(make_server):
    proxy, h = make_server(_engine())
    a = anthropic.Anthropic(base_url=h.url, api_key=proxy.issue_key("ex-img"), max_retries=0)
    a.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    first = proxy.sink.records[-1]
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [
            {"type": "text", "text": "What is in this screenshot?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
            {"type": "image", "source": {"type": "url", "url": "https://img.example.com/a/b.png?token=SECRET"}},
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": PDF}, "title": "spec.pdf"},
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "plain words"}},
        ]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "/a.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "read:"}, {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": PNG}}]}]},
    ]
    r = a.messages.create(model="m", max_tokens=8, messages=msgs)
    assert r.content and all(b.type in ("text", "tool_use") for b in r.content)
    rec = _context_only(proxy, f"[image: image/png, {PNG_BYTES} bytes]", "[image: https://img.example.com, not fetched]",
                        "[document: spec.pdf, application/pdf, 33 bytes]", f"[image: image/jpeg, {PNG_BYTES} bytes]")
    assert "SECRET" not in load_tokenizer().decode(rec.input_ids.tolist()) and "plain words" in load_tokenizer().decode(rec.input_ids.tolist())
    assert rec.payload_ref["media_placeholders"] == ["messages[2].content[1]", "messages[2].content[2]", "messages[2].content[3]",
                                                     "messages[4].content[0].content[1]"]
    assert first.payload_ref["media_placeholders"] == []


def test_openai_chat_image_audio_file_parts_become_text(make_server):
    proxy, h = make_server(_engine())
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-oai"), max_retries=0)
    content = [
        {"type": "text", "text": "Look: "},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}", "detail": "low"}},
        {"type": "image_url", "image_url": {"url": "http://cdn.example.org/x.jpg"}},
        {"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}},
        {"type": "file", "file": {"file_data": f"data:application/pdf;base64,{PDF}", "filename": "r.pdf"}},
        {"type": "file", "file": {"file_id": "file-abc"}},
    ]
    c.chat.completions.create(model="m", max_tokens=8, messages=[{"role": "user", "content": content}])
    _context_only(proxy, f"[image: image/png, {PNG_BYTES} bytes]", "[image: http://cdn.example.org, not fetched]",
                  "[audio: audio/wav, 44 bytes]", "[file: r.pdf, application/pdf, 33 bytes]", "[file: file_id file-abc]")


def test_responses_input_image_and_file_become_text(make_server):
    proxy, h = make_server(_engine())
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-resp"), max_retries=0)
    c.responses.create(model="m", max_output_tokens=8, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "see"},
        {"type": "input_image", "image_url": f"data:image/gif;base64,{PNG}", "detail": "auto"},
        {"type": "input_file", "filename": "notes.pdf", "file_data": f"data:application/pdf;base64,{PDF}"},
    ]}])
    _context_only(proxy, f"[image: image/gif, {PNG_BYTES} bytes]", "[file: notes.pdf, application/pdf, 33 bytes]")


def test_reject_mode_is_a_400_naming_the_field_in_every_api(make_server):
    proxy, h = make_server(_engine(), config=ProxyConfig(media="reject"))
    key = proxy.issue_key("ex-rej")
    a = anthropic.Anthropic(base_url=h.url, api_key=key, max_retries=0)
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0)
    img = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[1\]"):
        a.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, img]}])
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[0\]") as e:
        c.chat.completions.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://x.example/a.png"}}]}])
    assert e.value.body["param"] == "messages[0].content[0]"
    with pytest.raises(openai.BadRequestError, match=r"input\[0\]\.content\[0\]"):
        c.responses.create(model="m", max_output_tokens=8, input=[{"role": "user", "content": [{"type": "input_image", "image_url": "https://x.example/a.png"}]}])
    assert not proxy.sink.records  # nothing was generated
    c.chat.completions.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "text is fine"}])
    assert len(proxy.sink.records) == 1


def test_thinking_is_accepted_and_never_returned(make_server):
    proxy, h = make_server(_engine())
    a = anthropic.Anthropic(base_url=h.url, api_key=proxy.issue_key("ex-think"), max_retries=0)
    r = a.messages.create(model="m", max_tokens=16, thinking={"type": "enabled", "budget_tokens": 1024},
                          messages=[{"role": "user", "content": "think hard"}])
    assert r.content and all(b.type == "text" for b in r.content)
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        a.messages.create(model="m", max_tokens=16, messages=[{"role": "user", "content": "x"}], extra_body={"thinking": "on"})


def test_top_logprobs_without_logprobs_or_over_20_is_a_400_naming_the_field(make_server):
    """(Alternatives themselves: tests/proxy/test_top_logprobs.py.)"""
    proxy, h = make_server(_engine())
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-lp"), max_retries=0)
    for extra in ({"top_logprobs": 3}, {"logprobs": True, "top_logprobs": 21}):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "x"}], **extra)
        assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="m", prompt="x", max_tokens=4, logprobs=6)
    assert e.value.body["param"] == "logprobs"
    r = c.chat.completions.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=0)
    assert all(t.top_logprobs == [] for t in r.choices[0].logprobs.content)
    comp = c.completions.create(model="m", prompt="x", max_tokens=4, logprobs=0).choices[0].logprobs
    assert comp.token_logprobs and comp.top_logprobs is None


def test_a_claude_code_helper_call_is_recorded_as_helper(make_server):
    proxy, h = make_server(_engine())
    a = anthropic.Anthropic(base_url=h.url, api_key=proxy.issue_key("ex-help"), max_retries=0)
    system = [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
              {"type": "text", "text": "Analyze if this message indicates a new conversation topic. If it does, extract a 2-3 word title."}]
    a.messages.create(model="m", max_tokens=32, system=system, messages=[{"role": "user", "content": "fix the bug"}])
    a.messages.create(model="m", max_tokens=32, system="You are Claude Code. You are an interactive CLI tool.", messages=[{"role": "user", "content": "fix the bug"}])
    assert [r.role for r in proxy.sink.records] == [Role.HELPER, Role.MAIN]
    assert proxy.execution_stats("ex-help").roles == {"HELPER": 1, "MAIN": 1}
    tree = build_tree(proxy.sink.records)
    assert tree.stats.helper_calls == 1 and np.all(tree.call_roles == int(Role.MAIN))
