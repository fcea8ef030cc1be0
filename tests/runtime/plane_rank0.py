"""What the execution-plane tests share, and a stand-in for rank 0 run as its own process.

As a script (argv: RUN_DIR ENGINE_URL ENGINE_SECRET BEFORE AFTER), it starts the plane as rank 0
would (`spawn_plane`: its own session), attaches, registers the engine, dispatches one group of one
gated execution (tests/runtime/gated_harness.py) and prints every event it is given as a JSON line;
then it waits to be killed."""

import asyncio
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gyre.executions.config import ExecutionsConfig, RunnerConfig  # noqa: E402
from gyre.executions.tasks import EvaluatorSpec, ExecutionSpec, Group, Task  # noqa: E402
from gyre.runtime.execution_plane import PlaneConfig, spawn_plane  # noqa: E402
from gyre.runtime.plane_client import PlaneClient, wait_for_plane  # noqa: E402

TINY = ROOT / "tests" / "runtime" / "tiny_harness.py"
GATED = ROOT / "tests" / "runtime" / "gated_harness.py"
# The tiny harness's reward (fraction of even-length answer lines), as tests/jobs.py's.
AWK_EVALUATOR = ["awk", "{n++; if (length($0) % 2 == 0) e++} END {print (n ? e / n : 0)}", "answer.txt"]


def plane_config(run_dir: Path, orphan_s: float = 600.0) -> PlaneConfig:
    return PlaneConfig(run_dir=str(run_dir), orphan_s=orphan_s,
                       executions=ExecutionsConfig(runner=RunnerConfig(sandbox="none", timeout_s=3600, kill_grace_s=2.0)))


def group(gid: str, harness: list[str], n: int = 1) -> Group:
    task = Task(gid.split(".")[0], "say words", EvaluatorSpec("command", AWK_EVALUATOR), harness=harness)
    return Group(gid, task, [ExecutionSpec(f"{gid}.{i}", task, gid, i) for i in range(n)])


def gated(before: int, after: int) -> list[str]:
    return [sys.executable, str(GATED), str(before), str(after)]


def even_fraction(path: Path) -> float:
    """The awk evaluator's reward, recomputed here."""
    lines = path.read_text().splitlines()
    return sum(len(x) % 2 == 0 for x in lines) / len(lines)


async def main(run_dir: Path, url: str, secret: str, before: int, after: int) -> None:
    proc = spawn_plane(plane_config(run_dir))
    await wait_for_plane(run_dir, proc)

    def show(ev) -> None:
        print(json.dumps({"kind": ev.kind.value, "execution_id": ev.execution_id}), flush=True)

    client = await PlaneClient.attach(run_dir, on_event=show)
    await client.add_engine(url, name="cell0", kind="cell", index=0, secret=secret)
    client.dispatch_group(group("t0.g0", gated(before, after)))
    await asyncio.Event().wait()


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(main(Path(a[0]), a[1], a[2], int(a[3]), int(a[4])))
