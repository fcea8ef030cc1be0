"""The plane's client as rank 0 uses it, against a real plane process, a real engine server and
real harnesses: a controller killed mid-execution loses nothing (the next one replays the end), and
the plane gives what the in-process data plane gives."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.engines.engine_http import HttpEngine, serve_engine
from gyre.executions.runner import EventKind
from gyre.runtime.execution_plane import spawn_plane
from gyre.runtime.plane_client import PlaneClient, plane_alive, wait_for_plane
from gyre.runtime.plane_wire import read_plane_file
from gyre.runtime.proxy_access import serve_data_plane
from gyre.trajectory.store import TitoStore
from tests.runtime.plane_rank0 import ROOT, TINY, even_fraction, group, plane_config


@pytest.fixture
def engine():
    h = serve_engine(DeterministicEngine("A", eos_prob=0.05))
    yield h
    h.stop()


async def _until(cond, step: float = 0.02) -> None:
    """Wait for an event (no bound on the time it takes: the machine is loaded)."""
    while not cond():
        await asyncio.sleep(step)


def test_controller_killed_mid_execution_the_next_one_replays_its_end(tmp_path, engine):
    """A stand-in for rank 0 (its own process group, as torchrun runs a worker) starts the plane
    and dispatches a gated harness; once the harness has made its first calls, the stand-in's
    whole group is SIGKILLed (torchrun's killpg). The plane and the harness run on; a new client
    attaches through execution_plane.json, replays from the cursor the dead one acknowledged, and
    sees the execution end once, with its result; the TITO file has every call once.
    (Planted: spawn_plane without start_new_session; the killpg took the plane, and this failed.)"""
    before, after = 2, 2
    run = tmp_path / "run"
    run.mkdir()
    rank0 = subprocess.Popen([sys.executable, str(ROOT / "tests" / "runtime" / "plane_rank0.py"), str(run), engine.url,
                              engine.secret, str(before), str(after)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             start_new_session=True)
    ws = run / "executions" / "t0.g0.0" / "workspace"
    try:
        old = [json.loads(rank0.stdout.readline()) for _ in range(2)]  # dispatched, started
        assert [e["kind"] for e in old] == ["dispatched", "started"]
        while not (ws / "phase1").exists():
            time.sleep(0.02)
        info = read_plane_file(run)
        os.killpg(rank0.pid, signal.SIGKILL)
        rank0.wait()
        old += [json.loads(line) for line in rank0.stdout.read().splitlines()]
    finally:
        if rank0.poll() is None:
            os.killpg(rank0.pid, signal.SIGKILL)
    assert plane_alive(info)  # out of the killed group
    (ws / "go").touch()

    async def attach_and_wait():
        seen = []
        client = await PlaneClient.attach(run, on_event=seen.append)
        result = await client.adopt("t0.g0.0")
        await client.close_plane()
        return seen, result, client

    seen, result, client = asyncio.run(attach_and_wait())
    kinds = [e["kind"] for e in old] + [e.kind.value for e in seen]
    assert kinds.count("finished") == 1 and kinds.count("evaluated") == 1
    assert set(kinds) == {"dispatched", "started", "finished", "evaluated"}
    end = next(e for e in seen if e.kind is EventKind.EVALUATED)
    assert end.result is not None and end.result.outcome.value == "completed" and result.outcome.value == "completed"
    answers = ws / "answer.txt"
    assert len(answers.read_text().splitlines()) == before + after
    assert result.reward.reward == pytest.approx(even_fraction(answers), abs=1e-6)
    records = TitoStore(run / "tito").load("t0.g0.0")
    assert [r.call_id for r in records] == list(range(before + after))
    assert client.totals()["calls"] == before + after  # the close stats came with the replayed end
    while plane_alive(info):  # close_plane ended it
        time.sleep(0.05)
    assert not (run / "execution_plane.json").exists()


def test_the_plane_gives_what_the_in_process_data_plane_gives(tmp_path, engine):
    """One group through the in-process data plane (serve_data_plane in this loop) and through the
    plane process: the same outcomes, rewards, close counts and TITO records (the det engine is
    deterministic). (Planted: result_from_json dropped the reward's value; this failed.)"""
    harness = [sys.executable, str(TINY), "3"]

    async def in_process(run: Path):
        cfg = plane_config(run)
        proxy, handle, access, runner = await serve_data_plane(None, cfg.proxy, cfg.executions, run, None,
                                                               TitoStore(run / "tito"), lambda *a: None, None)
        proxy.router.add_engine(HttpEngine(engine.url, name="cell0", secret=engine.secret), kind="cell", index=0)
        results = await asyncio.gather(*runner.dispatch_group(group("t0.g0", harness, n=2)))
        await runner.shutdown()
        await proxy.router.close()
        await handle.astop()
        proxy.sink.close()
        return results, dict(access.totals)

    async def through_plane(run: Path):
        await wait_for_plane(run, proc := spawn_plane(plane_config(run)))
        client = await PlaneClient.attach(run)
        await client.add_engine(engine.url, name="cell0", kind="cell", index=0, secret=engine.secret)
        results = await asyncio.gather(*client.dispatch_group(group("t0.g0", harness, n=2)))
        await client.shutdown()
        await client.close()
        assert proc.wait() == 0
        return results, dict(client.totals())

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    ra, ta = asyncio.run(in_process(a))
    rb, tb = asyncio.run(through_plane(b))
    assert ta == tb and ta["calls"] == 6
    for x, y in zip(ra, rb):
        assert (x.execution_id, x.outcome, x.exit_code, x.reward.status, x.reward.reward) == \
               (y.execution_id, y.outcome, y.exit_code, y.reward.status, y.reward.reward)
        assert y.exec_dir == b / "executions" / y.execution_id
        assert x.reward.reward == pytest.approx(even_fraction(x.workspace / "answer.txt"), abs=1e-6)
        recs_a, recs_b = TitoStore(a / "tito").load(x.execution_id), TitoStore(b / "tito").load(y.execution_id)
        assert len(recs_a) == len(recs_b) == 3
        for p, q in zip(recs_a, recs_b):
            assert p.call_id == q.call_id and p.role == q.role
            assert np.array_equal(p.input_ids, q.input_ids) and np.array_equal(p.output_ids, q.output_ids)
            assert np.array_equal(p.output_logprobs, q.output_logprobs) and p.finish_reason == q.finish_reason


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.sampled_from(["reroutes", "engine_deaths", "dead_engine_calls", "engine_failures"]),
                       st.tuples(st.integers(0, 1000), st.integers(0, 1000)), min_size=1),
       st.tuples(st.integers(0, 50), st.integers(0, 50)))
def test_an_attempts_router_counts_are_its_own_since_it_attached(counts, moved):
    """The plane's router lives across attempts; each attempt's summary counts from its attach
    (run.json adds attempts up): base + this attempt's = now, nested ones too; the engines'
    table is passed through (planted: returning `now` -> the sums double count)."""
    from gyre.runtime.plane_client import since

    base = {k: a for k, (a, _) in counts.items()}
    now = {k: a + b for k, (a, b) in counts.items()}
    base["migration"], now["migration"] = {"moved": moved[0]}, {"moved": moved[0] + moved[1]}
    base["engines"] = now["engines"] = {"cell0": {"served": 7}}
    got = since(now, base)
    assert {k: got[k] for k in counts} == {k: b for k, (_, b) in counts.items()}
    assert got["migration"] == {"moved": moved[1]} and got["engines"] == {"cell0": {"served": 7}}
    assert since(now, {}) == now  # a fresh plane: everything is this attempt's
