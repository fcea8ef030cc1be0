"""Groups whose rewards are all equal (zero advantage) cost no forward and no backward (issue 51).

  * such a group makes no micro-step (`materialize_step`'s default, as slime and verl filter
    them), yet its valid executions stay in |E|: the other groups' gradient is the one with the
    group packed at weight 0, and the float64 formula of docs/design.md §6 written out here;
  * a step in which every group is all-equal sends `Reduce(trained=False)`: no reduce, no AdamW
    step (which would move the weights through its momentum), the version still advances and the
    posted snapshot is the previous one bit for bit;
  * the step row and summary.json count them (`zero_advantage_groups`);
  * a real job whose evaluator prints 1 for every execution trains no token at all.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from gyre.backends.actors.cpu_actor import CpuActor
from gyre.backends.config import OptimizerConfig
from gyre.loss import LossConfig
from gyre.runtime.messages import Reduce, StepDone, TrainWork, WorkDone
from gyre.runtime.samples import GroupWork, group_work, train_bundle
from gyre.trajectory.advantages import Outcome
from gyre.trajectory.materialize import ScoredExecution, ScoredGroup, materialize_step
from gyre.trajectory.record import Role
from tests.backends.helpers import tiny_model
from tests.runtime.test_loss_seams import VOCAB, _call, _core_worker, _grads, _target_logprobs, _term

WIGGLE = [0.001, -0.002, 0.0015, 0.0]  # small δ: ω ≠ 1, every s inside the clip range


def _groups(model):
    """g0: rewards (1, 0) → A = (+1, −1); g1: (1, 1) and g2: (0, 0, excluded) all equal.
    |E| = 2 + 2 + 2 = 6 valid executions (g2's excluded one is not in E)."""
    rewards = {"g0": [1.0, 0.0], "g1": [1.0, 1.0], "g2": [0.0, 0.0, None]}
    behavior, groups, k = {}, [], 0
    for gid, rs in rewards.items():
        items = []
        for i, r in enumerate(rs):
            eid, k = f"{gid}e{i}", k + 1
            p, o = [1, 2, 3, 4 + k], [10 + k, 20 + k, 30 + k, 40 + k]
            with torch.no_grad():
                behavior[eid] = [(p, o, (_target_logprobs(model, p, o) - torch.tensor(WIGGLE)).tolist())]
            recs = [_call(eid, 0, Role.MAIN, p, o, b) for p, o, b in behavior[eid]]
            items.append(ScoredExecution(eid, Outcome.scored(r) if r is not None else Outcome.eval_failed(),
                                         records=recs))
        groups.append(ScoredGroup(gid, 0, items))
    return groups, behavior


def _train(batch_or_bundles, seed):
    actor = CpuActor(tiny_model(seed=seed, dtype=torch.float64, vocab=VOCAB), is_core=True, loss=LossConfig())
    for b in batch_or_bundles:
        train_bundle(actor, b)
    return actor


def test_all_equal_groups_make_no_micro_step_and_leave_the_gradient_as_it_was():
    model = tiny_model(seed=5, dtype=torch.float64, vocab=VOCAB)
    groups, behavior = _groups(model)
    rng = lambda: np.random.default_rng(0)  # noqa: E731
    kept = materialize_step(groups, max_tokens=64, rng=rng(), skip_zero_advantage=False)
    skipped = materialize_step(groups, max_tokens=64, rng=rng())  # the default
    assert kept.all_equal_groups == skipped.all_equal_groups == ["g1", "g2"]
    assert [s.execution_id for s in kept.samples] == ["g0e0", "g0e1", "g1e0", "g1e1", "g2e0", "g2e1"]
    assert [s.execution_id for s in skipped.samples] == ["g0e0", "g0e1"]
    # |E| = 6 either way: g0's 4 targets weigh −A/(6·4) = ∓1/24
    for batch in (kept, skipped):
        assert {m.num_executions for m in batch.micro_steps} == {6}
    w = sorted(x for m in skipped.micro_steps for x in m.token_weight[m.target_mask].tolist())
    assert w == [-1 / 24] * 4 + [1 / 24] * 4
    assert sum(m.num_tokens for m in skipped.micro_steps) == 2 * 8  # g0's two sequences, nothing else

    a_kept = _train([[m] for m in kept.micro_steps], seed=5)
    a_skip = _train([[m] for m in skipped.micro_steps], seed=5)
    ref = sum(_term(model, behavior[e], advantage=a, num_executions=6)[0] for e, a in (("g0e0", 1.0), ("g0e1", -1.0)))
    ref.backward()
    want, got_kept, got_skip = _grads(model), _grads(a_kept.model), _grads(a_skip.model)
    assert got_skip.keys() == got_kept.keys() == want.keys()
    for n in want:
        # skipping changes no float: the zero-weight tokens added exact zeros to the kept run's sums
        assert torch.equal(got_skip[n], got_kept[n]), n
        err = float((got_skip[n] - want[n]).norm() / want[n].norm().clamp_min(1e-300))
        assert err <= 1e-6, f"{n}: relative error {err:.2e} against the formula"


def test_group_work_of_an_all_equal_group_is_one_empty_item():
    model = tiny_model(seed=5, dtype=torch.float64, vocab=VOCAB)
    groups, _ = _groups(model)
    g1 = groups[1]
    work = group_work("g1", 0, g1.executions, num_executions=4, max_tokens=64, j_max=5, normalize_std=True,
                      rng=np.random.default_rng(0))
    assert work.zero_advantage and not work.trains
    assert work.bundles == [[]]  # one empty item: the scheduler still counts the group done
    assert work.rewards == [1.0, 1.0]  # still in E: the step's |E| (valid) counts them
    g0 = group_work("g0", 0, groups[0].executions, num_executions=4, max_tokens=64, j_max=5, normalize_std=True,
                    rng=np.random.default_rng(0))
    assert not g0.zero_advantage and g0.trains
    assert train_bundle(None, []) == {"micro_steps": 0.0}  # an empty item never touches the actor


def test_a_step_of_only_all_equal_groups_leaves_weights_and_optimizer_state_bit_identical():
    """After a real update (AdamW now holds momentum), a Reduce(trained=False) must not step:
    an AdamW step on zero gradients would still move every weight by its momentum."""
    actor = CpuActor(tiny_model(seed=3, dtype=torch.float64, vocab=VOCAB), is_core=True,
                     config=OptimizerConfig(lr=1e-2))
    worker, rec = _core_worker(actor)
    model = tiny_model(seed=5, dtype=torch.float64, vocab=VOCAB)
    groups, _ = _groups(model)
    batch = materialize_step(groups[:1], max_tokens=64, rng=np.random.default_rng(0))
    for m in batch.micro_steps:
        train_bundle(actor, [m])
    worker.reduce_calls = []
    actor.reduce_gradients = lambda group: worker.reduce_calls.append(group)
    worker.handle(Reduce(step=0, k=1, final=False, grad_scale=1.0))
    assert actor.version == 1 and actor.has_optimizer_state and worker.reduce_calls == [None]
    before = actor.export_parameters()
    state = {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
             for k, s in actor.optimizer.state_dict()["state"].items()}

    worker.handle(Reduce(step=1, k=1, final=True, grad_scale=1.0, trained=False))
    assert worker.reduce_calls == [None]  # no all-reduce for a step nobody trained
    assert actor.version == 2
    after = actor.export_parameters()
    assert all(torch.equal(after[n], before[n]) for n in before)
    for k, s in actor.optimizer.state_dict()["state"].items():
        for n, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(state[k][n])), (k, n)
    (v1, _, _), (v2, params, published) = rec.put
    assert (v1, v2, published) == (1, 2, True)
    assert all(torch.equal(params[n], before[n]) for n in before)
    done = [m for m in rec.sent if isinstance(m, StepDone)]
    assert [d.step for d in done] == [0, 1] and done[1].stats == {"update_skipped": 1.0}


