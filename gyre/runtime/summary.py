"""What a run reports: one `metrics.jsonl` row per optimizer step (`step_row`) and the attempt's
`summary.json` (`build_summary`), built from the ledger (`gyre.runtime.ledger`) and the sources
their signatures name: the scheduler's counters, the router's reroutes, the proxy's totals, the
health monitor, the run directory, the end (`RunEnd`). Pure: the caller reads the sources and
writes the result (`gyre.runtime.records`). Also the log's lines for a person: `Progress` and
`end_lines`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from gyre.runtime.ledger import RunLedger
from gyre.runtime.outputs import reroute_fields, reward_trend
from gyre.scheduler import SchedulerConfig

logger = logging.getLogger(__name__)

__all__ = ["Progress", "RunEnd", "build_summary", "clock", "end_lines", "step_row", "trend_line"]


def step_row(ledger: RunLedger, step: int, now: float, *, step_time_s: float, scheduler: Any,
             reroutes: int, rerouted: Sequence[Any], unmatched_turns: int, sink_errors: int,
             stats: dict[str, float]) -> dict[str, Any]:
    """The metrics.jsonl row of closed step `step` at wall time `now`.

    scheduler: its counters now (`.water_level`, `.dispatched`, `.finished`); reroutes: the router's total
    so far; rerouted: its reroute records since the previous row (`Router.take_reroutes`);
    unmatched_turns: re-sent assistant turns that matched no sampled turn (gyre/proxy/render.py)
    over the executions closed since the previous row; sink_errors: TITO records the proxy failed
    to write, so far; stats: the core's update stats (grad norm, checkpoint_s, ...)."""
    return {
        "step": step,
        "version": step + 1,
        "time_s": now - ledger.t_start,
        "step_time_s": step_time_s,
        **{k: getattr(scheduler, k) for k in ("water_level", "dispatched", "finished")},
        "reroutes": reroutes,
        **reroute_fields(list(rerouted)),  # KV migration vs recompute
        "unmatched_turns": unmatched_turns,
        "sink_errors": sink_errors,
        "incomplete_tito": len(ledger.incomplete_tito()),  # executions excluded for it, so far
        **ledger.step_fields(step, now),
        **{k: float(v) for k, v in stats.items() if k != "version"},
    }


@dataclass
class RunEnd:
    """How the attempt ended, as the stop sequence saw it."""

    steps: int  # optimizer steps done over the whole run (a resume counts on)
    end: float  # wall-clock time the outputs were written
    cancelled_at_end: int = 0  # executions still running at the end, cancelled
    ranks_not_stopped: list[int] = field(default_factory=list)
    error: str | None = None  # the run's error, when it failed
    interrupted: str | None = None  # "SIGINT" / "SIGTERM": a signal stopped the run
    silent_rank: int | None = None  # a rank that stopped answering (--train.control-timeout-s)
    last_checkpoint_s: float | None = None  # the last periodic checkpoint's write (the stop budget)


