"""One directory per run: where a run's outputs go, decided once on rank 0 before anything starts.

    --run-dir ""  (the default)   a fresh `runs/<preset>/<YYYYmmdd-HHMMSS>/` (`runs/train/...`
                                  with no --preset), and the link
                                  `runs/<preset>/latest` pointing at it; running the same command
                                  again makes another directory and keeps every earlier run
    --run-dir DIR                 exactly DIR; refused when DIR already holds a run, unless
                                  --train.resume (continue it) or --overwrite (replace it)
    --train.resume                continue DIR, or the run `runs/<preset>/latest` points at

Data a preset prepares (the cpu-demo's tasks and warm start) lives beside the runs, in
`runs/<preset>/data`, and is reused by every run. Rank 0 decides and creates the directory and
writes `run.json` (the config and command line); the other ranks read the decision from the
rendezvous store, so every rank writes to the same place even when their clocks differ. A
refusal is raised on every rank, before any engine, proxy or harness exists.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LATEST = "latest"
# What a run leaves in its directory; any of these means the directory already holds a run.
RUN_OUTPUTS = ("run.json", "metrics.jsonl", "summary.json", "events.jsonl", "role_timeline.png", "executions",
               "checkpoints", "tito", "transport", "tensorboard", "wandb", "report")
_KEY = "rundir/decision"


class RunDirError(ValueError):
    """The run directory cannot be used as asked; the message names the flags that fix it."""


def runs_root(preset: str) -> Path:
    """Where a preset's runs go when --run-dir is not given: `runs/<preset>`, or `runs/train` for a
    training job built from flags alone (the default preset, smoke, trains nothing)."""
    return Path("runs") / ("train" if preset == "smoke" else preset)


def previous_outputs(path: Path) -> list[str]:
    """The names of a previous run's outputs found in `path` (empty: a fresh directory)."""
    return [name for name in RUN_OUTPUTS if (path / name).exists()]


def _fresh_timestamped(root: Path, now: float) -> Path:
    """Create and return `root/<timestamp>` (with -2, -3, ... when two runs start in one second)."""
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    for n in range(1, 1000):
        path = root / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RunDirError(f"could not create a fresh run directory under {root}")


def _point_latest(root: Path, target: Path) -> None:
    """Atomically make `root/latest` a relative link to `target`."""
    link, tmp = root / LATEST, root / f".{LATEST}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(target.name, tmp)
    os.replace(tmp, link)


def decide(cfg: Any, *, now: float | None = None) -> Path:
    """Rank 0's decision (creates the directory); raises RunDirError with the fix when refused."""
    resume = cfg.train.resume
    if not cfg.run_dir:
        root = runs_root(cfg.preset)
        if resume:
            latest = root / LATEST
            if not latest.exists():
                raise RunDirError(f"--train.resume: there is no previous run to resume ({latest} does not exist); "
                                  f"give the run's directory with --run-dir DIR")
            return latest.resolve()
        path = _fresh_timestamped(root, time.time() if now is None else now)
        _point_latest(root, path)
        return path.resolve()
    path = Path(cfg.run_dir)
    if resume:
        if not path.is_dir():
            raise RunDirError(f"--train.resume: run directory {path} does not exist")
        return path.resolve()
    found = previous_outputs(path)
    if found:
        if not cfg.overwrite:
            raise RunDirError(
                f"run directory {path} already holds a run ({', '.join(found)}). Pass --train.resume to continue it, "
                f"--overwrite to delete those outputs and start over, or another --run-dir (leave --run-dir unset "
                f"for a fresh timestamped directory under {runs_root(cfg.preset)}/)")
        for name in found:
            p = path / name
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        logger.warning("--overwrite: deleted the previous run's %s in %s", ", ".join(found), path)
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


def write_manifest(path: Path, cfg: Any, world_size: int) -> None:
    """`run.json`: what was run, so a directory explains itself (resumes add `resumes`)."""
    manifest = path / "run.json"
    entry = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv, "world_size": world_size}
    if manifest.exists():
        data = json.loads(manifest.read_text())
        data.setdefault("resumes", []).append(entry)
    else:
        data = {**entry, "config": dataclasses.asdict(cfg)}
    manifest.write_text(json.dumps(data, indent=1, default=str))


def resolve(cfg: Any, rank: int, world_size: int, store: Any) -> Path:
    """Every rank: the run's directory, decided by rank 0 and shared through `store`.

    Sets `cfg.run_dir` to the decided path. Raises RunDirError on every rank when refused.
    """
    if rank == 0:
        try:
            path = decide(cfg)
            write_manifest(path, cfg, world_size)
            store.set(_KEY, json.dumps({"path": str(path)}))
        except RunDirError as e:
            store.set(_KEY, json.dumps({"error": str(e)}))
            raise
    else:
        store.wait([_KEY])  # blocking: rank 0's decision
    decision = json.loads(store.get(_KEY))
    if "error" in decision:
        raise RunDirError(decision["error"])
    cfg.run_dir = decision["path"]
    return Path(cfg.run_dir)
