"""An engine server in a process of its own, to be SIGKILLed by a test: a `DeterministicEngine`
served by `serve_engine`. Prints one JSON line {"url", "secret"} once it listens, then serves
until killed.

    python -m tests.proxy.engine_proc NAME [--salt S] [--version V] [--delay D] [--hang-after N]

`--hang-after N`: every request stops after its N-th token and waits (it never ends by itself),
so a test can kill the process while a call is surely mid-generation, with exactly N tokens sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.engines.engine_http import serve_engine


class HangingEngine(DeterministicEngine):
    """Sends `hang_after` tokens of each request, then waits forever (an abort ends it)."""

    def __init__(self, name: str, hang_after: int, **kw) -> None:
        super().__init__(name, **kw)
        self.hang_after = hang_after

    async def generate(self, request_id, input_ids, sampling):
        n = 0
        async for ev in super().generate(request_id, input_ids, sampling):
            yield ev
            n += 1
            if n == self.hang_after:
                await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--salt", type=int, default=0)
    ap.add_argument("--version", type=int, default=0)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--hang-after", type=int, default=0)
    a = ap.parse_args()
    kw = dict(salt=a.salt, version=a.version, token_delay=a.delay)
    engine = HangingEngine(a.name, a.hang_after, **kw) if a.hang_after else DeterministicEngine(a.name, **kw)
    handle = serve_engine(engine)
    print(json.dumps({"url": handle.url, "secret": handle.secret}), flush=True)
    sys.stdout.close()
    threading.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    main()
