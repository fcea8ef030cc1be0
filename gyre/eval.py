"""`python -m gyre.eval`: a checkpoint's pass rate on a task split, through the same harness,
proxy and engine a training run uses, with a 95 % interval.

    python -m gyre.eval --preset smollm2 --split heldout                       # the base model
    python -m gyre.eval --preset smollm2 --split heldout --checkpoint runs/smollm2/latest
    python -m gyre.eval --model.checkpoint DIR --executions.dataset.path tasks.jsonl --samples 4

Every gyre.run flag is accepted (model, tasks, harness, formats); the eval's own flags:

    --checkpoint PATH   what to evaluate: an HF directory, a step checkpoint
                        (RUN/checkpoints/step_000032), or a run directory (its newest complete
                        checkpoint). Default: --model.checkpoint, the base model.
    --split NAME        only the tasks whose `metadata.split` is NAME (default: every task); when
                        the dataset has none, the tasks of NAME.jsonl beside it
    --samples K         executions per task (default 1)
    --max-tasks N       the first N tasks of the split (default: all)
    --pass-at R         an execution passes when its reward >= R (default 1.0)
    --out FILE          the results file (default: beside the run, RUN/eval/<split>-<name>.json,
                        or runs/eval/ for a bare checkpoint)

One process serves the checkpoint with the built-in engine behind a real proxy; the runner and
the evaluator work exactly as in training. Nothing is trained, no TITO is kept. The results file
holds every reward and the pass rate with its Wilson interval (`python -m gyre.report RUN` shows
a run's evaluations); the last line printed is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- statistics (pure)
def wilson(passed: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95 % by default).

    >>> [round(x, 4) for x in wilson(6, 32)]
    [0.0889, 0.3531]
    """
    if n <= 0:
        return (0.0, 1.0)
    if passed == 0 or passed == n:  # one end is the proportion itself, exactly (no rounding past it)
        low, high = wilson_inner(passed, n, z)
        return (0.0, high) if passed == 0 else (low, 1.0)
    return wilson_inner(passed, n, z)


def wilson_inner(passed: int, n: int, z: float) -> tuple[float, float]:
    p = passed / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def difference_interval(k1: int, n1: int, k2: int, n2: int, z: float = 1.959964) -> tuple[float, float, float]:
    """(p2 − p1, low, high): Newcombe's hybrid score interval for the difference of two independent
    proportions (Newcombe 1998, method 10), from each one's Wilson interval.

    >>> [round(x, 4) for x in difference_interval(6, 32, 26, 32)]
    [0.625, 0.3908, 0.7644]
    """
    p1, p2 = k1 / n1, k2 / n2
    l1, u1 = wilson(k1, n1, z)
    l2, u2 = wilson(k2, n2, z)
    d = p2 - p1
    low = d - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2)
    high = d + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2)
    return d, low, high


def summarize(rewards: list[float | None], pass_at: float) -> dict[str, Any]:
    """Pass rate and mean reward of executions (None: no valid reward, counted as a fail)."""
    n = len(rewards)
    passed = sum(1 for r in rewards if r is not None and r >= pass_at)
    valid = [r for r in rewards if r is not None]
    low, high = wilson(passed, n)
    return {"executions": n, "passed": passed, "pass_rate": passed / n if n else 0.0, "pass_ci95_low": low,
            "pass_ci95_high": high, "mean_reward": sum(valid) / len(valid) if valid else None,
            "no_reward": n - len(valid), "pass_at": pass_at}


# ----------------------------------------------------------------------------- what to evaluate
def resolve_checkpoint(path: str) -> tuple[Path, Path | None]:
    """(the HF-loadable directory, the run directory it belongs to or None) of `--checkpoint`: an
    HF directory, a step checkpoint inside RUN/checkpoints/, or a run directory (its newest
    complete checkpoint)."""
    from gyre import checkpoint

    p = Path(path)
    if (p / "checkpoints").is_dir():
        return checkpoint.newest_complete(p / "checkpoints").path, p.resolve()
    if not (p / "config.json").is_file():
        raise SystemExit(f"gyre.eval: --checkpoint {path}: no config.json there, and no checkpoints/ of a run")
    run = p.resolve().parent.parent if p.resolve().parent.name == "checkpoints" else None
    return p, run


def split_file(dataset: str, split: str | None) -> str:
    """Where the tasks of `split` are: the dataset itself, or, when none of its tasks is of that
    split and `<split>.jsonl` lies beside it, that file (a preset's dataset is its train split:
    `--preset smollm2 --split heldout` reads runs/smollm2/data/heldout.jsonl)."""
    from gyre.executions.tasks import Dataset

    if split is None or any(t.metadata.get("split") == split for t in Dataset.from_jsonl(dataset).tasks):
        return dataset
    beside = Path(dataset).with_name(f"{split}.jsonl")
    return str(beside) if beside.is_file() else dataset


def select_tasks(tasks: list[Any], split: str | None, max_tasks: int | None) -> list[Any]:
    """The tasks of `split` (their `metadata["split"]`), in file order, at most `max_tasks`."""
    chosen = [t for t in tasks if split is None or t.metadata.get("split") == split]
    if not chosen:
        splits = sorted({str(t.metadata.get("split")) for t in tasks})
        raise SystemExit(f"gyre.eval: no task has metadata.split == {split!r}; the file has splits {splits}")
    return chosen[:max_tasks] if max_tasks else chosen


