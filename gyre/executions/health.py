"""Is the run producing anything to train on? (A run must never silently train on nothing.)

Every evaluated execution is either *useful* (it made model calls and has a valid reward or a
timeout's partial reward) or *failed*, for one of four reasons:

    crashed            the harness exited non-zero or died of a crash signal (SIGSEGV, ...); a
                       harness SIGKILLed / SIGTERMed from outside (outcome `killed`) is not a
                       failure by itself: its workspace is evaluated
    launch_failed      the harness never started (bad argv, workspace could not be prepared)
    evaluator_failed   no valid reward within the evaluator's attempt budget (the execution
                       is excluded from its group)
    no_model_calls     the harness ended without one call through the proxy: no tokens to train
                       (one killed from outside before its first call is also excluded from its
                       group by the runner: a reward with no trajectory is no sample)

`HealthMonitor` keeps the last `window` evaluated executions (cancelled ones are not counted:
the controller stopped them) and trips when at least `stop_fraction` of them failed. With the
defaults (window = one step's N·B executions, fraction 1.0) a run stops as soon as a whole
step's worth of executions in a row gave nothing; the error quotes the first failure's stderr
tail and where its logs are, which is almost always the whole diagnosis (a missing module, a
wrong harness path, an unreachable proxy).
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
    def __init__(self, window: int, stop_fraction: float) -> None:
        if window < 1:
            raise ValueError(f"executions.health.window must be >= 1, got {window}")
        if not 0.0 < stop_fraction:
            raise ValueError(f"executions.health.stop_fraction must be > 0, got {stop_fraction}")
        self.window, self.stop_fraction = window, stop_fraction
        self.recent: deque[Failure | None] = deque(maxlen=window)
        self.counts: Counter[str] = Counter()  # failures by reason over the whole run

    def observe(self, result: Any, calls: int | None) -> str | None:
        """Record one evaluated execution; the error message when the run should stop, else None."""
        if result.outcome is Outcome.CANCELLED:
            return None
        failure = classify(result, calls)
        if failure is not None:
            self.counts[failure.reason] += 1
        self.recent.append(failure)
        failed = [f for f in self.recent if f is not None]
        if len(self.recent) < self.window or len(failed) < self.stop_fraction * self.window:
            return None
        return self.message(failed)

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
