"""Anthropic prefill (issue 34, item 6): a trailing assistant message is continued, as Anthropic
does: the prompt ends with its text right after the generation prompt (not a closed turn and a new
one), the reply holds only the continuation, the record's output continues it, and the turn
re-sent whole (prefill + continuation) splices back to exactly those ids."""

import anthropic
import pytest

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.models.tokenizer import load_tokenizer

from .test_sdk import _visible_text

USER = {"role": "user", "content": "Give me the answer as JSON."}
PREFILL = '{"answer":'


@pytest.mark.parametrize("stream", [False, True])
def test_a_trailing_assistant_message_is_continued(make_server, stream):
    proxy, h = make_server([(DeterministicEngine("e", eos_prob=0.1, salt=4), "cell", 0)])
    c = anthropic.Anthropic(base_url=h.url, api_key=proxy.issue_key("ex-prefill"), max_retries=0)
    c.messages.create(model="m", max_tokens=30, messages=[USER])
    plain = proxy.sink.records[-1]
    ask = dict(model="m", max_tokens=30, messages=[USER, {"role": "assistant", "content": PREFILL}])
    if stream:
        with c.messages.stream(**ask) as s:
            text = "".join(ev.delta.text for ev in s if ev.type == "content_block_delta" and ev.delta.type == "text_delta")
    else:
        text = "".join(b.text for b in c.messages.create(**ask).content if b.type == "text")
    rec = proxy.sink.records[-1]
    prefill_ids = load_tokenizer().encode(PREFILL, add_special_tokens=False)
    # The prompt is the plain call's prompt + the prefill's ids: the same turn, continued.
    assert rec.input_ids.tolist() == plain.input_ids.tolist() + prefill_ids
    assert rec.payload_ref["prefill"] == len(prefill_ids)
    assert text == _visible_text(rec.output_ids)  # only the continuation comes back
    # Re-sent whole, the turn is the prefill + the sampled ids, spliced.
    c.messages.create(model="m", max_tokens=5, messages=[USER, {"role": "assistant", "content": PREFILL + text}, {"role": "user", "content": "ok"}])
    nxt = proxy.sink.records[-1]
    assert nxt.payload_ref["spliced_turns"] == 1
    start, end = nxt.payload_ref["spliced_spans"][0]
    assert nxt.input_ids[:start].tolist() == plain.input_ids.tolist()
    assert nxt.input_ids[start:end].tolist() == prefill_ids + rec.output_ids.tolist()


def test_a_prefill_ending_in_whitespace_is_refused_as_anthropic_does(make_server):
    proxy, h = make_server([(DeterministicEngine("e"), "cell", 0)])
    c = anthropic.Anthropic(base_url=h.url, api_key=proxy.issue_key("ex-ws"), max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace") as err:
        c.messages.create(model="m", max_tokens=5, messages=[USER, {"role": "assistant", "content": "Sure: "}])
    assert "messages[1].content" in err.value.body["error"]["message"]
