"""benchmarks/scale_bench.py splits a call's added latency into legs by matching the client's
call to the proxy's record of it. A refused call (a 429, a 413) leaves no record, so matching by
the harness's call count would pair every later call with the record after its own; matching
is by the interval the call spans."""

import random

from benchmarks.scale_bench import _legs


def test_each_call_is_matched_to_the_record_its_interval_holds():
    rng = random.Random(0)
    delay, walls, times, expect = 0.02, [], {"x": []}, {"to_proxy": [], "in_proxy": [], "to_client": []}
    t = 100.0
    for i in range(200):
        tokens = rng.randrange(1, 17)
        sent = t
        if i % 7 == 3:  # refused at the door: the client saw an error, the proxy kept no record
            walls.append(("x", tokens, sent, sent + 0.001))
            t += 0.5
            continue
        up, inside, down = rng.uniform(1e-4, 0.05), rng.uniform(1e-4, 0.05), rng.uniform(1e-4, 0.05)
        start = sent + up
        end = start + tokens * delay + inside
        times["x"].append((start, end))
        walls.append(("x", tokens, sent, end + down))
        expect["to_proxy"].append(up)
        expect["in_proxy"].append(inside)
        expect["to_client"].append(down)
        t = end + down + rng.uniform(0.01, 1.0)  # think time
    got = _legs(walls, times, delay)
    assert got["calls"] == len(times["x"]) and got["unmatched"] == sum(1 for i in range(200) if i % 7 == 3)
    for leg, xs in expect.items():  # nearest rank of the sorted legs, as the benchmark's percentiles
        xs = sorted(xs)
        for p, value in zip((50, 99), got[leg]):
            assert abs(value - 1e3 * xs[round(p / 100 * (len(xs) - 1))]) <= 0.006, (leg, p)
