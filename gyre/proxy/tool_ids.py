"""The ids of the tool calls the proxy hands out (OpenAI `call_…`, Anthropic `toolu_…`).

Each ends in the proxy call that sampled it (after a "g", never a hex digit), so a re-sent turn
with tool calls names its own sample (`render.SPLICE_CALL`): two identical parallel sub-agents that
sampled the same text in other ids each get their own ids back. To clients they stay opaque ids.
"""

from __future__ import annotations

import re
import secrets

_TOOL_ID = re.compile(r"(?:call_|toolu_)[0-9a-f]{16}g(\d+)")


def tool_call_id(prefix: str, call_id: int) -> str:
    """The id of a tool call the proxy's call `call_id` produced (`prefix`: "call_", "toolu_")."""
    return f"{prefix}{secrets.token_hex(8)}g{call_id}"


def named_call(ids: list) -> int | None:
    """The call every one of a re-sent turn's tool-call ids names (`tool_call_id`), else None."""
    found = {int(m.group(1)) if (m := _TOOL_ID.fullmatch(i if isinstance(i, str) else "")) else None for i in ids}
    return found.pop() if len(found) == 1 and None not in found else None
