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
