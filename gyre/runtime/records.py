"""What a run writes, in one owner (`RunRecords`): the groups journal, metrics.jsonl, the trackers
and the end files (summary.json, events.jsonl, the role timeline, run.json's `ended` record).
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from gyre.runtime.ledger import GroupPhase
from gyre.runtime.outputs import MetricsWriter, append_events, plot_role_timeline, train_fractions, write_json
from gyre.runtime.attempts import JOURNAL, GroupJournal, end_attempt
from gyre.runtime.rundir import RunDir
from gyre.runtime.summary import RunEnd
from gyre.runtime.writes import Guarded

logger = logging.getLogger(__name__)


class Phases:
    """Runs a sequence of parts best-effort: one that raises is logged once, with what it was,
    named in `failed`, and the next runs."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def run(self, name: str, fn: Callable[[], Any], default: Any = None) -> Any:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - the rest must still happen
            self._log(name, e)
            return default

    async def arun(self, name: str, fn: Callable[[], Awaitable[Any]]) -> None:
        try:
            await fn()
        except Exception as e:  # noqa: BLE001
            self._log(name, e)

    def _log(self, name: str, e: BaseException) -> None:
        from gyre.runtime.writes import describe

        self.failed.append(name)
        if isinstance(e, OSError):
            logger.error("stop: %s", describe(e, name))
        else:
            logger.error("stop: %s failed: %s: %s", name, type(e).__name__, e, exc_info=e)


class RunRecords:
    """This attempt's records (`run`): `step(row)` once a step, `finish` at the end, `close` last;
    the trackers are closed by the controller's thread on every path. `ledger`: the timeline and
    the groups not trained; `events`: the scheduler's log; `summarize(how, fractions)`: summary.json;
    `on_error(exc, what, path)`: a failed write (`gyre.runtime.writes`); `fresh`: a new metrics.jsonl."""

    def __init__(self, run: RunDir, *, ledger: Any, events: Any, summarize: Callable[[RunEnd, dict], dict],
                 trackers: Any, on_error: Callable[..., None], fresh: bool, title: str = "Gyre role timeline") -> None:
        self.run, self.path, self.attempt = run, run.path, run.attempt
        self.ledger, self.events, self.summarize, self.trackers, self.title = ledger, events, summarize, trackers, title
        self.steps = run.start_version  # optimizer steps done over the whole run (a resume counts on)
        self.path.mkdir(parents=True, exist_ok=True)
        self.journal = Guarded(GroupJournal(self.path, self.attempt), JOURNAL, self.path / JOURNAL, on_error)
        if fresh:
            (self.path / "metrics.jsonl").unlink(missing_ok=True)
        self.metrics = Guarded(MetricsWriter(str(self.path / "metrics.jsonl")), "metrics.jsonl",
                               self.path / "metrics.jsonl", on_error)

    def step(self, row: dict[str, Any]) -> None:
        """A step's metrics row: metrics.jsonl, then the trackers' copy."""
        self.metrics.write(row)
        self.trackers.log(row, row["step"])
        self.steps += 1

    def finish(self, how: RunEnd, phases: Phases) -> dict[str, Any]:
        """The end files, each on its own; returns the summary. A clean end closes the groups not
        trained (a resume does not count them lost); the plot (slow) comes after the records."""
        if how.error is None:
            phases.run("groups.jsonl (closed groups)", lambda: self.journal.closed(
                [r.group_id for r in self.ledger.groups.values() if r.phase is not GroupPhase.CONSUMED]))
        intervals = phases.run("the timeline", lambda: self.ledger.intervals(how.end), default={})
        fractions = phases.run("the training fractions", lambda: train_fractions(intervals), default={})
        summary = phases.run("the summary", lambda: self.summarize(how, fractions), default={})
        try:  # this attempt's record in run.json; the run's totals over every attempt so far
            summary["run"] = end_attempt(self.path, self.attempt, summary)
        except (OSError, ValueError, LookupError) as e:
            logger.warning("run.json: this attempt's end not recorded (%s); summary.json has no run totals", e)
        phases.run("summary.json", lambda: write_json(self.path / "summary.json", summary))
        # The scheduler's event log: replayable by `python -m gyre.sim --durations.source run-dir`.
        phases.run("events.jsonl", lambda: append_events(self.events, str(self.path / "events.jsonl"),
                                                         attempt=self.attempt, start_version=self.run.start_version))
        png = str(self.path / "role_timeline.png")
        phases.run("role_timeline.png", lambda: plot_role_timeline(intervals, png, title=self.title))
        phases.run("the trackers' timeline", lambda: (
            self.trackers.log({"train_fraction": {str(c): f for c, f in fractions.items()}}, how.steps),
            self.trackers.image("role_timeline", png, how.steps)))
        return summary

    def close(self, phases: Phases) -> None:
        """metrics.jsonl, then the journal: nothing writes after it."""
        phases.run("metrics.jsonl (close)", self.metrics.close)
        phases.run("groups.jsonl (close)", self.journal.close)
