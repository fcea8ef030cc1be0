"""Evaluator: score an ended execution's preserved workspace (docs/design.md §5).

Runs after an execution ends for any reason. Outcomes and what they get:

    COMPLETED, TIMED_OUT, CANCELLED,
    KILLED                           → evaluate the workspace (partial progress counts)
    CRASHED                          → zero-reward placeholder (`on_crash="placeholder"`, the
                                       default) or evaluate (`on_crash="evaluate"`)
    LAUNCH_FAILED                    → zero-reward placeholder

An evaluation is up to `max_attempts` attempts, each under `timeout_s`, with doubling back-off.
An attempt fails when the evaluator raises, exits non-zero, hangs (it is killed), or returns
anything but a finite number in [0, 1]. The first valid attempt gives a VALID reward; none ⇒
EXCLUDED (the execution leaves its group's statistics). A placeholder is a valid 0.0 with no
trajectory behind it.

Evaluator forms (`gyre.executions.tasks.EvaluatorSpec`; docs/train-your-own-agent.md): a
"module:function" called as function(workspace, task, **kwargs) in a child Python process (a hang
is killed cleanly); a Python callable, in a worker thread, unsandboxed; a command run in the
workspace whose last non-empty stdout line is the reward (a number or `{"reward": x, ...}`; env
GYRE_WORKSPACE, GYRE_TASK_FILE). Commands and children run in the harnesses' sandbox
(`gyre.executions.eval_sandbox`); a workspace replaced by a symbolic link is never scored
(`detail["refused"]` says why, checked before every attempt).
"""

from __future__ import annotations

import asyncio
import enum
import importlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.executions import eval_sandbox, scratch
from gyre.executions.config import EvaluatorConfig, RunnerConfig
from gyre.executions.procs import kill_tree
from gyre.executions.sandbox import die_with_runner
from gyre.executions.tasks import EvaluatorSpec, Task

logger = logging.getLogger(__name__)

_REWARD_TAG = "GYRE_REWARD "


class Outcome(enum.Enum):
    """How a harness process ended."""

    COMPLETED = "completed"  # exited with status 0
    TIMED_OUT = "timed_out"  # killed by the runner's wall-clock limit
    CRASHED = "crashed"  # non-zero exit, or a crash signal (SIGSEGV, SIGABRT, ...)
    KILLED = "killed"  # SIGKILL / SIGTERM from outside the runner (OOM killer, an operator): not the
    # harness's failure, so never a zero placeholder in its group; its workspace is evaluated as after a timeout
    LAUNCH_FAILED = "launch_failed"  # never started (bad argv, workspace could not be prepared)
    CANCELLED = "cancelled"  # stopped by the controller (shutdown)


class RewardStatus(enum.Enum):
    VALID = "valid"  # the evaluator produced a reward
    EXCLUDED = "excluded"  # no valid reward within the attempt budget: leave the group's statistics
    PLACEHOLDER = "placeholder"  # harness failed outright: reward 0.0, no trajectory to train on


@dataclass
class Attempt:
    ok: bool
    seconds: float
    reward: float | None = None
    error: str = ""


@dataclass
class RewardResult:
    execution_id: str
    status: RewardStatus
    reward: float | None  # None iff EXCLUDED
    attempts: list[Attempt] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)
    evaluator: str = ""  # which evaluator ran (`evaluator_name`); "" when none did

    def to_json(self) -> dict[str, Any]:
        return {
            "execution_id": self.execution_id,
            "status": self.status.value,
            "reward": self.reward,
            "attempts": [a.__dict__ for a in self.attempts],
            "detail": self.detail,
            "evaluator": self.evaluator,
        }


def evaluator_name(spec: EvaluatorSpec) -> str:
    """How an evaluator is named in messages: "module:function", a callable's name, or the command."""
    if spec.kind == "command":
        return " ".join(spec.target)[:300]
    return spec.target if isinstance(spec.target, str) else getattr(spec.target, "__qualname__", repr(spec.target))


