"""Rank 0's side of `--executions.plane process`: start the execution plane
(`gyre.runtime.execution_plane`), or attach to the one an earlier attempt of the run started, and
put this attempt's engines behind its router (re-attach: each engine under its name again, at its
new URL). `live_executions` is what the restarted run directory asks first: which executions of
earlier attempts the plane still runs (docs/cluster.md, "What a fault costs").
"""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

from gyre.backends.config import ModelConfig
from gyre.executions.config import ExecutionsConfig
from gyre.proxy.config import ProxyConfig
from gyre.runtime.execution_plane import PlaneConfig, spawn_plane
from gyre.runtime.plane_client import PlaneClient, plane_alive, wait_for_plane
from gyre.runtime.plane_wire import PlaneGone, read_plane_file
from gyre.runtime.proxy_access import engine_ranks, engine_url

logger = logging.getLogger(__name__)


def _running_plane(run_dir: Path) -> dict[str, Any] | None:
    try:
        info = read_plane_file(run_dir)
    except (PlaneGone, ValueError, OSError, KeyError):
        return None
    return info if plane_alive(info) else None


def live_executions(run_dir: Path) -> frozenset[str] | None:
    """The executions the run's execution plane is running now; None when no plane is alive (or it
    does not answer: what it runs is then treated as lost)."""
    if (info := _running_plane(run_dir)) is None:
        return None
    req = urllib.request.Request(info["url"] + "/plane/in_flight", headers={"Authorization": f"Bearer {info['token']}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return frozenset(json.loads(r.read())["in_flight"])
    except (OSError, ValueError, KeyError, urllib.error.URLError) as e:
        logger.warning("the execution plane (pid %s) did not answer (%s): its executions count as lost", info["pid"], e)
        return None


def restarts_left() -> int:
    """How many more times torchrun will restart the workers (--max-restarts less the restarts so
    far; 0 outside torchrun): with none left, a stop for a signal ends the executions as rank 0's
    own data plane would."""
    env = os.environ  # the restarts so far as every rank agreed (gyre.run: a node restarted for another's count 0)
    done = env.get("GYRE_TORCHRUN_RESTARTS", env.get("TORCHELASTIC_RESTART_COUNT", 0))
    return max(0, int(env.get("TORCHELASTIC_MAX_RESTARTS", 0)) - int(done))


async def attach_data_plane(model: ModelConfig, proxy_cfg: ProxyConfig, executions: ExecutionsConfig, run_dir: Path,
                            ledger: Any, tito: Any, store: Any, topo: Any, secret: str | None,
                            on_error: Callable[..., None], on_event: Callable[[Any], None]) -> PlaneClient:
    """`proxy_access.start_data_plane`'s counterpart: the run's plane (started now, or an earlier
    attempt's still running) with every cell's and pool engine's server behind its router."""
    if (info := _running_plane(run_dir)) is not None:
        logger.warning("attaching to the execution plane an earlier attempt started (pid %d): its executions run on",
                       info["pid"])
    else:
        # The plane ends with the process whose end means no controller comes back: torchrun's
        # agent (it restarts the workers), else this rank 0.
        agent = os.getppid() if "TORCHELASTIC_RESTART_COUNT" in os.environ else os.getpid()
        cfg = PlaneConfig(run_dir=str(run_dir), orphan_s=executions.plane_orphan_s, parent_pid=agent,
                          checkpoint=model.checkpoint, proxy=proxy_cfg, executions=executions)
        info = await wait_for_plane(run_dir, spawn_plane(cfg))
        logger.info("execution plane started (pid %d): the proxy at %s", info["pid"], info["proxy_url"])
    client = await PlaneClient.attach(run_dir, on_event=on_event, on_error=on_error, ledger=ledger)
    client.survives = restarts_left() > 0
    for kind, index, rank in engine_ranks(topo):
        await client.add_engine(await engine_url(store, rank), name=f"{kind}{index}", kind=kind, index=index,
                                secret=secret)
    return client
