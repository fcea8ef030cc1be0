"""An execution's proxy state rebuilt from its records, when a proxy first sees an execution whose
TITO file already holds calls: the proxy was restarted (or replaced) under a running harness.

Three things outlive the process this way. Call ids continue after the largest recorded one:
they name the records and the tool-call ids handed out (gyre/proxy/tool_ids.py), so they must be
unique for the execution's whole life. The stored turns come back from each recorded turn's
`turn` entry (`turn_ref`: its context length and digest, content and tool calls; the ids are the
record's own), so the history the harness re-sends splices to the sampled ids instead of being
read as edits. The stats count every recorded call, so a close reports the whole execution.

What does not come back: kept /v1/responses objects, and the main agent's system prompt (role
classification fixes it again from the next main call). Records of a proxy older than `turn`
continue their call ids, but their turns do not splice (logged once per execution).
"""

from __future__ import annotations

import itertools
import logging
from array import array
from typing import Any

import numpy as np

from gyre.proxy.render import Rendered, StoredTurn, turn_fingerprint
from gyre.proxy.state import ExecutionState
from gyre.trajectory.record import Role
from gyre.trajectory.store import CallHead, StoreCorruptError

logger = logging.getLogger(__name__)


def turn_ref(n_ctx: int, digest: bytes, content: str, calls: list[dict]) -> dict[str, Any]:
    """The record's `payload_ref["turn"]` for a turn kept for splicing (`gyre.proxy.core.Call`):
    what `resumed_state` needs besides the record's ids to keep it again."""
    return {"n": n_ctx, "digest": digest.hex(), "content": content, "calls": calls}


def resumed_state(execution_id: str, sink: Any) -> ExecutionState:
    """A fresh `ExecutionState`, or, when the sink already holds records of the execution
    (`sink.heads(execution_id)`, see gyre/proxy/sink.py), the state those calls left."""
    state = ExecutionState(execution_id=execution_id)
    heads_of = getattr(sink, "heads", None)
    if heads_of is None:
        return state
    try:
        heads = heads_of(execution_id)
    except (OSError, StoreCorruptError) as e:  # the writer will refuse it too: the sink's error, counted there
        logger.error("proxy: execution %s: its records cannot be read (%s); its call ids start again at 0", execution_id, e)
        return state
    if heads:
        restore(state, heads)
    return state


def restore(state: ExecutionState, heads: list[CallHead]) -> None:
    """Put the calls of `heads` (one execution's, in file order) into `state`."""
    state.call_ids = itertools.count(max(h.call_id for h in heads) + 1)
    without_turn = 0
    for h in heads:
        p = h.payload_ref
        seen = Rendered(ids=[], spliced=p.get("spliced_turns", 0), unmatched=p.get("unmatched_turns", 0),
                        tolerated=p.get("tolerated_turns", 0), unmatched_kinds=list(p.get("unmatched_kinds", ())))
        aborted = p.get("aborted", h.finish_reason == "abort")
        state.stats = state.stats.with_call(seen, Role(h.role), p.get("reroutes", 0), aborted)
        t = p.get("turn")
        if t is None:
            without_turn += "aborted" not in p  # written by a proxy before `turn` (this one writes both)
            continue
        ids = array("i", h.ids(t["n"]).astype(np.int32, copy=False).tobytes())
        state.turns.add(turn_fingerprint(t["content"], t["calls"]),
                        StoredTurn(h.call_id, t["n"], bytes.fromhex(t["digest"]), ids, t["content"], list(t["calls"])))
    logger.info("proxy: execution %s resumed from %d recorded call(s); call ids go on from %d", state.execution_id, len(heads),
                max(h.call_id for h in heads) + 1)
    if without_turn:
        logger.warning("proxy: execution %s: %d recorded call(s) of an older proxy carry no turn; re-sent, their turns "
                       "will not splice", state.execution_id, without_turn)
