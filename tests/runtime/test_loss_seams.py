"""The loss at the runtime's seams, through the real glue, against hand values or float64 formulas.

  * the ledger's `scored` (`samples.outcome` of each reward, the TITO completeness check) →
    `samples.group_work`: which executions leave E (EXCLUDED, or an incomplete TITO) and which
    stay in it at reward 0 (PLACEHOLDER), with their advantages and |E|;
  * a whole execution split over two micro-steps, trained by `samples.train_bundle` on a real
    CpuActor, has the loss and gradients of docs/design.md §6 computed directly in float64;
  * |E| = valid: a step with an excluded execution reaches the optimizer with the gradient of
    the loss over the valid executions, not over B·N;
  * a step with no valid execution makes no update.

The float64 references run the HF model on each call's tokens unpacked and write the formula
out here; they share no code with the packer, the loss module or the actor.
"""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gyre.backends.config import OptimizerConfig
from gyre.backends.actors.cpu_actor import CpuActor
from gyre.executions.evaluator import RewardResult, RewardStatus
from gyre.executions.tasks import ExecutionSpec, Group, Task
from gyre.loss import LossConfig
from gyre.runtime.ledger import RunLedger
from gyre.runtime.messages import Reduce, StepDone
from gyre.runtime.samples import group_work, outcome, step_denominator, train_bundle
from gyre.trajectory.advantages import Outcome
from gyre.trajectory.materialize import ScoredExecution
from gyre.trajectory.record import CallRecord, Role
from tests.backends.helpers import tiny_model

VOCAB = 64
EPS_LOW, EPS_HIGH, CAP = 0.005, 0.005, 5.0  # LossConfig's defaults, written out for the formulas


def _call(eid, call_id, role, prompt, out, behavior):
    return CallRecord(eid, call_id, role, np.array(prompt), np.array(out), np.array(behavior, np.float32), 0)


def _target_logprobs(model, prompt, out):
    """ℓ_t of each output token of one call, the HF model run on prompt + out alone: [len(out)]."""
    ids = torch.tensor([list(prompt) + list(out)])
    logits = model(input_ids=ids, use_cache=False).logits[0].double()
    n = len(prompt)
    return torch.log_softmax(logits[n - 1 : n - 1 + len(out)], -1).gather(1, torch.tensor(out)[:, None])[:, 0]


def _term(model, calls, advantage, num_executions):
    """docs/design.md §6 for one execution whose targets are exactly its calls' outputs:
    −(1/|E|)·(m_i·A_i/L_i)·Σ_t ω_t·ℓ_t, with m_i and ω_t from the behavior log-probs as stored."""
    lp = torch.cat([_target_logprobs(model, p, o) for p, o, _ in calls])
    b = torch.cat([torch.tensor(np.array(bh, np.float32), dtype=torch.float64) for _, _, bh in calls])
    delta = lp.detach() - b
    length = lp.numel()
    s = math.exp(float(delta.sum()) / length)
    m = 0.0 if (advantage > 0 and s > 1 + EPS_HIGH) or (advantage < 0 and s < 1 - EPS_LOW) else 1.0
    omega = torch.clamp(torch.exp(delta), max=CAP)
    return -(m * advantage / length) * (omega * lp).sum() / num_executions, s



def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(got, want, what=""):
    """Norm-wise per tensor, 1e-6: Qwen2's RMSNorm computes in float32 even in a float64 model, so
    the same gradient at another loss scale differs by ~1e-7 (the errors hunted here are ≥ 1/3)."""
    assert got.keys() == want.keys()
    for n in want:
        err = float((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-300))
        assert err <= 1e-6, f"{what} {n}: relative error {err:.2e}"


