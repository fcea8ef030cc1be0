"""Is the run producing anything to train on? (A run must never silently train on nothing.)

Every evaluated execution is either *useful* (it made model calls and has a valid reward or a
timeout's partial reward) or *failed*, for one of four reasons:

    crashed            the harness exited non-zero or died of a crash signal; one SIGKILLed /
                       SIGTERMed from outside (outcome `killed`) is not a failure by itself
    launch_failed      the harness never started (bad argv, workspace could not be prepared)
    evaluator_failed   no valid reward within the evaluator's attempts (excluded from its group)
    no_model_calls     the harness ended without one call through the proxy: no tokens to train

`HealthMonitor` keeps the last `window` evaluated executions (cancelled ones do not count) and
trips when at least `stop_fraction` of them failed. With the defaults (one step's N·B, fraction
1.0) a run stops as soon as a whole step's worth in a row gave nothing; the error quotes the first
failure's stderr tail and where its logs are, which is almost always the whole diagnosis.

An evaluator that never works is caught on its own, even while others score: when its first
`evaluator_window` evaluations all failed (a workspace refused for a link is the harness's doing
and does not count), the run stops, naming it and quoting its last error. One valid reward clears
it for the rest of the run (docs/train-your-own-agent.md, (f)).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre.executions.evaluator import Outcome, RewardStatus


@dataclass(frozen=True)
class Failure:
    execution_id: str
    reason: str  # crashed | launch_failed | evaluator_failed | no_model_calls
    detail: str  # exit status, launch error, evaluator error
    exec_dir: Path


def classify(result: Any, calls: int | None) -> Failure | None:
    """A Failure for an evaluated `ExecutionResult` that gives nothing to train on, else None.
    `calls`: model calls the proxy saw for it (None: unknown, not checked)."""
    eid, d = result.execution_id, Path(result.exec_dir)
    if result.outcome is Outcome.LAUNCH_FAILED:
        return Failure(eid, "launch_failed", result.error or "could not launch", d)
    if result.outcome is Outcome.CRASHED:
        code = result.exit_code
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
        return Failure(eid, "crashed", how, d)
    reward = result.reward
    if reward is not None and reward.status is RewardStatus.EXCLUDED and "excluded" in reward.detail:
        return Failure(eid, "no_model_calls", reward.detail["excluded"], d)  # the runner's own exclusion
    if reward is not None and reward.status is RewardStatus.EXCLUDED:
        errors = [a.error for a in reward.attempts if a.error]
        return Failure(eid, "evaluator_failed", errors[-1] if errors else "no valid reward", d)
    if calls == 0:
        return Failure(eid, "no_model_calls", f"{result.outcome.value} without calling the model", d)
    return None


def tail(path: Path, lines: int = 12, max_chars: int = 2000) -> str:
    """The last `lines` lines of a text file ('' when missing)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])[-max_chars:]


class HealthMonitor:
    def __init__(self, window: int, stop_fraction: float, evaluator_window: int = 0) -> None:
        """`evaluator_window`: stop when an evaluator's first this many evaluations all failed (0: never)."""
        if window < 1:
            raise ValueError(f"executions.health.window must be >= 1, got {window}")
        if not 0.0 < stop_fraction:
            raise ValueError(f"executions.health.stop_fraction must be > 0, got {stop_fraction}")
        if evaluator_window < 0:
            raise ValueError(f"executions.health.evaluator_window must be >= 0, got {evaluator_window}")
        self.window, self.stop_fraction, self.evaluator_window = window, stop_fraction, evaluator_window
        self.recent: deque[Failure | None] = deque(maxlen=window)
        self.counts: Counter[str] = Counter()  # failures by reason over the whole run
        self.evaluator_failures: Counter[str] = Counter()  # by evaluator, until its first valid reward
        self.evaluators_scored: set[str] = set()

    def observe(self, result: Any, calls: int | None) -> str | None:
        """Record one evaluated execution; the error message when the run should stop, else None."""
        if result.outcome is Outcome.CANCELLED:
            return None
        failure = classify(result, calls)
        if failure is not None:
            self.counts[failure.reason] += 1
        self.recent.append(failure)
        broken = self._evaluator_never_works(result, failure)
        if broken is not None:
            return broken
        failed = [f for f in self.recent if f is not None]
        if len(self.recent) < self.window or len(failed) < self.stop_fraction * self.window:
            return None
        return self.message(failed)

    def _evaluator_never_works(self, result: Any, failure: Failure | None) -> str | None:
        reward = result.reward
        name = getattr(reward, "evaluator", "")
        if not self.evaluator_window or not name or name in self.evaluators_scored:
            return None
        if reward.status is RewardStatus.VALID:
            self.evaluators_scored.add(name)
            self.evaluator_failures.pop(name, None)
            return None
        if failure is None or failure.reason != "evaluator_failed" or "refused" in reward.detail:
            return None
        self.evaluator_failures[name] += 1
        n = self.evaluator_failures[name]
        if n < self.evaluator_window:
            return None
        lines = [
            f"evaluator {name} failed on each of its first {n} evaluations and has never given a reward "
            f"(task {result.task_id}); stopping the run (executions.health.evaluator_window = "
            f"{self.evaluator_window}; 0 never stops for this).",
            f"Its last evaluation, execution {result.execution_id} ({Path(result.exec_dir) / 'result.json'}), "
            f"failed {len(reward.attempts)} attempt(s), the last with:",
        ]
        lines.extend("    " + line for line in failure.detail.strip().splitlines()[-12:])
        return "\n".join(lines)

    def message(self, failed: list[Failure]) -> str:
        by_reason = Counter(f.reason for f in failed)
        first = failed[0]
        lines = [
            f"{len(failed)} of the last {self.window} executions gave nothing to train on "
            f"({', '.join(f'{n} {r}' for r, n in sorted(by_reason.items()))}); stopping the run "
            f"(executions.health.stop_fraction = {self.stop_fraction:g} over executions.health.window = {self.window}).",
            f"First of them: execution {first.execution_id}, {first.reason}: {first.detail}.",
        ]
        for name in ("stderr.log", "stdout.log"):
            text = tail(first.exec_dir / name)
            if text:
                lines.append(f"Its {name} ({first.exec_dir / name}) ends with:")
                lines.extend("    " + line for line in text.splitlines())
                break
        else:
            lines.append(f"Its logs are in {first.exec_dir} (stderr.log and stdout.log are empty or missing).")
        return "\n".join(lines)