def test_the_controller_sends_trained_false_only_when_no_group_of_the_step_made_a_micro_step(tmp_path):
    from tests.runtime.test_controller_reduce import _controller, _switch_in

    for bundles, zero, trained in (([[]], True, False), ([["ms"]], False, True)):
        (tmp_path / str(trained)).mkdir()
        ctl = _controller(tmp_path / str(trained), num_cells=2)
        ctl._apply(ctl.sched.start())
        rec = ctl.ledger.groups[0]
        for spec in rec.spec.executions:
            ctl._apply(ctl.sched.on_execution_finished(0, spec.index))
        ctl.ledger.set_work(0, GroupWork(bundles, [1.0, 1.0] if zero else [1.0, 0.0], zero_advantage=zero))
        ctl._apply(ctl.sched.on_group_ready(0, 1))
        _switch_in(ctl, 0)
        ctl.pending.add(0)
        ctl._serve_pending()
        (work,) = [m for _, m in ctl.plane.sent if isinstance(m, TrainWork)]
        ctl._on_message(WorkDone(cell=0, rank=0, step=0, group=0, item=0,
                                 metrics={"micro_steps": float(len(bundles[0]))}))
        (reduce,) = [m for _, m in ctl.plane.sent if isinstance(m, Reduce)]
        assert reduce.trained is trained and reduce.grad_scale == 1.0
        ctl._on_message(StepDone(cell=0, rank=0, step=0, stats={}))
        (row,) = [json.loads(x) for x in (tmp_path / str(trained) / "run" / "metrics.jsonl").read_text().splitlines()]
        assert row["zero_advantage_groups"] == int(zero) and row["groups"] == 1
        assert ctl.ledger.zero_advantage_groups == int(zero)


