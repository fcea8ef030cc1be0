"""The engine API refuses whoever lacks the run's secret (issue 20: a hostile harness cannot hurt
the run). Real servers (`serve_engine` with the deterministic engine), real HTTP and websocket.

  * without the secret, or with a wrong one, every route answers 401 and changes nothing: the
    weights' version stays, a running call runs on, the engine still serves, /start, /release,
    /resume do nothing, no generate starts;
  * with the secret every route works;
  * the ids the router gives engines carry 96 random bits: knowing the execution id (and the old
    id format) is not enough to abort its call;
  * engines bind loopback on one node; a wildcard bind announces a routable address;
  * the secret reaches every rank over gloo and never through the store;
  * a real 2-rank job trains with authentication on, while a hostile harness inside it reads the
    engines' URLs from torchrun's store and is refused (401) on each route.
"""

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import torch
from safetensors.torch import save as st_save

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.engines.engine_host import EngineHost, bind_address
from gyre.backends.engines.engine_http import HttpEngine, serve_engine
from gyre.backends.protocols import SamplingParams
from gyre.proxy.router import Router
from gyre.serving import route_address
from tests.jobs import RUNS, write_tasks
from tests.jobs import env as jobs_env

WEIGHTS = st_save({"w": torch.ones(2)})
BAD = {"none": {}, "wrong": {"Authorization": "Bearer not-the-secret"}, "empty bearer": {"Authorization": "Bearer "},
       "no scheme": None}  # None: the right secret without "Bearer " (filled in below)


async def _refused(session: aiohttp.ClientSession, url: str, headers: dict) -> dict[str, int]:
    """Every route with `headers`; route -> status (the websocket: the handshake's status)."""
    got = {}
    for method, path, body in [("POST", "/update_weights?version=4242", WEIGHTS), ("POST", "/abort", json.dumps({"request_id": "victim"})),
                               ("POST", "/release_memory", b""), ("POST", "/resume", b""), ("POST", "/start", b""),
                               ("POST", "/generate", json.dumps({"request_id": "intruder", "input_ids": [1, 2, 3]})),
                               ("GET", "/health", None), ("GET", "/info", None)]:
        async with session.request(method, url + path, data=body, headers=headers) as r:
            got[path] = r.status
            if r.status != 401:
                await r.read()
    try:
        ws = await session.ws_connect(url + "/ws", headers=headers)
        await ws.send_str(json.dumps({"op": "abort", "rid": "victim"}))
        await ws.close()
        got["/ws"] = 101
    except aiohttp.WSServerHandshakeError as e:
        got["/ws"] = e.status
    return got


@pytest.mark.parametrize("bad", list(BAD))
def test_without_the_secret_every_route_is_refused_and_nothing_changes(bad):
    engine = DeterministicEngine("victim", token_delay=0.005, version=3)
    handle = serve_engine(engine)
    headers = BAD[bad] if BAD[bad] is not None else {"Authorization": handle.secret}
    owner = HttpEngine(handle.url, secret=handle.secret)

    async def main():
        stream = owner.generate("victim", [5, 6, 7], SamplingParams(max_tokens=120))
        seen = [await stream.__anext__() for _ in range(3)]  # the victim's call is running
        async with aiohttp.ClientSession() as s:
            got = await _refused(s, handle.url, headers)
        seen += [ev async for ev in stream]  # ... and runs on to its end: not aborted
        assert got == dict.fromkeys(got, 401) and len(got) == 9, got
        assert len(seen) == 120 and {ev.version for ev in seen} == {3}
        assert engine.version == 3 and not engine.released and not engine.started
        assert engine.generate_calls == 1  # the intruder's generate never started
        await owner.release_memory()
        async with aiohttp.ClientSession() as s:
            async with s.post(handle.url + "/resume", headers=headers) as r:
                assert r.status == 401
        assert engine.released  # still released: the refused /resume did nothing
        await owner.resume()
        assert [ev.token_id async for ev in owner.generate("after", [1], SamplingParams(max_tokens=4))]  # still serves
        await owner.close()

    try:
        asyncio.run(main())
    finally:
        handle.stop()


