"""The wire between Gyre and SGLang 0.5.23, pure: what the adapter (sglang_engine.py) sends (Engine
kwargs, sampling params, logit bias, prefix-free rids, the TP ranks' GPUs) and reads back from a
streamed chunk (tokens, log-probs, the finish, weight versions). SGLang's side: docs/gpu-sglang.md."""

from __future__ import annotations

from typing import Any

import torch

from gyre.backends.config import SglangConfig
from gyre.backends.protocols import SamplingParams


# ServerArgs fields Gyre derives itself (`server_args`, `factory.build_sglang_engine`): a pass-through may
# not set them (gyre.config_checks.check_model_dtype refuses them up front, `server_args` again).
GYRE_OWNED_SERVER_ARGS = {
    "model_path": "the --model.checkpoint directory, or the one Gyre writes",
    "tp_size": "= --parallel.cell-size",
    "base_gpu_id": "this rank's GPU",
    "dtype": "= --model.dtype",
    "skip_tokenizer_init": "token ids in, token ids out",
    "weight_version": "the served version",
}


def server_args(config: SglangConfig, known: set[str] | None = None) -> dict[str, Any]:
    """`sglang.Engine(**kwargs)` from Gyre's config; `config.extra` (pass-through) wins over the
    fields Gyre merely defaults (mem_fraction_static, enable_memory_saver, host, log_level) and
    may not set the ones it derives (GYRE_OWNED_SERVER_ARGS). `known`: ServerArgs' field names;
    a pass-through name outside them is refused with the closest ones (SGLang's own error would be a
    TypeError from inside Engine())."""
    if not config.model_path:
        raise ValueError("sglang.model_path: an HF checkpoint directory is required")
    if config.tp_size < 1:
        raise ValueError(f"sglang.tp_size must be ≥ 1, got {config.tp_size}")
    if not 0.0 < config.mem_fraction_static < 1.0:
        raise ValueError(f"sglang.mem_fraction_static must be in (0, 1), got {config.mem_fraction_static}")
    args: dict[str, Any] = {
        "model_path": config.model_path,
        "tp_size": config.tp_size,
        "mem_fraction_static": config.mem_fraction_static,
        "base_gpu_id": config.base_gpu_id,
        "dtype": config.dtype,
        "enable_memory_saver": config.enable_memory_saver,
        "skip_tokenizer_init": True,  # token ids in, token ids out (TITO, docs/design.md §4)
        "host": "127.0.0.1",
        "log_level": "error",
    }
    for key, value in config.extra.items():
        name = key.replace("-", "_")
        if name in GYRE_OWNED_SERVER_ARGS:
            raise ValueError(f"sglang pass-through {key!r}: Gyre sets ServerArgs.{name} itself "
                             f"({GYRE_OWNED_SERVER_ARGS[name]})")
        if known is not None and name not in known:
            import difflib

            close = difflib.get_close_matches(name, sorted(known), n=5, cutoff=0.6)
            raise ValueError(f"--sglang.{name.replace('_', '-')}: sglang's ServerArgs has no field {name!r}"
                             + (f"; closest: {', '.join(close)}" if close else "")
                             + f" ({len(known)} fields; see `python -m sglang.launch_server --help`)")
        args[name] = _coerce(value)
    return args


def unsampleable_bias(sampleable_vocab: int | None, vocab_size: int) -> dict[str, float]:
    """SGLang `logit_bias` that keeps sampling to ids < sampleable_vocab: PAD_BIAS on every padded
    embedding row (an id the tokenizer cannot decode must never be sampled). SGLang adds it before
    sampling and the reported log-probs; keys must lie in [0, vocab_size) (docs/gpu-sglang.md,
    the padded vocabulary, with SGLang's file:line)."""
    if sampleable_vocab is None or sampleable_vocab >= vocab_size:
        if sampleable_vocab is not None and sampleable_vocab > vocab_size:
            raise ValueError(f"sampleable_vocab {sampleable_vocab} > the model's vocab_size {vocab_size}: the "
                             f"tokenizer has ids the model cannot produce (wrong checkpoint or tokenizer?)")
        return {}
    if sampleable_vocab < 1:
        raise ValueError(f"sampleable_vocab must be >= 1, got {sampleable_vocab}")
    return {str(i): PAD_BIAS for i in range(sampleable_vocab, vocab_size)}


