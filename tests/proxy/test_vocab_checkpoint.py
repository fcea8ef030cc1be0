"""A checkpoint directory's tokenizer at the proxy (gyre/backends/models/vocab.py, gyre/config_checks.py):

* which tokenizer a run uses: --proxy.tokenizer-path, else the checkpoint's own, else the project's;
* the stop ids come from the checkpoint (generation_config.json, config.json, the tokenizer's eos);
* a tokenizer larger than the model is refused at start naming both sizes; a larger model
  (padding rows) is accepted;
* a proxy serving a checkpoint's tokenizer answers, through the official openai SDK, calls whose
  engine emits ids past the tokenizer (padding rows) and ids >= 1024 (the old failure: the
  project's 1024-entry byte table raised IndexError and every call was a 500).
"""

import json

import openai
import pytest

from gyre.backends.models import vocab as V
from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.models.tokenizer import ASSET_DIR, ENDOFTEXT, IM_END, load_tokenizer
from gyre.config import ConfigError, parse_config
from gyre.config_checks import check_model_vocab
from gyre.proxy import Proxy, ProxyConfig, serve_proxy
from tests import realmodels


def _vocab(cfg):
    check_model_vocab(cfg.model, cfg.proxy)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A Qwen2.5-format checkpoint: 1536 tokenizer ids, 1568 embedding rows."""
    return realmodels.write_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen", "qwen2.5", pad_vocab=32)


def test_resolution_order(ckpt, tmp_path):
    assert V.resolve_tokenizer_dir(str(ckpt), None) == str(ckpt)  # the checkpoint's own
    assert V.resolve_tokenizer_dir(str(ckpt), "/x/tok") == "/x/tok"  # an explicit path wins
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    assert V.resolve_tokenizer_dir(str(bare), None) is None  # no tokenizer there: the project's
    assert V.resolve_tokenizer_dir(None, None) is None
    assert V.load_tokenizer_dir(None) is load_tokenizer()
    # load_tokenizer takes any tokenizer directory now; the 1024-id rule is the project asset's only
    tok = load_tokenizer(str(ckpt))
    assert len(tok) == 1536 and tok.convert_tokens_to_ids("<|im_end|>") == 1531
    assert load_tokenizer(ASSET_DIR) is load_tokenizer()


def test_stop_ids_come_from_the_checkpoint(ckpt, tmp_path):
    tok = load_tokenizer(str(ckpt))
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert V.stop_token_ids(tok, str(ckpt)) == [im_end]  # generation_config.json's int
    d = tmp_path / "gen"
    d.mkdir()
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, im_end, 10**7]}))
    (d / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert V.stop_token_ids(tok, str(d)) == [eot, im_end, 7]  # a list, then config.json, then the tokenizer's eos (dup)
    # the project tokenizer (the presets) keeps its pair whatever the directory holds
    project = load_tokenizer()
    assert V.stop_token_ids(project, str(d)) == project.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    vocab = V.load_vocab(str(ckpt), None)
    assert vocab.path == str(ckpt) and vocab.size == 1536 and vocab.stop_ids == (im_end,)


def test_a_tokenizer_larger_than_the_model_is_refused_naming_both_sizes(ckpt, tmp_path):
    V.check_vocab(1568, 1536)  # padding rows: fine
    with pytest.raises(V.VocabError, match=r"1536 token ids but .* only 1500 embedding rows"):
        V.check_vocab(1500, 1536)
    import shutil

    small = tmp_path / "small"
    shutil.copytree(ckpt, small)
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = 1400
    (small / "config.json").write_text(json.dumps(config))
    cfg = parse_config(["--preset", "cpu-demo-smoke", "--model.checkpoint", str(small)])
    with pytest.raises(ConfigError, match=r"1536 token ids but --model.checkpoint .*small has only 1400 embedding rows"):
        _vocab(cfg)
    _vocab(parse_config(["--preset", "cpu-demo-smoke", "--model.checkpoint", str(ckpt)]))
    # A checkpoint without tokenizer files that is not project-sized (a Gyre checkpoint of a user's
    # model): refused, never paired with the project's 1024 ids.
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(ConfigError, match=r"has no tokenizer .* and 1568 embedding rows; .* --proxy.tokenizer-path"):
        _vocab(parse_config(["--preset", "cpu-demo-smoke", "--model.checkpoint", str(bare)]))
    _vocab(parse_config(["--preset", "cpu-demo-smoke", "--model.checkpoint", str(bare),
                                    "--proxy.tokenizer-path", str(ckpt)]))
    with pytest.raises(ConfigError, match="--model.checkpoint /no/such: no such directory"):
        _vocab(parse_config(["--preset", "cpu-demo-smoke", "--model.checkpoint", "/no/such"]))


@pytest.mark.parametrize("stream", [False, True])
def test_the_proxy_answers_calls_that_sample_padding_rows(ckpt, stream):
    vocab = V.load_vocab(str(ckpt), None)
    rows = 1568
    # Ids spread over the whole embedding: some >= 1024 (the old IndexError), some padding rows.
    engine = DeterministicEngine("e", vocab_size=rows, first_regular_id=0, eos_token_id=vocab.stop_ids[0], salt=3)
    proxy = Proxy(ProxyConfig(), tokenizer=vocab.tokenizer, stop_ids=vocab.stop_ids)
    proxy.router.add_engine(engine, kind="cell", index=0)
    h = serve_proxy(proxy)
    try:
        c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-pad"), max_retries=0)
        msgs = [{"role": "user", "content": "hello"}]
        if stream:
            text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                model="m", messages=msgs, max_tokens=200, stream=True) if ch.choices)
        else:
            text = c.chat.completions.create(model="m", messages=msgs, max_tokens=200).choices[0].message.content or ""
        rec = proxy.sink.records[-1]
        out = rec.output_ids.tolist()
        assert any(i >= 1536 for i in out) and any(1024 <= i < 1536 for i in out)  # the case is exercised
        table = V.byte_table(vocab.tokenizer)
        assert text == table.join(i for i in out if i not in vocab.stop_ids).decode("utf-8", "replace")
        assert proxy.undecodable_tokens == sum(1 for i in out if i >= 1536)  # counted, warned about once
    finally:
        h.stop()
