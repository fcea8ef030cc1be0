"""Bucketed weight updates (issue 52 item 1) and the weight read-back (item 3), on CPU.

Peak extra memory during an update (tensor bytes held at once: the built-in engine's staged
buckets, the conformance fake's count of what the adapter hands SGLang) stays ≤ bucket + one
tensor for three model sizes, flat while the model grows; one version however many buckets;
a failure part-way leaves no engine serving a mix. The read-back catches a planted mapping slip
that real SGLang's load_weights would skip with only a warning (models/qwen3.py:760,
llama.py:779), and that the update alone lets through."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from hypothesis import given, settings, strategies as st

from gyre.backends.config import SglangConfig
from gyre.backends.engines.cpu_engine import CpuEngine
from gyre.backends.engines.sglang_engine import SglangEngine
from gyre.backends.protocols import SamplingParams
from gyre.backends.transfer import buckets, readback
from tests.backends import sglang_fake
from tests.realmodels import build_model

KIB = 1024
BUCKET = 64 * KIB
LAYERS = (2, 6, 12)  # three model sizes: about 0.5, 1.2 and 2.2 MB of float32


def _model(family: str, layers: int, seed: int):
    return build_model(family, 256, seed=seed, num_hidden_layers=layers)


def _sent(model) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def _nbytes(sd) -> tuple[int, int]:
    sizes = [buckets.nbytes(t) for t in sd.values()]
    return sum(sizes), max(sizes)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=40), st.integers(1, 3000))
def test_plan_keeps_order_covers_every_name_once_and_bounds_each_bucket(sizes, limit):
    named = [(f"t{i}", s) for i, s in enumerate(sizes)]
    out = buckets.plan(named, limit)
    assert [n for b in out for n in b] == [n for n, _ in named]
    size = dict(named)
    for b in out:
        total = sum(size[n] for n in b)
        assert total <= limit or len(b) == 1  # a tensor over the limit travels alone
        assert b  # no empty bucket
    for a, b in zip(out, out[1:]):  # greedy: the next tensor did not fit
        assert sum(size[n] for n in a) + size[b[0]] > limit


def test_bucket_mb_flag_is_refused_unless_positive():
    from gyre.backends.config import TransferConfig

    assert buckets.bucket_bytes(0.5) == 512 * KIB
    with pytest.raises(ValueError, match="--transfer.bucket-mb"):
        TransferConfig(bucket_mb=0)


# ----------------------------------------------------------------------------- built-in engine
def test_builtin_engine_update_peak_is_one_bucket_flat_in_model_size():
    """Three sizes; the old update (a second DecoderWeights) held the whole model (sum of sizes)."""
    peaks = []
    for layers in LAYERS:
        old, new = _model("qwen3", layers, 0), _model("qwen3", layers, 1)
        eng = CpuEngine(old.config, _sent(old), bucket_bytes=BUCKET)

        async def go():
            await eng.start()
            await eng.update_weights(_sent(new), version=3)
            await eng.stop()

        asyncio.run(go())
        total, largest = _nbytes(_sent(new))
        assert eng.held.peak <= BUCKET + largest < total / 3, (layers, eng.held.peak, total)
        assert eng.held.now == 0 and eng.version == 3
        for k, t in _sent(new).items():  # every weight arrived
            assert torch.equal(eng._weights.tensors[k], t), k
        peaks.append(eng.held.peak)
    assert max(peaks) == min(peaks)  # flat: the largest tensor and the bucket decide, not the layers


def test_builtin_engine_failure_between_buckets_leaves_it_refusing_not_mixed(monkeypatch):
    old, new = _model("qwen3", 2, 0), _model("qwen3", 2, 1)
    eng = CpuEngine(old.config, _sent(old), bucket_bytes=BUCKET)
    calls = []
    real = CpuEngine._copy_bucket

    def flaky(self, bucket):
        calls.append(len(bucket))
        if len(calls) == 2:
            raise MemoryError("planted: staging bucket 2 failed")
        real(self, bucket)

    monkeypatch.setattr(CpuEngine, "_copy_bucket", flaky)

    async def go():
        await eng.start()
        with pytest.raises(MemoryError):
            await eng.update_weights(_sent(new), version=1)
        state = (eng.version, eng._torn)
        with pytest.raises(RuntimeError, match="torn"):
            eng.generate("x", [1, 2, 3], SamplingParams(max_tokens=2)).__aiter__().__anext__().send(None)
        await eng.update_weights(_sent(new), version=2)  # a complete update heals it
        out = [ev async for ev in eng.generate("y", [1, 2, 3], SamplingParams(max_tokens=2))]
        await eng.stop()
        return state, out

    (version, torn), out = asyncio.run(go())
    assert version == 0 and torn == 1 and len(calls) > 2
    assert [e.version for e in out] == [2, 2]


def test_builtin_engine_read_back_equals_what_was_sent_and_names_a_differing_parameter():
    old, new = _model("qwen3", 2, 0), _model("qwen3", 2, 1)
    eng = CpuEngine(old.config, _sent(old), bucket_bytes=BUCKET)

    async def go():
        await eng.start()
        await eng.update_weights(_sent(new), version=1)
        loop = asyncio.get_running_loop()

        def read(names, rows):
            return asyncio.run_coroutine_threadsafe(eng.read_weights(names, rows), loop).result()

        n = await asyncio.to_thread(readback.check, read, _sent(new), 1, dtype=eng.weights_dtype, full=True)
        eng._weights.tensors["model.layers.1.mlp.up_proj.weight"][0, 0] += 0.5  # planted: a stale value
        with pytest.raises(readback.WeightReadbackMismatch, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
            await asyncio.to_thread(readback.check, read, _sent(new), 1, dtype=eng.weights_dtype, full=True)
        await eng.stop()
        return n

    assert asyncio.run(go()) == len(_sent(new))


def test_read_back_sample_covers_every_layer_and_rotates():
    names = [f"model.layers.{i}.{p}" for i in range(3) for p in ("a", "b", "c")] + ["model.norm.weight", "model.embed"]
    assert readback.sample(names, 0, full=True) == names
    seen = set()
    for v in range(3):
        s = readback.sample(names, v, full=False)
        assert len(s) == 4 and {n.split(".")[2] for n in s if ".layers." in n} == {"0", "1", "2"}
        seen |= set(s)
    assert seen >= {n for n in names if ".layers." in n}


# ----------------------------------------------------------------------------- SGLang (conformance fake)
@pytest.fixture(autouse=True)
def _fake_defaults(monkeypatch):
    monkeypatch.setattr(sglang_fake.FakeEngine, "step_s", 0.002)
    monkeypatch.setattr(sglang_fake.FakeEngine, "chunk_delay_steps", 0)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)


def _ckpt(tmp_path, family: str, layers: int):
    from gyre.backends.models.hf import save_checkpoint

    model = _model(family, layers, 0)
    model.config.eos_token_id = None
    path = tmp_path / f"{family}-{layers}"
    save_checkpoint(model, str(path))
    return str(path)


def _sglang(path: str, **kw) -> SglangEngine:
    cfg = SglangConfig(model_path=path, dtype="float32", extra={"attention_backend": "triton"})
    return SglangEngine(cfg, api=sglang_fake.API, bucket_bytes=BUCKET, **kw)


def _recording(eng: SglangEngine, seen: list):
    tm = eng._engine.tokenizer_manager
    real = tm.update_weights_from_tensor

    async def rec(obj, request=None):
        seen.append((obj.weight_version, obj.flush_cache, tm.engine.weight_version))
        return await real(obj, request)

    tm.update_weights_from_tensor = rec


def test_sglang_update_peak_is_one_bucket_flat_and_one_version(tmp_path):
    """Three sizes: the fake counts the adapter's staged copies (sglang_fake.UPDATE_BYTES) while
    SGLang would map them; before, one full copy of the model per TP rank."""
    peaks = []
    for layers in LAYERS:
        path = _ckpt(tmp_path, "qwen3", layers)
        new = _model("qwen3", layers, 1)
        eng, seen = _sglang(path), []

        async def go():
            await eng.start()
            _recording(eng, seen)
            sglang_fake.UPDATE_BYTES.reset()
            await eng.update_weights(new.state_dict(), version=1)
            held = {k: v.clone() for k, v in sglang_fake._as_checkpoint(eng._engine.weights.tensors,
                                                                         eng._engine.model_config).items()}
            await eng.stop()
            return held

        held = asyncio.run(go())
        total, largest = _nbytes(_sent(new))
        peak = sglang_fake.UPDATE_BYTES.peak
        assert peak <= BUCKET + largest < total / 3, (layers, peak, total)
        assert sglang_fake.UPDATE_BYTES.now == 0
        for k, t in _sent(new).items():
            assert torch.equal(held[k], t), k
        # One version: only the last call names it and flushes; SGLang's version moves once, at the end.
        assert len(seen) > 3
        assert [s[:2] for s in seen] == [(None, False)] * (len(seen) - 1) + [("1", True)]
        assert {s[2] for s in seen} == {"0"}  # every call found the old version still served
        peaks.append(peak)
    assert max(peaks) == min(peaks)


def test_sglang_tp2_each_rank_gets_the_bucket_not_the_model(tmp_path):
    path = _ckpt(tmp_path, "qwen3", 6)
    new = _model("qwen3", 6, 1)
    cfg = SglangConfig(model_path=path, dtype="float32", tp_size=2, extra={"attention_backend": "triton"})
    eng = SglangEngine(cfg, api=sglang_fake.API, bucket_bytes=BUCKET)

    async def go():
        await eng.start()
        sglang_fake.UPDATE_BYTES.reset()
        await eng.update_weights(new.state_dict(), version=1)
        await eng.stop()

    asyncio.run(go())
    total, largest = _nbytes(_sent(new))
    assert sglang_fake.UPDATE_BYTES.peak / 2 <= BUCKET + largest < total / 3  # per GPU


def test_sglang_failure_part_way_keeps_the_engine_paused_and_refusing(tmp_path, monkeypatch):
    path = _ckpt(tmp_path, "qwen3", 2)
    new = _model("qwen3", 2, 1)
    real = sglang_fake.FakeScheduler._on_UpdateWeightsFromTensorReqInput
    n = {"calls": 0}

    def flaky(self, m):
        n["calls"] += 1
        if n["calls"] == 2:
            return False, "planted: bucket 2 refused"
        return real(self, m)

    monkeypatch.setattr(sglang_fake.FakeScheduler, "_on_UpdateWeightsFromTensorReqInput", flaky)

    async def go():
        eng = _sglang(path)
        await eng.start()
        with pytest.raises(RuntimeError, match="bucket 2 of"):
            await eng.update_weights(new.state_dict(), version=1)
        sched = eng._engine.tokenizer_manager.scheduler
        torn = (eng.version, eng._engine.weight_version, sched.paused, sched.session)
        with pytest.raises(RuntimeError, match="torn"):
            await eng.generate("x", [1, 2, 3], SamplingParams(max_tokens=2)).__anext__()
        await eng.update_weights(new.state_dict(), version=2)
        out = [ev async for ev in eng.generate("y", [1, 2, 3], SamplingParams(max_tokens=2))]
        await eng.stop()
        return torn, out

    (version, served, paused, session), out = asyncio.run(go())
    assert version == 0 and served == "0" and paused and session is None
    assert [e.version for e in out] == [2, 2]


def _renaming(monkeypatch, old: str, new: str) -> None:
    """A planted mapping slip: the adapter sends every layer's `old` under the name `new`."""
    from gyre.backends.engines import sglang_checkpoint

    real = sglang_checkpoint.checkpoint_names

    def slipped(config, state):
        return {k.replace(old, new): v for k, v in real(config, state).items()}

    monkeypatch.setattr(sglang_checkpoint, "checkpoint_names", slipped)


