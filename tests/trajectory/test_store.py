from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.trajectory.record import CallRecord, Role
from gyre.trajectory.store import StoreCorruptError, TitoStore, TitoWriter, load_execution, read_execution, read_heads


def make_record(i: int, exec_id: str = "ex-1", n_in: int = 7, n_out: int = 3) -> CallRecord:
    rng = np.random.default_rng(i)
    return CallRecord(
        execution_id=exec_id,
        call_id=i,
        role=Role(i % 4),
        input_ids=rng.integers(0, 150_000, n_in),
        output_ids=rng.integers(0, 150_000, n_out),
        output_logprobs=rng.normal(size=n_out).astype(np.float32) - 2,
        policy_version=10 + i,
        start_time=1000.5 + i,
        end_time=1001.25 + i,
        finish_reason=["stop", "length", "tool_calls"][i % 3],
        output_versions=np.arange(n_out) + i,
        message_starts=np.array([0, 3, 5][: min(3, n_in)]),
        payload_ref={"request": f"req-{i}.json", "ünï": [1, 2]},
    )


def assert_same(a: CallRecord, b: CallRecord) -> None:
    for f in ("execution_id", "call_id", "role", "policy_version", "start_time", "end_time", "finish_reason", "payload_ref"):
        assert getattr(a, f) == getattr(b, f), f
    for f in ("input_ids", "output_ids", "output_logprobs", "output_versions", "message_starts"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and np.array_equal(x, y), f


def test_round_trip_exact(tmp_path):
    recs = [make_record(i, n_in=1 + 50 * i, n_out=i) for i in range(6)]  # includes an empty output
    with TitoStore(tmp_path).writer("ex-1") as w:
        for r in recs:
            w.append(r)
    res = read_execution(tmp_path / "ex-1.tito")
    assert not res.torn and res.torn_tail_bytes == 0
    assert len(res.records) == len(recs)
    for a, b in zip(recs, res.records):
        assert_same(a, b)
    assert TitoStore(tmp_path).execution_ids() == ["ex-1"]


def test_binary_not_json_lists(tmp_path):
    r = make_record(0, n_in=10_000, n_out=1000)
    with TitoWriter(tmp_path / "x.tito", "ex-1") as w:
        w.append(r)
    size = os.path.getsize(tmp_path / "x.tito")
    # 4 bytes per input id + 12 per output token + small header/meta
    assert size < 4 * 10_000 + 12 * 1000 + 400


def test_truncated_at_every_offset_of_last_record(tmp_path):
    path = tmp_path / "ex-1.tito"
    recs = [make_record(i, n_in=5 + i, n_out=2) for i in range(3)]
    with TitoWriter(path, "ex-1") as w:
        for r in recs[:2]:
            w.append(r)
        start_last = os.path.getsize(path)
        w.append(recs[2])
    data = path.read_bytes()
    cut_path = tmp_path / "cut.tito"
    for cut in range(start_last, len(data)):
        cut_path.write_bytes(data[:cut])
        res = read_execution(cut_path)
        assert len(res.records) == 2, cut
        for a, b in zip(recs, res.records):
            assert_same(a, b)
        assert res.torn_tail_bytes == cut - start_last
        assert res.valid_bytes == start_last
    cut_path.write_bytes(data)
    assert len(load_execution(cut_path)) == 3


def test_damaged_last_frame_is_torn_but_damage_in_the_middle_raises(tmp_path):
    path = tmp_path / "ex-1.tito"
    with TitoWriter(path, "ex-1") as w:
        w.append(make_record(0))
        mid = os.path.getsize(path)
        w.append(make_record(1))
        last = os.path.getsize(path)
        w.append(make_record(2))
    data = bytearray(path.read_bytes())
    flipped = bytearray(data)
    flipped[-3] ^= 0xFF  # inside the last frame's payload: checksum fails, it is the tail
    path.write_bytes(flipped)
    res = read_execution(path)
    assert len(res.records) == 2 and res.torn_tail_bytes == len(data) - last
    flipped = bytearray(data)
    flipped[mid + 20] ^= 0xFF  # inside the second frame, with a whole frame after it
    path.write_bytes(flipped)
    with pytest.raises(StoreCorruptError, match="offset"):
        read_execution(path)
    path.write_bytes(bytes(data) + b"\0" * 100)  # size extended, data never written
    res = read_execution(path)
    assert len(res.records) == 3 and res.torn_tail_bytes == 100
    path.write_bytes(b"not a store at all")
    with pytest.raises(StoreCorruptError, match="not a TITO store"):
        read_execution(path)


def test_writer_reopens_after_torn_tail_and_appends(tmp_path):
    path = tmp_path / "ex-1.tito"
    with TitoWriter(path, "ex-1") as w:
        w.append(make_record(0))
        w.append(make_record(1))
    data = path.read_bytes()
    path.write_bytes(data[:-5])  # crash mid-write of record 1
    with TitoWriter(path, "ex-1") as w:
        w.append(make_record(2))
    res = read_execution(path)
    assert not res.torn
    assert [r.call_id for r in res.records] == [0, 2]


def test_writer_refuses_other_execution_and_bad_ids(tmp_path):
    with TitoWriter(tmp_path / "a.tito", "ex-a") as w:
        with pytest.raises(ValueError, match="does not match"):
            w.append(make_record(0, exec_id="ex-b"))
    with pytest.raises(ValueError, match="execution_id"):
        TitoStore(tmp_path).path_for("../escape")


def test_concurrent_appends_are_whole_frames(tmp_path):
    path = tmp_path / "ex-1.tito"
    w = TitoWriter(path, "ex-1")
    def work(k):
        for j in range(25):
            w.append(make_record(k * 100 + j, n_in=200 + j, n_out=j))
    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.close()
    res = read_execution(path)
    assert not res.torn
    assert sorted(r.call_id for r in res.records) == sorted(k * 100 + j for k in range(4) for j in range(25))
    for r in res.records:
        assert_same(r, make_record(r.call_id, n_in=200 + r.call_id % 100, n_out=r.call_id % 100))


def growing_threads(n_calls: int, seed: int = 0) -> list[CallRecord]:
    """Two interleaved agent threads whose inputs repeat earlier input + output, plus compaction."""
    rng = np.random.default_rng(seed)
    ctx = {0: list(rng.integers(0, 1000, 300)), 1: list(rng.integers(0, 1000, 200))}
    recs = []
    for i in range(n_calls):
        t = int(rng.integers(0, 2))
        out = rng.integers(0, 1000, int(rng.integers(1, 60)))
        recs.append(CallRecord("ex-1", i, Role.MAIN if t == 0 else Role.SUB, np.array(ctx[t]), out,
                               rng.normal(size=len(out)), i, message_starts=np.array([0, 5])))
        ctx[t] += list(out) + list(rng.integers(0, 1000, int(rng.integers(0, 80))))
        if i % 17 == 16:  # compaction: keep the system prompt, drop the rest
            ctx[t] = ctx[t][:40] + list(out)
        if i % 11 == 10:  # edited history: cut inside the latest output
            ctx[t] = ctx[t][: len(ctx[t]) - int(rng.integers(1, 100))]
    return recs


def test_prefix_sharing_round_trip_and_size(tmp_path):
    recs = growing_threads(120)
    sizes = {}
    for window in (0, 1, 4):
        path = tmp_path / f"w{window}.tito"
        with TitoWriter(path, "ex-1", delta_window=window) as w:
            for r in recs[:60]:
                w.append(r)
        with TitoWriter(path, "ex-1", delta_window=window) as w:  # reopened: window starts empty
            assert w.num_records == 60
            for r in recs[60:]:
                w.append(r)
        got = load_execution(path)
        assert len(got) == len(recs)
        for a, b in zip(recs, got):
            assert_same(a, b)
        sizes[window] = os.path.getsize(path)
    full_inputs = 4 * sum(len(r.input_ids) for r in recs)
    assert sizes[0] > full_inputs  # verbatim
    assert sizes[4] < sizes[1] < sizes[0]  # a window over both threads shares more
    assert sizes[4] < sizes[0] / 3


def test_torn_tail_of_a_prefix_shared_record(tmp_path):
    recs = growing_threads(8, seed=3)
    path = tmp_path / "ex-1.tito"
    with TitoWriter(path, "ex-1") as w:
        for r in recs[:-1]:
            w.append(r)
        start_last = os.path.getsize(path)
        w.append(recs[-1])
    data = path.read_bytes()
    assert len(data) - start_last < 4 * len(recs[-1].input_ids)  # the last record is prefix-shared
    for cut in range(start_last, len(data), 7):
        path.write_bytes(data[:cut])
        res = read_execution(path)
        assert len(res.records) == 7 and res.torn_tail_bytes == cut - start_last
        for a, b in zip(recs, res.records):
            assert_same(a, b)


def test_inspect_cli(tmp_path, capsys):
    import json as _json

    from gyre.trajectory.__main__ import main

    recs = growing_threads(30, seed=5)
    with TitoStore(tmp_path).writer("ex-1") as w:
        for r in recs:
            w.append(r)
    assert main([str(tmp_path / "ex-1.tito"), "--j-max", "0"]) == 0
    out = _json.loads(capsys.readouterr().out)
    assert out["records"] == 30 and out["torn_tail_bytes"] == 0
    assert out["tree"]["calls"] == 30
    # unlimited selection trains every unique target exactly once
    assert out["selection"]["L"] == out["tree"]["unique_target_tokens"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**16), st.integers(1, 25), st.sampled_from([0, 1, 3]), st.floats(0, 1))
