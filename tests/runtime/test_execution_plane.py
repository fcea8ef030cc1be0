"""The execution plane as a real process: its routes refuse bad requests naming the field, and with
no controller calling for `orphan_s` it stops its harnesses, seals their records and exits 0."""

import asyncio
import json
import sys
from pathlib import Path

import aiohttp
import pytest

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.engines.engine_http import serve_engine
from gyre.runtime.execution_plane import PlaneConfig, config_from_json, spawn_plane
from gyre.runtime.plane_client import PlaneClient, PlaneError, wait_for_plane
from gyre.runtime.plane_wire import group_to_json
from gyre.trajectory.store import TitoStore, is_sealed
from tests.runtime.plane_rank0 import gated, group, plane_config


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_config_round_trips_through_json():
    """What spawn_plane writes is what the process reads (nested sections, tuples stay tuples)."""
    import dataclasses

    cfg = plane_config(Path("/x"), orphan_s=7.0)
    cfg.proxy = dataclasses.replace(cfg.proxy, roles=dataclasses.replace(cfg.proxy.roles, sub_agent_markers=("a", "b")))
    back = config_from_json(PlaneConfig, json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert back == cfg and back.proxy.roles.sub_agent_markers == ("a", "b")
    with pytest.raises(ValueError, match=r"config.proxy: unknown fields \['nope'\]"):
        config_from_json(PlaneConfig, {"run_dir": "/x", "proxy": {"nope": 1}})
    with pytest.raises(ValueError, match="--orphan-s must be > 0"):
        PlaneConfig(run_dir="/x", orphan_s=0)


def test_orphaned_plane_stops_its_harnesses_seals_records_and_exits(tmp_path):
    """A client dispatches a gated harness (it never gets its `go`) and goes away. With no call for
    orphan_s the plane stops the harness (cancelled, within its grace), seals its TITO file, says
    why once and exits 0. Before that, its routes answer bad requests with a 4xx naming the field.
    (Planted: Plane.stop without the runner's shutdown; no `finished` event, and this failed.)"""
    engine = serve_engine(DeterministicEngine("A", eos_prob=0.05))
    run = tmp_path / "run"
    run.mkdir()
    ws = run / "executions" / "t0.g0.0" / "workspace"

    async def main():
        proc = spawn_plane(plane_config(run, orphan_s=1.0))
        info = await wait_for_plane(run, proc)
        client = await PlaneClient.attach(run)
        await client.add_engine(engine.url, name="cell0", kind="cell", index=0, secret=engine.secret)
        g = group("t0.g0", gated(2, 1))
        client.dispatch_group(g)
        while not (ws / "phase1").exists():
            await asyncio.sleep(0.02)
        # Bad requests: 4xx naming the field.
        bad = [("POST", "/plane/dispatch", {"json": {}}, 400, "group"),
               ("POST", "/plane/dispatch", {"json": {"group": {**group_to_json(g), "executions": [{"index": 0}]}}},
                400, "group.executions[0].execution_id"),
               ("POST", "/plane/dispatch", {"json": {"group": group_to_json(g)}}, 409, "group.executions"),
               ("GET", "/plane/events", {"params": {"since": "x"}}, 400, "since"),
               ("POST", "/plane/shutdown", {"json": {"evaluate": "yes"}}, 400, "evaluate"),
               ("GET", "/plane/closed/t0.g0.0", {}, 404, "execution_id")]
        for method, path, kw, status, field in bad:
            with pytest.raises(PlaneError) as e:
                await client._call(method, path, **kw)
            assert e.value.status == status and json.loads(str(e.value).split(": ", 2)[2])["field"] == field, path
        async with aiohttp.ClientSession() as s:
            async with s.post(info["url"] + "/plane/heartbeat", headers={"Authorization": "Bearer wrong"}) as r:
                assert r.status == 401
        await client.detach()
        return proc, info

    proc, info = asyncio.run(main())
    harness_pid = int((ws / "pid").read_text())
    assert proc.wait() == 0
    engine.stop()
    assert _gone(harness_pid)
    log = (run / "execution_plane" / "plane.log").read_text()
    assert log.count("execution plane stopping: no controller called for 1s (--orphan-s)") == 1
    events = [json.loads(line) for line in (run / "execution_plane" / "events.jsonl").read_text().splitlines()]
    assert [e["seq"] for e in events] == list(range(len(events)))
    finished = [e for e in events if e.get("kind") == "finished"]
    assert len(finished) == 1 and finished[0]["result"]["outcome"] == "cancelled"
    assert finished[0]["closed"]["calls"] == 2
    assert events[-1]["type"] == "stopped"
    path = TitoStore(run / "tito").path_for("t0.g0.0")
    assert is_sealed(path) and [r.call_id for r in TitoStore(run / "tito").load("t0.g0.0")] == [0, 1]
    assert not (run / "execution_plane.json").exists()
    assert (run / "execution_plane" / "config.json").stat().st_mode & 0o077 == 0
