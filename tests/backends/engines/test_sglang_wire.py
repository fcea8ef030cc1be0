"""gyre.backends.engines.sglang_wire: what the SGLang adapter sends (Engine kwargs, sampling
params) and reads back from a streamed chunk, by hand against SGLang 0.5.23's shapes."""

from __future__ import annotations

import pytest

from gyre.backends.config import SglangConfig
from gyre.backends.engines.sglang_wire import match_stop, parse_chunk, parse_top, sampling_params, server_args, span_versions
from gyre.backends.protocols import SamplingParams


def test_server_args_translation_and_pass_through():
    cfg = SglangConfig(model_path="/ckpt/v3", tp_size=4, mem_fraction_static=0.6, base_gpu_id=4,
                       extra={"chunked-prefill-size": "4096", "enable-torch-compile": "true", "attention-backend": "fa3",
                              "mem_fraction_static": "0.5"})
    args = server_args(cfg)
    assert args["model_path"] == "/ckpt/v3" and args["tp_size"] == 4 and args["base_gpu_id"] == 4
    assert args["skip_tokenizer_init"] is True and args["host"] == "127.0.0.1" and args["enable_memory_saver"] is True
    assert args["chunked_prefill_size"] == 4096 and args["enable_torch_compile"] is True and args["attention_backend"] == "fa3"
    assert args["mem_fraction_static"] == 0.5  # pass-through wins
    with pytest.raises(ValueError, match="model_path"):
        server_args(SglangConfig())
    with pytest.raises(ValueError, match="mem_fraction_static"):
        server_args(SglangConfig(model_path="x", mem_fraction_static=1.5))


def test_sampling_params_translation():
    sp = SamplingParams(max_tokens=77, temperature=0.6, top_p=0.95, stop_token_ids=[2, 5], stop_sequences=[[1, 2]], seed=9)
    assert sampling_params(sp) == {"max_new_tokens": 77, "temperature": 0.6, "top_p": 0.95, "stop_token_ids": [2, 5],
                                   "skip_special_tokens": False, "no_stop_trim": True, "sampling_seed": 9}
    assert "sampling_seed" not in sampling_params(SamplingParams())
    assert "min_new_tokens" not in sampling_params(SamplingParams())
    assert sampling_params(SamplingParams(max_tokens=20, min_tokens=12))["min_new_tokens"] == 12


def test_parse_chunk_takes_this_chunks_slice_of_the_cumulative_list():
    """SGLang shares one growing list between chunks; the chunk's recorded length bounds it."""
    shared = [(-0.5, 7, None), (-1.5, 8, None)]
    c1 = {"meta_info": {"output_token_logprobs": shared, "output_token_logprobs_length": 1, "finish_reason": None}}
    c2 = {"meta_info": {"output_token_logprobs": shared, "output_token_logprobs_length": 2, "finish_reason": None}}
    shared.append((-0.25, 2, None))  # the list grew after both chunks were sent
    c3 = {"meta_info": {"output_token_logprobs": shared, "output_token_logprobs_length": 3,
                        "finish_reason": {"type": "stop", "matched": 2}, "weight_version": "3"}}
    assert parse_chunk(c1, 0) == ([(7, -0.5)], None, None)
    assert parse_chunk(c2, 1) == ([(8, -1.5)], None, None)
    assert parse_chunk(c3, 2) == ([(2, -0.25)], "stop", "3")
    legacy = {"meta_info": {"output_token_logprobs": [(-0.5, 7, None)], "finish_reason": {"type": "length"}}}
    assert parse_chunk(legacy, 0) == ([(7, -0.5)], "length", None)


def test_parse_top_maps_sglang_triples_of_this_chunks_slice():
    """meta_info['output_top_logprobs']: cumulative, one list of (logprob, token_id, text) per output
    token, most likely first (sglang tokenizer_manager); TokenEvent.top wants (token_id, logprob)."""
    shared = [[(-0.1, 7, None), (-2.5, 9, None)], [(-0.3, 8, None), (-1.5, 1, "x")]]
    c = {"meta_info": {"output_token_logprobs": [(-0.1, 7, None), (-1.5, 1, None)], "output_top_logprobs": shared}}
    assert parse_top(c, 0, 1) == [[(7, -0.1), (9, -2.5)]]
    assert parse_top(c, 1, 1) == [[(8, -0.3), (1, -1.5)]]
    assert parse_top({"meta_info": {}}, 0, 2) == [None, None]  # not asked / not sent


def test_match_stop_finds_the_earliest_end():
    assert match_stop([5, 1, 2, 3, 1, 2], [[1, 2]]) == 3
    assert match_stop([5, 1, 2, 3], [[2, 3], [5]]) == 1
    assert match_stop([5, 1], [[1, 2]]) is None



def test_span_versions():
    spans = [{"version": "0", "start": 0, "end": 3}, {"version": "1", "start": 3, "end": 5}]
    assert span_versions(spans, 5) == ["0", "0", "0", "1", "1"]
    assert span_versions(None, 2) == [None, None]
