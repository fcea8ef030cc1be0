"""Where a benchmark's figures came from: the machine, the package versions and the commit, for
the results file a benchmark writes when asked (`python -m benchmarks.NAME --out benchmarks/results/NAME.json`;
without `--out` it only prints)."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def provenance(*packages: str) -> dict:
    """{"machine", "versions", "git_commit"}: python and torch always, plus each of `packages`
    that is installed (distribution names, e.g. "mooncake-transfer-engine-non-cuda")."""
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in packages:
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "processor": platform.processor(),
                        "loadavg_1_5_15_at_end": os.getloadavg()},
            "versions": versions, "git_commit": commit}


OUT_HELP = "the results file to write (machine, versions, config, commit, figures); default: none, print only"


def write_results(path: str | os.PathLike | None, record: dict) -> None:
    """Write a benchmark's results file (`record` holds provenance(), its config and "figures") when
    `path` is given (its `--out`: a run writes into the checkout only when asked), then print the
    figures as the one JSON line every benchmark ends with."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["figures"]))
