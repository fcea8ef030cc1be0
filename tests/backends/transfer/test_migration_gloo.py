"""The gloo KV transport between two ranks: a held buffer arrives bit-exact; a released one is
refused (KeyError), so a target can never read KV the source already freed."""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks


def _pull_twice() -> list:
    import json
    import threading
    import time

    import torch
    import torch.distributed as dist

    from gyre.backends.transfer.migration import GlooKvTransport

    store = dist.distributed_c10d._get_default_store()
    t = GlooKvTransport(store, dist.new_group(backend="gloo"))
    buf = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    out: list = []
    if dist.get_rank() == 0:
        store.set("handle", json.dumps(t.hold("k", buf)))
        while not store.check(["pulled"]):  # polling: a blocking wait would hold the store connection
            time.sleep(0.01)
        t.drop("k")
        store.set("dropped", "1")
        while not store.check(["done"]):
            time.sleep(0.01)
    else:
        handle = json.loads(store.get("handle"))
        box: dict = {}
        th = threading.Thread(target=lambda: box.setdefault("got", t.pull(handle)))  # as the engine does: off-loop
        th.start()
        th.join()
        out.append(bool(torch.equal(box["got"], buf)))
        store.set("pulled", "1")
        while not store.check(["dropped"]):
            time.sleep(0.01)
        try:
            t.pull(handle)
            out.append("pulled a dropped buffer")
        except KeyError:
            out.append("refused")
        store.set("done", "1")
    t.close()
    return out


@pytest.mark.multirank
def test_gloo_kv_transport_two_phase():
    assert run_ranks(_pull_twice, 2, timeout=120) == [[], [True, "refused"]]
