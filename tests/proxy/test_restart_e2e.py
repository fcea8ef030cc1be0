"""Two proxy restarts mid-execution, end to end: a real `python -m gyre.proxy` over the on-disk
store, SIGKILLed twice while a call is in flight; a harness subprocess on the official `openai`
SDK that keeps its history and retries a failed call against the new proxy. The execution then
trains with every call once (gyre/proxy/resume.py, gyre/trajectory/tree.py)."""

import asyncio
import json
import os
import subprocess
import sys
import threading

import numpy as np

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.engines.engine_http import serve_engine
from gyre.proxy.admin import AdminClient
from gyre.trajectory.advantages import Outcome
from gyre.trajectory.materialize import ScoredExecution, ScoredGroup, materialize_step
from gyre.trajectory.store import read_execution
from tests.trajectory.sim import unpack

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WAIT_S = 300  # only so a hang fails instead of blocking the suite; nothing is timed

HARNESS = r"""
import json, sys, time
import openai

conn_path, n_calls = sys.argv[1], int(sys.argv[2])

def conn(after=0):
    # the proxy's URL and this execution's key; after a failure, those of the next proxy
    while True:
        try:
            with open(conn_path) as f:
                c = json.load(f)
            if c["gen"] > after:
                return c
        except (OSError, ValueError):
            pass
        time.sleep(0.05)

c = conn()
history = [{"role": "system", "content": "You are terse."}]
for k in range(n_calls):
    history.append({"role": "user", "content": f"step {k}"})
    while True:
        client = openai.OpenAI(base_url=c["url"] + "/v1", api_key=c["key"], max_retries=0)
        try:
            r = client.chat.completions.create(model="m", messages=history, max_tokens=12)
            break
        except (openai.APIConnectionError, openai.AuthenticationError) as e:
            print(json.dumps({"failed": k, "gen": c["gen"], "error": type(e).__name__}), flush=True)
            c = conn(c["gen"])
    history.append({"role": "assistant", "content": r.choices[0].message.content})
    print(json.dumps({"done": k, "gen": c["gen"]}), flush=True)
"""


class GatedEngine(DeterministicEngine):
    """Holds its `hold`-th generate requests (1-based) until released: the proxy is killed while
    such a call is in flight, so it cannot have been recorded."""

    def __init__(self, *args, hold=(), **kw) -> None:
        super().__init__(*args, **kw)
        self.n = 0
        self.arrived = {k: threading.Event() for k in hold}
        self.release = {k: threading.Event() for k in hold}

    async def generate(self, request_id, input_ids, sampling):
        self.n += 1
        k = self.n
        if k in self.arrived:
            self.arrived[k].set()
            while not self.release[k].is_set():
                await asyncio.sleep(0.01)
        async for ev in super().generate(request_id, input_ids, sampling):
            yield ev


def test_two_proxy_restarts_mid_execution_train_every_call_once(tmp_path):
    n_calls = 6
    # engine requests: c0 c1 c2(killed) c2 c3 c4(killed) c4 c5
    engine = GatedEngine("A", salt=7, eos_prob=0.05, hold=(3, 6))
    served = serve_engine(engine)
    store, conn_path = tmp_path / "store", tmp_path / "conn.json"
    env = {**os.environ, "GYRE_PROXY_ADMIN_TOKEN": "adm", "GYRE_ENGINE_SECRET": served.secret, "PYTHONPATH": ROOT}
    procs, logs = [], []

    def start_proxy(gen: int) -> AdminClient:
        log = open(tmp_path / f"proxy{gen}.log", "w")
        logs.append(log)
        p = subprocess.Popen([sys.executable, "-m", "gyre.proxy", "--store-dir", str(store), "--engines", f"A={served.url}@cell:0"],
                             stdout=subprocess.PIPE, stderr=log, env=env, text=True, cwd=ROOT)
        procs.append(p)
        url = json.loads(p.stdout.readline())["url"]
        admin = AdminClient(url, "adm")
        tmp = tmp_path / "conn.tmp"
        tmp.write_text(json.dumps({"gen": gen, "url": url, "key": admin.issue_key("ex-e2e", role="main")}))
        os.replace(tmp, conn_path)  # the harness reads a whole file or none
        return admin

    harness_py = tmp_path / "harness.py"
    harness_py.write_text(HARNESS)
    harness = None
    try:
        start_proxy(1)
        harness = subprocess.Popen([sys.executable, str(harness_py), str(conn_path), str(n_calls)], stdout=subprocess.PIPE,
                                   text=True, env=env)
        for gen, hold in ((2, 3), (3, 6)):
            assert engine.arrived[hold].wait(WAIT_S), f"engine request {hold} never came"
            procs[-1].kill()  # SIGKILL, the call in flight
            procs[-1].wait()
            engine.release[hold].set()
            admin = start_proxy(gen)
        out, _ = harness.communicate(timeout=WAIT_S)
        assert harness.returncode == 0, out
        events = [json.loads(line) for line in out.splitlines()]
        stats = admin.close_execution("ex-e2e")
    finally:
        for p in procs + ([harness] if harness else []):
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
        served.stop()

    assert [e["done"] for e in events if "done" in e] == list(range(n_calls))
    assert [(e["failed"], e["gen"]) for e in events if "failed" in e] == [(2, 1), (4, 2)]  # one failed try per kill

    res = read_execution(store / "ex-e2e.tito")
    recs = res.records
    # call ids unique for the execution's life, and every call the harness made recorded once
    assert [r.call_id for r in recs] == list(range(n_calls))
    for k, r in enumerate(recs):
        # its history, re-sent across both restarts, is spliced, never diagnosed as edits
        assert (r.payload_ref["spliced_turns"], r.payload_ref["unmatched_turns"]) == (k, 0), k
        if k:
            prev = recs[k - 1]
            assert r.input_ids[: prev.num_tokens].tolist() == np.concatenate([prev.input_ids, prev.output_ids]).tolist()
    assert (stats["calls"], stats["unmatched_turns"], stats["roles"]) == (n_calls, 0, {"MAIN": n_calls})

    # the path the runtime takes to training: one group, this execution against a worse one
    other = ScoredExecution("other", Outcome.scored(0.0), records=[])
    group = ScoredGroup("g", 0, [ScoredExecution("ex-e2e", Outcome.scored(1.0), tito_path=str(store / "ex-e2e.tito")), other])
    batch = materialize_step([group], max_tokens=1 << 14, rng=np.random.default_rng(0), j_max=None)
    assert batch.tree_stats["ex-e2e"]["calls"] == n_calls and batch.tree_stats["ex-e2e"]["leaves"] == 1
    (tokens, targets), = unpack(batch.micro_steps)
    last = recs[-1]
    assert tokens == np.concatenate([last.input_ids, last.output_ids]).tolist()
    # every sampled token of every call is a target exactly once, with its behavior log-prob
    want = {len(r.input_ids) + j - 1: float(r.output_logprobs[j]) for r in recs for j in range(len(r.output_ids))}
    assert {t: lp for t, lp, _, _ in targets} == want and len(targets) == sum(len(r.output_ids) for r in recs)
