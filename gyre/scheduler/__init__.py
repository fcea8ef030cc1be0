"""Elastic scheduler decision logic (docs/design.md §2–3), shared by the simulator and the runtime.

`ElasticScheduler` is a pure state machine: the driver (the simulator in `gyre.sim`, or the
runtime controller on the core's first rank) feeds it events and carries out the decisions it
returns, in order. It never blocks, sleeps, or touches the network; time comes from a `Clock`
(`SimClock` in the simulator and in tests, `WallClock` in the runtime), and every event and
decision is appended to an `EventLog`. The protocol (its calls and decisions), the water-level
rules and what a group is called in each part of Gyre: docs/theory.md §6.
"""

from gyre.scheduler.config import SchedulerConfig
from gyre.scheduler.core import CellRole, ElasticScheduler, IllegalRole, SchedulerError
from gyre.scheduler.events import (
    Clock,
    Decision,
    Dispatch,
    Event,
    EventLog,
    OptimizerStep,
    Publish,
    SimClock,
    SwitchToRollout,
    SwitchToTrain,
    WallClock,
    Work,
)

__all__ = [
    "SchedulerConfig",
    "ElasticScheduler",
    "CellRole",
    "IllegalRole",
    "SchedulerError",
    "Clock",
    "SimClock",
    "WallClock",
    "EventLog",
    "Event",
    "Decision",
    "Dispatch",
    "SwitchToTrain",
    "SwitchToRollout",
    "OptimizerStep",
    "Publish",
    "Work",
]
