"""What a run reports: one `metrics.jsonl` row per optimizer step and the attempt's `summary.json`,
built from the ledger and a few named sources (docs/design.md §2, §5). Pure: the caller reads
the sources and writes the result.

    source                     step row                               summary.json
    ─────────────────────────  ─────────────────────────────────────  ──────────────────────────────
    the ledger (runtime/ledger) claims, rewards, staleness, |E|, loss   outcomes, incomplete TITO,
                               metrics, cell times, switches,         handovers, staleness by step,
                               hand-over, incomplete TITO so far      carried-over groups
    the scheduler              water level, dispatched, finished      measured staleness
    the router                 reroutes (KV migration vs recompute)   reroutes, migration, engine
                                                                      failures and stalls
    the proxy                  unmatched turns, sink errors           call totals, worst unmatched
                                                                      executions, sink errors
    the health monitor                                                failed executions
    the run directory          (none)                                 attempt, lost, redispatched
    the end (`RunEnd`)                                                steps, wall time, error,
                                                                      interrupt, silent and
                                                                      unstopped ranks, cancelled
    the core's update stats    grad norm, checkpoint_s, ...
    metrics.jsonl rows                                                reward trend (bootstrap CI)

Example (the row of step 3, from a ledger whose step 3 is closed)::

    row = step_row(ledger, 3, now, step_time_s=2.0, scheduler=sched, reroutes=0, rerouted=[],
                   unmatched_turns=0, sink_errors=0, stats={"grad_norm": 0.5})
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from gyre.config import GyreConfig
from gyre.runtime.ledger import RunLedger
from gyre.runtime.outputs import reroute_fields, reward_trend

logger = logging.getLogger(__name__)

__all__ = ["ProgressLine", "RunEnd", "build_summary", "step_line", "step_row"]


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


def step_line(row: dict[str, Any]) -> str:
    """A step's row as one line of the log."""
    reward = row["reward_mean"] if row["reward_mean"] is not None else float("nan")
    return (f"step {row['step']} done: reward {reward:.3f}  loss {row['loss']:.4g}  clip {row['clip_frac']:.2f}  "
            f"d {row['staleness_mean'] or 0.0:.2f}  cells {row['cells_in_step']}  ({row['step_time_s']:.1f}s)")


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


def build_summary(ledger: RunLedger, how: RunEnd, *, cfg: GyreConfig, fractions: dict[int, float],
                  router: dict[str, Any], proxy_totals: dict[str, int], worst_unmatched: list[dict[str, Any]],
                  sink_errors: int, health: dict[str, int], measured_staleness: Sequence[int], run: Any,
                  rows: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json: what the attempt did (run.json's `ended` record keeps `rundir.ENDED_FIELDS` of it).

    router: `Router.stats()`; proxy_totals: the integer per-execution proxy stats summed over every
    closed execution (`GyreProxyAccess.totals`); worst_unmatched: `Proxy.worst_unmatched(10)`;
    health: `HealthMonitor.counts`; measured_staleness: the scheduler's d per assigned group;
    run: this attempt in the run directory (`rundir.RunDir`); rows: metrics.jsonl so far."""
    summary = {
        "steps": how.steps,
        "wall_s": how.end - ledger.t_start,
        "mode": cfg.scheduler.mode,
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
        "execution_outcomes": ledger.outcomes(),
        "cancelled_at_end": how.cancelled_at_end,
        # executions of earlier attempts in this run directory that were still running (or not all
        # evaluated) when their attempt ended, so not trained into the checkpoint resumed from: their
        # tasks ran again first in this one. Evaluated groups were carried over instead. See run.json's
        # attempts and groups.jsonl.
        "attempt": run.attempt,
        "lost_in_flight": run.lost_in_flight,
        "redispatched_groups": len(run.redo_tasks),
        "carried_over_groups": ledger.carried_over,  # evaluated in an earlier attempt, trained in this one
        "zero_advantage_groups": ledger.zero_advantage_groups,  # all-equal rewards: no forward/backward spent
        "measured_staleness_mean": float(np.mean(measured_staleness)) if len(measured_staleness) else None,
        "staleness_by_step": ledger.staleness_by_step(),
        "expected_staleness": cfg.scheduler.expected_staleness,
        "failed_executions": dict(health),
        "error": how.error,
        "interrupted": how.interrupted,
        "silent_rank": how.silent_rank,
        "ranks_not_stopped": list(how.ranks_not_stopped),
        "engine_stalls": router["engine_stalls"],  # calls moved off an engine that sent no token in time
        "sink_errors": sink_errors,
        "incomplete_tito": ledger.incomplete_tito(),  # execution -> what is missing; excluded from training
        "last_checkpoint_s": how.last_checkpoint_s,
        "shutdown_timeout_s": cfg.train.shutdown_timeout_s,
    }
    if len(rows) >= 2:
        try:
            summary["reward_trend"] = reward_trend(rows, max(1, len(rows) // 4), seed=cfg.seed)
        except ValueError as e:
            logger.warning("reward trend not computed: %s", e)
    return summary


class ProgressLine:
    """The controller's progress line for the log: when the picture changed, or every `every_s`
    seconds while nothing moves (None otherwise). `sched`: the scheduler (its counters now)."""

    def __init__(self, every_s: float = 15.0) -> None:
        self.every_s = every_s
        self._last: tuple | None = None
        self._last_t = 0.0

    def __call__(self, sched: Any, steps_done: int, steps: int, now: float) -> str | None:
        s = sched
        state = (steps_done, s.ready_unassigned, s.water_level, s.cells_in_training, s.started, s.finished)
        if state == self._last and now - self._last_t < self.every_s:
            return None
        self._last, self._last_t = state, now
        return (f"step {steps_done}/{steps} | groups ready {s.ready_unassigned} | water level {s.water_level} "
                f"(C_R {s.rollout_capacity}) | cells training {s.cells_in_training} | "
                f"d/p/f {s.dispatched}/{s.started}/{s.finished}")