def test_any_truncation_loads_exactly_the_whole_frames(tmp_path, seed, n, window, frac):
    recs = growing_threads(n, seed)
    path = tmp_path / f"h{seed}-{n}-{window}.tito"
    ends = []
    with TitoWriter(path, "ex-1", delta_window=window) as w:
        for r in recs:
            w.append(r)
            ends.append(os.path.getsize(path))
    data = path.read_bytes()
    cut = int(frac * len(data))
    path.write_bytes(data[:cut])
    whole = sum(1 for e in ends if e <= cut)
    res = read_execution(path)
    assert len(res.records) == whole
    for a, b in zip(recs, res.records):
        assert_same(a, b)
    valid = ends[whole - 1] if whole else (16 if cut >= 16 else 0)  # a torn header holds nothing
    assert res.torn_tail_bytes == cut - valid
    path.unlink()


def test_torn_file_header(tmp_path):
    path = tmp_path / "ex-1.tito"
    with TitoWriter(path, "ex-1") as w:
        w.append(make_record(0))
    data = path.read_bytes()
    for cut in range(0, 17):
        path.write_bytes(data[:cut])
        res = read_execution(path)
        assert res.records == [] and res.torn_tail_bytes == (cut if cut < 16 else 0)
    path.write_bytes(data[:9])
    with TitoWriter(path, "ex-1") as w:  # a writer repairs a torn header too
        w.append(make_record(1))
    assert [r.call_id for r in load_execution(path)] == [1]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**16), st.integers(1, 25), st.sampled_from([0, 1, 3]), st.floats(0, 1), st.data())
