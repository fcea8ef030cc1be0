"""Role classification (docs/design.md §4): which part of an execution a model call belongs to.

A call is the main agent's turn, its context compaction (summary), a sub-agent's turn or
compaction, or a harness's background *helper* call (recorded, never trained). The trajectory tree
groups records by role, so a wrong role puts a sub-agent's tokens into the main agent's tree.
First match wins: an explicit header (`proxy.roles.header`), the helper rules, the role hint the
execution's key was issued with, then the configured markers in the last user message and whether
the system prompt differs from the execution's first non-empty main-agent one, compared without
volatile lines (`RoleRulesConfig`). The rules, and adding one for a new harness:
docs/proxy_harnesses.md ("Helper calls").
"""

from __future__ import annotations

from gyre.proxy.config import RoleRulesConfig
from gyre.trajectory.record import Role

ROLE_NAMES = {
    "main": Role.MAIN,
    "main_summary": Role.MAIN_SUMMARY,
    "summary": Role.MAIN_SUMMARY,
    "sub": Role.SUB,
    "sub_agent": Role.SUB,
    "subagent": Role.SUB,
    "sub_summary": Role.SUB_SUMMARY,
    "helper": Role.HELPER,
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
        self._helper_system = tuple(m.lower() for m in rules.helper_system_markers if m)
        self._helper_user = tuple(m.lower() for m in rules.helper_user_markers if m)
        self._volatile = tuple(p for p in rules.volatile_system_lines if p)

    def stable_system(self, system: str) -> str:
        """The system prompt without its volatile lines (`RoleRulesConfig.volatile_system_lines`)."""
        if not self._volatile or not any(p in system for p in self._volatile):
            return system
        return "\n".join(ln for ln in system.split("\n") if not ln.lstrip().startswith(self._volatile))

    def _key(self, system: str) -> str:
        system = self.stable_system(system)
        if self.rules.system_prompt_match == "prefix":
            return system[: self.rules.system_prompt_prefix_chars]
        return system

    def is_helper(self, system: str, last_user: str, max_tokens: int | None = None, has_tools: bool = False) -> bool:
        """A user-turn marker counts only in a call without tools (a harness's background calls
        send none; its agent always does) and within the turn's first `HELPER_USER_CHARS`
        characters (where the background prompts state their job): task text that merely mentions
        a marker does not make the main agent's call a helper."""
        if max_tokens is not None and max_tokens <= self.rules.helper_max_tokens:
            return True
        if self._helper_system and any(m in system.lower() for m in self._helper_system):
            return True
        head = last_user[: self.HELPER_USER_CHARS].lower()
        return bool(self._helper_user) and not has_tools and any(m in head for m in self._helper_user)

    HELPER_USER_CHARS = 256

    def classify(self, system: str, last_user: str, header_value: str | None, key_hint: Role | None, main_system: str | None,
                 max_tokens: int | None = None, has_tools: bool = False) -> tuple[Role, str | None]:
        """(role, the execution's main system prompt after this call): `main_system` is what its
        earlier calls fixed (None: not yet), `key_hint` the role its key was issued with."""
        if header_value:
            role = parse_role(header_value)  # ValueError -> 400 upstream
        elif self.is_helper(system, last_user, max_tokens, has_tools):
            role = Role.HELPER
        elif key_hint is not None and self.rules.use_key_hint:
            role = key_hint
        else:
            low = last_user.lower()
            is_sub = any(m in low for m in self._sub)
            if not is_sub and main_system is not None:
                is_sub = self._key(system) != main_system
            is_summary = any(m in low for m in self._summary)
            if is_sub:
                role = Role.SUB_SUMMARY if is_summary else Role.SUB
            else:
                role = Role.MAIN_SUMMARY if is_summary else Role.MAIN
        if role is Role.MAIN and main_system is None and self._key(system).strip():
            # An empty system prompt fixes nothing: a later call with the harness's real one is
            # the main agent (the first call of some harnesses has no instructions yet).
            main_system = self._key(system)
        return role, main_system