def test_with_the_secret_every_route_works():
    engine = DeterministicEngine("owned", token_delay=0.005)
    handle = serve_engine(engine, secret="a-given-secret")
    assert handle.secret == "a-given-secret"
    auth = {"Authorization": "Bearer a-given-secret"}

    async def main():
        async with aiohttp.ClientSession(headers=auth) as s:
            async with s.post(handle.url + "/start") as r:
                assert r.status == 200 and engine.started
            async with s.post(handle.url + "/update_weights?version=4242", data=WEIGHTS) as r:
                assert r.status == 200 and engine.version == 4242
            async with s.post(handle.url + "/generate", json={"request_id": "g", "input_ids": [1, 2], "sampling": {"max_tokens": 5}}) as r:
                assert r.status == 200 and len((await r.text()).splitlines()) == 5
            ws = await s.ws_connect(handle.url + "/ws")
            await ws.send_str(json.dumps({"op": "generate", "rid": "w", "input_ids": [1, 2], "sampling": {"max_tokens": 500}}))
            await ws.receive_str()  # the first tokens: the call runs
            async with s.post(handle.url + "/abort", json={"request_id": "w"}) as r:
                assert r.status == 200 and len((await r.json())["tokens"]) >= 1
            await ws.close()
            async with s.post(handle.url + "/release_memory") as r:
                assert r.status == 200 and engine.released
            async with s.post(handle.url + "/resume") as r:
                assert r.status == 200 and not engine.released
            async with s.get(handle.url + "/health") as r:
                assert r.status == 200 and (await r.json())["version"] == 4242

    try:
        asyncio.run(main())
    finally:
        handle.stop()


class _Recording(DeterministicEngine):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.ids: list[str] = []

    async def generate(self, request_id, input_ids, sampling):
        self.ids.append(request_id)
        async for ev in super().generate(request_id, input_ids, sampling):
            yield ev


def test_engine_request_ids_cannot_be_derived_from_the_execution():
    engine = _Recording("ids", token_delay=0.005)
    handle = serve_engine(engine)
    router = Router()
    router.add_engine(HttpEngine(handle.url, name="e", secret=handle.secret), kind="cell", index=0)

    async def main():
        # the same call key twice (a retried call), another call, and a long call we try to abort
        for key in ("ex/0/0", "ex/0/0", "ex/1/1"):
            assert [ev async for ev in router.generate(key, "ex", [1, 2], SamplingParams(max_tokens=3))]
        long = router.generate("ex/2/2", "ex", [3, 4], SamplingParams(max_tokens=150))
        got = [await long.__anext__()]
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {handle.secret}"}) as s:
            for guess in ("ex/2/2.0", "ex/2/2", "ex/2/2.1", "ex/2/2.0.0"):  # even holding the secret
                async with s.post(handle.url + "/abort", json={"request_id": guess}) as r:
                    assert (await r.json())["tokens"] == []
        got += [ev async for ev in long]
        assert len(got) == 150  # the call was not aborted
        await router.slots["e"].engine.close()

    try:
        asyncio.run(main())
    finally:
        handle.stop()
    assert len(engine.ids) == 4
    for rid, key in zip(engine.ids, ("ex/0/0", "ex/0/0", "ex/1/1", "ex/2/2")):
        assert rid.startswith(key + ".")  # logs still name the execution and the call
        tail = rid.rsplit(".", 1)[1]
        assert len(tail) * 4 >= 96 and int(tail, 16) >= 0, rid  # hex: >= 96 random bits
    a, b = engine.ids[0], engine.ids[1]
    assert a != b and a.rsplit(".", 1)[1] != b.rsplit(".", 1)[1]
    assert len({rid.rsplit(".", 1)[1] for rid in engine.ids}) == 4


