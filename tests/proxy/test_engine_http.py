"""An engine served over HTTP behaves like the engine in process (same tokens, abort, lifecycle)."""

import asyncio

import pytest
import torch

from gyre.backends.protocols import RolloutEngine, SamplingParams
from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.engines.engine_http import HttpEngine, serve_engine


@pytest.mark.parametrize("transport", ["ws", "http"])
def test_http_engine_matches_in_process_and_aborts(transport):
    local = DeterministicEngine("ref", salt=5, eos_prob=0.02)
    remote_engine = DeterministicEngine("remote", salt=5, eos_prob=0.02, token_delay=0.002)
    handle = serve_engine(remote_engine)
    try:
        client = HttpEngine(handle.url, transport=transport)
        assert isinstance(client, RolloutEngine)

        async def main():
            await client.start()
            assert client.name == "remote"
            sp = SamplingParams(max_tokens=40)
            prompt = [9, 8, 7, 6]
            ref = [ev async for ev in local.generate("r", prompt, sp)]
            got = [ev async for ev in client.generate("g", prompt, sp)]
            assert [(e.token_id, e.logprob, e.version, e.finish_reason) for e in got] == [
                (e.token_id, e.logprob, e.version, e.finish_reason) for e in ref
            ]
            # abort mid-stream: returns every token generated, a superset of what we consumed
            seen = []
            stream = client.generate("long", prompt, SamplingParams(max_tokens=500))
            async for ev in stream:
                seen.append(ev)
                if len(seen) == 5:
                    aborted = await client.abort("long")
                    break
            await stream.aclose()
            assert len(aborted) >= 5 and [e.token_id for e in aborted[:5]] == [e.token_id for e in seen]
            await client.update_weights({"w": torch.zeros(3)}, version=4)
            h = await client.health()
            assert h.version == 4 and h.ok
            # a client that goes away makes the server abort the request
            stream = client.generate("gone", prompt, SamplingParams(max_tokens=500))
            async for _ in stream:
                break
            await stream.aclose()
            for _ in range(200):
                if remote_engine.load() == 0:
                    break
                await asyncio.sleep(0.01)
            assert remote_engine.load() == 0
            await client.release_memory()
            assert (await client.health()).released
            await client.resume()
            await client.close()

        asyncio.run(main())
    finally:
        handle.stop()


def test_engine_process_going_away_fails_open_streams():
    """A dropped engine connection ends its streams with an error (the router then reroutes)."""
    handle = serve_engine(DeterministicEngine("dies", token_delay=0.01))
    client = HttpEngine(handle.url, name="dies")

    async def main():
        stream = client.generate("r", [1, 2, 3], SamplingParams(max_tokens=1000))
        got = 0
        with pytest.raises((ConnectionError, RuntimeError)):
            async for _ in stream:
                got += 1
                if got == 3:
                    await asyncio.get_running_loop().run_in_executor(None, handle.stop)
        assert got >= 3
        await client.close()

    asyncio.run(main())