# Finite, not -inf: exp(-1e9 - max) is exactly 0 in float32/bfloat16 softmax, so the ids are never
# sampled, while any p·log p or max-subtraction over the row stays finite (no 0·inf NaN).
PAD_BIAS = -1e9


def _coerce(value: str) -> Any:
    """Pass-through CLI strings → bool / int / float where they parse, else the string."""
    if not isinstance(value, str):
        return value
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def sampling_params(sp: SamplingParams) -> dict[str, Any]:
    """SGLang sampling_params dict for one request (stop sequences are matched by the adapter)."""
    out: dict[str, Any] = {
        "max_new_tokens": sp.max_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "stop_token_ids": list(sp.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,  # keep the stop token in the output: it was sampled and is trained
    }
    if sp.seed is not None:
        out["sampling_seed"] = int(sp.seed)
    if sp.min_tokens:
        out["min_new_tokens"] = int(sp.min_tokens)
    return out


def parse_chunk(chunk: dict[str, Any], seen: int) -> tuple[list[tuple[int, float]], str | None, str | None]:
    """New (token_id, logprob) pairs of a streamed chunk, its finish type, its weight version.

    SGLang's meta_info['output_token_logprobs'] is the request's cumulative list — the same list
    object, which keeps growing after the chunk was sent — so the chunk's own
    'output_token_logprobs_length' bounds what belongs to it (sglang 0.5.23 tokenizer_manager)."""
    meta = chunk.get("meta_info", {})
    entries = meta.get("output_token_logprobs") or []
    end = int(meta.get("output_token_logprobs_length", len(entries)))
    pairs = [(int(e[1]), float(e[0])) for e in entries[seen:end]]
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    version = meta.get("weight_version")
    return pairs, kind, None if version is None else str(version)


def parse_top(chunk: dict[str, Any], seen: int, n: int) -> list[list[tuple[int, float]] | None]:
    """TokenEvent.top for the chunk's n new tokens (positions seen .. seen+n-1): SGLang's
    (logprob, token_id, text) triples as (token_id, logprob); None where SGLang sent none."""
    rows = chunk.get("meta_info", {}).get("output_top_logprobs") or []
    out: list[list[tuple[int, float]] | None] = []
    for i in range(seen, seen + n):
        row = rows[i] if i < len(rows) else None
        out.append(None if row is None else [(int(e[1]), float(e[0])) for e in row])
    return out


def match_stop(ids: list[int], stop_sequences: list[list[int]]) -> int | None:
    """Length of the output to keep if some stop sequence ends inside `ids`, else None."""
    best = None
    for s in stop_sequences:
        for end in range(len(s), len(ids) + 1):
            if ids[end - len(s) : end] == list(s):
                best = end if best is None else min(best, end)
                break
    return best


def prefix_free_rid(request_id: str, serial: int) -> str:
    """The SGLang rid of a request: `"<len>:<request_id>:<serial>."`. SGLang aborts every rid that
    *starts with* the one named (scheduler.py:5688, 5800); no rid of this form is a prefix of
    another (the length fixes where the id ends, the '.' where the serial ends), so an abort of
    "call.1" can never reach "call.10". The serial keeps a retried id apart from an aborted
    one that has not landed yet."""
    return f"{len(request_id)}:{request_id}:{serial}."


def tp_devices(config: SglangConfig) -> list[torch.device]:
    """The GPU of each TP rank of the engine: base_gpu_id + tp_rank * gpu_id_step (entrypoints/
    engine.py:935-939, one node, no pipeline stages; gpu_id_step defaults to 1, arg_groups/
    fields/device.py:32, and may come through the pass-through)."""
    extra = {k.replace("-", "_"): v for k, v in config.extra.items()}
    step = int(_coerce(extra.get("gpu_id_step", 1)))
    return [torch.device("cuda", config.base_gpu_id + rank * step) for rank in range(config.tp_size)]


def span_versions(spans: list[dict[str, Any]] | None, n: int) -> list[str | None]:
    """Per-token weight versions from SGLang's finishing chunk, meta_info['weight_versions'] =
    [{"version", "start", "end"}, ...] over output positions (utils/weight_versions.py:90-105);
    None where no span covers a position (no spans sent)."""
    out: list[str | None] = [None] * n
    for span in spans or []:
        for i in range(int(span["start"]), min(int(span["end"]), n)):
            out[i] = str(span["version"])
    return out