# ----------------------------------------------------------------------------- the outcome glue
def test_excluded_leave_e_and_placeholders_stay_at_zero_through_the_ledger_glue():
    """Five executions, B·N = 8: e0 scored 1.0; e1, e2 evaluation failed after running (records);
    e3 harness crashed before its first call (placeholder, no records); e4 scored 1.0 but the
    proxy counted 2 calls and its TITO holds 1 record (incomplete: excluded like e1, e2).

    Valid: e0 (1.0) and e3 (0.0): mean 0.5, so A = (+0.5, −0.5) without std; the table is
    [e0 (L = 3), e3 (L = 0)], e0's tokens weigh −0.5/(8·3) = −1/48, |E| = 2, grad_scale 8/2 = 4.
    (EXCLUDED and PLACEHOLDER swapped, e1 and e2 would be valid zeros and e3 excluded: A =
    (2/3, −1/3, −1/3), |E| = 3; e4 trained despite its lost record: A = (1/3, ..), |E| = 3.)
    """
    prompt = [1, 2, 3, 4]
    recs = {e: [_call(e, 0, Role.MAIN, prompt, [10 + k, 20 + k, 30 + k], [-1.0, -1.5, -2.0])] for e, k in
            (("e0", 0), ("e1", 1), ("e2", 2), ("e4", 4))}
    rewards = [
        RewardResult("e0", RewardStatus.VALID, 1.0),
        RewardResult("e1", RewardStatus.EXCLUDED, None),
        RewardResult("e2", RewardStatus.EXCLUDED, None),
        RewardResult("e3", RewardStatus.PLACEHOLDER, 0.0),
        RewardResult("e4", RewardStatus.VALID, 1.0),
    ]
    assert [outcome(r) for r in rewards[:4]] == [Outcome.scored(1.0), Outcome.eval_failed(), Outcome.eval_failed(),
                                                 Outcome.harness_failed()]
    assert outcome(None) == Outcome.eval_failed()  # no reward result at all: not in E either

    task = Task.from_json({"task_id": "t", "instruction": "x", "harness": ["true"], "evaluator": {"command": ["true"]}})
    ledger = RunLedger(num_cells=1)
    ledger.add_group(0, Group("g", task, [ExecutionSpec(r.execution_id, task, "g", i) for i, r in enumerate(rewards)]),
                     version=0)
    for i, r in reversed(list(enumerate(rewards))):  # evaluation order is not execution order
        ledger.closed(r.execution_id, calls=2 if r.execution_id == "e4" else len(recs.get(r.execution_id, [])))
        ledger.evaluated(SimpleNamespace(execution_id=r.execution_id, index=i, reward=r))
    scored = ledger.scored(0, lambda eid: (recs.get(eid, []), False))
    assert [e.execution_id for e in scored] == ["e0", "e1", "e2", "e3", "e4"]
    assert ledger.incomplete_tito() == {"e4": "1 TITO records for its 2 calls"}
    work = group_work("g", 0, scored, num_executions=8, max_tokens=64, j_max=5, normalize_std=False,
                      rng=np.random.default_rng(0))
    assert work.rewards == [1.0, None, None, 0.0, None]
    (bundle,) = work.bundles
    (ms,) = bundle
    assert ms.advantages.tolist() == [0.5, -0.5]
    assert ms.exec_lengths.tolist() == [3, 0]
    assert ms.num_executions == 8
    assert ms.exec_index[ms.target_mask].tolist() == [0, 0, 0]
    assert ms.token_weight[ms.target_mask].tolist() == pytest.approx([-1 / 48] * 3, rel=1e-15)
    assert step_denominator([work.rewards], nominal=8, loss=LossConfig()) == (2, 4.0)
    assert step_denominator([work.rewards], nominal=8, loss=LossConfig(denominator="nominal")) == (2, 1.0)


