"""Admission on its own records (gyre/proxy/admission.py): an `Allowance` per execution, no proxy
core; the bucket's arithmetic on a clock the test moves, figures computed by hand."""

import asyncio

import pytest

from gyre.proxy import admission as adm
from gyre.proxy.admission import Admission, Allowance
from gyre.proxy.config import ProxyConfig
from gyre.proxy.errors import ApiError


def _admission(**kw) -> tuple[Admission, dict[str, Allowance]]:
    held: dict[str, Allowance] = {}
    return Admission(ProxyConfig(**kw), lambda eid: held.setdefault(eid, Allowance())), held


def test_a_slot_is_the_handler_task_held_in_the_allowance_while_the_call_runs():
    a, held = _admission(max_calls_per_key=2, calls_per_second_per_key=0)

    async def main():
        release, inside = asyncio.Event(), []

        async def call():
            with a.admit("e") as allowance:
                inside.append(allowance)
                await release.wait()

        calls = [asyncio.create_task(call()) for _ in range(2)]
        while len(inside) < 2:
            await asyncio.sleep(0)
        assert inside == [held["e"]] * 2 and held["e"].tasks == set(calls)
        with pytest.raises(ApiError, match="2 calls in flight") as e:
            with a.admit("e"):
                pass
        assert e.value.status == 429
        with a.admit("other"):  # another execution's slots are its own
            pass
        release.set()
        await asyncio.gather(*calls)
        return held["e"].tasks

    assert asyncio.run(main()) == set()


def test_the_bucket_by_hand(monkeypatch):
    """rate 2/s: a bucket of 4 units; a call costs 1 + bytes // 100 (capped at 4); work is debited uncapped."""
    now = [100.0]
    monkeypatch.setattr(adm.time, "monotonic", lambda: now[0])
    a, held = _admission(max_calls_per_key=0, calls_per_second_per_key=2.0, body_bytes_per_call=100, body_values_per_call=10)

    async def admit(nbytes):
        with a.admit("e", nbytes):
            pass

    asyncio.run(admit(150))  # 2 units: 4 -> 2
    assert held["e"].bucket == 2.0 and held["e"].bucket_t == 100.0
    a.charge("e", a.work_units(nbytes=1000, values=55, charged_bytes=True))  # 55 // 10 = 5 units: 2 -> -3
    assert held["e"].bucket == -3.0
    now[0] = 101.0  # one second refills 2 units: -1, short of a 1-unit call by 2 units = 1 s at 2/s
    with pytest.raises(ApiError) as e:
        asyncio.run(admit(0))
    assert (e.value.status, e.value.retry_after, held["e"].bucket) == (429, 1.0, -1.0)
    now[0] = 110.0  # refilled to the cap, never past it
    asyncio.run(admit(10**9))  # a body past the bucket costs the whole bucket
    assert held["e"].bucket == 0.0
    assert a.work_units(nbytes=1000, values=0, charged_bytes=False) == 10  # bytes admission did not know


def test_render_time_is_charged_and_the_lock_is_per_execution():
    a, held = _admission(calls_per_second_per_key=1.0, render_ms_per_unit=20.0)
    a.charge_render("e", 0.1)  # 100 ms / 20 ms = 5 units from a full bucket of 2
    assert held["e"].bucket == pytest.approx(-3.0)

    async def main():
        return a.render_lock("e"), a.render_lock("e"), a.render_lock("f")

    first, again, other = asyncio.run(main())
    assert first is again is held["e"].render_lock and other is not first
