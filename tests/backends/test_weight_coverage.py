"""The weight-update coverage check at an SGLang engine's start (gyre.backends.transfer.coverage),
against the conformance fake's check_weights (sglang 0.5.23 utils/weight_checker.py) and its real
skip / warn behaviour for a name load_weights does not know (models/qwen3.py:760; qwen3_moe.py
skips silently).

The read-back after the first update cannot see a Qwen model (no get_weights_by_name in 0.5.23's
Qwen classes): a renamed parameter there served stale weights unseen (shown below with the check
off). With the check (the default, auto) the engine stops at start naming the parameter."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from gyre.backends.engines.sglang_engine import SglangEngine
from gyre.backends.protocols import EngineState, SamplingParams
from gyre.backends.config import SglangConfig
from gyre.backends.transfer import coverage, readback
from tests.backends import sglang_fake
from tests.backends.test_weight_buckets import BUCKET, _ckpt, _fake_defaults, _model, _read, _renaming, _sent  # noqa: F401

SLIP = ("post_attention_layernorm", "post_attn_layernorm")  # Gyre's side renames it in every layer


def _engine(path: str, mode: str, start_weights, **kw) -> SglangEngine:
    cfg = SglangConfig(model_path=path, dtype="float32", extra={"attention_backend": "triton"})
    return SglangEngine(cfg, api=sglang_fake.API, bucket_bytes=BUCKET, coverage_check=mode,
                        start_weights=start_weights, **kw)


def _held(eng: SglangEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in sglang_fake._as_checkpoint(eng._engine.weights.tensors,
                                                                 eng._engine.model_config).items()}


def _actions(monkeypatch, seen: list) -> None:
    """Record every check_weights action and update call, in order (wrapping the fake's TM)."""
    tm = sglang_fake.FakeTokenizerManager
    check, update = tm.check_weights, tm.update_weights_from_tensor

    async def rec_check(self, obj, request=None):
        seen.append(obj.action)
        return await check(self, obj, request)

    async def rec_update(self, obj, request=None):
        seen.append(("update", obj.weight_version))
        return await update(self, obj, request)

    monkeypatch.setattr(tm, "check_weights", rec_check)
    monkeypatch.setattr(tm, "update_weights_from_tensor", rec_update)


def test_failed_names_reads_sglangs_message_of_every_rank():
    """The message shape of weight_checker.py:293-311, two TP ranks joined by " | " (communicator.py:110)."""
    one = ("check tensor equality failed:\nname=model.layers.0.mlp.gate_up_proj.weight max_abs_err=0.5 "
           "mean_abs_err=0.25 num_exceed=3 expect=raw(shape=(4,) dtype=torch.bfloat16) actual=raw(shape=(4,) "
           "dtype=torch.bfloat16) \nname=model.norm.weight max_abs_err=1.0 mean_abs_err=1.0 num_exceed=1 expect=x "
           "actual=y ")
    other = "check tensor equality failed:\nname=model.norm.weight max_abs_err=2.0 mean_abs_err=1 num_exceed=1 "
    assert coverage.failed_names(one + " | " + other) == ["model.layers.0.mlp.gate_up_proj.weight", "model.norm.weight"]
    assert coverage.failed_names("Success. | Success.") == []


def test_fake_check_weights_has_weight_checkers_semantics(tmp_path):
    """snapshot then compare: equal; one tensor changed by hand: that name alone, with its max error;
    reset: every tensor differs; no snapshot: an AssertionError (message ""); unknown action."""
    path = _ckpt(tmp_path, "qwen3", 2)

    async def go():
        eng = SglangEngine(SglangConfig(model_path=path, dtype="float32", extra={"attention_backend": "triton"}),
                           api=sglang_fake.API)
        await eng.start()
        tm, io, fake = eng._tm, eng._io, eng._engine

        async def check(action, **kw):
            return await tm.check_weights(io.CheckWeightsReqInput(action=action, **kw), None)

        out = {"no snapshot": await check("compare"), "unknown": await check("scrub")}
        assert (await check("snapshot"))[:2] == (True, "Success.")
        out["equal"] = await check("compare")
        assert fake.checker.snapshot is None  # freed after a successful compare
        await check("snapshot")
        state = _held(eng)
        name = "model.layers.1.mlp.down_proj.weight"
        state[name][0, 0] += 0.75
        fake.weights = sglang_fake._weights(state, fake.model_config)
        out["one"] = await check("compare")
        out["kept"] = fake.checker.snapshot is not None  # a failed compare keeps it (weight_checker.py:203)
        await check("snapshot")
        await check("reset_tensors")
        out["reset"] = await check("compare")
        out["skip"] = await check("compare", skip_tensor_list=[".layers."])
        out["checksum"] = await check("checksum")
        await eng.stop()
        return out, len(state), name

    out, n, name = asyncio.run(go())
    assert out["no snapshot"][:2] == (False, "")
    assert out["unknown"][:2] == (False, "Unsupported action='scrub'")
    assert out["equal"] == (True, "Success.", None, None)
    ok, message, _, _ = out["one"]
    assert not ok and message.startswith("check tensor equality failed:\n")
    assert coverage.failed_names(message) == [name] and "max_abs_err=0.75 " in message and out["kept"]
    assert len(coverage.failed_names(out["reset"][1])) == n
    assert set(coverage.failed_names(out["skip"][1])) == {"model.embed_tokens.weight", "model.norm.weight"}
    ok, _, ranks, digest = out["checksum"]
    assert ok and len(ranks) == 1 and len(ranks[0]["checksums"]) == n and len(digest) == 64


@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe"])
def test_a_renamed_parameter_stops_a_qwen_engine_at_start_naming_it(tmp_path, monkeypatch, caplog, family):
    """Planted slip, default mode (auto: Qwen cannot be read back by name). Qwen3 warns "not found
    in params_dict" and Qwen3-MoE says nothing (the fake's `_skip_unknown`); either way the update
    succeeds and only the compare sees the two layers' norms still random."""
    path = _ckpt(tmp_path, family, 2)
    _renaming(monkeypatch, *SLIP)
    eng = _engine(path, "auto", _model(family, 2, 0).state_dict())
    with caplog.at_level(logging.WARNING), pytest.raises(coverage.WeightCoverageError) as e:
        asyncio.run(eng.start())
    msg = str(e.value)
    assert "leaves 2 tensors" in msg
    assert "model.layers.0.post_attention_layernorm.weight" in msg and "model.layers.1.post_attention_layernorm" in msg
    assert "--transfer.coverage-check off" in msg
    assert eng.state is EngineState.STOPPED and eng._engine is None  # nothing serves the random weights
    warned = "Parameter model.layers.0.post_attn_layernorm.weight not found in params_dict" in caplog.text
    assert warned == (family == "qwen3")


def test_without_the_check_the_same_slip_serves_stale_weights_unseen(tmp_path, monkeypatch, caplog):
    """Today's path (--transfer.coverage-check off): start, the update and the read-back all pass on
    Qwen3 (read-back compares nothing, 0.5.23 cannot read Qwen back) while the engine serves the old
    norm under the new version: the gap the check closes."""
    path = _ckpt(tmp_path, "qwen3", 2)
    _renaming(monkeypatch, *SLIP)
    new = _model("qwen3", 2, 1)

    async def go():
        eng = _engine(path, "off", _model("qwen3", 2, 0).state_dict())
        await eng.start()
        await eng.update_weights(new.state_dict(), version=1)
        loop = asyncio.get_running_loop()
        n = await asyncio.to_thread(readback.check, _read(eng, loop), _sent(new), 1, dtype=eng.weights_dtype, full=True)
        held = _held(eng)
        await eng.stop()
        return n, held

    with caplog.at_level(logging.WARNING):
        compared, held = asyncio.run(go())
    assert compared == 0
    name = "model.layers.0.post_attention_layernorm.weight"
    assert not torch.equal(held[name], _sent(new)[name]) and torch.equal(held[name], _sent(_model("qwen3", 2, 0))[name])
    assert torch.equal(held["model.layers.0.mlp.up_proj.weight"], _sent(new)["model.layers.0.mlp.up_proj.weight"])


def test_without_a_slip_the_check_passes_before_serving_and_keeps_version_and_weights(tmp_path, monkeypatch, caplog):
    """Order: snapshot, reset, the update's buckets (the version only on the last, the start one),
    compare; generate is refused meanwhile; afterwards the checkpoint's weights are served
    bitwise, the version is still 0, the snapshot is freed, one log line says so."""
    path = _ckpt(tmp_path, "qwen3", 2)
    start = _model("qwen3", 2, 0).state_dict()
    seen, refused = [], []
    real_update = SglangEngine.update_weights

    async def update_while_checking(self, state_dict, version):
        try:
            await self.generate("early", [1, 2, 3], SamplingParams(max_tokens=1)).__anext__()
        except RuntimeError as e:
            refused.append(str(e))
        return await real_update(self, state_dict, version)

    monkeypatch.setattr(SglangEngine, "update_weights", update_while_checking)
    _actions(monkeypatch, seen)
    eng = _engine(path, "auto", start)

    async def go():
        await eng.start()
        out = ([ev async for ev in eng.generate("x", [1, 2, 3], SamplingParams(max_tokens=2))], _held(eng),
               eng._engine.weight_version, eng._engine.checker.snapshot)
        await eng.stop()
        return out

    with caplog.at_level(logging.INFO, logger="gyre.backends.transfer.coverage"):
        events, held, served, snapshot = asyncio.run(go())
    assert seen[:2] == ["snapshot", "reset_tensors"] and seen[-1] == "compare"
    updates = seen[2:-1]
    assert len(updates) > 1 and updates == [("update", None)] * (len(updates) - 1) + [("update", "0")]
    assert refused and "not serving yet" in refused[0]
    assert eng.version == 0 and served == "0" and [e.version for e in events] == [0, 0] and snapshot is None
    for k, t in _sent(_model("qwen3", 2, 0)).items():
        assert torch.equal(held[k], t), k
    assert caplog.text.count("every parameter the weight-update path writes matched the checkpoint") == 1


def test_a_dummy_load_is_primed_first_so_the_check_compares_the_starting_weights(tmp_path):
    """--sglang.load-format dummy: SGLang starts on random weights, not the checkpoint's (the fake:
    a seed-0 init); the check pushes the starting weights once before its snapshot, passes, and
    the engine serves them."""
    path = _ckpt(tmp_path, "qwen3", 2)
    start = _model("qwen3", 2, 0).state_dict()
    cfg = SglangConfig(model_path=path, dtype="float32", extra={"attention_backend": "triton", "load-format": "dummy"})
    eng = SglangEngine(cfg, api=sglang_fake.API, bucket_bytes=BUCKET, coverage_check="auto", start_weights=start)

    async def go():
        await eng.start()
        held = _held(eng)
        await eng.stop()
        return held

    held = asyncio.run(go())
    for k, t in _sent(_model("qwen3", 2, 0)).items():
        assert torch.equal(held[k], t), k


def test_auto_leaves_llama_to_the_read_back_and_always_checks_it(tmp_path, monkeypatch):
    """Llama has get_weights_by_name (models/llama.py:819): auto sends no check_weights; always
    does, and catches the same slip there."""
    path = _ckpt(tmp_path, "llama3.1", 2)
    start = _model("llama3.1", 2, 0).state_dict()

    async def calls(mode):
        eng = _engine(path, mode, start)
        await eng.start()
        out = list(eng._engine.tokenizer_manager.calls)
        await eng.stop()
        return out

    assert "CheckWeightsReqInput" not in asyncio.run(calls("auto"))
    assert asyncio.run(calls("always")).count("CheckWeightsReqInput") == 3
    _renaming(monkeypatch, *SLIP)
    assert "CheckWeightsReqInput" not in asyncio.run(calls("auto"))  # the read-back's job (test_weight_buckets)
    with pytest.raises(coverage.WeightCoverageError, match=r"model\.layers\.1\.post_attention_layernorm\.weight"):
        asyncio.run(calls("always"))


def test_the_flag_reaches_the_engine_built_for_a_run(tmp_path, monkeypatch):
    """--transfer.coverage-check (default auto) and the start weights go to the factory's engine;
    off hands it no weights to hold."""
    from gyre.backends import factory
    from gyre.config import parse_config

    monkeypatch.setenv(factory.SGLANG_API_ENV, "tests.backends.sglang_fake:API")
    model = _model("qwen3", 2, 0)
    built = {}
    for flags in ([], ["--transfer.coverage-check", "off"], ["--transfer.coverage-check", "always"]):
        cfg = parse_config(["--backend.engine", "sglang", "--run-dir", str(tmp_path / "run"), *flags])
        eng = factory.build_engine(cfg.model, cfg.engine, cfg.backend, model.config, model.state_dict(), version=0,
                                   eos_token_ids=[], name="c", transfer=cfg.transfer, run_dir=cfg.run_dir)
        built[tuple(flags)] = (eng.coverage_check, eng._start_weights is not None)
    assert list(built.values()) == [("auto", True), ("off", False), ("always", True)]
    with pytest.raises(SystemExit):
        parse_config(["--transfer.coverage-check", "sometimes"])