def parse_reward(value: Any) -> tuple[float, dict[str, Any]]:
    """Validate an evaluator's return value: a number in [0, 1] or a dict with key "reward".
    Raises ValueError naming what is wrong."""
    detail: dict[str, Any] = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"evaluator returned a dict without 'reward': keys {sorted(value)}")
        detail = {k: v for k, v in value.items() if k != "reward"}
        value = value["reward"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"evaluator reward must be a number, got {type(value).__name__} {value!r}")
    r = float(value)
    if not math.isfinite(r) or not 0.0 <= r <= 1.0:
        raise ValueError(f"evaluator reward must be a finite number in [0, 1], got {r}")
    return r, detail


def parse_reward_line(stdout: str) -> tuple[float, dict[str, Any]]:
    """Reward from a command's stdout: the last line tagged `GYRE_REWARD ` if any, else the last
    non-empty line; a bare number or JSON."""
    lines = [ln.strip() for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        raise ValueError("evaluator printed nothing on stdout")
    tagged = [ln[len(_REWARD_TAG):] for ln in lines if ln.startswith(_REWARD_TAG)]
    text = tagged[-1] if tagged else lines[-1]
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"evaluator's last stdout line is not a number or JSON: {text[:200]!r}") from None
    return parse_reward(value)


class Evaluator:
    """Scores executions with retries and a timeout per attempt. Async; bounded concurrency."""

    def __init__(self, cfg: EvaluatorConfig, runner: RunnerConfig | None = None) -> None:
        """`runner`: the harnesses' configuration, whose sandbox `cfg.sandbox inherit` means
        (None: its defaults, `auto`)."""
        if cfg.max_attempts < 1:
            raise ValueError(f"evaluator.max_attempts must be >= 1, got {cfg.max_attempts}")
        if not cfg.timeout_s > 0:
            raise ValueError(f"evaluator.timeout_s must be > 0, got {cfg.timeout_s}")
        self.cfg = cfg
        self.runner = runner if runner is not None else RunnerConfig()
        self.sandbox = eval_sandbox.resolve(cfg, self.runner)
        eval_sandbox.announce(self.sandbox, cfg, self.runner)
        self._sem: asyncio.Semaphore | None = None
        self._warned_in_process = False

    async def evaluate(self, execution_id: str, task: Task, workspace: Path, outcome: Outcome) -> RewardResult:
        if outcome is Outcome.LAUNCH_FAILED or (outcome is Outcome.CRASHED and self.cfg.on_crash == "placeholder"):
            logger.info("execution %s %s: zero-reward placeholder", execution_id, outcome.value)
            return RewardResult(execution_id, RewardStatus.PLACEHOLDER, 0.0, detail={"outcome": outcome.value})
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.cfg.concurrency)
        attempts: list[Attempt] = []
        name = evaluator_name(task.evaluator)
        backoff = self.cfg.retry_backoff_s
        for k in range(self.cfg.max_attempts):
            if k:
                await asyncio.sleep(backoff)
                backoff *= 2
            t0 = time.monotonic()
            refused = eval_sandbox.workspace_refusal(workspace)  # before each attempt: an attempt runs workspace code
            if refused is not None:
                logger.warning("execution %s: workspace not evaluated: %s", execution_id, refused)
                attempts.append(Attempt(ok=False, seconds=0.0, error=f"workspace refused: {refused}"))
                return RewardResult(execution_id, RewardStatus.EXCLUDED, None, attempts,
                                    {"outcome": outcome.value, "refused": refused}, name)
            try:
                async with self._sem:
                    reward, detail = await self._attempt(task.evaluator, task, workspace)
            except Exception as e:  # noqa: BLE001 - any evaluator failure is an attempt failure
                attempts.append(Attempt(ok=False, seconds=time.monotonic() - t0, error=f"{type(e).__name__}: {e}"[:2000]))
                logger.warning("execution %s: evaluator attempt %d/%d failed: %s", execution_id, k + 1, self.cfg.max_attempts, attempts[-1].error)
                continue
            attempts.append(Attempt(ok=True, seconds=time.monotonic() - t0, reward=reward))
            detail["outcome"] = outcome.value
            return RewardResult(execution_id, RewardStatus.VALID, reward, attempts, detail, name)
        logger.warning("execution %s: no valid reward after %d attempts: excluded", execution_id, len(attempts))
        return RewardResult(execution_id, RewardStatus.EXCLUDED, None, attempts, {"outcome": outcome.value}, name)

    async def _attempt(self, spec: EvaluatorSpec, task: Task, workspace: Path) -> tuple[float, dict[str, Any]]:
        timeout = self.cfg.timeout_s
        if spec.kind == "python" and callable(spec.target):
            if not self._warned_in_process:
                self._warned_in_process = True
                logger.warning("evaluator %s runs in this process, not sandboxed: it must not execute workspace code",
                               getattr(spec.target, "__qualname__", spec.target))
            try:
                value = await asyncio.wait_for(asyncio.to_thread(spec.target, workspace, task, **spec.kwargs), timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"in-process evaluator exceeded {timeout}s (thread abandoned)") from None
            return parse_reward(value)
        workspace = Path(os.path.abspath(workspace))  # bound at this path in a sandbox
        with scratch.temporary_directory("gyre-eval-") as tmp:
            task_file = Path(tmp) / "task.json"
            task_file.write_text(json.dumps(task.to_json()))
            argv, cwd, env = eval_sandbox.launch(self.sandbox, self.cfg, self.runner, spec, workspace=workspace,
                                                 task_file=task_file, scratch_dir=tmp)
            name = spec.target[0] if spec.kind == "command" else spec.target
            stdout, stderr, rc = await run_with_timeout(argv, cwd=cwd, env=env, timeout_s=timeout, name=name)
        if rc != 0:
            raise RuntimeError(f"evaluator exited with status {rc}: {stderr.strip()[-1000:]}")
        return parse_reward_line(stdout)


