"""gyre.runtime.rundir: one directory per run, decided on rank 0 and shared with every rank."""

import json
import threading

import pytest
import torch.distributed as dist

from gyre.runtime import rundir
from gyre.config import parse_config


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _cfg(*args):
    return parse_config(["--job", "train", *args])


def test_default_runs_get_fresh_timestamped_dirs_and_latest_follows(in_tmp):
    t = 1_800_000_000.0  # two runs in the same second, a third later
    a = rundir.decide(_cfg(), now=t)
    b = rundir.decide(_cfg(), now=t)
    c = rundir.decide(_cfg(), now=t + 61)
    root = in_tmp / "runs" / "train"  # no --preset: runs/train
    assert a.parent == b.parent == c.parent == root.resolve()
    assert b.name == a.name + "-2" and c.name != a.name and len({a, b, c}) == 3
    assert (root / "latest").resolve() == c
    assert rundir.decide(_cfg("--train.resume")) == c  # resume without --run-dir: the latest run


def test_resume_without_any_previous_run_names_the_fix(in_tmp):
    with pytest.raises(rundir.RunDirError, match="no previous run to resume.*runs/train/latest.*--run-dir"):
        rundir.decide(_cfg("--train.resume"))


def test_an_explicit_dir_with_a_run_is_refused_then_overwritten_only_where_gyre_wrote(in_tmp):
    run = in_tmp / "mine"
    (run / "executions" / "x").mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    (run / "notes.txt").write_text("the user's own file")
    with pytest.raises(rundir.RunDirError) as e:
        rundir.decide(_cfg("--run-dir", str(run)))
    msg = str(e.value)
    assert "executions" in msg and "summary.json" in msg
    for flag in ("--train.resume", "--overwrite", "--run-dir"):
        assert flag in msg
    assert rundir.decide(_cfg("--run-dir", str(run), "--overwrite")) == run.resolve()
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]
    assert rundir.decide(_cfg("--run-dir", str(run))) == run.resolve()  # now fresh: accepted


def test_every_rank_gets_rank_0s_decision_or_its_refusal(in_tmp):
    store = dist.HashStore()
    cfgs = [_cfg("--seed", "3") for _ in range(3)]
    got: dict[int, object] = {}

    def rank(r):
        try:
            got[r] = rundir.resolve(cfgs[r], r, 3, store)
        except rundir.RunDirError as e:
            got[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    rank(0)
    for t in threads:
        t.join(10)
    assert got[0] == got[1] == got[2] and all(c.run_dir == str(got[0]) for c in cfgs)
    manifest = json.loads((got[0] / "run.json").read_text())
    assert manifest["world_size"] == 3 and manifest["config"]["seed"] == 3

    # A refusal reaches every rank as the same error.
    store2 = dist.HashStore()
    (in_tmp / "taken").mkdir()
    (in_tmp / "taken" / "metrics.jsonl").write_text("")
    cfgs = [_cfg("--run-dir", str(in_tmp / "taken")) for _ in range(2)]
    errors = {}

    def rank2(r):
        try:
            rundir.resolve(cfgs[r], r, 2, store2)
        except rundir.RunDirError as e:
            errors[r] = str(e)

    t = threading.Thread(target=rank2, args=(1,))
    t.start()
    rank2(0)
    t.join(10)
    assert errors[0] == errors[1] and "already holds a run" in errors[0]