# ----------------------------------------------------------------------------- the run
def evaluate(cfg: Any, ckpt: Path, tasks: list[Any], samples: int, work_dir: Path) -> list[dict[str, Any]]:
    """Serve `ckpt` with the built-in engine behind a real proxy and run every task `samples`
    times through the harness and the evaluator; returns one row per execution."""
    import dataclasses

    from gyre.backends import factory
    from gyre.backends.models.hf import dtype_of, load_model
    from gyre.backends.models.vocab import load_vocab
    from gyre.executions.evaluator import Evaluator
    from gyre.executions.runner import HarnessRunner
    from gyre.executions.tasks import ExecutionSpec
    from gyre.proxy import MemorySink, Proxy, serve_proxy
    from gyre.runtime.job import _chat_format_stop_ids
    from gyre.runtime.proxy_access import GyreProxyAccess

    factory.set_threads(cfg.train.torch_threads)
    vocab = load_vocab(cfg.model.checkpoint or str(ckpt), cfg.proxy.tokenizer_path)  # the base model's tokenizer
    model = load_model(str(ckpt), dtype=dtype_of(cfg.model.dtype))
    stop_ids = sorted(set(vocab.stop_ids) | _chat_format_stop_ids(cfg.proxy, vocab.tokenizer, model.config))
    params = {name: p.detach() for name, p in model.named_parameters()}
    engine = factory.build_engine(cfg.model, cfg.engine, cfg.backend, model.config, params, version=0,
                                  eos_token_ids=stop_ids, sampleable_vocab=vocab.size, name="eval", transfer=cfg.transfer)
    proxy = Proxy(cfg.proxy, sink=MemorySink(), tokenizer=vocab.tokenizer, stop_ids=vocab.stop_ids)
    proxy.router.add_engine(engine, kind="cell", index=0)
    handle = serve_proxy(proxy)
    try:
        handle.call(engine.start())
        runner_cfg = dataclasses.replace(cfg.executions.runner, run_dir=str(work_dir))
        runner = HarnessRunner(runner_cfg, Evaluator(cfg.executions.evaluator, runner_cfg),
                               proxy=GyreProxyAccess(proxy, handle.url))
        specs = [ExecutionSpec(f"eval-{i}-{s}", t, f"eval-{i}", s) for i, t in enumerate(tasks) for s in range(samples)]
        done: list[dict[str, Any]] = []
        t0 = time.monotonic()

        async def one(spec):
            result = await runner.dispatch(spec)
            reward = result.reward.reward if result.reward is not None else None
            done.append({"task_id": spec.task.task_id, "sample": spec.index, "outcome": result.outcome.value,
                         "reward": reward})
            if len(done) % max(1, len(specs) // 10) == 0 or len(done) == len(specs):
                passed = sum(1 for d in done if d["reward"] is not None and d["reward"] >= 1.0)
                logger.info("eval: %d/%d executions, %d with reward 1 (%.0fs)", len(done), len(specs), passed,
                            time.monotonic() - t0)

        async def main():
            await asyncio.gather(*(one(s) for s in specs))

        asyncio.run(main())
    finally:
        handle.call(engine.stop()) if hasattr(engine, "stop") else None
        handle.stop()
    order = {(s.task.task_id, s.index): k for k, s in enumerate(specs)}
    return sorted(done, key=lambda d: order[(d["task_id"], d["sample"])])


def default_out(run: Path | None, split: str | None, ckpt: Path) -> Path:
    name = ckpt.name if ckpt.name.startswith("step_") else "base" if run is None else ckpt.name
    where = (run / "eval") if run is not None else Path("runs") / "eval"
    return where / f"{split or 'all'}-{name}.json"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from gyre.config import parse_config
    from gyre.logging_utils import setup_logging

    own = argparse.ArgumentParser(prog="python -m gyre.eval", add_help=False, allow_abbrev=False)
    own.add_argument("--checkpoint", default="")
    own.add_argument("--split", default=None)
    own.add_argument("--samples", type=int, default=1)
    own.add_argument("--max-tasks", type=int, default=None)
    own.add_argument("--pass-at", type=float, default=1.0)
    own.add_argument("--out", default="")
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    args, rest = own.parse_known_args(argv)
    if args.samples < 1:
        raise SystemExit("gyre.eval: --samples must be >= 1")
    cfg = parse_config(rest)
    setup_logging(cfg.log_level)
    if cfg.train.prepare and cfg.model.checkpoint and not Path(cfg.model.checkpoint).exists():
        from gyre.runtime.job import _prepare

        _prepare(cfg)  # the preset's data (the base checkpoint, the tasks), as gyre.run's rank 0 writes it
    ckpt, run = resolve_checkpoint(args.checkpoint or cfg.model.checkpoint or "")
    from gyre.executions.tasks import Dataset

    path = split_file(cfg.executions.dataset.path, args.split)
    if path != cfg.executions.dataset.path:
        logger.info("eval: %s has no task of split %s; reading %s", cfg.executions.dataset.path, args.split, path)
    tasks = select_tasks(Dataset.from_jsonl(path).tasks, args.split, args.max_tasks)
    out = Path(args.out) if args.out else default_out(run, args.split, ckpt)
    out.parent.mkdir(parents=True, exist_ok=True)
    logger.info("eval: %s on %d tasks (split %s) x %d samples -> %s", ckpt, len(tasks), args.split or "all",
                args.samples, out)
    import tempfile

    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="gyre-eval-", dir=out.parent) as work:
        rows = evaluate(cfg, ckpt, tasks, args.samples, Path(work))
    figures = {"checkpoint": str(ckpt), "split": args.split, "tasks": len(tasks), "samples": args.samples,
               **summarize([r["reward"] for r in rows], args.pass_at), "wall_s": round(time.time() - t0, 1)}
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({**figures, "executions_detail": rows}, indent=1))
    tmp.replace(out)
    print(f"pass rate {figures['pass_rate']:.3f} ({figures['passed']}/{figures['executions']}), 95% interval "
          f"[{figures['pass_ci95_low']:.3f}, {figures['pass_ci95_high']:.3f}]; results: {out}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
