"""One rank's command loop with an SGLang engine whose scheduler dies, for
tests/runtime/test_engine_sigquit.py (run as `python -m tests.runtime.engine_sigquit_rank DIR CRASH_ON
COMMANDS`).

What a rank does (gyre/runtime/job.py): the adapter over the conformance fake of SGLang 0.5.23,
served by `EngineHost` on its own thread, the job's SIGQUIT watch, a `CellWorker` on the main
thread taking commands in `job.serve`. Not here: torch.distributed, the controller (the control
plane is a list; the reports the rank sends are printed as JSON lines on stdout). The fake's
scheduler dies handling the control request named CRASH_ON and SIGQUITs this process, as SGLang's
does its rank (tests/backends/sglang_fake.py, `FakeScheduler._die`); with CRASH_ON `_SReq` it dies
on a generate request, sent once the commands are done, while the rank waits for the next. Exit status: 1 for the job's
diagnosed failure (`WorkerFailed`, as `gyre.run` exits for a RunFailed), 0 after a Stop.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any


class _Control:
    """The rank's side of the control plane: commands from a list, reports printed."""

    def __init__(self, commands: list[Any], idle: Any) -> None:
        self.commands, self.idle = commands, idle

    def recv(self, timeout: float | None = None, what: str = "a command") -> Any:
        if not self.commands:  # nothing more: the engine serves a call while the rank waits
            import time

            self.idle()
            time.sleep(60)
            raise TimeoutError("no SIGQUIT came")
        return self.commands.pop(0)

    def try_recv(self) -> Any:
        return None

    def send(self, to: int, report: Any) -> None:
        print(json.dumps({"type": type(report).__name__, **dataclasses.asdict(report)}), flush=True)


class _Actor:
    version = 0

    def restore(self) -> None:
        pass

    def offload(self) -> int:
        return 0


class _Weights:
    def fetch_published(self, version: int) -> tuple[int, dict]:
        return version, {}


def main(workdir: str, crash_on: str, commands: str) -> int:
    import asyncio

    from gyre.backends.config import SglangConfig
    from gyre.backends.protocols import SamplingParams
    from gyre.backends.engines.engine_host import EngineHost
    from gyre.backends.engines.sglang_engine import SglangEngine
    from gyre.backends.models.hf import save_checkpoint
    from gyre.config import ParallelConfig
    from gyre.errors import RunFailed
    from gyre.runtime import job
    from gyre.runtime.messages import ToRollout, ToTrain
    from gyre.runtime.worker import CellWorker
    from gyre.topology import Topology
    from tests.backends import sglang_fake
    from tests.backends.helpers import tiny_model

    save_checkpoint(tiny_model(seed=0), workdir)
    sglang_fake.FakeEngine.crash_on = crash_on
    engine = SglangEngine(SglangConfig(model_path=workdir, dtype="float32", extra={"attention_backend": "triton"}),
                          api=sglang_fake.API)
    engine.name = "rank0"  # as gyre.backends.factory.build_engine names it
    host = job.host_engine(engine, host="127.0.0.1", announce="127.0.0.1", secret=None)
    assert isinstance(host, EngineHost)
    topo = Topology.from_config(ParallelConfig(), 1, 0)
    def serve_a_call() -> None:  # as the proxy's calls reach the engine, on the engine's thread
        async def call() -> None:
            async for _ in engine.generate("call-1", [1, 2, 3], SamplingParams(max_tokens=4)):
                pass

        asyncio.run_coroutine_threadsafe(call(), host.handle.loop)

    names = [c for c in commands.split(",") if c]
    control = _Control([{"ToTrain": ToTrain(), "ToRollout": ToRollout(version=0)}[c] for c in names], serve_a_call)
    worker = CellWorker(topo, None, control, _Weights(), host, make_actor=lambda is_core: _Actor())
    try:
        job.serve(worker, control, topo, linger_s=0.0)
    except RunFailed as e:
        print(json.dumps({"type": "exit", "error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
