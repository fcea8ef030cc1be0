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


def test_the_engines_own_time_is_taken_out_when_the_engines_clocked_it():
    """With each request's engine time (`_EngineClock`), a call's in_proxy leg and the goal's
    proxy_added are less the engine's real time, its lateness a leg of its own; a call whose engine
    interval is missing is counted, not guessed."""
    rng = random.Random(1)
    delay, walls, times, engine = 0.02, [], {"x": []}, {"x": []}
    expect = {"in_proxy": [], "engine_late": [], "proxy_added": []}
    t, missing = 100.0, 0
    for i in range(150):
        tokens = rng.randrange(1, 17)
        sent, up, down = t, rng.uniform(1e-4, 0.01), rng.uniform(1e-4, 0.01)
        begun_after, late, after = rng.uniform(1e-4, 0.01), rng.uniform(0, 0.03), rng.uniform(1e-4, 0.01)
        start = sent + up
        engine_s = tokens * delay + late
        end = start + begun_after + engine_s + after
        times["x"].append((start, end))
        walls.append(("x", tokens, sent, end + down))
        if i % 11 == 5:
            missing += 1  # the engine process's record of it was lost
        else:
            engine["x"].append((start + begun_after, start + begun_after + engine_s))
            expect["in_proxy"].append(begun_after + after)
            expect["engine_late"].append(late)
            expect["proxy_added"].append(up + begun_after + after + down)
        t = end + down + rng.uniform(0.01, 1.0)
    got = _legs(walls, times, delay, engine)
    assert got["engine_unmatched"] == missing and got["calls"] == 150 - missing
    for leg, xs in expect.items():
        xs = sorted(xs)
        for p, value in zip((50, 99), got[leg]):
            assert abs(value - 1e3 * xs[round(p / 100 * (len(xs) - 1))]) <= 0.006, (leg, p)
