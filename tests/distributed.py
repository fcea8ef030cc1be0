"""Run a function on real gloo ranks, launched the way torchrun launches them.

`run_ranks(fn, world_size, *args)` starts `world_size` processes through torch's elastic
launcher (the machinery behind torchrun) with a c10d rendezvous on localhost:0 — no hard-coded
port — so every rank sees RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT exactly as
under torchrun. `fn` must be a module-level function (it is pickled into spawned processes);
it runs with `torch.distributed` already initialized on gloo, and its return values come back
as a list indexed by rank.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def _rank_main(fn: Callable[..., Any], args: tuple, init: bool) -> Any:
    if init:
        dist.init_process_group("gloo")
    try:
        return fn(*args)
    finally:
        if init and dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, init: bool = True, timeout: float = 120.0) -> list[Any]:
    """Run `fn(*args)` on `world_size` gloo ranks; return the per-rank results, rank order."""
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        rdzv_configs={"timeout": int(timeout)},
        max_restarts=0,
        monitor_interval=0.05,
        start_method="spawn",
        logs_specs=None,
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = elastic_launch(config, _rank_main)(fn, args, init)
    return [results[r] for r in range(world_size)]


def netns_problem() -> str | None:
    """Why Mooncake cannot run in a private network namespace here (None: it can). Mooncake listens
    on all interfaces, so tests run it inside `unshare --net` with only loopback up."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare/ip not installed"
    cmd = ["unshare", "--net"] + ([] if os.geteuid() == 0 else ["--map-root-user"]) + ["sh", "-c", "ip link set lo up"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a private network namespace: {r.stderr.strip()[:200]}"
    try:
        import mooncake.engine  # noqa: F401
    except Exception as exc:  # noqa: BLE001 — any import failure means: not usable here
        return f"mooncake not importable ({exc}); pip install mooncake-transfer-engine-non-cuda and apt-get install libibverbs1"
    return None


def run_ranks_in_netns(fn: str, world_size: int, *args: Any, timeout: float = 300) -> list[Any]:
    """`run_ranks(fn, world_size, *args)` inside a private network namespace with only loopback;
    `fn` is "module:function" (importable from the repository root); results travel as JSON."""
    root = str(Path(__file__).resolve().parents[1])
    module, _, name = fn.partition(":")
    script = (f"import json; from tests.distributed import run_ranks; from {module} import {name}; "
              f"print('RESULT', json.dumps(run_ranks({name}, {world_size}, *{args!r})))")
    prefix = ["unshare", "--net"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    r = subprocess.run(prefix + ["sh", "-c", f"ip link set lo up && exec {sys.executable} -c \"{script}\""],
                       cwd=root, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")})
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])
