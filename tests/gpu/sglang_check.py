"""The SGLang engine's lifecycle on a real GPU with sglang 0.5.23 installed: the first thing to run
on a new GPU box (docs/gpu-sglang.md). Runs in a process of its own: a failed SGLang scheduler
sends SIGQUIT to its parent, which must not be pytest (tests/gpu/test_sglang_gpu.py runs this
module as a subprocess and reads its report).

    python -m tests.gpu.sglang_check [--out report.json] [--dtype bfloat16] [--attention-backend NAME]

bf16 by default, with SGLang's own attention backend: what a run with --backend.engine sglang serves
(--model.dtype auto resolves to bfloat16; fp32 is refused there). `--dtype float32
--attention-backend triton` tries fp32 (Hopper's default attention takes fp16/bf16 only, and
sgl-kernel's RMSNorm is called whatever the dtype: sglang/srt/layers/layernorm.py:628, 631).

Checks, each against something independent (the CPU actor's log-probs for the same weights and
tokens, the process table, the versions the test itself published):
  generate      32 tokens; log-probs match the CPU actor's (bf16: < 5e-2; fp32: < 2e-3)
  update        mid-stream update in a weight-update session: the request survives, earlier
                tokens have version 0 and the old weights' log-probs, later ones version 1 and
                the new weights'
  abort+release abort a running request and release at once: no scheduler crash (the rank
                would get SIGQUIT); resume, update, generate again with the right log-probs
  prefix rids   aborting "x.1" leaves "x.10" running to its end
  distributed   (2+ GPUs) the core's WeightBroadcaster on cuda:0 → the engine on cuda:1 over NCCL
  harness       a child process started before the engine is alive after the engine stops
Prints one JSON line per check and a final {"ok": ...}; exit status 0 iff every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import traceback

import torch


def _models(path: str):
    from gyre.backends.models.hf import build_model, model_config, save_checkpoint

    cfg = model_config("small", 1024, eos_token_id=None, bos_token_id=0)
    old = build_model(cfg, seed=0)
    save_checkpoint(old, path)
    return old, build_model(cfg, seed=1)


def _ref(model, prompt, events) -> torch.Tensor:
    from tests.backends.engines.test_cpu_engine import actor_logprobs

    return actor_logprobs(model, prompt, [e.token_id for e in events])


def _gap(model, prompt, events, lo=0, hi=None) -> float:
    lp = torch.tensor([e.logprob for e in events])
    return float((lp - _ref(model, prompt, events)).abs()[lo:hi].max())


async def _checks(args, report) -> None:
    from gyre.backends.config import SglangConfig
    from gyre.backends.protocols import SamplingParams
    from gyre.backends.engines.sglang_engine import SglangApi, SglangEngine
    from gyre.backends.engines.weight_group import WeightBroadcaster

    path = tempfile.mkdtemp(prefix="gyre-sglang-check-")
    old, new = _models(path)
    tol = 2e-3 if args.dtype == "float32" else 5e-2
    prompt = [5, 6, 7]
    harness = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    gpu = 1 if torch.cuda.device_count() > 1 else 0
    extra = {"disable_cuda_graph": "true"} | ({"attention_backend": args.attention_backend}
                                             if args.attention_backend else {})
    api = SglangApi.from_spec(args.api) if args.api else None
    eng = SglangEngine(SglangConfig(model_path=path, dtype=args.dtype, mem_fraction_static=0.3, base_gpu_id=gpu,
                                    extra=extra), api=api)
    await eng.start()
    try:
        out = [ev async for ev in eng.generate("a", prompt, SamplingParams(max_tokens=32))]
        report("generate", len(out) == 32 and _gap(old, prompt, out) < tol, tokens=len(out), gap=_gap(old, prompt, out))

        later = []
        async for ev in eng.generate("b", prompt, SamplingParams(max_tokens=64)):
            later.append(ev)
            if len(later) == 8:
                await eng.update_weights(new.state_dict(), version=1)
        v = [e.version for e in later]
        k = v.index(1) if 1 in v else len(v)
        ok = len(later) == 64 and k >= 8 and v == [0] * k + [1] * (64 - k)
        gaps = (_gap(old, prompt, later, 0, k), _gap(new, prompt, later, k) if k < 64 else None)
        report("update", ok and gaps[0] < tol and gaps[1] is not None and gaps[1] < tol, first_new=k, gaps=gaps,
               mismatches=eng.version_mismatches)

        stream = eng.generate("c", prompt, SamplingParams(max_tokens=500))
        first = await stream.__anext__()
        aborted = await eng.abort("c")
        await eng.release_memory()
        await eng.resume()
        await eng.update_weights(old.state_dict(), version=2)
        again = [ev async for ev in eng.generate("d", prompt, SamplingParams(max_tokens=16))]
        await stream.aclose()
        report("abort+release", aborted == [first] and {e.version for e in again} == {2} and _gap(old, prompt, again) < tol,
               gap=_gap(old, prompt, again))

        long = asyncio.create_task(_collect(eng.generate("x.10", prompt, SamplingParams(max_tokens=40))))
        short = eng.generate("x.1", prompt, SamplingParams(max_tokens=40))
        await short.__anext__()
        await eng.abort("x.1")
        await short.aclose()
        report("prefix rids", len(await long) == 40)

        if torch.cuda.device_count() > 1:
            torch.cuda.set_device(0)
            core = WeightBroadcaster("127.0.0.1", 0, 1 + eng.config.tp_size, backend="nccl", timeout_s=120)
            await asyncio.gather(asyncio.to_thread(core.connect),
                                 eng.init_weights_update_group("127.0.0.1", core.port, 1, 1 + eng.config.tp_size))
            params = {k: v.cuda() for k, v in new.state_dict().items()}
            names, dtypes, shapes = WeightBroadcaster.describe(params)
            await asyncio.gather(asyncio.to_thread(core.send, params),
                                 eng.update_weights_from_distributed(names, dtypes, shapes, version=3))
            got = [ev async for ev in eng.generate("e", prompt, SamplingParams(max_tokens=16))]
            report("distributed", {e.version for e in got} == {3} and _gap(new, prompt, got) < tol, gap=_gap(new, prompt, got))
        else:
            report("distributed", None, skipped="needs 2 GPUs (NCCL will not put two ranks on one GPU)")
    finally:
        await eng.stop()
    report("harness", harness.poll() is None)
    harness.kill()


async def _collect(stream):
    return [ev async for ev in stream]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--dtype", default="bfloat16", help="what a run serves (default); float32 needs "
                   "--attention-backend triton")
    p.add_argument("--attention-backend", default=None,
                   help="default: SGLang's choice (fa3 on Hopper, fp16/bf16 only); triton serves float32")
    p.add_argument("--api", default="", help="test only: module:attribute of a stand-in for sglang (the CPU fake)")
    args = p.parse_args()
    results: list[dict] = []

    def report(name, ok, **detail):
        row = {"check": name, "ok": ok, **detail}
        results.append(row)
        print(json.dumps(row), flush=True)

    try:
        asyncio.run(_checks(args, report))
    except Exception:
        report("crashed", False, error=traceback.format_exc()[-3000:])
    ok = all(r["ok"] is not False for r in results) and any(r["ok"] for r in results)
    print(json.dumps({"ok": ok}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ok": ok, "checks": results}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