# ----------------------------------------------------------------------------- split execution
def test_execution_split_over_two_micro_steps_trains_like_the_formula():
    """Execution x: two calls that branch after a shared 3-token prefix (two leaves, 12 targets),
    11 tokens each, with max_tokens 16: one bundle of two micro-steps. δ = +0.03 on the first
    call's tokens and −0.03 on the second's, so the whole execution has s ≈ 1 (trained, A = +1)
    while the first micro-step alone would have s = e^{0.03} > 1.005 (gated). Its loss and
    gradients through train_bundle must be the formula's for the whole execution."""
    model = tiny_model(seed=0, dtype=torch.float64, vocab=VOCAB)
    calls = {"x": [([1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15], 0.03), ([1, 2, 3, 9, 8], [20, 21, 22, 23, 24, 25], -0.03)],
             "y": [([1, 2, 3, 7], [30, 31, 32, 33], 0.0)]}
    with torch.no_grad():
        behavior = {e: [(p, o, (_target_logprobs(model, p, o) - d).tolist()) for p, o, d in cs] for e, cs in calls.items()}
    records = {e: [_call(e, i, Role.MAIN if i == 0 else Role.SUB, p, o, b) for i, (p, o, b) in enumerate(cs)]
               for e, cs in behavior.items()}
    items = [ScoredExecution("x", Outcome.scored(1.0), records=records["x"]),
             ScoredExecution("y", Outcome.scored(0.0), records=records["y"])]
    work = group_work("g", 0, items, num_executions=2, max_tokens=16, j_max=5, normalize_std=True,
                      rng=np.random.default_rng(0))
    split = [b for b in work.bundles if len(b) > 1]
    assert len(split) == 1 and len(split[0]) == 2  # the premise: x is cut into two micro-steps
    assert bool(split[0][0].exec_split[0]) and split[0][0].exec_lengths.tolist() == [12, 4]

    actor = CpuActor(tiny_model(seed=0, dtype=torch.float64, vocab=VOCAB), is_core=True, loss=LossConfig())
    metrics = train_bundle(actor, split[0])

    ref, s = _term(model, behavior["x"], advantage=1.0, num_executions=2)  # A_x = +1: rewards (1, 0), std 0.5
    assert abs(s - 1.0) < 1e-5  # whole: in the clip range, trained
    ref.backward()
    assert metrics["loss"] == pytest.approx(ref.item(), rel=1e-9)
    assert metrics["num_clipped"] == 0.0 and metrics["micro_steps"] == 2.0
    _assert_grads_close(_grads(actor.model), _grads(model))


# ----------------------------------------------------------------------------- |E| = valid
def _capture_optimizer_input(actor):
    """Replace the AdamW step by a recorder of the gradients it would see (after scale and clip)."""
    seen = {}
    actor.optimizer.step = lambda: seen.update(_grads(actor.model))
    return seen


def test_excluded_execution_leaves_the_denominator():
    """One group of N = 3 (B = 1, so B·N = 3): e0 scored 1, e1 scored 0, e2 evaluation failed.
    E = {e0, e1}, A = (+1, −1). The gradient reaching the optimizer must be that of
    −(1/2)·Σ_{i∈E} (m_i·A_i/L_i)·Σ_t ω_t·ℓ_t; with --loss.denominator nominal, 2/3 of it."""
    model = tiny_model(seed=1, dtype=torch.float64, vocab=VOCAB)
    wiggle = [0.001, -0.002, 0.0015, 0.0]  # small δ: ω ≠ 1, every s inside the clip range
    calls = {e: [([1, 2, 3, 4 + k], [10 + k, 20 + k, 30 + k, 40 + k], wiggle)] for k, e in enumerate(("e0", "e1", "e2"))}
    with torch.no_grad():
        behavior = {e: [(p, o, (_target_logprobs(model, p, o) - torch.tensor(d)).tolist()) for p, o, d in cs]
                    for e, cs in calls.items()}
    outcomes = {"e0": Outcome.scored(1.0), "e1": Outcome.scored(0.0), "e2": Outcome.eval_failed()}
    items = [ScoredExecution(e, outcomes[e], records=[_call(e, 0, Role.MAIN, p, o, b) for p, o, b in behavior[e]])
             for e in ("e0", "e1", "e2")]
    work = group_work("g", 0, items, num_executions=3, max_tokens=64, j_max=5, normalize_std=True,
                      rng=np.random.default_rng(0))

    ref = sum(_term(model, behavior[e], advantage=a, num_executions=2)[0] for e, a in (("e0", 1.0), ("e1", -1.0)))
    ref.backward()
    want = _grads(model)

    for denominator, factor in (("valid", 1.0), ("nominal", 2 / 3)):
        loss_cfg = LossConfig(denominator=denominator)
        actor = CpuActor(tiny_model(seed=1, dtype=torch.float64, vocab=VOCAB), is_core=True,
                         config=OptimizerConfig(max_grad_norm=1e9), loss=loss_cfg)  # no clipping
        for b in work.bundles:
            train_bundle(actor, b)
        valid, scale = step_denominator([work.rewards], nominal=3, loss=loss_cfg)
        assert valid == 2
        seen = _capture_optimizer_input(actor)
        actor.optimizer_step(grad_scale=scale)
        _assert_grads_close(seen, {n: g * factor for n, g in want.items()}, denominator)