def test_heads_are_the_records_without_decoding_them(tmp_path, seed, n, window, frac, data):
    """`read_heads` (what a restarted proxy reads): each whole record's call id, role, finish,
    payload and any slice of input + output, as `read_execution` decodes them; a torn tail dropped."""
    recs = growing_threads(n, seed)
    path = tmp_path / f"h{seed}-{n}-{window}.tito"
    with TitoWriter(path, "ex-1", delta_window=window) as w:
        for r in recs:
            w.append(r)
    raw = path.read_bytes()
    path.write_bytes(raw[: max(16, int(frac * len(raw)))])
    full = read_execution(path)
    heads, torn = read_heads(path)
    assert torn == full.torn_tail_bytes and len(heads) == len(full.records)
    for h, r in zip(heads, full.records):
        assert (h.call_id, h.role, h.finish_reason, h.payload_ref) == (r.call_id, r.role, r.finish_reason, r.payload_ref)
        assert (h.n_input, h.n_output) == (len(r.input_ids), len(r.output_ids))
        seq = np.concatenate([r.input_ids, r.output_ids])
        a = data.draw(st.integers(0, len(seq)))
        b = data.draw(st.integers(a, len(seq)))
        assert h.ids(a, b).tolist() == seq[a:b].tolist() and h.ids(0).tolist() == seq.tolist()
    path.unlink()
