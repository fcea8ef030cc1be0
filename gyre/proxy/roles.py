"""Role classification (docs/design.md §4): which part of an execution a model call belongs to.

A call is the main agent's turn, the main agent's context compaction (summary), a sub-agent's
turn, or a sub-agent's compaction. The trajectory tree (docs/design.md §5) groups records by
role, so a wrong role puts a sub-agent's tokens into the main agent's tree. Decided, first
match wins, by: an explicit header (`proxy.roles.header`), the role hint the execution's key
was issued with, then the configured markers in the last user message and whether the system
prompt differs from the execution's first main-agent system prompt (`RoleRulesConfig`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gyre.proxy.config import RoleRulesConfig
from gyre.trajectory.record import Role

if TYPE_CHECKING:
    from gyre.proxy.keys import KeyInfo

ROLE_NAMES = {
    "main": Role.MAIN,
    "main_summary": Role.MAIN_SUMMARY,
    "summary": Role.MAIN_SUMMARY,
    "sub": Role.SUB,
    "sub_agent": Role.SUB,
    "subagent": Role.SUB,
    "sub_summary": Role.SUB_SUMMARY,
}


def parse_role(value: str) -> Role:
    try:
        return ROLE_NAMES[value.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown role {value!r}; expected one of {sorted(ROLE_NAMES)}") from None


class RoleClassifier:
    """Decides a call's role from the configured rules (see `RoleRulesConfig`)."""

    def __init__(self, rules: RoleRulesConfig) -> None:
        self.rules = rules
        self._summary = tuple(m.lower() for m in rules.summary_markers if m)
        self._sub = tuple(m.lower() for m in rules.sub_agent_markers if m)

    def _key(self, system: str) -> str:
        if self.rules.system_prompt_match == "prefix":
            return system[: self.rules.system_prompt_prefix_chars]
        return system

    def classify(self, state, system: str, last_user: str, header_value: str | None, key: KeyInfo | None) -> Role:
        """`state` is the execution's state (`main_system` is read and set here)."""
        if header_value:
            role = parse_role(header_value)  # ValueError -> 400 upstream
        elif key is not None and key.role_hint is not None and self.rules.use_key_hint:
            role = key.role_hint
        else:
            low = last_user.lower()
            is_sub = any(m in low for m in self._sub)
            if not is_sub and state.main_system is not None:
                is_sub = self._key(system) != state.main_system
            is_summary = any(m in low for m in self._summary)
            if is_sub:
                role = Role.SUB_SUMMARY if is_summary else Role.SUB
            else:
                role = Role.MAIN_SUMMARY if is_summary else Role.MAIN
        if role is Role.MAIN and state.main_system is None:
            state.main_system = self._key(system)
        return role