def test_grad_scale_is_applied_before_the_clip():
    """Raw gradient g with norm n, grad_scale 2, clip at 1.5·n: scaled first, 2g (norm 2n) is
    clipped to 1.5g. (Scaled after the clip it would be 2g; not scaled, g.) The reported norm is
    the scaled one, 2n."""
    model = tiny_model(seed=2, dtype=torch.float64, vocab=VOCAB)
    actor = CpuActor(model, is_core=True)
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    raw = _grads(model)
    norm = math.sqrt(sum(float((v ** 2).sum()) for v in raw.values()))
    seen = _capture_optimizer_input(actor)
    out = actor.optimizer_step(max_grad_norm=1.5 * norm, grad_scale=2.0)
    assert out["grad_norm"] == pytest.approx(2 * norm, rel=1e-12)
    for n, v in raw.items():
        torch.testing.assert_close(seen[n], 1.5 * v, rtol=1e-6, atol=0, msg=n)


def test_loss_config_grad_scale_hand_values():
    assert LossConfig().grad_scale(nominal=8, valid=6) == pytest.approx(8 / 6)
    assert LossConfig().grad_scale(nominal=8, valid=8) == 1.0
    assert LossConfig(denominator="nominal").grad_scale(nominal=8, valid=6) == 1.0
    assert LossConfig().grad_scale(nominal=8, valid=0) is None
    assert LossConfig(denominator="nominal").grad_scale(nominal=8, valid=0) is None
    with pytest.raises(ValueError, match="valid <= nominal"):
        LossConfig().grad_scale(nominal=4, valid=5)
    assert step_denominator([[1.0, None], [0.0, 0.5]], nominal=4, loss=LossConfig()) == (3, pytest.approx(4 / 3))
    with pytest.raises(ValueError, match="loss.cap"):
        LossConfig(cap=0.0)


# ----------------------------------------------------------------------------- no valid execution
class _Recorder:
    def __init__(self):
        self.sent, self.put = [], []

    def send(self, dst, msg):
        self.sent.append(msg)

    def prefix(self, k):
        return None  # the core trains alone: reduce_gradients(None) is a no-op


def _core_worker(actor):
    from gyre.runtime.worker import CellWorker
    from gyre.runtime.cell import CellState

    rec = _Recorder()
    board = SimpleNamespace(post=lambda version, params, published=False: rec.put.append((version, params, published)))
    topo = SimpleNamespace(cell=0, position=0, rank=0, is_core=True)
    worker = CellWorker(topo, rec, rec, board, None, lambda is_core: actor)
    worker.actor = actor
    worker._to(CellState.DRAINING)
    worker._to(CellState.JOINING)
    return worker, rec


def test_a_step_with_no_valid_execution_makes_no_update(caplog):
    actor = CpuActor(tiny_model(seed=3, dtype=torch.float64, vocab=VOCAB), is_core=True, version=4)
    for p in actor.model.parameters():
        p.grad = torch.ones_like(p)  # whatever was accumulated must not move the parameters
    before = actor.export_parameters()
    worker, rec = _core_worker(actor)
    with caplog.at_level(logging.WARNING, logger="gyre.runtime.worker"):
        worker.handle(Reduce(step=4, k=1, final=True, grad_scale=None))
    assert "step 4: no execution has a valid reward" in caplog.text and "no update" in caplog.text
    assert actor.version == 5 and not actor.has_optimizer_state
    assert all(p.grad is None for p in actor.model.parameters())
    (version, params, published), = rec.put
    assert version == 5 and published
    for n, v in before.items():
        assert torch.equal(params[n], v), n
    done = [m for m in rec.sent if isinstance(m, StepDone)]
    assert done and done[0].stats == {"update_skipped": 1.0}


def test_reduce_passes_the_grad_scale_to_the_core_update():
    actor = CpuActor(tiny_model(seed=3, dtype=torch.float64, vocab=VOCAB), is_core=True)
    calls = []
    actor.optimizer_step = lambda max_grad_norm=None, *, grad_scale=1.0: calls.append(grad_scale) or {"grad_norm": 0.0}
    worker, _ = _core_worker(actor)
    worker.handle(Reduce(step=0, k=1, final=True, grad_scale=8 / 6))
    assert calls == [8 / 6]
