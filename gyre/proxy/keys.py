"""Per-execution API keys (docs/design.md §4).

Each execution gets its own key; the key is the only thing that decides which execution a call
belongs to, so one execution can never write into another's record. Keys can be revoked (the
execution ended or was cancelled): a revoked key gets 401 like an unknown one.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

from gyre.ids import check_id
from gyre.proxy.roles import parse_role
from gyre.trajectory.record import Role

logger = logging.getLogger(__name__)

_GENERATED = "gyre-"  # the prefix of generated keys (reserved)


@dataclass(frozen=True)
class KeyInfo:
    key: str
    execution_id: str
    role_hint: Role | None = None


class KeyRegistry:
    """key -> (execution, role hint). Lookups are dict reads (hot path)."""

    def __init__(self) -> None:
        self._keys: dict[str, KeyInfo] = {}
        self._by_execution: dict[str, set[str]] = {}
        # revoked keys that were given (`issue(key=...)`), refused if given again. A generated
        # key (`_GENERATED` + 192 random bits) is never generated again and cannot be given (the
        # prefix is reserved), so it is not remembered: that would grow the set by one key per
        # execution for the whole run
        self._revoked: set[str] = set()
        self._given: set[str] = set()  # live keys that were given, not generated

    def issue(self, execution_id: str, role_hint: Role | str | None = None, key: str | None = None) -> str:
        """A new key for `execution_id` (an explicit `key` may be given, e.g. from a harness config)."""
        check_id(execution_id, "issue: execution_id")
        if isinstance(role_hint, str):
            role_hint = parse_role(role_hint)
        if key is not None and key.startswith(_GENERATED):
            raise ValueError(f"issue: key: {_GENERATED!r} starts the proxy's generated keys; a given key must not")
        if key is not None and (key in self._keys or key in self._revoked):
            raise ValueError("issue: key already in use")
        if key is not None:
            self._given.add(key)
        key = key or f"{_GENERATED}{secrets.token_urlsafe(24)}"
        self._keys[key] = KeyInfo(key=key, execution_id=execution_id, role_hint=role_hint)
        self._by_execution.setdefault(execution_id, set()).add(key)
        return key

    def lookup(self, key: str | None) -> KeyInfo | None:
        if not key:
            return None
        return self._keys.get(key)

    def revoke(self, key: str) -> None:
        info = self._keys.pop(key, None)
        if info is None:
            raise KeyError("revoke: unknown key")
        self._forget(key)
        self._by_execution.get(info.execution_id, set()).discard(key)

    def revoke_execution(self, execution_id: str) -> int:
        """Revoke every key of an execution; returns how many."""
        keys = list(self._by_execution.pop(execution_id, ()))
        for k in keys:
            self._keys.pop(k, None)
            self._forget(k)
        return len(keys)

    def _forget(self, key: str) -> None:
        if key in self._given:
            self._given.discard(key)
            self._revoked.add(key)