async def run_with_timeout(argv: list[str], *, cwd: str, env: dict[str, str], timeout_s: float,
                           name: str = "") -> tuple[str, str, int]:
    """Run argv in its own session; kill the whole tree on timeout (raises TimeoutError naming
    `name`, default argv[0])."""
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
        preexec_fn=die_with_runner(),  # killed with the rank, however it ends
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        await kill_tree(proc.pid, grace_s=0.5, proc=proc)
        raise TimeoutError(f"evaluator {name or argv[0]} exceeded {timeout_s}s and was killed") from None
    except asyncio.CancelledError:
        await kill_tree(proc.pid, grace_s=0.5, proc=proc)
        raise
    return out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), proc.returncode


def expected_files(workspace: Path, task: Task, files: dict[str, str], strip: bool = True) -> dict[str, Any]:
    """Built-in partial-progress evaluator: the fraction of `files` (relative path → expected
    content) present in the workspace with that content (whitespace-trimmed when `strip`)."""
    if not files:
        raise ValueError("expected_files needs at least one file")
    correct = []
    for rel, want in files.items():
        try:  # no link followed: a link to another workspace's answer is not this one's answer
            got = eval_sandbox.read_beneath(workspace, rel).decode()
        except (OSError, ValueError):  # missing, a link, not a regular file, too large, not UTF-8
            continue
        if (got.strip() == want.strip()) if strip else (got == want):
            correct.append(rel)
    return {"reward": len(correct) / len(files), "correct": sorted(correct), "total": len(files)}


def _worker_main(argv: list[str]) -> int:
    """Child-process entry: `python -m gyre.executions.evaluator WORKSPACE TASK_JSON`."""
    if len(argv) != 2:
        print("usage: python -m gyre.executions.evaluator WORKSPACE TASK_JSON", file=sys.stderr)
        return 2
    workspace, task_file = Path(argv[0]), Path(argv[1])
    task = Task.from_json(json.loads(task_file.read_text()))
    module_name, _, func_name = task.evaluator.target.partition(":")
    fn = getattr(importlib.import_module(module_name), func_name)
    value = fn(workspace, task, **task.evaluator.kwargs)
    reward, detail = parse_reward(value)
    print(_REWARD_TAG + json.dumps({"reward": reward, **detail}, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