def _read(eng: SglangEngine, loop):
    return lambda names, rows: asyncio.run_coroutine_threadsafe(eng.read_weights(names, rows), loop).result()


def test_a_renamed_parameter_passes_the_update_silently_and_the_read_back_names_it(tmp_path, monkeypatch, caplog):
    """Llama (sglang 0.5.23 has get_weights_by_name for it, models/llama.py:819): SGLang warns and
    keeps the old value (llama.py:779); the update succeeds; the read-back stops it."""
    path = _ckpt(tmp_path, "llama3.1", 2)
    new = _model("llama3.1", 2, 1)
    _renaming(monkeypatch, "post_attention_layernorm", "post_attn_layernorm")

    async def go():
        eng = _sglang(path)
        await eng.start()
        await eng.update_weights(new.state_dict(), version=1)  # no error: SGLang skips the name
        loop = asyncio.get_running_loop()
        with pytest.raises(readback.WeightReadbackMismatch) as e:
            await asyncio.to_thread(readback.check, _read(eng, loop), _sent(new), 1, dtype=eng.weights_dtype, full=True)
        await eng.stop()
        return str(e.value)

    with caplog.at_level(logging.WARNING):
        msg = asyncio.run(go())
    assert "Parameter model.layers.0.post_attn_layernorm.weight not found in params_dict" in caplog.text
    assert "model.layers.0.post_attention_layernorm.weight" in msg and "model.layers.1.post_attention_layernorm" in msg
    assert "2 of" in msg  # those two and nothing else


