"""What the TITO writer holds per open execution (issue 33: ≤ 1 MiB per open execution beyond
what its records need). Its prefix-sharing window holds the latest `delta_window` full sequences;
a multi-turn execution's sequences share their prefixes, so the window must hold them once."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np

from gyre.trajectory.record import CallRecord, Role
from gyre.trajectory.store import TitoWriter, load_execution


def multi_turn(calls: int, grow: int, out: int, seed: int = 0) -> list[CallRecord]:
    """An execution whose every call re-sends the whole history: input = the previous input +
    output + `grow - out` new tokens (a tool result)."""
    rng = np.random.default_rng(seed)
    recs, ctx = [], rng.integers(0, 150_000, grow, dtype=np.int32)
    for i in range(calls):
        o = rng.integers(0, 150_000, out, dtype=np.int32)
        recs.append(CallRecord(execution_id="ex-1", call_id=i, role=Role.MAIN, input_ids=ctx, output_ids=o,
                               output_logprobs=np.zeros(out, np.float32), policy_version=0))
        ctx = np.concatenate([ctx, o, rng.integers(0, 150_000, grow - out, dtype=np.int32)])
    return recs


def test_window_holds_a_growing_context_once(tmp_path):
    recs = multi_turn(calls=100, grow=1000, out=200)  # the last call's sequence: 100k tokens
    context_bytes = 4 * (len(recs[-1].input_ids) + len(recs[-1].output_ids))
    gc.collect()
    tracemalloc.start()
    try:
        w = TitoWriter(tmp_path / "ex-1.tito", "ex-1", delta_window=4)
        for r in recs:
            w.append(r)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]  # the records were made before: only the writer's
    finally:
        tracemalloc.stop()
    # one copy of the context (~400 KB), plus at most one more while a joined copy replaces
    # the segmented ones; 4 full copies (1.6 MB, the old window) fail this
    assert held < 2.2 * context_bytes and held < 1 << 20, (held, context_bytes)
    w.close()
    got = load_execution(tmp_path / "ex-1.tito")
    assert len(got) == len(recs)
    for a, b in zip(recs, got):
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.output_ids, b.output_ids)


def test_window_finds_the_same_prefix_across_joins(tmp_path):
    """Past 64 segments a sequence is joined into one array; the file is then byte-identical to
    what a window of plain full copies writes (found by comparing against a window of 1 file:
    both share each call's whole previous sequence)."""
    recs = multi_turn(calls=150, grow=40, out=8, seed=1)
    for window in (1, 4):
        with TitoWriter(tmp_path / f"w{window}.tito", "ex-1", delta_window=window) as w:
            for r in recs:
                w.append(r)
    a, b = (tmp_path / "w1.tito").read_bytes(), (tmp_path / "w4.tito").read_bytes()
    assert a == b
    # every call after the first stores only its new tokens: 40 input + 8 output (12 bytes) each
    assert len(a) < 16 + 150 * (100 + 4 * 40 + 12 * 8) + 4 * 40
