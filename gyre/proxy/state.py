"""One execution's records in the proxy, one per concern (docs/design.md §4).

    ExecutionState   the turns kept for splicing, kept Responses, the closing flags; composed of
    CallStats        what its recorded calls came to (frozen; `Proxy.close_execution` returns it)
    Allowance        what admission holds for it (gyre/proxy/admission.py owns it)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

from gyre.proxy.admission import Allowance
from gyre.proxy.render import Rendered, TurnStore
from gyre.trajectory.record import Role


def _bump(counts: Mapping[str, int], keys: Any) -> dict[str, int]:
    out = dict(counts)
    for k in keys:
        out[k] = out.get(k, 0) + 1
    return out


@dataclass(frozen=True)
class CallStats:
    """An execution's recorded calls, counted: exactly what its TITO record holds once closed."""

    calls: int = 0
    spliced_turns: int = 0
    unmatched_turns: int = 0
    tolerated_turns: int = 0  # spliced by the tolerant rules (counted in spliced_turns too)
    reroutes: int = 0
    aborted_calls: int = 0
    sink_errors: int = 0  # calls whose record the sink failed to write: its TITO is incomplete
    inflight: int = 0  # calls in flight when this was taken (at a close: aborted, not recorded)
    unmatched_kinds: Mapping[str, int] = field(default_factory=dict)  # render.UNMATCHED_KINDS -> turns
    roles: Mapping[str, int] = field(default_factory=dict)  # Role name -> calls

    def with_call(self, rendered: Rendered, role: Role, reroutes: int, aborted: bool) -> CallStats:
        """These stats and one more recorded call."""
        return replace(self, calls=self.calls + 1, spliced_turns=self.spliced_turns + rendered.spliced,
                       unmatched_turns=self.unmatched_turns + rendered.unmatched,
                       tolerated_turns=self.tolerated_turns + rendered.tolerated, reroutes=self.reroutes + reroutes,
                       aborted_calls=self.aborted_calls + aborted, roles=_bump(self.roles, (role.name,)),
                       unmatched_kinds=_bump(self.unmatched_kinds, rendered.unmatched_kinds))

    def counts(self) -> dict[str, int]:
        """The integer fields (what a run sums over its closed executions)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.type in ("int", int)}


@dataclass
class ExecutionState:
    execution_id: str
    call_ids: itertools.count = field(default_factory=itertools.count)
    turns: TurnStore = field(default_factory=TurnStore)
    main_system: str | None = None  # fixed by its first main-agent call (`RoleClassifier.classify`)
    warned_unmatched: bool = False
    stats: CallStats = field(default_factory=CallStats)
    allowance: Allowance = field(default_factory=Allowance)
    responses: Any = field(default_factory=dict)  # kept /v1/responses (responses_api), dropped with the execution
    closed: bool = False  # close_execution ran: records are no longer written
    closing: bool = False  # aclose_execution is aborting its calls: their clients are told (gyre/proxy/endings.py)