def test_read_back_passes_without_a_slip_and_qwen_classes_are_unreadable_in_sglang(tmp_path, caplog):
    """Llama reads back equal; Qwen3 has no get_weights_by_name in sglang 0.5.23 (the exporter
    answers None, weight_exporter.py:181-188): nothing compared, a warning says so."""
    counts = {}
    for family in ("llama3.1", "qwen3"):
        path = _ckpt(tmp_path, family, 2)
        new = _model(family, 2, 1)

        async def go():
            eng = _sglang(path)
            await eng.start()
            await eng.update_weights(new.state_dict(), version=1)
            loop = asyncio.get_running_loop()
            n = await asyncio.to_thread(readback.check, _read(eng, loop), _sent(new), 1, dtype=eng.weights_dtype,
                                        full=True)
            await eng.stop()
            return n

        with caplog.at_level(logging.WARNING):
            counts[family] = asyncio.run(go())
    assert counts == {"llama3.1": len(_sent(_model("llama3.1", 2, 1))), "qwen3": 0}
    assert "SGLang cannot read weights back for this model class" in caplog.text


# ----------------------------------------------------------------------------- broadcast path, real gloo processes
ENGINE_SIDE = r"""
import asyncio, json, sys, torch
from tests.backends import sglang_fake as f
from tests.backends.transfer.test_buckets import _sglang

path, port, spec, out = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
names, dtypes, shapes = spec

async def go():
    eng = _sglang(path)
    await eng.start()
    await eng.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2, backend="gloo")
    calls = []
    tm = eng._engine.tokenizer_manager
    real = tm.update_weights_from_distributed
    async def rec(obj, request=None):
        calls.append([len(obj.names), obj.weight_version, obj.flush_cache])
        return await real(obj, request)
    tm.update_weights_from_distributed = rec
    f.UPDATE_BYTES.reset()
    await eng.update_weights_from_distributed(names, dtypes, shapes, version=1)
    held = f._as_checkpoint(eng._engine.weights.tensors, eng._engine.model_config)
    torch.save({"peak": f.UPDATE_BYTES.peak, "calls": calls, "served": eng._engine.weight_version,
                "held": {k: held[k].clone() for k in names}}, out)
    await eng.stop()

asyncio.run(go())
"""


