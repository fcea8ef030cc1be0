"""A Gyre checkpoint as a plain HF model directory that transformers (or SGLang, vLLM) loads.

    python -m gyre.export runs/smollm2/latest out/smollm2-rl               # the run's newest complete checkpoint
    python -m gyre.export runs/smollm2/latest/checkpoints/step_000008 out/step8 --dtype bfloat16

A checkpoint (gyre/checkpoint.py) holds the actor's weights in the HF layout (config.json,
model.safetensors) beside Gyre's own files (optimizer.pt, gyre_actor.json, COMPLETE). The
export copies the weights and config, adds what the run served with but the checkpoint does not
hold — the tokenizer and its chat template (the run's `--proxy.tokenizer-path`, else its
`--model.checkpoint`'s, else the project tokenizer of the built-in presets), and the starting
checkpoint's generation_config.json — and leaves Gyre's files out:

    config.json  model.safetensors  generation_config.json  tokenizer.json  tokenizer_config.json
    (chat_template inside)  [chat_template.jinja, special_tokens_map.json, ...]  gyre_export.json

`AutoModelForCausalLM.from_pretrained(OUT)` then gives the logits Gyre's actor computed
(tests/test_export.py). The directory is written under a temporary name and renamed into place.
Only complete checkpoints are exported (`gyre.checkpoint.check`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path

from gyre import checkpoint

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tekken.json", "vocab.json", "merges.txt")
DTYPES = ("float32", "bfloat16", "float16")


class ExportError(ValueError):
    """What cannot be exported, and why."""


def find_checkpoint(path: str | os.PathLike) -> Path:
    """`path` itself when it is a checkpoint directory, else the newest complete one of the run
    directory `path` (its checkpoints/)."""
    p = Path(path)
    if (p / checkpoint.MODEL).is_file() or (p / checkpoint.MARKER).is_file():
        why = checkpoint.check(p)
        if why is not None:
            raise ExportError(f"{p} is not a complete checkpoint: {why}")
        return p
    found = checkpoint.newest_complete(p / "checkpoints")
    if found.path is None:
        skipped = f" (skipped: {found.describe_skipped()})" if found.skipped else ""
        raise ExportError(f"{p}: neither a checkpoint nor a run directory with a complete checkpoint{skipped}")
    return found.path


def run_dir_of(ckpt: Path) -> Path | None:
    """The run directory a checkpoint belongs to (…/RUN/checkpoints/step_N), when it has run.json."""
    run = ckpt.resolve().parent.parent
    return run if (run / "run.json").is_file() else None


def source_dirs(ckpt: Path) -> tuple[str | None, str | None]:
    """(tokenizer directory, starting checkpoint) of the run that wrote `ckpt`, from its run.json
    (None, None: the project tokenizer, no starting checkpoint). Paths the run was given relative
    to its working directory are looked up from the current one, then from each of the run
    directory's ancestors (runs/<preset>/<time>/ sits under the directory it was launched from)."""
    from gyre.backends.models.vocab import resolve_tokenizer_dir

    run = run_dir_of(ckpt)
    if run is None:
        return None, None
    cfg = json.loads((run / "run.json").read_text()).get("config", {})
    model, tok = cfg.get("model", {}).get("checkpoint"), cfg.get("proxy", {}).get("tokenizer_path")

    def locate(p: str | None) -> str | None:
        if not p:
            return None
        for base in (Path.cwd(), *run.resolve().parents):
            q = Path(p) if Path(p).is_absolute() else base / p
            if q.is_dir():
                return str(q)
        raise ExportError(f"{ckpt}: the run's {p!r} (run.json) is not found from here or above {run}; "
                          f"pass --tokenizer DIR")

    model_dir = locate(model)
    return resolve_tokenizer_dir(model_dir, locate(tok)), model_dir


