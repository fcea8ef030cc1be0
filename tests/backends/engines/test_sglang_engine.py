"""SGLang adapter on CPU: import guard and the lifecycle against the conformance fake of SGLang
0.5.23 (tests/backends/sglang_fake.py); the wire's pure translation and parsing: test_sglang_wire.py.
(Over 600 lines: the adapter's contract tests against the fake, one per SGLang state and request field; the edges of issue 30 live in test_sglang_edges.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gyre.backends.config import SglangConfig
from gyre.backends.protocols import RolloutEngine, SamplingParams
from gyre.backends.engines.sglang_engine import SglangEngine
from gyre.backends.engines.sglang_wire import prefix_free_rid, server_args


def test_import_does_not_pull_sglang_or_cuda_libraries():
    code = "import sys, gyre.backends.engines.sglang_engine, gyre.backends.actors.megatron_actor, gyre.backends.transfer.snapshots; " \
           "print(sorted(m for m in ('sglang', 'megatron', 'mooncake') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_satisfies_protocol_without_starting():
    assert isinstance(SglangEngine(SglangConfig(model_path="/ckpt")), RolloutEngine)


# ----------------------------------------------------------------------------- against the fake
# The adapter's lifecycle against tests/backends/sglang_fake.py, a conformance fake of SGLang
# 0.5.23's tokenizer-manager / scheduler boundary (its docstring cites the source it follows).
# Tokens and log-probs are real (Gyre's CPU decoder over the checkpoint); log-probs are checked
# against the CPU actor's forward over the whole sequence, an independent computation.

import asyncio  # noqa: E402

import torch  # noqa: E402

from gyre.backends.engines.sglang_engine import EngineState  # noqa: E402
from tests.backends import sglang_fake  # noqa: E402
from tests.backends.helpers import check_backends_of, engine_of, tiny_model  # noqa: E402
from tests.backends.engines.test_cpu_engine import actor_logprobs  # noqa: E402

PROMPT = [5, 6, 7, 8]


def _dtype(cfg):
    """What `check_model_dtype` reads of a parsed command line."""
    return cfg.model, cfg.backend, cfg.sglang


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from gyre.backends.models.hf import save_checkpoint

    path = tmp_path_factory.mktemp("sglang_ckpt")
    model = tiny_model(seed=0)
    model.config.eos_token_id = None  # lengths fixed by max_tokens
    save_checkpoint(model, str(path))
    return str(path), model


@pytest.fixture(autouse=True)
def _fake_defaults(monkeypatch):
    monkeypatch.setattr(sglang_fake.FakeEngine, "step_s", 0.002)
    monkeypatch.setattr(sglang_fake.FakeEngine, "chunk_delay_steps", 0)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)


# float32 (log-probs compared with the CPU actor at 1e-4) needs an attention backend that serves it:
# the fake, like SGLang on an H200, refuses float32 with the default fa3 (sglang_fake.HALF_ONLY_ATTENTION).
FP32 = {"attention_backend": "triton"}


def _engine(path: str, version: int = 0, **kw) -> SglangEngine:
    return SglangEngine(SglangConfig(model_path=path, dtype="float32", extra=dict(FP32)), version=version,
                        api=sglang_fake.API, **kw)


def _calls(eng: SglangEngine) -> list[str]:
    return eng._engine.tokenizer_manager.calls


def _ref(model, prompt, events):
    return actor_logprobs(model, prompt, [e.token_id for e in events])


def test_generate_streams_real_tokens_with_policy_logprobs(ckpt):
    path, model = ckpt

    async def go():
        eng = _engine(path)
        await eng.start()
        out = [ev async for ev in eng.generate("a", PROMPT, SamplingParams(max_tokens=12, temperature=1.0))]
        await eng.stop()
        return out

    out = asyncio.run(go())
    assert len(out) == 12 and out[-1].finish_reason == "length" and all(e.finish_reason is None for e in out[:-1])
    assert {e.version for e in out} == {0}
    assert (torch.tensor([e.logprob for e in out]) - _ref(model, PROMPT, out)).abs().max() < 1e-4


def test_weight_update_mid_stream_runs_in_a_session_and_versions_every_token(ckpt, monkeypatch):
    """pause(retract) → begin → update(weight_version) → end → continue: the request survives, its
    tokens before the update have the old weights' log-probs and version 0, after it the new
    weights' (KV recomputed) and version 1. Output chunks lag 2 decode steps (in transit)."""
    path, model = ckpt
    new = tiny_model(seed=1)
    monkeypatch.setattr(sglang_fake.FakeEngine, "chunk_delay_steps", 2)

    async def go():
        eng = _engine(path)
        await eng.start()
        out = []
        async for ev in eng.generate("b", PROMPT, SamplingParams(max_tokens=24)):
            out.append(ev)
            if len(out) == 6:
                await eng.update_weights(new.state_dict(), version=1)
        calls = list(_calls(eng))
        await eng.stop()
        return eng, out, calls

    eng, out, calls = asyncio.run(go())
    assert len(out) == 24
    assert calls[:5] == ["PauseGenerationReqInput", "BeginWeightUpdateReqInput", "UpdateWeightsFromTensorReqInput",
                         "EndWeightUpdateReqInput", "ContinueGenerationReqInput"]
    versions = [e.version for e in out]
    k = versions.index(1)
    assert k >= 6 and versions == [0] * k + [1] * (24 - k)  # tokens in transit at the update kept version 0
    lp = torch.tensor([e.logprob for e in out])
    assert (lp[:k] - _ref(model, PROMPT, out)[:k]).abs().max() < 1e-4
    assert (lp[k:] - _ref(new, PROMPT, out)[k:]).abs().max() < 1e-4
    assert eng.version == 1 and eng.version_mismatches == 0  # agrees with the scheduler's spans


