"""`gyre.run --help`: one screen for a person — the sections and the flags people change — with
`--help-all` for tyro's full listing of every field (over a thousand lines).

The values shown are the chosen preset's (`--preset cpu-demo --help` shows cpu-demo's), and each
flag's line is the first sentence of its field's docstring, the same text `--help-all` prints.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import fields, is_dataclass
from typing import Any

# The flags people change, in the order a run is set up: what to train, on what, how long, how.
COMMON = (
    "preset", "run_dir", "seed",
    "model.checkpoint", "model.preset", "model.dtype",
    "executions.dataset.path", "executions.runner.harness_command", "executions.runner.max_concurrency",
    "executions.runner.timeout_s",
    "train.steps", "train.max_tokens", "train.checkpoint_every", "train.resume",
    "actor.lr", "scheduler.n_per_group", "scheduler.batch_groups", "scheduler.mode",
    "parallel.cell_size", "proxy.chat_format", "backend.engine", "backend.actor", "log_level",
)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: its attribute docstring} of a dataclass, read from its source as tyro reads it."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body, out = tree.body[0].body, {}
    for a, b in zip(body, body[1:]):
        if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
            out[a.target.id] = inspect.cleandoc(b.value.value)
    return out


def first_sentence(text: str, limit: int = 110) -> str:
    """The docstring's first sentence on one line, cut at `limit` characters.

    >>> first_sentence("Optimizer steps of the whole run, counted across resumes: a run\\nresumed. More.")
    'Optimizer steps of the whole run, counted across resumes: a run resumed.'
    """
    flat = " ".join(text.split())
    end = flat.find(". ")
    one = flat if end < 0 else flat[:end + 1]
    return one if len(one) <= limit else one[:limit - 1].rstrip() + "…"


def lookup(cfg: Any, dotted: str) -> tuple[Any, type, str]:
    """(value, the dataclass that declares it, field name) of `section.sub.field` in `cfg`."""
    *path, name = dotted.split(".")
    owner = cfg
    for p in path:
        owner = getattr(owner, p)
    return getattr(owner, name), type(owner), name


def short_help(cfg: Any, presets_epilog: str, prog: str = "python -m gyre.run") -> str:
    """The one-screen help: usage, the sections (one line each), the common flags with the
    preset's value, the presets, and where the rest is."""
    lines = ["usage: torchrun --standalone --nproc-per-node N -m gyre.run [--preset NAME] [FLAGS]",
             f"       {prog} --help-all   (every flag, with its full description)", "",
             (type(cfg).__doc__ or "").strip(), "", "sections (--SECTION.FIELD):"]
    docs = field_docs(type(cfg))
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if is_dataclass(value):
            doc = (type(value).__doc__ or "").strip()
            if doc.startswith(type(value).__name__ + "("):  # the dataclass's generated signature: none written
                doc = ""
            about = first_sentence(doc or docs.get(f.name, ""), 90)
            lines.append(f"  {f.name:<12} {about}")
    lines += ["", "the flags people change (this preset's value in brackets):"]
    for dotted in COMMON:
        value, owner, name = lookup(cfg, dotted)
        flag = "--" + dotted.replace("_", "-")
        shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
        if shown == "":
            shown = '""'
        lines.append(f"  {flag:<38} [{shown}]")
        lines.append(f"      {first_sentence(field_docs(owner).get(name, ''))}")
    lines += ["", presets_epilog, "",
              "Backend options pass through: --sglang.NAME VALUE goes to SGLang's ServerArgs as is.",
              "Before a long job: python -m gyre.doctor [the same flags] checks the machine and the config."]
    return "\n".join(lines)
