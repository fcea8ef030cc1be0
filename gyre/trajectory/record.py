"""The TITO record: one per model call, written by the proxy, read by the trajectory processor.

This is the single definition of the record type (docs/design.md §4); the proxy produces it and
`gyre.trajectory` consumes it, whatever produced it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class Role(enum.IntEnum):
    """Role of a model call. The integer value is the selection priority (lower = chosen first).

    docs/design.md §5: main > main summary > sub-agent > sub-agent summary. HELPER is a harness's
    background call (a title, a topic check, a bash-prefix check: gyre/proxy/roles.py): recorded,
    but never trained; `build_tree` leaves it out, so no trajectory can select it.
    """

    MAIN = 0
    MAIN_SUMMARY = 1
    SUB = 2
    SUB_SUMMARY = 3
    HELPER = 4

    @property
    def trained(self) -> bool:
        return self is not Role.HELPER


@dataclass
class CallRecord:
    """Token-in/token-out record of one model call (docs/design.md §4).

    Arrays are numpy so the store can write them as raw bytes:
      input_ids        [I] int32   exact prompt token ids the engine saw (after splicing)
      output_ids       [O] int32   sampled token ids
      output_logprobs  [O] float32 behavior log-prob of each sampled token
      output_versions  [O] int32   policy version that sampled each token (a weight update
                                   mid-call changes it for later tokens)
      message_starts   [M] int32   offsets into input_ids where each chat message starts, when
                                   the renderer knows them (empty otherwise)
    Where the proxy spliced original sampled ids into the input is recorded in
    payload_ref["spliced_spans"] (informational: the tree decides provenance by exact prefix
    match against earlier outputs, not by this).
    """

    execution_id: str
    call_id: int
    role: Role
    input_ids: np.ndarray
    output_ids: np.ndarray
    output_logprobs: np.ndarray
    policy_version: int
    start_time: float = 0.0
    end_time: float = 0.0
    finish_reason: str = "stop"
    output_versions: np.ndarray | None = None
    message_starts: np.ndarray | None = None
    # References to the raw request/response payloads needed for re-rendering (paths or
    # payload ids in the proxy's payload log); small JSON-able metadata only.
    payload_ref: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.role = Role(self.role)
        self.input_ids = np.ascontiguousarray(self.input_ids, dtype=np.int32)
        self.output_ids = np.ascontiguousarray(self.output_ids, dtype=np.int32)
        self.output_logprobs = np.ascontiguousarray(self.output_logprobs, dtype=np.float32)
        if self.output_versions is None:
            self.output_versions = np.full(len(self.output_ids), self.policy_version, dtype=np.int32)
        else:
            self.output_versions = np.ascontiguousarray(self.output_versions, dtype=np.int32)
        if self.message_starts is None:
            self.message_starts = np.zeros(0, dtype=np.int32)
        else:
            self.message_starts = np.ascontiguousarray(self.message_starts, dtype=np.int32)
        if len(self.output_logprobs) != len(self.output_ids):
            raise ValueError(
                f"CallRecord {self.execution_id}/{self.call_id}: output_logprobs has "
                f"{len(self.output_logprobs)} entries for {len(self.output_ids)} output tokens"
            )
        if len(self.output_versions) != len(self.output_ids):
            raise ValueError(
                f"CallRecord {self.execution_id}/{self.call_id}: output_versions has "
                f"{len(self.output_versions)} entries for {len(self.output_ids)} output tokens"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids) + len(self.output_ids)