def test_update_outside_a_session_is_refused_as_sglang_does(ckpt):
    """The fake holds the rule the adapter depends on (weight_updater.py:232-239)."""
    path, _ = ckpt

    async def go():
        eng = _engine(path)
        await eng.start()
        tm, io = eng._engine.tokenizer_manager, sglang_fake.io_struct
        obj = io.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[sglang_fake.serialize([])])
        refused = await tm.update_weights_from_tensor(obj, None)
        end_alone = await tm.end_weight_update(io.EndWeightUpdateReqInput(), None)
        await eng.stop()
        return refused, end_alone

    refused, end_alone = asyncio.run(go())
    assert refused == (False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()")
    assert end_alone[0] is False


def test_abort_then_release_waits_for_the_extra_decode_step(ckpt):
    """An aborted request runs one more decode step in SGLang; release waits for it to land and
    for the scheduler to be paused, so the idle assertion holds; resume → update → serve again."""
    path, model = ckpt

    async def go():
        eng = _engine(path)
        await eng.start()
        stream = eng.generate("c", PROMPT, SamplingParams(max_tokens=500))
        seen = [await stream.__anext__() for _ in range(3)]
        aborted = await eng.abort("c")
        await eng.release_memory()  # the consumer still holds the suspended stream
        rest = [ev async for ev in stream]
        tm = eng._engine.tokenizer_manager
        after_release = (dict(tm.rid_to_state), tm.scheduler.dead, (await eng.health()).released)
        await eng.resume()
        await eng.update_weights(model.state_dict(), version=1)
        again = [ev async for ev in eng.generate("d", PROMPT, SamplingParams(max_tokens=5))]
        await eng.stop()
        return seen, aborted, rest, after_release, again

    seen, aborted, rest, (states, dead, released), again = asyncio.run(go())
    assert aborted == seen and rest == []
    assert states == {} and dead is None and released
    assert len(again) == 5 and {e.version for e in again} == {1}
    assert (torch.tensor([e.logprob for e in again]) - _ref(model, PROMPT, again)).abs().max() < 1e-4


def test_release_with_a_request_running_is_refused_and_reported(ckpt):
    path, _ = ckpt

    async def go():
        eng = _engine(path)
        await eng.start()
        task = asyncio.create_task(_collect(eng.generate("busy.1", PROMPT, SamplingParams(max_tokens=30))))
        while not eng._requests or not eng._requests["busy.1"].out:
            await asyncio.sleep(0.001)
        with pytest.raises(RuntimeError, match=r"refused: 1 requests still running here \(\['busy.1'\]\)"):
            await eng.release_memory()
        out = await task  # the request was not touched
        state, dead = eng.state, eng._engine.tokenizer_manager.scheduler.dead
        await eng.release_memory()  # idle now
        await eng.stop()
        return out, state, dead

    out, state, dead = asyncio.run(go())
    assert len(out) == 30 and state is EngineState.RUNNING and dead is None


def test_release_right_after_a_request_finished_pauses_first(ckpt):
    """The scheduler's last_batch still holds a request that finished one step earlier, so
    is_fully_idle() is False (scheduler.py:5337); the adapter pauses (retract) before releasing."""
    path, _ = ckpt

    async def go():
        eng = _engine(path)
        await eng.start()
        out = await _collect(eng.generate("e", PROMPT, SamplingParams(max_tokens=4)))
        sched = eng._engine.tokenizer_manager.scheduler
        busy_before = not sched.is_fully_idle()
        await eng.release_memory()
        await eng.stop()
        return out, busy_before

    out, busy_before = asyncio.run(go())
    assert len(out) == 4 and busy_before


def test_fake_crashes_on_release_when_not_idle(ckpt, caplog):
    """Without the adapter's care the real scheduler dies: it logs why, SIGQUITs the rank
    (scheduler.py:6370-6379) and never answers. Caught here by a handler of the test's own (the
    default action would end pytest; tests/runtime/test_engine_sigquit.py runs it in a rank)."""
    import signal

    path, _ = ckpt
    got: list[int] = []

    async def go():
        eng = _engine(path)
        await eng.start()
        await _collect(eng.generate("f", PROMPT, SamplingParams(max_tokens=4)))
        tm = eng._engine.tokenizer_manager
        release = tm.release_memory_occupation(sglang_fake.io_struct.ReleaseMemoryOccupationReqInput(), None)
        with pytest.raises(asyncio.TimeoutError):  # no answer, ever
            await asyncio.wait_for(release, 0.5)
        await eng.stop()

    before = signal.signal(signal.SIGQUIT, lambda signum, frame: got.append(signum))
    try:
        asyncio.run(go())
    finally:
        signal.signal(signal.SIGQUIT, before)
    assert got == [signal.SIGQUIT]
    assert "Scheduler hit an exception" in caplog.text and "only when server is idle" in caplog.text


def test_prefix_free_rids_keep_aborts_to_their_own_request(ckpt):
    """SGLang aborts every rid starting with the one named (scheduler.py:5688, 5800)."""
    path, _ = ckpt
    ids = ["call.1", "call.10", "call.1.", "1:call", "a:b", "a", "a:b:1."]
    rids = [prefix_free_rid(i, s) for s in (1, 2, 11) for i in ids]
    assert not [(a, b) for a in rids for b in rids if a != b and b.startswith(a)]

    async def go():
        eng = _engine(path)
        await eng.start()
        long = asyncio.create_task(_collect(eng.generate("call.10", PROMPT, SamplingParams(max_tokens=20))))
        short = eng.generate("call.1", PROMPT, SamplingParams(max_tokens=20))
        await short.__anext__()
        await eng.abort("call.1")
        out = await long
        await eng.stop()
        return out

    assert len(asyncio.run(go())) == 20



def test_drain_reroutes_calls_in_flight_none_aborted_at_the_harness(ckpt):
    """The router drains an SGLang cell with calls in flight: they continue on another SGLang
    engine from their generated tokens, every call completes, and the drained engine releases
    its memory at once (its aborts land first)."""
    from gyre.proxy.router import Router, SlotState

    path, model = ckpt

    async def go():
        a, b = _engine(path), _engine(path)
        a.name, b.name = "A", "B"
        await a.start()
        await b.start()
        router = Router()
        router.add_engine(a, kind="cell", index=1)
        prompts = [[5 + i, 6, 7] for i in range(4)]

        async def call(i):
            return [ev async for ev in router.generate(f"call{i}", f"ex{i}", prompts[i], SamplingParams(max_tokens=40))]

        tasks = [asyncio.create_task(call(i)) for i in range(4)]
        while sum(len(r.out) for r in a._requests.values()) < 8:
            await asyncio.sleep(0.001)
        router.add_engine(b, kind="cell", index=0)
        moved = await router.drain("A")
        await a.release_memory()
        outs = await asyncio.gather(*tasks)
        state = router.slots["A"].state
        await a.stop()
        await b.stop()
        return prompts, moved, outs, router.reroutes, state

    prompts, moved, outs, reroutes, state = asyncio.run(go())
    assert moved == 4 and reroutes == 4 and state is SlotState.DRAINED
    assert [len(o) for o in outs] == [40] * 4  # none aborted: every call got all its tokens
    for prompt, out in zip(prompts, outs):  # the same weights on both: ℓ of the whole sequence
        assert (torch.tensor([e.logprob for e in out]) - _ref(model, prompt, out)).abs().max() < 1e-4


async def _collect(stream):
    return [ev async for ev in stream]


def test_factory_builds_the_adapter_behind_the_engine_contract(monkeypatch):
    """With the test-only GYRE_SGLANG_API hook naming the fake, `--backend.engine sglang` is
    runnable and the factory's engine passes the same contract as the CPU engine; without it,
    and without CUDA + sglang, it is refused up front."""
    from gyre.backends import factory
    from gyre.config import ConfigError, GyreConfig
    from tests.contracts.test_engine_contract import test_engine_contract

    cfg = GyreConfig()
    cfg.backend.engine = "sglang"
    monkeypatch.delenv(factory.SGLANG_API_ENV, raising=False)
    with pytest.raises(ConfigError, match="--backend.engine sglang: needs CUDA and the sglang package"):
        check_backends_of(cfg)
    monkeypatch.setenv(factory.SGLANG_API_ENV, "tests.backends.sglang_fake:API")
    check_backends_of(cfg)
    assert factory.runnable(factory.ENGINES) == ["cpu", "sglang"]
    engine = engine_of(cfg, tiny_model().config, tiny_model().state_dict(), version=0, eos_token_ids=[],
                                  name="x")
    assert isinstance(engine, SglangEngine) and engine._api is sglang_fake.API
    test_engine_contract("sglang", (tiny_model(seed=0), tiny_model(seed=7)))


RESTART_SCRIPT = r"""
import asyncio, subprocess, sys
from gyre.backends.config import SglangConfig
from gyre.backends.protocols import SamplingParams
from gyre.backends.engines.sglang_engine import SglangEngine
from tests.backends import sglang_fake

sglang_fake.FakeEngine.spawn_scheduler_process = True
harness = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=False)  # rank 0's harness

async def go():
    for _ in range(2):  # start, serve, stop, and again
        eng = SglangEngine(SglangConfig(model_path=sys.argv[1], dtype="float32", extra={"attention_backend": "triton"}),
                           api=sglang_fake.API)
        await eng.start()
        scheduler = eng._engine.process
        out = [ev async for ev in eng.generate("a", [1, 2], SamplingParams(max_tokens=3))]
        await eng.stop()
        print("served", len(out), "scheduler ended", scheduler.poll() is not None, "harness alive", harness.poll() is None)

asyncio.run(go())
print("harness", harness.pid)
"""


@pytest.mark.jobs  # a harness's whole life across two engine restarts and the engine's exit
def test_a_harness_started_on_rank_0_survives_engine_restarts_and_exit(ckpt, tmp_path):
    """SGLang's Engine.shutdown kills every child of the rank and runs at exit (engine.py:1491,
    326); the fake does the same. The adapter ends only the engine's own processes."""
    import os
    import signal

    path, _ = ckpt
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, "-c", RESTART_SCRIPT, path], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["served 3 scheduler ended True harness alive True"] * 2, proc.stdout
    pid = int(lines[2].split()[1])
    try:
        os.kill(pid, 0)  # still alive after the engine's process exited (no atexit shutdown)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_start_under_torchrun_keeps_gyres_logging_and_environment(ckpt, monkeypatch):
    """torchrun sets TORCHELASTIC_USE_AGENT_STORE (the scheduler would hang: the fake raises);
    SGLang's configure_logger replaces the root handlers (engine.py:1152)."""
    import logging

    path, _ = ckpt
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    root = logging.getLogger()
    mine = logging.NullHandler()
    before = list(root.handlers)
    root.addHandler(mine)
    try:
        async def go():
            eng = _engine(path, version=4)
            await eng.start()
            args = eng._engine.server_args
            await eng.stop()
            return args

        args = asyncio.run(go())
        assert mine in root.handlers and os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert args["weight_version"] == "4" and args["skip_tokenizer_init"] is True
    finally:
        root.handlers[:] = before