def test_bind_loopback_on_one_node_and_announce_a_routable_address_across_nodes():
    for host in ("127.0.0.1", "0.0.0.0", "::", "10.1.2.3"):
        assert bind_address(host, single_node=True, peer="10.9.9.9") == ("127.0.0.1", "127.0.0.1")
    bind, announce = bind_address("0.0.0.0", single_node=False, peer="127.0.0.1")
    assert bind == "0.0.0.0" and announce == route_address("127.0.0.1") == "127.0.0.1"
    assert bind_address("10.1.2.3", single_node=False, peer="10.9.9.9") == ("10.1.2.3", "10.1.2.3")
    assert bind_address("127.0.0.1", single_node=False, peer="127.0.0.1") == ("127.0.0.1", "127.0.0.1")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        bind_address("0.0.0.0", single_node=False, peer=None)
    # a wildcard bind: the announced URL names the routable address, and it answers (with the secret)
    host = EngineHost(DeterministicEngine("wild"), host="0.0.0.0", announce="127.0.0.1", secret="s")
    try:
        assert host.url.startswith("http://127.0.0.1:") and "0.0.0.0" not in host.url

        async def main():
            client = HttpEngine(host.url, secret="s")
            assert (await client.health()).ok
            await client.close()
            async with aiohttp.ClientSession() as s, s.get(host.url + "/health") as r:
                assert r.status == 401

        asyncio.run(main())
    finally:
        host.stop()


def _share(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from gyre.backends.engines.engine_host import share_secret

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    dist.PrefixStore("gyre/", dist.distributed_c10d._get_default_store()).set(f"engine/{rank}", "http://127.0.0.1:1")
    Path(out, f"{rank}").write_text(share_secret(dist.group.WORLD, src=0))
    dist.barrier()
    if rank == 0:  # the file store deletes its file when the group ends: keep a copy
        Path(out, "store.copy").write_bytes(Path(init.removeprefix("file://")).read_bytes())
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.multirank
def test_the_secret_reaches_every_rank_and_not_the_store(tmp_path):
    import torch.multiprocessing as mp

    store_file = tmp_path / "store"
    mp.spawn(_share, args=(f"file://{store_file}", str(tmp_path)), nprocs=2)
    s0, s1 = (tmp_path / "0").read_text(), (tmp_path / "1").read_text()
    assert s0 == s1 and len(s0) >= 43  # 256 bits, URL-safe base64
    raw = (tmp_path / "store.copy").read_bytes()  # every key and value the job put in the (file) store
    assert b"engine/1" in raw and s0.encode() not in raw
    import base64

    assert base64.urlsafe_b64decode(s0 + "=") not in raw


@pytest.mark.jobs
def test_a_job_trains_with_auth_on_and_a_hostile_harness_is_refused(tmp_path):
    steps = 2
    report = tmp_path / "report"
    report.mkdir()
    harness = Path(__file__).with_name("hostile_harness.py")
    tasks = write_tasks(tmp_path / "tasks.jsonl", [sys.executable, str(harness), str(report)])
    run_dir = tmp_path / "run"
    # tests/jobs.py RUNS["async"]; the worst case for the engines: a harness outside any sandbox
    # (a sandboxed one cannot even reach them: tests/security/test_sandbox.py).
    cmd = RUNS["async"].command(tasks, run_dir, "--proxy.host", "0.0.0.0",  # one node: engines bind loopback anyway
                                steps=steps, sandbox="none")
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=jobs_env())
    log, urls = [], []
    for line in proc.stdout:  # hand the engines' URLs to the hostile harness as they are announced
        log.append(line)
        m = re.search(r"engine \S+ serving at (http://\S+)", line)
        if m:
            urls.append(m.group(1))
            (report / "urls.txt").write_text("\n".join(urls))
    assert proc.wait(timeout=400) == 0, "".join(log)[-5000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))  # it trained
    attack = json.loads((report / "attack.json").read_text())
    assert attack["store"] is not None, attack  # the harness reached torchrun's store (so the secret is not there)
    urls = attack["urls"]
    assert len(urls) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls), attack  # --proxy.host 0.0.0.0, one node
    for url in urls:
        assert attack["status"][url] == dict.fromkeys(attack["status"][url], 401) and len(attack["status"][url]) == 6, attack
