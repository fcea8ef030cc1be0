"""A proxy's store sink keeps one descriptor per open execution (benchmarks/scale_bench.py: ~2 per
open execution with its connection), so it raises the soft open-file limit to the hard one: with
a low soft limit, more executions than that limit can be open at once and none loses a record."""

import resource

import numpy as np
import pytest

from gyre.proxy.sink import StoreSink
from gyre.trajectory.record import CallRecord, Role
from gyre.trajectory.store import TitoStore


@pytest.fixture
def low_soft_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"hard open-file limit {hard}: too low to show the raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))
    try:
        yield hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _record(eid: str, call_id: int) -> CallRecord:
    ids = np.arange(10 + call_id, 40 + call_id, dtype=np.int32)
    return CallRecord(eid, call_id, Role.MAIN, ids, ids[:5].copy(), np.full(5, -0.5, np.float32), policy_version=0)


def test_more_open_executions_than_the_soft_limit_all_keep_their_records(tmp_path, low_soft_limit):
    sink = StoreSink(TitoStore(tmp_path))
    n = 300  # > 128 open files at once
    for call in range(2):
        for i in range(n):
            sink.on_record(_record(f"x{i}", call))
    sink.close()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == hard or soft >= 1 << 20
    store = TitoStore(tmp_path)
    got = {eid: [r.call_id for r in store.load(eid)] for eid in store.execution_ids()}
    assert got == {f"x{i}": [0, 1] for i in range(n)}
