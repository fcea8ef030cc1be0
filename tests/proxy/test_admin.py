"""The proxy as its own process, driven through the admin API; records land in the store."""

import json
import os
import subprocess
import sys

import openai
import pytest

from gyre.proxy.admin import AdminClient, AdminError
from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.engines.engine_http import serve_engine
from gyre.trajectory.store import TitoStore


def test_proxy_process_admin_api(tmp_path):
    engine_a = serve_engine(DeterministicEngine("A", eos_prob=0.05))  # the engines' secrets: a
    engine_b = serve_engine(DeterministicEngine("B", eos_prob=0.05))  # from the env, b by the admin API
    env = {**os.environ, "GYRE_PROXY_ADMIN_TOKEN": "s3cret", "GYRE_ENGINE_SECRET": engine_a.secret}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gyre.proxy", "--store-dir", str(tmp_path), "--engines", f"A={engine_a.url}@cell:1"],
        stdout=subprocess.PIPE, env=env, text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    try:
        ready = json.loads(proc.stdout.readline())
        admin = AdminClient(ready["url"], "s3cret")
        with pytest.raises(AdminError) as e:
            AdminClient(ready["url"], "wrong").router_stats()
        assert e.value.status == 401
        key = admin.issue_key("ex-proc", role="main")
        admin.add_engine(engine_b.url, name="B", kind="pool", index=0, secret=engine_b.secret)
        assert set(admin.router_stats()["engines"]) == {"A", "B"}
        c = openai.OpenAI(base_url=ready["url"] + "/v1", api_key=key, max_retries=0)
        for q in ("one", "two"):
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": q}], max_tokens=12)
        assert admin.drain("A") == 0
        assert admin.router_stats()["engines"]["A"]["state"] == "drained"
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "three"}], max_tokens=12)
        admin.resume("A")
        with pytest.raises(AdminError) as e:
            admin.resume("A")  # ACTIVE -> ACTIVE is illegal
        assert e.value.status == 409
        with pytest.raises(AdminError) as e:
            admin.drain("nope")
        assert e.value.status == 404
        admin.set_policy_version(3)
        stats = admin.close_execution("ex-proc")
        assert stats["calls"] == 3 and stats["roles"] == {"MAIN": 3}
        recs = TitoStore(tmp_path).load("ex-proc")
        assert [r.call_id for r in recs] == [0, 1, 2]
        assert recs[2].payload_ref["engines"] == ["B"]
        with pytest.raises(openai.AuthenticationError):
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    finally:
        proc.terminate()
        proc.wait(30)
        engine_a.stop()
        engine_b.stop()
