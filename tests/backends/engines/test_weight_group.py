"""The weight-update group between the core and SGLang meets: Gyre's `WeightBroadcaster` (rank 0,
this process) and SGLang's side of `init_weights_update_group` (rank 1, a process of its own, as
SGLang's scheduler is) build the same store layout, and a broadcast arrives bit-exact.

SGLang's side is sglang 0.5.23's `init_custom_process_group` (utils/common.py:2859-2927) as
`init_weights_update_group` calls it (model_executor/model_runner_components/weight_updater.py:
133-139): a tcp:// rendezvous, PrefixStore(group_name), then torch's `_new_process_group_helper`,
which adds PrefixStore(f"{group_name}/") and PrefixStore(f"{device}/"). Rank 1 receives the way
SGLang does (weight_updater.py:276-298): `torch.distributed.broadcast(src=0, group=pg,
async_op=True)` per name, then wait, which needs the group registered with torch's world.

  rewrite  the conformance fake's own rewrite of that function (tests/backends/sglang_fake.py)
  sglang   the fake's join with GYRE_SGLANG_SRC set: it execs SGLang's own function from the
           unpacked wheel (skipped without it)
  DETAIL   both sides with TORCH_DISTRIBUTED_DEBUG=DETAIL (torch's checking wrapper)

Every wait is short (TIMEOUT_S), so a layout mismatch fails as a timeout in seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from gyre.backends.engines.weight_group import WeightBroadcaster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TIMEOUT_S = 60  # the child's start (python, torch, the fake) included; a layout mismatch still fails, later

# Rank 1: the engine's TP rank 0 with rank_offset=1 (weight_updater.py:122).
CHILD = r"""
import json, sys, torch
import torch.distributed as dist
from tests.backends import sglang_fake as f

port, group_name, specs, out = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
f.JOIN_TIMEOUT_S = float(sys.argv[5])
m = f.InitWeightsUpdateGroupReqInput(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2,
                                     group_name=group_name, backend="gloo")
pg = f._join_group(m)
got, handles = {}, []
for name, dtype, shape in specs:  # weight_updater.py:280-298
    t = torch.empty(shape, dtype=getattr(torch, dtype))
    handles.append(dist.broadcast(t, src=0, group=pg, async_op=True))
    got[name] = t
for h in handles:
    h.wait()
torch.save({"tensors": got, "source": getattr(f, "JOINED_WITH", None)}, out)
"""


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(3, 5, generator=g)
    w[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45])  # bit patterns a cast would change
    return {"model.embed.weight": w,
            "model.layers.0.mlp.down_proj.weight": torch.randn(4, 6, generator=g).to(torch.bfloat16).t(),  # not contiguous
            "model.layers.0.norm.weight": torch.randn(2, 3, 4, generator=g).to(torch.float16),
            "model.step": torch.tensor([2**53 + 1, -3, 0], dtype=torch.int64)}


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("side,debug", [("rewrite", "OFF"), ("sglang", "OFF"), ("rewrite", "DETAIL")])
def test_weight_broadcaster_meets_sglangs_group_and_tensors_arrive_bit_exact(side, debug, tmp_path):
    """debug=DETAIL: with TORCH_DISTRIBUTED_DEBUG=DETAIL torch wraps SGLang's group in a checking
    wrapper with a gloo helper group of its own (distributed_c10d.py:2289-2306); rank 0 must too."""
    import torch.distributed as dist

    env = {**os.environ, "PYTHONPATH": ROOT, "TORCH_DISTRIBUTED_DEBUG": debug}
    if side == "sglang":
        if not os.environ.get("GYRE_SGLANG_SRC"):
            pytest.skip("set GYRE_SGLANG_SRC to an unpacked sglang 0.5.23 wheel to run SGLang's own join")
    else:
        env.pop("GYRE_SGLANG_SRC", None)
    params = _params()
    names = list(params)
    level = dist.get_debug_level()
    dist.set_debug_level(getattr(dist.DebugLevel, debug))
    try:
        core = WeightBroadcaster("127.0.0.1", 0, 2, backend="gloo", timeout_s=TIMEOUT_S)
        got = _run(core, params, env, tmp_path / "got.pt")
    finally:
        dist.set_debug_level(level)
    assert got["source"] == ("sglang" if side == "sglang" else "rewrite")
    assert list(got["tensors"]) == names
    for name, sent in params.items():
        arrived = got["tensors"][name]
        assert arrived.dtype == sent.dtype and arrived.shape == sent.shape, name
        assert _bits(arrived) == _bits(sent), name


def _run(core: WeightBroadcaster, params: dict[str, torch.Tensor], env: dict[str, str], out) -> dict:
    """Rank 1 in a process of its own, rank 0 here; what rank 1 received."""
    names, dtypes, shapes = WeightBroadcaster.describe(params)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(core.port), core.group_name,
                              json.dumps(list(zip(names, dtypes, shapes))), str(out), str(TIMEOUT_S)],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        core.connect()
        core.send(params)
        log = child.communicate(timeout=TIMEOUT_S)[0]
    except Exception as e:  # rank 0 timed out (or rank 1 did not finish): show both sides
        try:
            log = child.communicate(timeout=5)[0]  # rank 1's own timeout, a moment later
        except subprocess.TimeoutExpired:
            child.kill()
            log = child.communicate()[0]
        pytest.fail(f"rank 0: {type(e).__name__}: {e}\n--- rank 1:\n{log[-3000:]}")
    assert child.returncode == 0, log[-3000:]
    return torch.load(out)