def test_update_from_the_core_over_a_weight_update_group(ckpt):
    """The core hosts the group (WeightBroadcaster, gloo here, NCCL on GPUs), the engine joins it
    as SGLang's scheduler does and receives a broadcast mid-stream inside a session; later tokens
    carry the new weights' log-probs and version."""
    from gyre.backends.engines.weight_group import WeightBroadcaster

    path, model = ckpt
    new = tiny_model(seed=2)
    params = {k: v for k, v in new.state_dict().items() if k != "lm_head.weight" or not new.config.tie_word_embeddings}

    async def go():
        eng = _engine(path)
        await eng.start()
        core = WeightBroadcaster("127.0.0.1", 0, 2, backend="gloo", timeout_s=60)
        await asyncio.gather(asyncio.to_thread(core.connect),
                             eng.init_weights_update_group("127.0.0.1", core.port, rank_offset=1, world_size=2, backend="gloo"))
        out = []
        async for ev in eng.generate("g", PROMPT, SamplingParams(max_tokens=16)):
            out.append(ev)
            if len(out) == 5:
                names, dtypes, shapes = WeightBroadcaster.describe(params)
                await asyncio.gather(asyncio.to_thread(core.send, params),
                                     eng.update_weights_from_distributed(names, dtypes, shapes, version=1))
        calls = list(_calls(eng))
        await eng.stop()
        return out, calls

    out, calls = asyncio.run(go())
    assert calls[1:6] == ["PauseGenerationReqInput", "BeginWeightUpdateReqInput", "UpdateWeightsFromDistributedReqInput",
                          "EndWeightUpdateReqInput", "ContinueGenerationReqInput"]
    k = [e.version for e in out].index(1)
    lp = torch.tensor([e.logprob for e in out])
    assert k >= 5 and (lp[:k] - _ref(model, PROMPT, out)[:k]).abs().max() < 1e-4
    assert (lp[k:] - _ref(new, PROMPT, out)[k:]).abs().max() < 1e-4


