"""Is the cpu_demo's reward learnable from reward alone by the warm-started model? A cheap check.

The only thing the warm start leaves to RL is the number written for each word. This script
measures, for every word, the model's probability of writing the right number at the exact
position where the harness's `write_next` argument is sampled (`value_accuracy`: the expected
per-file reward of a well-formed call), then runs a few REINFORCE steps on that single token
with group-relative advantages (reward 1 if right) and measures it again. It is a diagnostic
of the task design, not the training path: the real run trains through the proxy, the
trajectory trees and the GSPO loss.

    python -m examples.cpu_demo.learnability --checkpoint runs/cpu_demo/warm_start
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from examples.cpu_demo.harness import SYSTEM_MAIN, TOOLS_MAIN
from examples.cpu_demo.task import WORDS, answer

DIGITS = [str(d) for d in range(10)]


def value_prompts(tokenizer, words: list[str] = WORDS) -> list[list[int]]:
    """Token ids of a main-agent prompt that asks for `word`, followed by the tool-call text up
    to the opening quote of the content argument, one per word."""
    prefix = '<tool_call>\n{"name": "write_next", "arguments": {"content": "'
    out = []
    for w in words:
        msgs = [{"role": "system", "content": SYSTEM_MAIN},
                {"role": "user", "content": f"Task: words {w} red blue green pink teal.\nnext: {w}.txt | helper: pink teal"}]
        text = tokenizer.apply_chat_template(msgs, tools=TOOLS_MAIN, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text).input_ids + tokenizer(prefix).input_ids)
    return out


def digit_ids(tokenizer) -> list[int]:
    ids = [tokenizer.convert_tokens_to_ids(d) for d in DIGITS]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise RuntimeError("tokenizer has no single-token digits")
    return ids


def _last_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    L = max(len(p) for p in prompts)
    inp = torch.zeros(len(prompts), L, dtype=torch.long)
    att = torch.zeros(len(prompts), L, dtype=torch.long)
    for r, p in enumerate(prompts):  # left-pad so the last position is the sampling position
        inp[r, L - len(p):] = torch.tensor(p)
        att[r, L - len(p):] = 1
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    hidden = model.model(input_ids=inp, attention_mask=att, position_ids=pos).last_hidden_state[:, -1]
    return model.lm_head(hidden).float()  # [W, V]


@torch.no_grad()
def value_accuracy(model, tokenizer, words: list[str] = WORDS) -> float:
    """Mean over words of P(first content token = the right number)."""
    ids = digit_ids(tokenizer)
    probs = torch.softmax(_last_logits(model, value_prompts(tokenizer, words)), -1)
    return float(sum(probs[k, ids[int(answer(w))]] for k, w in enumerate(words)) / len(words))


def reinforce(model, tokenizer, *, steps: int = 30, group: int = 8, lr: float = 1e-3, seed: int = 0) -> list[float]:
    """REINFORCE on the value token, G samples per word, advantage = r − mean_group(r)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = value_prompts(tokenizer)
    ids = digit_ids(tokenizer)
    right = torch.tensor([ids[int(answer(w))] for w in WORDS])
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    curve = [value_accuracy(model, tokenizer)]
    for _ in range(steps):
        logp = torch.log_softmax(_last_logits(model, prompts), -1)  # [W, V]
        samples = torch.multinomial(logp.detach().exp(), group, replacement=True, generator=gen)  # [W, G]
        reward = (samples == right[:, None]).float()
        adv = reward - reward.mean(1, keepdim=True)
        loss = -(adv * logp.gather(1, samples)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        curve.append(value_accuracy(model, tokenizer))
    return curve


def main(argv: list[str] | None = None) -> int:
    from gyre.backends.models.hf import load_model
    from gyre.backends.models.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args(argv)
    tok = load_tokenizer()
    model = load_model(a.checkpoint)
    curve = reinforce(model, tok, steps=a.steps)
    print(json.dumps({"value_accuracy_before": curve[0], "value_accuracy_after": curve[-1], "curve": curve}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