def export(ckpt: str | os.PathLike, out: str | os.PathLike, *, tokenizer: str | None = None, dtype: str | None = None,
           overwrite: bool = False) -> Path:
    """Write checkpoint (or run directory) `ckpt` as an HF directory `out`; returns `out`.
    `tokenizer`: the tokenizer directory (default: the run's, see `source_dirs`); `dtype`: cast
    the weights (default: as saved, the run's --model.dtype)."""
    from gyre.backends.models.tokenizer import ASSET_DIR

    src, dst = find_checkpoint(ckpt), Path(out)
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise ExportError(f"{dst} exists and is not empty; pass --overwrite to replace it")
    tok_dir, start = (tokenizer, None) if tokenizer else source_dirs(src)
    tok_dir = tok_dir or ASSET_DIR
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write(src, tmp, Path(tok_dir), Path(start) if start else None, dtype)
        if dst.exists():
            shutil.rmtree(dst)
        os.rename(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("exported %s to %s (tokenizer from %s)", src, dst, tok_dir)
    return dst


def _write(src: Path, tmp: Path, tok_dir: Path, start: Path | None, dtype: str | None) -> None:
    weights = [p for p in sorted(src.iterdir()) if p.name.endswith(WEIGHT_SUFFIXES)]
    if not weights:
        raise ExportError(f"{src}: no *.safetensors weights")
    config = json.loads((src / "config.json").read_text())
    for p in weights:
        if dtype is None or p.name.endswith(".json"):
            shutil.copyfile(p, tmp / p.name)
        else:
            _cast(p, tmp / p.name, dtype)
    if dtype is not None:
        config["dtype"] = dtype
        config.pop("torch_dtype", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = next((g for g in (src / "generation_config.json", *(() if start is None else (start / "generation_config.json",)))
                if g.is_file()), None)  # the checkpoint's own (save_pretrained writes one), else the starting model's
    if gen is not None:
        shutil.copyfile(gen, tmp / gen.name)
    copied = [n for n in TOKENIZER_FILES if (tok_dir / n).is_file()]
    if "tokenizer.json" not in copied and "tekken.json" not in copied:
        raise ExportError(f"tokenizer directory {tok_dir} has no tokenizer.json (or tekken.json)")
    for n in copied:
        shutil.copyfile(tok_dir / n, tmp / n)
    _template_in_config(tmp)
    meta = {"checkpoint": str(src.resolve()), "version": checkpoint.version_of(src), "tokenizer": str(tok_dir.resolve()),
            "generation_config": str(gen.resolve()) if gen else None, "dtype": dtype or config.get("dtype")}
    (tmp / "gyre_export.json").write_text(json.dumps(meta, indent=1) + "\n")


def _template_in_config(path: Path) -> None:
    """tokenizer_config.json carries the chat template even where the tokenizer directory kept it
    in chat_template.jinja only (transformers 5's layout), so older readers see it too."""
    conf_file, jinja = path / "tokenizer_config.json", path / "chat_template.jinja"
    conf = json.loads(conf_file.read_text()) if conf_file.is_file() else {}
    if not conf.get("chat_template") and jinja.is_file():
        conf["chat_template"] = jinja.read_text()
        conf_file.write_text(json.dumps(conf, indent=2, ensure_ascii=False) + "\n")


def _cast(src: Path, dst: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    want = getattr(torch, dtype)
    tensors = {k: (v.to(want) if v.is_floating_point() else v) for k, v in load_file(str(src)).items()}
    save_file(tensors, str(dst), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gyre.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint directory (checkpoints/step_N) or a run directory (its newest)")
    p.add_argument("out", help="the HF directory to write")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the run's, from its run.json)")
    p.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: as the run saved them). bfloat16 "
                   "rounds away updates below its 2^-8 relative spacing: a pretrained-lr RL run's are mostly that")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        print(export(a.checkpoint, a.out, tokenizer=a.tokenizer, dtype=a.dtype, overwrite=a.overwrite))
    except ExportError as e:
        print(f"gyre.export: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
