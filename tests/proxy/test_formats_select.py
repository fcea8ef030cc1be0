"""Choosing the chat format: from the checkpoint's template, overridable, unknown refused."""

import logging

import pytest

from gyre.backends.models.tokenizer import load_tokenizer
from gyre.proxy import Proxy, ProxyConfig
from gyre.proxy.formats import FORMATS, UnknownChatFormat, format_for
from tests.realmodels import build_tokenizer, chat_template


def test_gyre_tokenizer_is_qwen25():
    assert format_for(load_tokenizer()).name == "qwen2.5"
    assert Proxy(ProxyConfig()).format.name == "qwen2.5"


@pytest.mark.parametrize("family", list(FORMATS))
def test_each_family_template_is_recognised(family):
    assert format_for(template=chat_template(family)).name == family


def test_unknown_template_is_refused_with_the_known_list():
    gemma = "{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
    with pytest.raises(UnknownChatFormat) as e:
        format_for(template=gemma)
    assert all(name in str(e.value) for name in FORMATS) and "--proxy.chat-format" in str(e.value)
    with pytest.raises(UnknownChatFormat, match="no chat template"):
        format_for(template="")
    with pytest.raises(UnknownChatFormat, match="'mistral' is not a known"):
        format_for(template=gemma, override="mistral")
    # a template two formats would claim is not guessed
    with pytest.raises(UnknownChatFormat, match="several formats"):
        format_for(template=chat_template("qwen2.5") + chat_template("llama3.1"))


def test_override_and_config_cross_check(caplog):
    assert format_for(template="anything", override="llama3.1").name == "llama3.1"
    with caplog.at_level(logging.WARNING):
        assert format_for(template=chat_template("qwen3"), config={"model_type": "llama"}).name == "qwen3"
    assert "model_type=llama" in caplog.text


def test_proxy_refuses_a_format_the_tokenizer_cannot_speak():
    with pytest.raises(ValueError, match="<\\|eot_id\\|>"):
        Proxy(ProxyConfig(chat_format="llama3.1"))  # Gyre's tokenizer has no <|eot_id|>
    with pytest.raises(ValueError, match="tool_parser=hermes"):
        Proxy(ProxyConfig(tool_parser="hermes"), tokenizer=build_tokenizer("qwen3-coder"))
    p = Proxy(ProxyConfig(), tokenizer=build_tokenizer("llama3.1"))
    tok = p.tokenizer
    assert p.format.name == "llama3.1" and p.eos_ids == {tok.convert_tokens_to_ids(t) for t in ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")}
