"""A GGUF file as a plain HF checkpoint directory, written once and atomically.

    convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "runs/smollm2/data/model")   # bf16 safetensors

transformers reads GGUF (dequantizing it with the `gguf` package) but refuses `save_pretrained`
on the model it loaded, and its config carries a `quantization_config` that would make every
later load look for the GGUF again. So the conversion writes the pieces itself:

    config.json               the architecture, no quantization_config, dtype = the saved dtype
    model.safetensors         every tensor in `dtype` (bf16 by default); a tied head is stored once
    tokenizer.json, tokenizer_config.json (chat_template inside), generation_config.json
    gyre_converted.json       written last: the source (name, size) and each file's size

The directory is built under a temporary name beside the target and renamed into place, so a
killed conversion leaves a `.NAME.tmp-PID` directory (removed by the next conversion) and never a
half-written NAME. `converted(path, source)` is the reuse test: the marker is there, names the
same source, and every file it lists has the size it recorded.

Needs `gguf` (and `accelerate`) beside transformers: `pip install -e '.[real]'` (setup.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MARKER = "gyre_converted.json"
NEEDS = ("gguf", "accelerate")  # imported by transformers' GGUF loader; setup.py's `real` extra installs them
INSTALL = "pip install --no-build-isolation -e '.[real]'"


class MissingPackage(ImportError):
    """A package the conversion needs is not installed; the message is the pip command."""


def check_packages(names: tuple[str, ...] = NEEDS, install: str = INSTALL) -> None:
    """Refuse, naming the pip command, when one of `names` is not importable (found, not imported)."""
    import importlib.util

    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        raise MissingPackage(f"converting a GGUF checkpoint needs {', '.join(missing)}: install it with `{install}` "
                             f"(from the Gyre checkout)")


def converted(path: str | os.PathLike, source: str | os.PathLike | None = None) -> bool:
    """`path` is a finished conversion (of `source`, when given): marker there, files intact."""
    path = Path(path)
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if source is not None:
        src = Path(source)
        if marker.get("source") != src.name or marker.get("source_bytes") != src.stat().st_size:
            return False
    files = marker.get("files") or {}
    return bool(files) and all((path / n).is_file() and (path / n).stat().st_size == size for n, size in files.items())


def hf_config_dict(config, architecture: str) -> dict:
    """The config.json of a GGUF-loaded model's config, as a plain checkpoint's: no
    quantization_config (transformers would look for the GGUF again), no GGUF-side name, the
    architectures list set (SGLang and Gyre's registry read it), and float fields that GGUF stores
    as float32 (rms_norm_eps 9.999999747e-06) given back their shortest float32 spelling (1e-05)."""
    import struct

    raw = config.to_diff_dict()  # what save_pretrained writes: the fields that differ from the class's defaults
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "_commit_hash"):
        raw.pop(k, None)
    raw["architectures"] = [architecture]  # a GGUF-loaded config has none
    for k in ("rms_norm_eps", "layer_norm_eps"):
        v = raw.get(k)
        if isinstance(v, float) and v and struct.unpack("f", struct.pack("f", v))[0] == v:
            raw[k] = float(f"{v:.7g}")  # the shortest decimal that is the same float32
    return raw


def convert_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
                 install: str = INSTALL) -> Path:
    """Write `gguf_file` as an HF checkpoint directory `out_dir` in `dtype`, unless a finished
    conversion of the same file is already there (then reuse it). Atomic; returns `out_dir`."""
    src, out = Path(gguf_file), Path(out_dir)
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file {src} not found")
    if converted(out, src):
        logger.info("GGUF %s: reusing the conversion at %s", src.name, out)
        return out
    if out.exists() and not (out / MARKER).exists():  # never replace what this module did not write
        raise FileExistsError(f"{out} exists and is not a GGUF conversion (no {MARKER}); remove it or convert "
                              f"into another directory")
    check_packages(install=install)
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in [*out.parent.glob(f".{out.name}.tmp-*"), *out.parent.glob(f".{out.name}.old-*")]:
        if not _alive(stale.name.rsplit("-", 1)[-1]):  # a conversion killed before its rename, or before removing the old
            logger.info("removing %s, left by an interrupted conversion", stale)
            shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    try:
        _write(src, tmp, dtype)
        _install(tmp, out, src)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("GGUF %s: converted to %s (%s) in %.1fs", src.name, out, str(dtype).removeprefix("torch."),
                time.perf_counter() - t0)
    return out


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return int(pid) != os.getpid()


def _write(src: Path, tmp: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    raw = hf_config_dict(model.config, type(model).__name__)
    raw["dtype"] = str(dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    state = model.state_dict()
    tied = bool(raw.get("tie_word_embeddings"))
    if tied:  # one tensor under two names; HF checkpoints of tied models store the embedding only
        state.pop("lm_head.weight", None)
    save_file({k: v.detach().to(dtype).contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    tok.save_pretrained(str(tmp))
    _tokenizer_config(tmp, tok.chat_template, raw.get("max_position_embeddings"))
    model.generation_config.save_pretrained(str(tmp))
    del model


def _tokenizer_config(path: Path, template: str | None, max_len: int | None) -> None:
    """tokenizer_config.json as a hub checkpoint's: the chat template inside (transformers 5 also
    writes chat_template.jinja; older readers and other tools look here), the generic fast class
    (transformers 5 names its own `TokenizersBackend`, which 4.x cannot load; both read
    tokenizer.json verbatim under `PreTrainedTokenizerFast`), and the model's context length
    instead of transformers' "unlimited" 1e30, and no loader-side fields."""
    file = path / "tokenizer_config.json"
    conf = json.loads(file.read_text()) if file.exists() else {}
    for k in ("is_local", "local_files_only", "backend", "name_or_path"):
        conf.pop(k, None)
    conf["tokenizer_class"] = "PreTrainedTokenizerFast"
    if max_len:
        conf["model_max_length"] = int(max_len)
    if template:
        conf["chat_template"] = template
    file.write_text(json.dumps(conf, indent=2, ensure_ascii=False) + "\n")


def _install(tmp: Path, out: Path, src: Path) -> None:
    """Marker last (fsynced with the files), then the rename; an older or broken `out` is moved
    aside first, and a finished one another process renamed into place meanwhile is kept."""
    files = {}
    for p in sorted(tmp.iterdir()):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
            files[p.name] = p.stat().st_size
    marker = {"source": src.name, "source_bytes": src.stat().st_size, "files": files}
    with open(tmp / MARKER, "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    old = None
    if out.exists():  # an older conversion (another source, or a file since damaged): replaced
        if converted(out, src):  # another process finished first
            return
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError:
        if not converted(out, src):
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