@pytest.mark.jobs  # runs the whole device-check script
def test_the_gpu_check_script_passes_against_the_fake(tmp_path):
    """tests/gpu/sglang_check.py (the first command on a GPU box) is itself exercised here, with
    the fake standing in for sglang: its checks hold where SGLang follows the fake's semantics."""
    import json

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.sglang_check", "--api", "tests.backends.sglang_fake:API",
                           "--out", str(out)], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    checks = {c["check"]: c["ok"] for c in json.loads(out.read_text())["checks"]}
    assert checks == {"generate": True, "update": True, "abort+release": True, "prefix rids": True,
                      "distributed": None, "harness": True}


@pytest.mark.skipif(not os.environ.get("GYRE_SGLANG_SRC"), reason="set GYRE_SGLANG_SRC to an unpacked sglang 0.5.23 wheel")
def test_fake_request_fields_match_sglang_source():
    """The fake's io_struct copies have the fields (and literal defaults) of the real classes
    (sglang/srt/managers/io_struct.py), read with `ast`: io_struct cannot be imported on CPU."""
    import ast
    import dataclasses

    src = os.path.join(os.environ["GYRE_SGLANG_SRC"], "sglang", "srt", "managers", "io_struct.py")
    tree = ast.parse(open(src).read())
    real = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            real[node.name] = {s.target.id: (ast.literal_eval(s.value) if s.value is not None and
                                             isinstance(s.value, ast.Constant) else "?")
                               for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    for name, cls in vars(sglang_fake.io_struct).items():
        ours = {f.name: (f.default if f.default is not dataclasses.MISSING else "?") for f in dataclasses.fields(cls)}
        theirs = {**real["BaseReq"], **real[name]}  # every request class derives from BaseReq (rid, ...)
        assert set(real[name]) <= set(ours) <= set(theirs), (name, sorted(ours), sorted(theirs))
        for field_name, default in theirs.items():
            if field_name in ours and default != "?":
                assert ours[field_name] == default, (name, field_name, ours[field_name], default)


def test_min_tokens_logprobs_are_sglangs_masked_ones_and_a_warning_says_so(ckpt, caplog):
    """SGLang applies the min_new_tokens stop mask before SGLANG_RETURN_ORIGINAL_LOGPROB's
    log-softmax (model_runner.py:2093, layers/sampler.py:230-236): the first min_tokens
    log-probs exceed the trainer's (the stop ids' mass is renormalised away), later ones match."""
    import logging

    path, model = ckpt

    async def go():
        eng = _engine(path)
        await eng.start()
        sp = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=list(range(40, 200)))
        out = []
        async for ev in eng.generate("m", PROMPT, sp):
            out.append(ev)
        await eng.stop()
        return out

    with caplog.at_level(logging.WARNING, logger="gyre.backends.engines.sglang_engine"):
        out = asyncio.run(go())
    lp, ref = torch.tensor([e.logprob for e in out]), _ref(model, PROMPT, out)
    assert (lp[:3] - ref[:3] > 1e-3).all()
    assert (lp[3:] - ref[3:]).abs().max() < 1e-4
    assert any("min_tokens > 0" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- dtype and --sglang.*
def test_model_dtype_auto_is_bf16_with_a_cuda_backend_and_fp32_on_cpu():
    from gyre.config import parse_config

    assert parse_config([]).model.dtype == "float32"
    assert parse_config(["--backend.engine", "sglang"]).model.dtype == "bfloat16"
    assert parse_config(["--backend.actor", "megatron"]).model.dtype == "bfloat16"
    assert parse_config(["--backend.engine", "sglang", "--model.dtype", "float32"]).model.dtype == "float32"
    assert parse_config(["--preset", "cpu-demo"]).model.dtype == "float32"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fp32_with_sglang_is_refused_up_front(dtype, monkeypatch):
    """check_train_config refuses it before any rank starts (SGLang would crash its scheduler at
    start, SIGQUITting the rank); the message names both flags."""
    from gyre.backends import factory
    from gyre.config import ConfigError, parse_config
    from gyre.config_checks import check_model_dtype

    monkeypatch.setenv(factory.SGLANG_API_ENV, "tests.backends.sglang_fake:API")
    cfg = parse_config(["--backend.engine", "sglang", "--model.dtype", dtype])
    with pytest.raises(ConfigError, match=f"--model.dtype {dtype} with --backend.engine sglang"):
        check_model_dtype(*_dtype(cfg))
    check_model_dtype(*_dtype(parse_config(["--backend.engine", "sglang"])))  # auto → bfloat16: fine
    check_model_dtype(*_dtype(parse_config(["--model.dtype", "float32"])))  # the CPU engine: fine


def test_sglang_pass_through_reaches_server_args(tmp_path, monkeypatch):
    """`--sglang.<name> VALUE` (ServerArgs names, not copied into Gyre's config) lands in
    cfg.sglang.extra and, coerced, in the kwargs of sglang.Engine (the fake's ServerArgs)."""
    from gyre.backends import factory
    from gyre.config import parse_config

    monkeypatch.setenv(factory.SGLANG_API_ENV, "tests.backends.sglang_fake:API")
    cfg = parse_config(["--backend.engine", "sglang", "--run-dir", str(tmp_path / "run"),
                        "--sglang.attention-backend", "triton", "--sglang.chunked-prefill-size=4096",
                        "--sglang.disable-cuda-graph", "--sglang.cuda-graph-max-bs-decode", "8",
                        "--sglang.mem-fraction-static", "0.5", "--train.steps", "3"])
    assert cfg.sglang.extra == {"attention_backend": "triton", "chunked_prefill_size": "4096",
                                "disable_cuda_graph": "true", "cuda_graph_max_bs_decode": "8"}
    assert cfg.sglang.mem_fraction_static == 0.5 and cfg.train.steps == 3  # declared fields stay tyro's
    model = tiny_model()
    eng = engine_of(cfg, model.config, model.state_dict(), version=2, eos_token_ids=[3], name="p")

    async def go():
        await eng.start()
        args = eng._engine.server_args
        await eng.stop()
        return args

    args = asyncio.run(go())
    assert args["attention_backend"] == "triton" and args["chunked_prefill_size"] == 4096
    assert args["disable_cuda_graph"] is True and args["cuda_graph_max_bs_decode"] == 8
    assert args["mem_fraction_static"] == 0.5 and args["dtype"] == "bfloat16" and args["weight_version"] == "2"


def test_unknown_or_gyre_owned_sglang_options_are_refused(ckpt, monkeypatch):
    """A name ServerArgs lacks is refused before Engine() with the closest ones (0.5.23 has no
    cuda_graph_max_bs: it is cuda_graph_max_bs_decode); Gyre's own fields are refused up front."""
    from gyre.config import ConfigError, parse_config
    from gyre.config_checks import check_model_dtype

    path, _ = ckpt
    eng = SglangEngine(SglangConfig(model_path=path, extra={"cuda_graph_max_bs": "8"}), api=sglang_fake.API)
    with pytest.raises(ValueError, match="no field 'cuda_graph_max_bs'; closest: cuda_graph_max_bs_decode"):
        asyncio.run(eng.start())
    assert eng.state is EngineState.STOPPED and eng._engine is None  # refused before Engine()
    with pytest.raises(ConfigError, match=r"--sglang.tp-size: Gyre sets ServerArgs.tp_size itself \(= --parallel.cell-size\)"):
        check_model_dtype(*_dtype(parse_config(["--backend.engine", "sglang", "--sglang.tp-size", "2"])))
    with pytest.raises(ValueError, match="Gyre sets ServerArgs.dtype"):
        server_args(SglangConfig(model_path=path, extra={"dtype": "float16"}))


@pytest.mark.skipif(not os.environ.get("GYRE_SGLANG_SRC"), reason="set GYRE_SGLANG_SRC to an unpacked sglang 0.5.23 wheel")
def test_fake_server_args_and_architectures_are_sglangs():
    """Every ServerArgs name the fake accepts is a field of the real one (the classes of
    arg_groups/fields/*.py, read with `ast`), and every architecture the fake and Gyre serve is an
    EntryClass of sglang's models/ (the ModelRegistry keys)."""
    import ast
    import glob

    from gyre.backends.engines.sglang_checkpoint import SGLANG_ARCHITECTURES
    from gyre.backends.engines.sglang_wire import GYRE_OWNED_SERVER_ARGS

    root = os.path.join(os.environ["GYRE_SGLANG_SRC"], "sglang", "srt")
    fields = set()
    for f in glob.glob(os.path.join(root, "arg_groups", "fields", "*.py")):
        for node in ast.parse(open(f).read()).body:
            if isinstance(node, ast.ClassDef):
                fields |= {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    assert sglang_fake.SERVER_ARGS <= fields, sorted(sglang_fake.SERVER_ARGS - fields)
    assert set(GYRE_OWNED_SERVER_ARGS) <= fields
    entries = set()
    for f in ("qwen2", "qwen3", "qwen3_moe", "llama"):
        for node in ast.parse(open(os.path.join(root, "models", f + ".py")).read()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EntryClass" for t in node.targets):
                value = node.value
                entries |= {e.id for e in (value.elts if isinstance(value, ast.List) else [value])}
    assert sglang_fake.ARCHITECTURES == set(SGLANG_ARCHITECTURES) and sglang_fake.ARCHITECTURES <= entries
