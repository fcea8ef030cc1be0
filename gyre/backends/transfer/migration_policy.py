"""When moving a drained call's KV cache to another engine pays, against recomputing its prefill
there (docs/design.md §4; the transport is `gyre.backends.transfer.migration`). Pure arithmetic:
the proxy's router decides with it, so it is kept apart from the torch-bound transport, and
importing the proxy never imports torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MigrationMode = Literal["off", "auto", "always"]
_DEFAULT_BANDWIDTH_BPS = 0.3e9  # until measured: the slower of gloo / Mooncake TCP here (backend_bench)


@dataclass
class MigrationPolicy:
    """When migrating pays: kv_bytes / bandwidth + overhead < prefill_tokens / prefill_tok_s.

    `bandwidth_Bps` 0: learned from the migrations themselves (`observe`: bytes / seconds of each
    target's pull, a running mean; 0.3 GB/s before the first). `prefill_tok_s` 0: the engines'
    own measurement at start-up (`CpuEngine.attach_kv_transport`, reported by `migration_info`).
    `overhead_s`: the handshake's fixed cost (control round trips, pack/unpack)."""

    mode: MigrationMode = "off"
    bandwidth_Bps: float = 0.0
    prefill_tok_s: float = 0.0
    overhead_s: float = 0.005
    measured_Bps: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("off", "auto", "always"):
            raise ValueError(f"migration mode must be off, auto or always, got {self.mode!r}")
        if self.bandwidth_Bps < 0 or self.prefill_tok_s < 0:
            raise ValueError(f"migration: bandwidth {self.bandwidth_Bps} and prefill throughput {self.prefill_tok_s} "
                             "must be ≥ 0 (0: measured)")

    def bandwidth(self) -> float:
        return self.bandwidth_Bps or self.measured_Bps or _DEFAULT_BANDWIDTH_BPS

    def observe(self, nbytes: int, seconds: float) -> None:
        """One migration's pull: fold its rate into the measured bandwidth (mean of the last ~8)."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        self.measured_Bps = rate if self.measured_Bps is None else 0.875 * self.measured_Bps + 0.125 * rate

    def estimate(self, tokens: int, kv_bytes_per_token: int, prefill_tok_s: float | None = None) -> tuple[float, float]:
        """(migration seconds, recompute seconds) for a request of `tokens` tokens."""
        rate = self.prefill_tok_s or prefill_tok_s
        if not rate:
            raise ValueError("migration: no prefill throughput configured or measured")
        return tokens * kv_bytes_per_token / self.bandwidth() + self.overhead_s, tokens / rate

    def pays(self, tokens: int, kv_bytes_per_token: int, prefill_tok_s: float | None = None) -> bool:
        if self.mode == "off":
            return False
        if self.mode == "always":
            return True
        migrate_s, recompute_s = self.estimate(tokens, kv_bytes_per_token, prefill_tok_s)
        return migrate_s < recompute_s