def test_broadcast_from_the_core_arrives_in_buckets_one_version(tmp_path):
    """The core's WeightBroadcaster (this process) and the engine side (the adapter over the fake,
    joining as SGLang's scheduler does, in a process of its own): the engine asks for the broadcast
    in bucket-sized update_weights_from_distributed calls (SGLang allocates a call's tensors before
    loading any, weight_updater.py:276-298), the core sends tensor by tensor; the weights arrive
    bit-exact, the version once, with the last call."""
    import json
    import os
    import subprocess
    import sys

    from gyre.backends.engines.weight_group import WeightBroadcaster

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    path = _ckpt(tmp_path, "qwen3", 6)
    params = _sent(_model("qwen3", 6, 1))
    core = WeightBroadcaster("127.0.0.1", 0, 2, backend="gloo", timeout_s=120)
    out = tmp_path / "got.pt"
    child = subprocess.Popen([sys.executable, "-c", ENGINE_SIDE, path, str(core.port),
                              json.dumps(WeightBroadcaster.describe(params)), str(out)],
                             cwd=root, env={**os.environ, "PYTHONPATH": root}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        core.connect()
        core.send(params)
        log = child.communicate(timeout=300)[0]
    except Exception:
        child.kill()
        pytest.fail(f"engine side:\n{child.communicate()[0][-3000:]}")
    assert child.returncode == 0, log[-3000:]
    got = torch.load(out)
    total, largest = _nbytes(params)
    assert got["peak"] <= BUCKET + largest < total / 3
    calls = got["calls"]
    assert len(calls) > 3 and sum(c[0] for c in calls) == len(params)
    assert [c[1:] for c in calls] == [[None, False]] * (len(calls) - 1) + [["1", True]]
    assert got["served"] == "1"
    for k, t in params.items():
        assert torch.equal(got["held"][k], t), k
