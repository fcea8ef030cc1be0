"""An engine served over HTTP behaves like the engine in process (same tokens, abort, lifecycle)."""

import asyncio
import time

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


@pytest.mark.parametrize("packed", [False, True])
def test_ws_ships_each_prompt_exactly_as_an_int32_frame(packed, monkeypatch):
    """Issue 34: the websocket carries a prompt as binary frames of little-endian int32 ids (one,
    or `part` frames of PART_IDS ids before it for a long prompt); the engine gets exactly the ids
    sent (random ids up to 2^31 - 1, lengths around the 16k conversion chunk and the part size),
    from a plain list or a `TokenIds`."""
    import random
    import threading

    import numpy as np

    from gyre.backends.engines import engine_mux
    from gyre.backends.protocols import TokenIds, free_ids

    freed = []  # the host frees a prompt over PART_IDS off its loop once the engine is done with it

    def spy(box):
        freed.append((threading.current_thread().name.startswith("asyncio"), free_ids(box)))  # the loop's executor, not the loop

    monkeypatch.setattr(engine_mux, "free_ids", spy)
    got: list[list[int]] = []
    handle = serve_engine(DeterministicEngine("rec", script=lambda ids: got.append(ids), byte_ids=list(range(256))))
    rng = random.Random(3)
    from gyre.backends.engines.engine_mux import PART_IDS

    prompts = [[rng.randrange(1 << 31) for _ in range(n)] for n in (1, 7, (1 << 14) + 1, PART_IDS, PART_IDS + 1, 2 * PART_IDS, 3 * PART_IDS + 5)]
    try:
        client = HttpEngine(handle.url, transport="ws")

        async def main():
            for i, ids in enumerate(prompts):
                sent = TokenIds(np.asarray(ids, dtype="<i4")) if packed else ids
                assert [ev async for ev in client.generate(f"p{i}", sent, SamplingParams(max_tokens=2))]
            await client.close()

        asyncio.run(main())
    finally:
        handle.stop()
    assert got == prompts
    deadline = time.monotonic() + 10  # each free runs on the executor after its call has ended
    while len(freed) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert freed == [(True, True)] * 3, freed  # PART_IDS + 1, 2x and 3x + 5 ids


def test_ws_refuses_a_broken_frame_and_still_takes_a_json_list():
    """A binary frame whose ids are not whole int32s gets an `x` (bad request) line naming the
    byte count, the connection stays up, and a text frame with "input_ids" as a JSON list still
    generates (the older form)."""
    import json

    import aiohttp

    handle = serve_engine(DeterministicEngine("e"))

    async def main():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {handle.secret}"}) as s:
            async with s.ws_connect(handle.url + "/ws") as ws:
                await ws.send_bytes(json.dumps({"op": "generate", "rid": "bad", "sampling": {"max_tokens": 2}}).encode() + b"\n" + b"\x01" * 7)
                bad = (await ws.receive_str()).strip()
                await ws.send_str(json.dumps({"op": "generate", "rid": "ok", "input_ids": [5, 6, 7], "sampling": {"max_tokens": 2}}))
                lines = []
                while not any(line.startswith("e ok") for line in lines):
                    lines += (await ws.receive_str()).splitlines()
                return bad, lines

    try:
        bad, lines = asyncio.run(main())
    finally:
        handle.stop()
    assert bad.startswith("x bad bad request:") and "7 bytes" in bad, bad
    assert [line.split()[0] for line in lines] == ["t", "t", "e"], lines
