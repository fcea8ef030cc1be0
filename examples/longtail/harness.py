"""longtail harness: executions with long-tailed, seeded durations, for scheduler benchmarks.

Each execution draws (from a seed mixed with GYRE_EXECUTION_ID, so reruns are identical):
  - a total work time T ~ LogNormal(ln(median_h), sigma) hours. The defaults (median 1.62 h,
    sigma 0.588) give a mean of 1.93 h and P(T > 4 h) = 6.25 %: with the runner's 4 h timeout
    that is the paper's NL2RepoBench workload (mean execution 1.93 h, 6.25 % harness timeouts);
  - a number of turns 1 + Poisson(turns_mean − 1), and T cut into turns by exponential gaps;
  - per turn a think share (a model call through the proxy, or a sleep with `--no-model`) and a
    tool share (a sleep), the split LogNormal-jittered around `think_fraction`.
A timed-out execution is one whose T exceeds the runner's limit: it simply keeps working until
the runner kills it. `progress.json` in the workspace is rewritten after every turn, so the
evaluator (task.py) scores partial progress.

`--time-scale` multiplies every duration (1e-3: an hour lasts 3.6 s), so benchmarks run fast.
A turn's think time is a model call followed by a sleep for whatever of the think time the call
did not take. By default the call asks for `--max-tokens` tokens; with `--think-tokens-per-s R`
it asks for R × (scaled think time) tokens instead, so against an engine that decodes R tokens/s
per request (`--engine.min-decode-step-s 1/R`) the call *is* the think time while the engine has
room, and takes longer when more calls compete for its batch than it holds: rollout throughput
then depends on the cells serving rollouts, as on GPUs. Such calls also send `min_tokens` = the
tokens asked (an OpenAI-API extension of SGLang and vLLM, honoured by the proxy), so an early EOS
cannot turn think time into a sleep that would go on while the cells train.

Only the stdlib and `openai` are used (`--client http`: the stdlib alone, ~10× less start-up CPU
than importing the SDK, for benchmarks with many executions on few cores); the runner's env
supplies OPENAI_BASE_URL/OPENAI_API_KEY.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

HOUR = 3600.0


@dataclass
class Plan:
    total_s: float  # unscaled seconds of work this execution would need
    turns: int
    think_s: list[float]  # unscaled, per turn
    tool_s: list[float]


def draw_plan(seed: int, execution_id: str, *, median_h: float = 1.62, sigma: float = 0.588, turns_mean: float = 40.0,
              think_fraction: float = 0.3, jitter: float = 0.5) -> Plan:
    """The execution's plan, a pure function of (seed, execution_id, parameters)."""
    h = hashlib.sha256(f"{seed}:{execution_id}".encode()).digest()
    rng = random.Random(int.from_bytes(h[:8], "little"))
    total = rng.lognormvariate(math.log(median_h * HOUR), sigma)
    turns = 1 + _poisson(rng, max(turns_mean - 1.0, 0.0))
    gaps = [rng.expovariate(1.0) for _ in range(turns)]
    s = sum(gaps)
    think, tool = [], []
    for g in gaps:
        turn = total * g / s
        f = min(0.95, max(0.05, think_fraction * rng.lognormvariate(0.0, jitter)))
        think.append(turn * f)
        tool.append(turn * (1 - f))
    return Plan(total, turns, think, tool)


def _poisson(rng: random.Random, lam: float) -> int:
    # Knuth for small λ, normal approximation above (λ here is tens).
    if lam < 30:
        L, k, p = math.exp(-lam), 0, 1.0
        while True:
            p *= rng.random()
            if p <= L:
                return k
            k += 1
    return max(0, int(round(rng.gauss(lam, math.sqrt(lam)))))


