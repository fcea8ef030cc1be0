"""Does the weight-update path write every parameter the engine serves? (SGLang's check_weights)

The read-back (`readback`) compares what the engine serves with what was sent, parameter by
parameter, through SGLang's `get_weights_by_name`; sglang 0.5.23 implements that only for a few
classes (models/llama.py:819, opt.py, granite.py, exaone4.py, embedding_gemma2.py), not for the
Qwen2/Qwen3/Qwen3-MoE classes users train, where a renamed parameter that `load_weights` skips
(qwen3.py:760, qwen2.py:719 warn; qwen3_moe.py:1224, 1244, 1266 say nothing) would serve stale
weights unseen. SGLang has a check for every class instead: `TokenizerManager.check_weights`
(managers/tokenizer_control_mixin.py:890-909 → scheduler_components/weight_updater.py:424-456 →
model_runner.py:2227 → utils/weight_checker.py:126-149), used once at start (`run`):

    snapshot        every named parameter and buffer of the model copied to one host arena
                    (weight_checker.py:151-176, 248-251): a host copy of the model, per TP rank its shard
    reset_tensors   every compared tensor filled with random values (weight_checker.py:178-183, 314-335)
    push            the starting weights through Gyre's normal bucketed update path, same version
    compare         the model against the snapshot, bitwise (weight_checker_comparator.py:123-171, raw tensors);
                    a tensor the update did not write still holds its random values, and SGLang
                    raises "check tensor equality failed:\\n name=... max_abs_err=..." (one line per
                    tensor, weight_checker.py:258-311), answered as success=False with that message
                    (weight_updater.py:453-456); on success the snapshot is freed (:203-204)

The starting weights are the values SGLang loaded from the checkpoint, so "equal" means every
parameter the model has was written by the update path. Non-persistent buffers (rotary caches)
are skipped by SGLang on both sides (weight_checker.py:60-82). Names in the error are SGLang's
own (q/k/v live in one qkv_proj, gate/up in one gate_up_proj, experts in w13/w2)."""

from __future__ import annotations

import logging
import re
from typing import Any, Awaitable, Callable

logger = logging.getLogger(__name__)

MODES = ("auto", "always", "off")
_NAME = re.compile(r"name=(\S+) max_abs_err=")  # weight_checker.py:293-300, one per differing tensor


class WeightCoverageError(RuntimeError):
    """The update path leaves parameters of the served model unwritten (names them)."""


def failed_names(message: str) -> list[str]:
    """The tensor names in SGLang's "check tensor equality failed" message (with TP, one message
    per rank joined by " | ", communicator.py:106-110), each once, in order."""
    return list(dict.fromkeys(_NAME.findall(message)))


def outcome(result: Any) -> tuple[bool, str]:
    """(success, message) of TM.check_weights' answer: a (success, message, ranks, checksum)
    tuple (tokenizer_control_mixin.py:890-909), or an object with .success / .message."""
    if isinstance(result, tuple):
        return bool(result[0]), str(result[1]) if len(result) > 1 else ""
    return bool(getattr(result, "success", True)), str(getattr(result, "message", ""))


async def run(check: Callable[[str], Awaitable[Any]], push: Callable[[], Awaitable[int]], *, engine: str,
              prime: bool = False) -> int:
    """snapshot → reset_tensors → push() → compare. `check(action)` calls TM.check_weights;
    `push()` sends the starting weights (same version) and returns how many tensors it sent.
    `prime`: push once before the snapshot too (the engine did not load the checkpoint: SGLang's
    load_format dummy, random weights), so the snapshot holds the starting weights.
    Raises WeightCoverageError naming the tensors the push left unwritten, RuntimeError when a
    step itself fails (the engine then holds random weights: the caller must not serve it).
    Returns the number of tensors sent."""
    if prime:
        await push()
    for action in ("snapshot", "reset_tensors"):
        ok, message = outcome(await check(action))
        if not ok:
            raise RuntimeError(f"{engine}: SGLang check_weights(action={action!r}) failed: {message or '(no message)'}")
    sent = await push()
    ok, message = outcome(await check("compare"))
    if not ok:
        names = failed_names(message)
        if not names:
            raise RuntimeError(f"{engine}: SGLang check_weights(action='compare') failed: {message or '(no message)'}")
        logger.error("%s: SGLang's compare after the coverage update: %s", engine, message)
        raise WeightCoverageError(
            f"{engine}: Gyre's weight update leaves {len(names)} tensors of the served model unwritten (they kept "
            f"the random values of SGLang's check_weights reset; a name SGLang's load_weights skipped or only "
            f"warned about): {', '.join(names[:8])}{' ...' if len(names) > 8 else ''} (SGLang's names: q/k/v are "
            f"one qkv_proj, gate/up one gate_up_proj). Stopped before serving; --transfer.coverage-check off "
            f"skips this check")
    logger.info("%s: every parameter the weight-update path writes matched the checkpoint (SGLang check_weights, "
                "bitwise, every tensor of the served model) after %d tensors sent; the host snapshot is freed",
                engine, sent)
    return sent


async def at_start(tm: Any, io: Any, mode: str, names: list[str], push: Callable[[], Awaitable[int]], *,
                   engine: str, prime: bool = False) -> int | None:
    """--transfer.coverage-check at an SGLang engine's start (`tm`: its TokenizerManager, `io`: its
    io_struct; `names`: the checkpoint names the update sends). auto: only when SGLang cannot read
    the class's weights back by name, which the read-back after the first update needs
    (get_weights_by_name answers None: the exporter catches the class's missing method,
    weight_exporter.py:181-188; Qwen2/Qwen3/Qwen3-MoE in 0.5.23); always: every start; off: never.
    Returns the tensors sent, None when not run."""
    if mode not in MODES:
        raise ValueError(f"--transfer.coverage-check: one of {MODES}, got {mode!r}")
    if mode == "off":
        return None
    if mode == "auto":
        probe = next(n for n in names if not n.endswith((".experts.gate_up_proj", ".experts.down_proj")))
        if await tm.get_weights_by_name(io.GetWeightsByNameReqInput(name=probe, truncate_size=1), None) is not None:
            logger.info("%s: weights read back by name after the first update; no coverage check at start", engine)
            return None

    async def check(action: str) -> Any:  # target: Gyre's updates write no draft model's own weights
        return await tm.check_weights(io.CheckWeightsReqInput(action=action, selector="target"), None)

    return await run(check, push, engine=engine, prime=prime)
