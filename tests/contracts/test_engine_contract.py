"""RolloutEngine contract (gyre.backends.protocols): streams carry versions, abort returns exactly
the tokens so far, update_weights changes later tokens' version, release/resume, health, load."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from gyre.backends import factory
from gyre.backends.protocols import RolloutEngine, SamplingParams, TokenIds
from gyre.backends.config import BackendConfig, CpuEngineConfig, ModelConfig
from tests.backends.helpers import tiny_model

ENGINES = factory.runnable(factory.ENGINES)


def _engine(kind: str, model, version: int = 0) -> RolloutEngine:
    return factory.build_engine(ModelConfig(), CpuEngineConfig(), BackendConfig(engine=kind), model.config,
                                model.state_dict(), version=version, eos_token_ids=[], name=f"contract-{kind}")


async def _drain(stream) -> list:
    return [ev async for ev in stream]


@pytest.fixture(scope="module")
def models():
    return tiny_model(seed=0), tiny_model(seed=7)


@pytest.mark.parametrize("kind", ENGINES)
def test_engine_contract(kind, models):
    old, new = models

    async def go():
        eng = _engine(kind, old, version=3)
        assert isinstance(eng, RolloutEngine)
        await eng.start()
        h = await eng.health()
        assert h.ok and h.version == 3 and not h.released and eng.load() == 0

        # A stream ends at max_tokens with 'length'; every event carries the served version.
        out = await _drain(eng.generate("a", [1, 2, 3], SamplingParams(max_tokens=6, seed=1)))
        assert len(out) == 6 and {e.version for e in out} == {3} and out[-1].finish_reason == "length"

        # A long prompt may come packed (the proxy's `TokenIds`): greedy, it gives what its list does.
        ids, greedy = [5, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_tokens=5, temperature=0.0)
        as_list = await _drain(eng.generate("p", ids, greedy))
        packed = await _drain(eng.generate("q", TokenIds(np.asarray(ids, dtype="<i4")), greedy))
        assert [e.token_id for e in packed] == [e.token_id for e in as_list] and len(packed) == 5

        # Abort returns exactly the tokens so far: those yielded, then the stream yields the rest.
        stream = eng.generate("b", [4, 5], SamplingParams(max_tokens=200, seed=2))
        seen = []
        async for ev in stream:
            seen.append(ev)
            if len(seen) == 4:
                assert eng.load() == 1
                got = await eng.abort("b")
                break
        rest = await _drain(stream)
        assert [e.token_id for e in got] == [e.token_id for e in seen + rest] and 4 <= len(got) < 200

        # update_weights mid-stream: later tokens carry the new version, earlier ones the old.
        events = []
        async for ev in eng.generate("c", [7, 8, 9], SamplingParams(max_tokens=30, seed=3)):
            events.append(ev)
            if len(events) == 5:
                await eng.update_weights(new.state_dict(), 4)
        versions = [e.version for e in events]
        assert len(events) == 30 and versions[:5] == [3] * 5 and versions[-1] == 4
        assert versions == sorted(versions)
        assert (await eng.health()).version == 4

        # release_memory / resume; health says so; generation works again after resume.
        await eng.release_memory()
        assert (await eng.health()).released
        await eng.resume()
        again = await _drain(eng.generate("d", [1], SamplingParams(max_tokens=3, seed=4)))
        assert len(again) == 3 and {e.version for e in again} == {4}
        await eng.stop()

    asyncio.run(go())
