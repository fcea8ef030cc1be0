"""A deterministic rollout engine: a real `RolloutEngine` whose tokens come from a hash.

Token k of a request is a function of the sequence before it (prompt + tokens 0..k-1: its length
and last two tokens, see `sequence_hash`) and the engine's `salt`, never of which engine or
request produced the earlier tokens. So two engines
with the same salt continue each other exactly, which lets tests check a rerouted call against
one uninterrupted generation, and engines with different salts make "A's tokens + B's
continuation" visible. Optionally `script(input_ids) -> str | None` makes the engine answer with
a given text, spelled one byte-token per byte (a valid but non-canonical tokenization: re-encoding
the text gives other ids, which is what TITO splicing has to survive). `token_delay` makes it slow:
token k of a request is due `token_delay` × (k + 1) after its start, a steady rate (a late wake-up
delays that token, not the rest: benchmarks measure the proxy's added latency against this).
With `SamplingParams.top_logprobs` = k, each event carries k plausible alternatives (`top_tokens`):
a proper distribution's top k, the sampled token among them with its own log-prob.

Used by tests and benchmarks; it implements the protocol for real (abort, versions, release).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from gyre.backends.protocols import EngineHealth, SamplingParams, TokenEvent

logger = logging.getLogger(__name__)

_MASK = (1 << 64) - 1


_now = time.monotonic  # the token schedule's clock (a test replaces it)


def _mix(h: int) -> int:
    """splitmix64 finalizer."""
    h = (h + 0x9E3779B97F4A7C15) & _MASK
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK
    return h ^ (h >> 31)


def sequence_hash(seq: list[int], salt: int) -> int:
    """State that decides the next token: the salt, the sequence length and its last two tokens.

    O(1) per token, and a function of the sequence alone, so an engine continuing
    `prompt + generated` computes exactly what the engine that generated them would have.
    """
    return _state(salt, len(seq), seq[-2:])


def _state(salt: int, n: int, tail: list[int]) -> int:
    last = tail[-1] if tail else -1
    prev = tail[-2] if len(tail) > 1 else -1
    # Tuple hashing of ints is deterministic across processes (no hash randomization for ints)
    # and one C call; the finalizer spreads it over 64 bits.
    return _mix(hash((salt, n, last, prev)) & _MASK)


@dataclass
class _Request:
    generated: list[TokenEvent] = field(default_factory=list)
    aborted: bool = False


class DeterministicEngine:
    """See module docstring. `first_regular_id` keeps hashed tokens off the special ids below it."""

    def __init__(
        self,
        name: str,
        *,
        vocab_size: int = 1024,
        eos_token_id: int = 2,
        first_regular_id: int = 7,
        eos_prob: float = 0.0,
        token_delay: float = 0.0,
        salt: int = 0,
        version: int = 0,
        script: Callable[[list[int]], str | None] | None = None,
        byte_ids: list[int] | None = None,
    ) -> None:
        if script is not None and byte_ids is None:
            raise ValueError("DeterministicEngine: `script` needs `byte_ids` (gyre.backends.models.tokenizer.byte_token_ids)")
        self.name = name
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.first_regular_id = first_regular_id
        self.eos_prob = eos_prob
        self.token_delay = token_delay
        self.salt = salt
        self.version = version
        self.script = script
        self.byte_ids = byte_ids
        self.released = False
        self.started = False
        self._requests: dict[str, _Request] = {}
        self.generate_calls = 0  # requests ever started here (tests read it)

    async def start(self) -> None:
        self.started = True

    def token_after(self, seq: list[int]) -> TokenEvent:
        """The token this engine emits after `seq` (pure; tests use it as the reference)."""
        return self.next_token(sequence_hash(seq, self.salt))

    def next_token(self, h: int) -> TokenEvent:
        """The token for sequence state `h` (pure)."""
        r = h
        if self.eos_prob > 0 and (_mix(r) >> 11) / float(1 << 53) < self.eos_prob:
            tok = self.eos_token_id
        else:
            tok = self.first_regular_id + r % (self.vocab_size - self.first_regular_id)
        logprob = -0.01 - ((r >> 20) % 5000) / 1000.0
        return TokenEvent(token_id=tok, logprob=logprob, version=self.version)

    def top_tokens(self, h: int, ev: TokenEvent, k: int) -> list[tuple[int, float]]:
        """k (token_id, logprob) pairs, most likely first, for the event sampled at state `h` (pure):
        the sampled token with its log-prob p, and k-1 other ids (from the hash) sharing the rest
        of the mass, 1-e^p, as halves, quarters, ...: sums to at most 1, all distinct."""
        rest = max(1.0 - math.exp(ev.logprob), 1e-12)
        pairs, seen = [(ev.token_id, ev.logprob)], {ev.token_id}
        r, i = h, 1
        while len(pairs) < k and len(seen) < self.vocab_size:
            r = _mix(r)
            tok = r % self.vocab_size
            if tok in seen:
                continue
            seen.add(tok)
            pairs.append((tok, math.log(rest * 0.5**i)))
            i += 1
        return sorted(pairs, key=lambda p: (-p[1], p[0]))

    def _scripted(self, input_ids: list[int], max_tokens: int) -> list[int] | None:
        if self.script is None:
            return None
        text = self.script(list(input_ids))
        if text is None:
            return None
        ids = [self.byte_ids[b] for b in text.encode("utf-8")] + [self.eos_token_id]
        return ids[:max_tokens]

    async def generate(self, request_id: str, input_ids: list[int], sampling: SamplingParams) -> AsyncIterator[TokenEvent]:
        if self.released:
            raise RuntimeError(f"engine {self.name}: memory released, not serving")
        if request_id in self._requests:
            raise ValueError(f"engine {self.name}: duplicate request id {request_id!r}")
        req = _Request()
        self._requests[request_id] = req
        self.generate_calls += 1
        try:
            scripted = self._scripted(input_ids, sampling.max_tokens)
            seq = list(input_ids[-2:])
            n = len(input_ids)
            stops = set(sampling.stop_token_ids)
            due, turn = _now(), max(1, 64 // (1 + sampling.top_logprobs))  # 64 tokens' worth of entries a turn
            for k in range(sampling.max_tokens):
                if self.token_delay > 0:
                    # token k is due token_delay × (k + 1) after the start: a late wake-up (timer
                    # granularity, a busy loop) delays this token, not every later one as well
                    due += self.token_delay
                    await asyncio.sleep(max(0.0, due - _now()))
                elif k % turn == turn - 1:
                    await asyncio.sleep(0)  # instant, yet its loop serves the other requests too, as a batch would
                if req.aborted:
                    return
                h = _state(self.salt, n, seq)
                if scripted is not None:
                    if k >= len(scripted):
                        return  # (only when max_tokens cut the script short, which the loop ends first)
                    ev = TokenEvent(token_id=scripted[k], logprob=-0.5, version=self.version)
                else:
                    ev = self.next_token(h)
                if sampling.top_logprobs > 0:
                    ev.top = self.top_tokens(h, ev, sampling.top_logprobs)
                seq = [seq[-1], ev.token_id] if seq else [ev.token_id]
                n += 1
                req.generated.append(ev)
                stop = ev.token_id in stops or ev.token_id == self.eos_token_id
                if not stop and sampling.stop_sequences:
                    tail = [e.token_id for e in req.generated]
                    stop = any(len(s) and tail[-len(s) :] == s for s in sampling.stop_sequences)
                if stop:
                    ev.finish_reason = "stop"
                elif k == sampling.max_tokens - 1:
                    ev.finish_reason = "length"
                yield ev
                if req.aborted or stop:
                    return
        finally:
            self._requests.pop(request_id, None)

    async def abort(self, request_id: str) -> list[TokenEvent]:
        req = self._requests.get(request_id)
        if req is None:
            return []
        req.aborted = True
        return list(req.generated)

    async def update_weights(self, state_dict, version: int) -> None:
        self.version = version

    async def release_memory(self) -> None:
        if self._requests:
            raise RuntimeError(f"engine {self.name}: release_memory with {len(self._requests)} requests running")
        self.released = True

    async def resume(self) -> None:
        self.released = False

    async def health(self) -> EngineHealth:
        return EngineHealth(ok=True, version=self.version, running=len(self._requests), waiting=0, released=self.released)

    def load(self) -> int:
        return len(self._requests)
