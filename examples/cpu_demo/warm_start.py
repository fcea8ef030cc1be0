"""Supervised warm start for the cpu_demo: the tool-call format and a blurred word → number mapping.

A model built from a config cannot follow a tool-call format, so before RL it is trained on
demonstrations produced by running the real harness loop (harness.Agent) against the scripted
policy (policy.py), rendered with the proxy's own chat template. Two phases:
  1. right-answer demonstrations until `value_accuracy` (learnability.py) reaches `learned`
     (0.9): format, todo list, delegation, summaries and the mapping;
  2. "blur": demonstrations that are right with probability `correct_prob` (0.3) and otherwise
     off by one, until value accuracy falls to `blurred` (0.35).
RL then starts from a model that has the features but guesses among length − 1, length and
length + 1. (From noisy demonstrations alone the tiny model learns only the marginal over
digits, and RL would have to build the mapping from scratch; see README.)

    python -m examples.cpu_demo.warm_start --out runs/cpu_demo/warm_start

writes an HF checkpoint (config.json + model.safetensors) and `warm_start.json` (both phases'
steps and accuracies, demo statistics, and the warm-started model's own measured reward,
tool-call validity and value accuracy).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from examples.cpu_demo.harness import SYSTEM_MAIN, TOOLS_MAIN, Agent, Reply, Todo
from examples.cpu_demo.policy import scripted_reply
from examples.cpu_demo.task import evaluate, make_task

logger = logging.getLogger(__name__)

_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
IM_END = "<|im_end|>"


def render(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    """The prompt text the proxy renders: tool-call arguments as objects, generation prompt on."""
    msgs = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        msgs.append(m)
    return tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)


def parse_output(text: str, call_prefix: str) -> tuple[str, list[dict[str, Any]]]:
    """Split a sampled assistant text into content and Hermes tool calls (as the proxy does)."""
    calls = []
    for k, m in enumerate(_CALL.finditer(text)):
        try:
            obj = json.loads(m.group(1))
            calls.append({"id": f"{call_prefix}-{k}", "name": str(obj.get("name")), "arguments": json.dumps(obj.get("arguments", {}))})
        except (json.JSONDecodeError, AttributeError):
            continue
    content = _CALL.sub("", text).replace(IM_END, "").strip()
    return content, calls


class ScriptedBackend:
    """Harness backend that answers with the scripted policy and records (prompt, output)."""

    def __init__(self, tokenizer, rng: random.Random, correct_prob: float, wrong: str = "off_by_one") -> None:
        self.tokenizer, self.rng, self.correct_prob, self.wrong = tokenizer, rng, correct_prob, wrong
        self.pairs: list[tuple[str, str]] = []

    def complete(self, messages, tools) -> Reply:
        prompt = render(self.tokenizer, messages, tools)
        out = scripted_reply(prompt, self.rng, self.correct_prob, self.wrong)
        self.pairs.append((prompt, out + IM_END))
        content, calls = parse_output(out, f"c{len(self.pairs)}")
        return Reply(content, calls, len(self.tokenizer(prompt).input_ids))


class ModelBackend:
    """Harness backend that samples from a local model (to measure the warm start itself)."""

    def __init__(self, tokenizer, model, max_tokens: int = 48, temperature: float = 1.0, seed: int = 0) -> None:
        self.tokenizer, self.model, self.max_tokens, self.temperature = tokenizer, model, max_tokens, temperature
        self.gen = torch.Generator().manual_seed(seed)
        self.n = 0
        self.im_end = tokenizer.convert_tokens_to_ids(IM_END)

    @torch.no_grad()
    def complete(self, messages, tools) -> Reply:
        from transformers import DynamicCache

        prompt = render(self.tokenizer, messages, tools)
        ids = self.tokenizer(prompt).input_ids
        cache = DynamicCache()  # a fresh cache per call (reusing the model's default one leaks state)
        out = self.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
        logits, new = out.logits[0, -1], []
        for _ in range(self.max_tokens):
            probs = torch.softmax(logits.float() / self.temperature, -1)
            t = int(torch.multinomial(probs, 1, generator=self.gen))
            if t == self.im_end:
                break
            new.append(t)
            out = self.model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True)
            logits = out.logits[0, -1]
        self.n += 1
        content, calls = parse_output(self.tokenizer.decode(new), f"m{self.n}")
        return Reply(content, calls, len(ids))


def run_episode(backend, task: dict[str, Any], workdir: Path, compact_at: int) -> tuple[float, Agent]:
    (workdir / "TODO.md").write_text(task["files"]["TODO.md"])
    todo = Todo.from_file(str(workdir / "TODO.md"))
    agent = Agent(backend, todo, compact_at=compact_at, retries=2, max_calls=12, workdir=str(workdir))
    agent.run("main", SYSTEM_MAIN, TOOLS_MAIN, f"Task: words {' '.join(todo.main + todo.helper)}.")
    return evaluate(workdir, None, task["evaluator"]["kwargs"]["words"])["reward"], agent


def run_episodes(backend, n: int, tag: str, rng: random.Random, compact_at: int) -> list[tuple[float, Agent]]:
    """`n` episodes on fresh tasks (`<tag>-<k>`), each in its own temporary workspace."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for e in range(n):
            wd = Path(tmp) / f"{tag}-{e}"
            wd.mkdir()
            out.append(run_episode(backend, make_task(f"{tag}-{e}", rng), wd, compact_at))
    return out


