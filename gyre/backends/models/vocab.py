"""The model's vocabulary as the proxy and the engines need it: the exact bytes of every token id,
which ids end a turn, which ids may be sampled, and which tokenizer a run uses.

    resolve_tokenizer_dir(checkpoint, tokenizer_path)  →  the one directory the run's tokenizer comes from
    load_vocab(checkpoint, tokenizer_path)             →  ModelVocab(tokenizer, path, size, stop_ids)
    stop_token_ids(tokenizer, model_dir)               →  the ids that end a turn (generation_config first)
    check_vocab(model_rows, tokenizer_ids)             →  refuse a tokenizer larger than the model
    check_project_fallback(checkpoint, rows, vocab)    →  refuse a checkpoint without tokenizer that is not project-sized
    byte_table(tokenizer)                              →  ByteTable: bytes of every id, built once
    id_count(tokenizer)                                →  one past the largest id (what sampleable_vocab is)

The byte table of a tokenizer (every id's exact bytes) and the check that a tokenizer can be
streamed are `gyre.backends.models.bytetable` (re-exported here: `byte_table`, `ByteTable`,
`id_count`, `VocabError`).
"""


from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from gyre.backends.models.bytetable import ByteTable, VocabError, byte_table, id_count  # noqa: F401  (re-exported)
from gyre.backends.models.tokenizer import ASSET_DIR, ENDOFTEXT, IM_END, load_tokenizer

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tekken.json")  # a directory holding one of these has a tokenizer


# ----------------------------------------------------------------------------- which tokenizer, which stops
def has_tokenizer(path: str | os.PathLike | None) -> bool:
    return bool(path) and any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def resolve_tokenizer_dir(checkpoint: str | None, tokenizer_path: str | None) -> str | None:
    """The directory the run's tokenizer is loaded from, or None for the project's own.

    `--proxy.tokenizer-path` when given (an explicit choice: a checkpoint without tokenizer files,
    or a tokenizer with a corrected chat template); else `--model.checkpoint` when it holds a
    tokenizer (`tokenizer.json` or `tekken.json`): the checkpoint's tokenizer is the proxy's;
    else None: the project tokenizer (gyre/assets/tokenizer), which only the built-in presets use.
    """
    if tokenizer_path:
        return tokenizer_path
    if has_tokenizer(checkpoint):
        return str(checkpoint)
    return None


def load_tokenizer_dir(path: str | None) -> Any:
    """The tokenizer of `path` (any fast tokenizer), or the project's for None
    (`gyre.backends.models.tokenizer.load_tokenizer`). Cached per path; treat it as read-only."""
    return load_tokenizer(path)


def _ids_of(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value if isinstance(v, int)]


def _json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def stop_token_ids(tokenizer: Any, model_dir: str | None) -> list[int]:
    """The ids that end a turn, from the checkpoint: generation_config.json's eos_token_id (an int
    or a list: Llama 3.1 lists <|end_of_text|>, <|eom_id|>, <|eot_id|>), config.json's, and the
    tokenizer's eos_token, in that order, duplicates and ids outside the tokenizer dropped. The
    project tokenizer (the presets): <|im_end|> and <|endoftext|>, as always."""
    name = getattr(tokenizer, "name_or_path", "") or ""
    if name and os.path.abspath(name) == os.path.abspath(ASSET_DIR):
        return list(tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT]))
    ids: list[int] = []
    if model_dir:
        ids += _ids_of(_json(os.path.join(model_dir, "generation_config.json")).get("eos_token_id"))
        ids += _ids_of(_json(os.path.join(model_dir, "config.json")).get("eos_token_id"))
    eos = getattr(tokenizer, "eos_token", None)
    if eos:
        i = tokenizer.convert_tokens_to_ids(eos)
        if isinstance(i, int):
            ids.append(i)
    size = id_count(tokenizer)
    out = list(dict.fromkeys(i for i in ids if 0 <= i < size))
    if not out:
        raise VocabError(f"no stop token: neither {model_dir}/generation_config.json nor config.json has an "
                         f"eos_token_id and the tokenizer has no eos_token; a turn could never end")
    return out


def model_rows(checkpoint: str | None) -> int | None:
    """The embedding rows of a checkpoint, from config.json (its text_config for a multimodal
    one), without loading the model; None when there is no config there."""
    if not checkpoint:
        return None
    cfg = _json(os.path.join(checkpoint, "config.json"))
    rows = cfg.get("vocab_size", (cfg.get("text_config") or {}).get("vocab_size"))
    return int(rows) if rows is not None else None


def check_project_fallback(checkpoint: str | None, rows: int | None, vocab: "ModelVocab") -> None:
    """A checkpoint without tokenizer files falls back to the project tokenizer only when it is a
    project-sized model (the presets' warm starts, checkpoints Gyre wrote of them): any other
    size means the checkpoint's own tokenizer is missing (a checkpoint Gyre wrote of a user's
    model has no tokenizer files), and pairing it with 1024 ids would train on nonsense."""
    if checkpoint and vocab.path is None and rows is not None and rows != vocab.size:
        raise VocabError(f"--model.checkpoint {checkpoint} has no tokenizer (no {' or '.join(TOKENIZER_FILES)}) and "
                         f"{rows} embedding rows; the project tokenizer ({vocab.size} ids) is only for the built-in "
                         f"presets: give the model's tokenizer directory with --proxy.tokenizer-path")


def check_vocab(rows: int, ids: int, *, model: str = "the model", tokenizer: str = "the tokenizer") -> None:
    """A tokenizer whose ids go past the model's embedding rows cannot work (its ids would index
    rows that do not exist): refused, naming both sizes. A larger model (padding rows: real
    Qwen2.5 has 151,936 rows for 151,665 ids) is fine: the engines never sample the extra rows
    (`sampleable_vocab`)."""
    if ids > rows:
        raise VocabError(f"{tokenizer} has {ids} token ids but {model} has only {rows} embedding rows "
                         f"(config.json vocab_size); a tokenizer must not be larger than the model it drives")
    if rows > ids:
        logger.info("vocabulary: %s has %d embedding rows, %s %d ids: the %d padding rows are never sampled",
                    model, rows, tokenizer, ids, rows - ids)


@dataclass(frozen=True)
class ModelVocab:
    """What a run takes from its tokenizer: the tokenizer, where it came from (None: the
    project's), its number of ids (what the engines may sample) and the ids that end a turn."""

    tokenizer: Any
    path: str | None
    size: int
    stop_ids: tuple[int, ...]


def load_vocab(checkpoint: str | None, tokenizer_path: str | None) -> ModelVocab:
    """The run's tokenizer (`resolve_tokenizer_dir`) and its stop ids (`stop_token_ids`: from the
    checkpoint when there is one, generation_config.json first)."""
    path = resolve_tokenizer_dir(checkpoint, tokenizer_path)
    tok = load_tokenizer_dir(path)
    model_dir = checkpoint if checkpoint and os.path.isdir(checkpoint) else path
    return ModelVocab(tok, path, id_count(tok), tuple(stop_token_ids(tok, model_dir)))