def build_summary(ledger: RunLedger, how: RunEnd, *, scheduler: SchedulerConfig, shutdown_timeout_s: float, seed: int,
                  fractions: dict[int, float], router: dict[str, Any], proxy_totals: dict[str, int],
                  worst_unmatched: list[dict[str, Any]], sink_errors: int, health: dict[str, int],
                  measured_staleness: Sequence[int], run: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json: what the attempt did (run.json's `ended` record keeps `attempts.ENDED_FIELDS` of it).
    router: `Router.stats()`; proxy_totals: `GyreProxyAccess.totals`; worst_unmatched:
    `Proxy.worst_unmatched(10)`; health: `HealthMonitor.counts`; measured_staleness: the
    scheduler's d per assigned group; run: `rundir.RunDir`; rows: metrics.jsonl so far."""
    summary = {
        "steps": how.steps,
        "wall_s": how.end - ledger.t_start,
        "mode": scheduler.mode,
        "train_fraction": {str(c): f for c, f in fractions.items()},
        "switch_latency_s": {k: (float(np.mean(v)) if v else None) for k, v in ledger.switch_latencies.items()},
        "handover_s": ledger.handover_summary(),  # the switches' parts: actor offload / restore, ...
        "reroutes": router["reroutes"],
        "migration": router["migration"],  # reroutes by KV migration vs recompute: counts, tokens, bytes, latency
        "calls": proxy_totals.get("calls", 0),
        "aborted_calls": proxy_totals.get("aborted_calls", 0),
        "spliced_turns": proxy_totals.get("spliced_turns", 0),
        "unmatched_turns": proxy_totals.get("unmatched_turns", 0),
        "tolerated_turns": proxy_totals.get("tolerated_turns", 0),  # spliced by --proxy.splice tolerant
        "worst_unmatched_executions": worst_unmatched,  # [{execution_id, unmatched_turns, calls, unmatched_kinds}]
        "engine_failures": router["engine_failures"],
        "dead_engine_calls": router.get("dead_engine_calls", 0),  # calls whose engine died under them, recomputed
        "execution_outcomes": ledger.outcomes(),
        "cancelled_at_end": how.cancelled_at_end,
        # earlier attempts' executions not trained into the checkpoint resumed from (run.json, groups.jsonl)
        "attempt": run.attempt,
        "lost_in_flight": run.lost_in_flight,
        "redispatched_groups": len(run.redo_tasks),
        "carried_over_groups": ledger.carried_over,  # evaluated in an earlier attempt, trained in this one
        "zero_advantage_groups": ledger.zero_advantage_groups,  # all-equal rewards: no forward/backward spent
        "measured_staleness_mean": float(np.mean(measured_staleness)) if len(measured_staleness) else None,
        "staleness_by_step": ledger.staleness_by_step(),
        "expected_staleness": scheduler.expected_staleness,
        "failed_executions": dict(health),
        "error": how.error,
        "interrupted": how.interrupted,
        "silent_rank": how.silent_rank,
        "ranks_not_stopped": list(how.ranks_not_stopped),
        "engine_stalls": router["engine_stalls"],  # calls moved off an engine that sent no token in time
        "sink_errors": sink_errors,
        "incomplete_tito": ledger.incomplete_tito(),  # execution -> what is missing; excluded from training
        "last_checkpoint_s": how.last_checkpoint_s,
        "shutdown_timeout_s": shutdown_timeout_s,
    }
    if len(rows) >= 2:
        try:
            summary["reward_trend"] = reward_trend(rows, max(1, len(rows) // 4), seed=seed)
        except ValueError as e:
            logger.warning("reward trend not computed: %s", e)
    return summary


def clock(seconds: float) -> str:
    """A duration for a person: `42s`, `17m05s`, `2h03m`.

    >>> clock(42.4), clock(1025), clock(7380)
    ('42s', '17m05s', '2h03m')
    """
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """The run's progress for a person reading the log: `step(row, sched, now)` once a step (its
    reward, loss, pace over the last `window` steps, ETA); `idle(sched, steps_done, now)` between
    steps, `idle_every_s` after the last line and then at a doubling gap. `sched`: the scheduler's
    counters (`.started`, `.finished`, `.ready_unassigned`, `.water_level`, `.cells_in_training`)."""

    def __init__(self, steps: int, idle_every_s: float = 60.0, window: int = 8) -> None:
        self.steps, self.idle_every_s, self.window = steps, idle_every_s, window
        self.times: list[float] = []
        self.reward_sum, self.reward_n = 0.0, 0
        self._quiet_since: float | None = None
        self._gap = idle_every_s

    def eta_s(self, steps_done: int) -> float | None:
        """Seconds to the last step at the pace of the last `window` steps (None before one)."""
        if not self.times:
            return None
        recent = self.times[-self.window:]
        return max(0, self.steps - steps_done) * sum(recent) / len(recent)

    def step(self, row: dict[str, Any], sched: Any, now: float) -> str:
        rewards = [float(r) for r in row.get("rewards") or [] if r is not None]
        self.reward_sum, self.reward_n = self.reward_sum + sum(rewards), self.reward_n + len(rewards)
        self.times.append(float(row["step_time_s"]))
        self._quiet_since, self._gap = now, self.idle_every_s
        done = row["step"] + 1
        reward = row["reward_mean"] if row["reward_mean"] is not None else float("nan")
        so_far = self.reward_sum / self.reward_n if self.reward_n else float("nan")
        eta = self.eta_s(done)
        pace = sum(self.times[-self.window:]) / len(self.times[-self.window:])
        return (f"step {done}/{self.steps} | executions {sched.finished} done, {sched.started - sched.finished} "
                f"running | reward {reward:.3f} (mean so far {so_far:.3f}) | loss {row['loss']:.4g} clip "
                f"{row['clip_frac']:.2f} d {row['staleness_mean'] or 0.0:.2f} | {pace:.1f}s/step, "
                f"ETA {clock(eta) if eta else 'done'}")

    def idle(self, sched: Any, steps_done: int, now: float) -> str | None:
        if self._quiet_since is None:
            self._quiet_since = now
        if now - self._quiet_since < self._gap:
            return None
        waited, self._quiet_since = now - self._quiet_since, now
        self._gap = min(2 * self._gap, 16 * self.idle_every_s)
        eta = self.eta_s(steps_done)
        return (f"step {steps_done + 1}/{self.steps} in progress: executions {sched.finished} done, "
                f"{sched.started - sched.finished} running, {sched.ready_unassigned} groups ready to train, "
                f"water level {sched.water_level}, cells training {sched.cells_in_training}; no step for "
                f"{clock(waited)}" + (f"; ETA {clock(eta)} at the pace so far" if eta else ""))


def trend_line(t: dict[str, Any], steps: int | str) -> str:
    """The reward trend of summary.json as one line: the fitted rise over the run with its 95 %
    interval first (benchmarks/README.md quotes it), then the first and last windows with what they counted:
    executions, and the groups they form when rewards were grouped."""
    def counted(n: int, groups: int | None) -> str:
        return f"{n} executions" + (f" in {groups} groups" if groups is not None else "")

    rise = (f"reward: fitted rise {t['fitted_rise']:+.3f} over {steps} steps, 95% interval "
            f"[{t['fitted_rise_ci95_low']:+.3f}, {t['fitted_rise_ci95_high']:+.3f}]"
            + (" (no clear change)" if t["fitted_rise_ci95_low"] <= 0 <= t["fitted_rise_ci95_high"] else ""))
    k = t.get("k_steps")
    window = f"first {k} / last {k} steps" if k else "first vs last steps"
    return (f"{rise}; {window}: {t['first_mean']:.3f} → {t['last_mean']:.3f} ({t['diff']:+.3f}, 95% interval "
            f"[{t['ci95_low']:+.3f}, {t['ci95_high']:+.3f}]; {counted(t['n_first'], t.get('groups_first'))} vs "
            f"{counted(t['n_last'], t.get('groups_last'))})")


def end_lines(summary: dict[str, Any], run_dir: Any, failed_phases: Sequence[str] = ()) -> list[str]:
    """The end of a run for a person reading the log (the rest is in summary.json).

    >>> end_lines({"steps": 3, "wall_s": 61.0, "execution_outcomes": {"completed": 6}, "calls": 9,
    ...            "aborted_calls": 0}, "runs/x")[0]
    'run ended after 3 steps in 1m01s'
    """
    s = summary
    why = (f", interrupted by {s['interrupted']}" if s.get("interrupted")
           else ", stopped by an error (stated next)" if s.get("error") else "")
    n = s.get("steps", "?")
    lines = [f"run ended after {n} step{'' if n == 1 else 's'} in {clock(s.get('wall_s', 0))}{why}"]
    t = s.get("reward_trend")
    lines.append(trend_line(t, n) if t else "reward trend: not computed (fewer than 2 steps)")
    outcomes = s.get("execution_outcomes") or {}
    parts = ", ".join(f"{v} {k}" for k, v in sorted(outcomes.items()))
    lines.append(f"executions: {sum(outcomes.values())}" + (f" ({parts})" if parts else "")
                 + (f"; {s['cancelled_at_end']} still running at the end were cancelled" if s.get("cancelled_at_end") else ""))
    lines.append(f"model calls: {s.get('calls', 0)}, {s.get('aborted_calls', 0)} aborted"
                 + (f"; ranks that did not report stopping: {s['ranks_not_stopped']}" if s.get("ranks_not_stopped") else ""))
    if failed_phases:
        lines.append(f"not written at the end: {', '.join(failed_phases)} (errors above)")
    lines.append(f"report: python -m gyre.report {run_dir}  (numbers: {run_dir}/summary.json)")
    return lines