def demo_sequences(pairs: list[tuple[str, str]]) -> list[tuple[str, list[tuple[int, int]]]]:
    """Merge (prompt, output) pairs into maximal conversations: a pair whose prompt+output is a
    prefix of another pair's prompt is covered by it. Returns (text, target char spans)."""
    full = [p + o for p, o in pairs]
    seqs: dict[str, list[tuple[int, int]]] = {}
    for i, f in enumerate(full):
        if not any(j != i and full[j].startswith(f) and len(full[j]) > len(f) for j in range(len(full))):
            seqs.setdefault(f, [])
    for p, o in pairs:
        for text, spans in seqs.items():
            if text.startswith(p + o) and (len(p), len(p) + len(o)) not in spans:
                spans.append((len(p), len(p) + len(o)))
    return [(t, sorted(s)) for t, s in seqs.items()]


def tokenize_with_mask(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    ids, mask, pos = [], [], 0
    for a, b in spans:
        for piece, target in ((text[pos:a], False), (text[a:b], True)):
            if piece:
                t = tokenizer(piece).input_ids
                ids += t
                mask += [target] * len(t)
        pos = b
    if pos < len(text):
        t = tokenizer(text[pos:]).input_ids
        ids += t
        mask += [False] * len(t)
    return ids, mask


def train(model, batches: list[tuple[list[int], list[bool]]], max_steps: int, lr: float, batch_size: int, seed: int,
          *, stop: Callable[[], bool] | None = None, check_every: int = 50) -> list[float]:
    """AdamW on the demonstrations (loss on assistant outputs only), lr constant after a 20-step
    warm-up. Ends after `max_steps`, or earlier once `stop()` (called every `check_every` steps)
    is true."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    losses = []
    model.train()
    for step in range(max_steps):
        batch = rng.sample(batches, min(batch_size, len(batches)))
        L = max(len(ids) for ids, _ in batch)
        inp = torch.zeros(len(batch), L, dtype=torch.long)
        att = torch.zeros(len(batch), L, dtype=torch.long)
        tgt = torch.full((len(batch), L), -100, dtype=torch.long)
        for r, (ids, mask) in enumerate(batch):
            inp[r, :len(ids)] = torch.tensor(ids)
            att[r, :len(ids)] = 1
            for k in range(1, len(ids)):
                if mask[k]:
                    tgt[r, k - 1] = ids[k]
        # Logits only where there is a target: the [T, V] projection of context positions is
        # most of a tiny model's cost.
        hidden = model.model(input_ids=inp, attention_mask=att).last_hidden_state
        sel = tgt != -100
        logits = model.lm_head(hidden[sel]).float()
        loss = torch.nn.functional.cross_entropy(logits, tgt[sel])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for g in opt.param_groups:  # constant after warm-up: a decaying lr stalls the word → number mapping
            g["lr"] = lr * min(1.0, (step + 1) / 20)
        opt.step()
        losses.append(loss.item())
        if (step + 1) % check_every == 0 or step == max_steps - 1:
            model.eval()
            done = stop is not None and stop()
            model.train()
            logger.info("warm start step %d/%d loss %.4f", step + 1, max_steps, losses[-1])
            if done:
                break
    model.eval()
    return losses


def warm_start(out: str, *, episodes: int = 120, steps: int = 1200, batch_size: int = 4, lr: float = 5e-3,
               learned: float = 0.9, blur_steps: int = 200, blur_lr: float = 1e-3, blurred: float = 0.35,
               correct_prob: float = 0.3, wrong: str = "off_by_one", compact_at: int = 650, preset: str = "tiny",
               seed: int = 0, eval_episodes: int = 4) -> dict[str, Any]:
    from examples.cpu_demo.learnability import value_accuracy
    from gyre.backends.models.hf import build_model, model_config, save_checkpoint
    from gyre.backends.models.tokenizer import load_tokenizer

    torch.manual_seed(seed)
    t0 = time.time()
    tok = load_tokenizer()
    rng = random.Random(seed)
    stats = {"calls": 0, "compactions": 0, "sub_agents": 0}

    def demonstrations(prob: float, tag: str) -> tuple[list, list[float], int, int]:
        backend = ScriptedBackend(tok, rng, prob, wrong)
        rewards = []
        for r, agent in run_episodes(backend, episodes, f"demo-{tag}", rng, compact_at):
            rewards.append(r)
            for k in stats:
                stats[k] += getattr(agent.stats, k)
        seqs = demo_sequences(backend.pairs)
        return [tokenize_with_mask(tok, text, spans) for text, spans in seqs], rewards, len(backend.pairs), len(seqs)

    data, demo_rewards, n_pairs, n_seqs = demonstrations(1.0, "x")
    blur = demonstrations(correct_prob, "b")[0] if blur_steps else []
    t_demo = time.time() - t0
    config = model_config(preset, vocab_size=len(tok), eos_token_id=tok.convert_tokens_to_ids(IM_END),
                          bos_token_id=None, pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    model = build_model(config, seed=seed)
    # Phase 1 on right answers builds the format and the word → number mapping (from noisy
    # demonstrations alone the tiny model learns only the marginal over digits); a short phase 2
    # on mostly off-by-one answers blurs the mapping: RL starts from a model that has the
    # features but guesses, which is where it learns fast (README: measured).
    losses = train(model, data, steps, lr, batch_size, seed, stop=lambda: value_accuracy(model, tok) >= learned)
    exact_accuracy, exact_steps = value_accuracy(model, tok), len(losses)
    if exact_accuracy < learned:
        logger.warning("warm start: value accuracy %.3f < %.2f after %d steps; RL starts without the mapping",
                       exact_accuracy, learned, steps)
    if blur_steps:
        losses += train(model, blur, blur_steps, blur_lr, batch_size, seed + 1,
                        stop=lambda: value_accuracy(model, tok) <= blurred, check_every=5)
    t_train = time.time() - t0 - t_demo
    save_checkpoint(model, out)
    acc = value_accuracy(model, tok)  # P(right number | a well-formed call), the part RL must learn
    # The warm-started model's own behaviour, through the same harness loop.
    eval_rng = random.Random(seed + 1)
    mb = ModelBackend(tok, model, seed=seed)
    rewards, valid, calls = [], 0, 0
    for r, agent in run_episodes(mb, eval_episodes, "eval", eval_rng, compact_at):
        rewards.append(r)
        calls += agent.stats.calls - agent.stats.compactions  # summaries are text, not tool calls
        valid += agent.stats.valid_calls
    report = {
        "checkpoint": out, "preset": preset, "episodes": episodes, "demo_calls": n_pairs,
        "demo_sequences": n_seqs, "exact_steps": exact_steps, "value_accuracy_before_blur": exact_accuracy,
        "blur_steps": len(losses) - exact_steps, "blur_lr": blur_lr, "demo_tokens": sum(len(i) for i, _ in data),
        "demo_targets": sum(sum(m) for _, m in data), "demo_reward": sum(demo_rewards) / len(demo_rewards),
        "demo_stats": stats, "correct_prob": correct_prob, "wrong": wrong, "steps": steps, "loss_first": losses[0],
        "loss_last": sum(losses[-10:]) / len(losses[-10:]), "seconds_demos": t_demo, "seconds_train": t_train,
        "model_reward": sum(rewards) / len(rewards), "model_rewards": rewards,
        "model_valid_call_fraction": valid / max(calls, 1), "model_value_accuracy": acc,
    }
    Path(out, "warm_start.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="supervised warm start of the cpu_demo model")
    p.add_argument("--out", default="runs/cpu_demo/warm_start")
    p.add_argument("--episodes", type=int, default=120)
    p.add_argument("--steps", type=int, default=1200, help="at most this many steps on right-answer demonstrations")
    p.add_argument("--blur-steps", type=int, default=200, help="then at most this many on mostly off-by-one ones")
    p.add_argument("--correct-prob", type=float, default=0.3)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    report = warm_start(a.out, episodes=a.episodes, steps=a.steps, blur_steps=a.blur_steps, correct_prob=a.correct_prob,
                        preset=a.preset, seed=a.seed)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