# ----------------------------------------------------------------------------- a real job
@pytest.mark.jobs
def test_a_job_whose_rewards_are_all_equal_trains_no_token(tmp_path):
    """Every execution scores 1 (a command evaluator printing 1): each group is all-equal, so no
    micro-step is made, the actor never runs a forward or backward, and the final checkpoint holds
    the initial weights bit for bit (the updates were skipped: AdamW would move nothing here, but
    a step on zero gradients still counts its `step`, and the optimizer state stays empty)."""
    from safetensors.torch import load_file

    from tests.jobs import RUNS, env, log_of, tiny_task, write_task_rows

    tasks = write_task_rows(tmp_path / "tasks.jsonl", [{**tiny_task(), "evaluator": {"command": ["echo", "1"]}}] * 4)
    run = tmp_path / "run"
    proc = subprocess.run(RUNS["zero_advantage"].command(tasks, run), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=env())
    assert proc.returncode == 0, log_of(proc)[-4000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["rewards"] == [1.0] * 4 and r["groups"] == 2
        assert r["zero_advantage_groups"] == 2
        assert r["tokens_trained"] == 0 and r["micro_steps"] == 0 and r["targets_trained"] == 0
        assert r["update_skipped"] == 1.0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["zero_advantage_groups"] == 4 and summary["steps"] == 2
    ckpt = run / "checkpoints" / "step_000002"
    assert not torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]  # AdamW never stepped
    final = load_file(str(ckpt / "model.safetensors"))
    from gyre.backends.models.hf import build_model, model_config

    initial = build_model(model_config("tiny", next(iter(v for k, v in final.items() if "embed" in k)).shape[0]),
                          seed=0).state_dict()
    assert final.keys() <= initial.keys()
    assert all(torch.equal(final[k], initial[k]) for k in final), "weights moved without a trained token"
    assert Path(ckpt / "gyre_actor.json").is_file() and json.loads((ckpt / "gyre_actor.json").read_text())["version"] == 2
