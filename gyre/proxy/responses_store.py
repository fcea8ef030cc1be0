"""Stored Responses of one execution (`/v1/responses` with `store`), bounded in bytes.

Each kept response holds the messages it added after its parent's history (its new input items
and its output turn) and its Response body (for `GET /v1/responses/{id}`). An execution keeps at
most `proxy.responses_store_bytes` of them (measured as the JSON size of messages + body); past
that the least recently used go first. Using a response (continuing it with
`previous_response_id`, fetching it, or a full-history re-send matched against it) touches it and
every ancestor in its chain, ancestors last, so a live chain is the last thing evicted: a
looping harness keeps its recent conversation and its memory stays bounded.

A `previous_response_id` naming an evicted response (or one of its evicted ancestors) is a 400
`previous_response_not_found`, as OpenAI answers for a response it no longer has: the client
re-sends the full input (what Codex and the Agents SDK do by default) and goes on. The proxy never
falls back to guessing a history it no longer has.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# The key of an assistant message that names the call whose output it is (gyre.proxy.render
# splices exactly that call's ids; the chat template never sees it).
from gyre.proxy.render import SPLICE_CALL


@dataclass
class KeptResponse:
    """A stored response: the messages it added after its parent's history, and its body."""

    parent: str | None
    messages: list[dict]
    body: dict
    nbytes: int = 0


class Evicted(KeyError):
    """A response in the chain is not (or no longer) stored."""

    def __init__(self, rid: str) -> None:
        super().__init__(rid)
        self.rid = rid


def plain(messages: list[dict]) -> list[dict]:
    """Messages as a client sends them (without the proxy's splice hints), for comparing."""
    return [{k: v for k, v in m.items() if k != SPLICE_CALL} if SPLICE_CALL in m else m for m in messages]


class ResponseStore:
    """LRU store of an execution's kept responses, at most `limit_bytes` (0: unbounded)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.items: OrderedDict[str, KeptResponse] = OrderedDict()
        self.nbytes = 0
        self.newest: str | None = None  # the last response stored (full-history re-sends are deltas on it)
        self.evicted = 0

    def __contains__(self, rid: str) -> bool:
        return rid in self.items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, rid: str) -> KeptResponse:
        return self.items[rid]

    def get(self, rid: str) -> KeptResponse | None:
        kept = self.items.get(rid)
        if kept is not None:
            self.items.move_to_end(rid)
        return kept

    def history(self, rid: str) -> list[dict]:
        """The messages the response's chain adds up to, oldest first; touches the chain (the
        root last). `Evicted` names the first response of the chain that is gone."""
        chain: list[str] = []
        cur: str | None = rid
        while cur is not None:
            kept = self.items.get(cur)
            if kept is None:
                raise Evicted(cur)
            chain.append(cur)
            cur = kept.parent
        for r in chain:
            self.items.move_to_end(r)
        return [m for r in reversed(chain) for m in self.items[r].messages]

    def put(self, rid: str, parent: str | None, messages: list[dict], body: dict[str, Any]) -> None:
        nbytes = len(json.dumps(messages, ensure_ascii=False, default=str)) + len(json.dumps(body, ensure_ascii=False, default=str))
        self.items[rid] = KeptResponse(parent, messages, body, nbytes)
        self.nbytes += nbytes
        self.newest = rid
        while self.limit and self.nbytes > self.limit and len(self.items) > 1:
            old, kept = self.items.popitem(last=False)
            self.nbytes -= kept.nbytes
            self.evicted += 1
            if old == self.newest:
                self.newest = None
