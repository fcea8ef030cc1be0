"""Write the tool_agent dataset: a train split and a held-out split, deterministic in the seed.

    python examples/tool_agent/make_tasks.py --out runs/tool-agent
        -> runs/tool-agent/train.jsonl     (train on this)
           runs/tool-agent/heldout.jsonl   (never trained on: evaluate before/after on it)

Each task is a question about one item's price ("How much does a mango cost?"). The workspace holds
`prices.json`, the shop's price list (every item, prices drawn per task, so no price can be memorized);
the harness's `get_price` tool reads it, the prompt never contains it. The held-out split asks about
items that no train task asks about, so it measures the skill (look up, then report what the tool
said), not the items seen in training.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

ITEMS = ["apple", "banana", "cherry", "mango", "lemon", "orange", "peach", "grape", "melon", "pear",
         "plum", "kiwi", "carrot", "potato", "tomato", "onion", "pepper", "cabbage", "pumpkin", "garlic",
         "bread", "cheese", "butter", "honey", "coffee", "tea", "rice", "sugar", "candle", "soap",
         "towel", "pillow", "blanket", "lamp", "clock", "mirror", "basket", "bottle", "notebook", "pencil",
         "hammer", "ladder", "bucket", "umbrella", "wallet", "scarf", "jacket", "hat"]
QUESTIONS = ["How much does {a} {item} cost?", "What is the price of {a} {item}?",
             "I want to buy {a} {item}. How much is it?"]
PRICE_RANGE = (10, 99)  # whole dollars: two digits, so a guess is right about 1 time in 90
HELDOUT_ITEMS = 12


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def split_items(seed: int) -> tuple[list[str], list[str]]:
    """(train items, held-out items): a seeded partition of ITEMS."""
    items = sorted(ITEMS)
    random.Random(f"items-{seed}").shuffle(items)
    return sorted(items[HELDOUT_ITEMS:]), sorted(items[:HELDOUT_ITEMS])


def make_task(split: str, i: int, item: str, rng: random.Random) -> dict[str, Any]:
    prices = {it: rng.randint(*PRICE_RANGE) for it in ITEMS}
    question = rng.choice(QUESTIONS).format(a=article(item), item=item)
    return {
        "task_id": f"price-{split}-{i:04d}",
        "instruction": question,
        "files": {"prices.json": json.dumps(prices, indent=0) + "\n"},
        "evaluator": {"python": "examples.tool_agent.evaluate:evaluate", "kwargs": {"expected": prices[item]}},
        "timeout_s": 900,
        "metadata": {"split": split, "item": item, "price": prices[item]},
    }


def make_split(split: str, n: int, seed: int) -> list[dict[str, Any]]:
    train_items, heldout_items = split_items(seed)
    items = train_items if split == "train" else heldout_items
    rng = random.Random(f"{split}-{seed}")  # a string seed: the same on every platform and Python run
    return [make_task(split, i, items[i % len(items)] if i < len(items) else rng.choice(items), rng)
            for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/tool-agent", help="directory for train.jsonl and heldout.jsonl")
    p.add_argument("--train", type=int, default=256, help="number of train tasks")
    p.add_argument("--heldout", type=int, default=64, help="number of held-out tasks")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", a.train), ("heldout", a.heldout)):
        with (out / f"{split}.jsonl").open("w") as f:
            for task in make_split(split, n, a.seed):
                f.write(json.dumps(task) + "\n")
        print(f"wrote {n} {split} tasks to {out / f'{split}.jsonl'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