class _HttpChat:
    """The one OpenAI call the harness makes (POST {base}/chat/completions), over the stdlib."""

    def __init__(self, retries: int = 5) -> None:
        self.url = os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions"
        self.key = os.environ.get("OPENAI_API_KEY", "")
        self.retries = retries

    def create(self, *, model: str, messages: list[dict], max_tokens: int, extra_body: dict | None = None) -> str:
        import urllib.error
        import urllib.request

        body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, **(extra_body or {})}).encode()
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(self.url, data=body, method="POST", headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {self.key}"})
            try:
                with urllib.request.urlopen(req, timeout=3600) as r:
                    return json.loads(r.read())["choices"][0]["message"]["content"] or ""
            except urllib.error.HTTPError as e:
                if (e.code < 500 and e.code != 429) or attempt == self.retries:
                    raise
            except (urllib.error.URLError, ConnectionError):
                if attempt == self.retries:
                    raise
            time.sleep(min(8.0, 0.5 * 2 ** attempt))
        raise AssertionError("unreachable")


def _write_progress(done: int, plan: Plan, t0: float) -> None:
    tmp = "progress.json.tmp"
    with open(tmp, "w") as f:
        json.dump({"turns_done": done, "turns": plan.turns, "elapsed_s": time.time() - t0}, f)
    os.replace(tmp, "progress.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply every duration (1e-3: 1 h → 3.6 s)")
    p.add_argument("--median-h", type=float, default=1.62)
    p.add_argument("--sigma", type=float, default=0.588)
    p.add_argument("--turns-mean", type=float, default=40.0)
    p.add_argument("--think-fraction", type=float, default=0.3)
    p.add_argument("--no-model", action="store_true", help="sleep the think time instead of calling the model")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each model call asks for")
    p.add_argument("--think-tokens-per-s", type=float, default=0.0,
                   help="> 0: a call asks for this × its scaled think time in tokens (min 1) instead of --max-tokens")
    p.add_argument("--client", choices=("openai", "http"), default="openai",
                   help="openai: the official SDK; http: the same call over the stdlib (cheap start-up)")
    a = p.parse_args(argv)
    eid = os.environ.get("GYRE_EXECUTION_ID", "local")
    plan = draw_plan(a.seed, eid, median_h=a.median_h, sigma=a.sigma, turns_mean=a.turns_mean, think_fraction=a.think_fraction)
    with open("plan.json", "w") as f:
        json.dump({**asdict(plan), "time_scale": a.time_scale}, f)
    client = chat = None
    if not a.no_model and a.client == "openai":
        from openai import OpenAI

        client = OpenAI(max_retries=5, timeout=3600)
    elif not a.no_model:
        chat = _HttpChat()
    model = os.environ.get("GYRE_MODEL", "gyre-policy")
    messages = [{"role": "system", "content": "You are a long-running agent."}, {"role": "user", "content": f"Work on {eid}."}]
    t0 = time.time()
    _write_progress(0, plan, t0)
    for k in range(plan.turns):
        think = plan.think_s[k] * a.time_scale
        if a.no_model:
            time.sleep(think)
        else:
            # A model call stands for the think time; the engine decides how long it really takes.
            started = time.time()
            n = max(1, round(think * a.think_tokens_per_s)) if a.think_tokens_per_s > 0 else a.max_tokens
            # Paced: all n tokens are decoded (min_tokens holds EOS back), so the think time is
            # spent in the engine, where it competes for the batch, and not in a sleep that would
            # go on while the cells train.
            extra = {"min_tokens": n} if a.think_tokens_per_s > 0 else None
            if client is not None:
                resp = client.chat.completions.create(model=model, messages=messages, max_tokens=n, extra_body=extra)
                text = resp.choices[0].message.content or ""
            else:
                text = chat.create(model=model, messages=messages, max_tokens=n, extra_body=extra)
            messages.append({"role": "assistant", "content": text})
            messages.append({"role": "user", "content": f"tool result {k}"})
            time.sleep(max(0.0, think - (time.time() - started)))
        time.sleep(plan.tool_s[k] * a.time_scale)
        _write_progress(k + 1, plan, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
