"""The sleeps of an idle poller, shared by the control plane's mailboxes (gyre/runtime/control.py)
and the gloo KV server (gyre/backends/transfer/migration.py): one rule, at the bottom of the layers."""


class Backoff:
    """The sleeps of an idle poller: `min_s` first, ×`factor` after each empty poll, at most
    `max_s`; `reset()` when something arrived. A message that arrives while a rank waits is seen
    within `max_s` (plus one round trip), and an idle rank polls at most 1/`max_s` times a second
    once ramped up (a handful of polls: 2, 4, 8, 16, 32, 50 ms).

    >>> b = Backoff(0.002, 0.05); [b.next() for _ in range(7)]
    [0.002, 0.004, 0.008, 0.016, 0.032, 0.05, 0.05]
    """

    def __init__(self, min_s: float = 0.002, max_s: float = 0.05, factor: float = 2.0) -> None:
        if not 0 < min_s <= max_s or factor < 1:
            raise ValueError(f"Backoff: need 0 < min_s <= max_s and factor >= 1, got {min_s}, {max_s}, {factor}")
        self.min_s, self.max_s, self.factor = min_s, max_s, factor
        self._next = min_s

    def next(self) -> float:
        """The sleep before the next poll (and advance)."""
        out = self._next
        self._next = min(self.max_s, self._next * self.factor)
        return out

    def reset(self) -> None:
        self._next = self.min_s
