"""gyre.runtime.rundir: one directory per run, decided on rank 0 and shared with every rank (its
attempts: tests/runtime/test_attempts.py)."""

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from gyre.runtime import rundir
from gyre.config import parse_config
from gyre.run import resolve_run_dir


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _cfg(*args):
    return parse_config(["--job", "train", *args])


def _decide(cfg, **kw):
    return rundir.decide(cfg.run_dir, cfg.preset, resume=cfg.train.resume, overwrite=cfg.overwrite, **kw)


def _refusals_on_two_ranks(cfgs, store) -> dict[int, str]:
    """`rundir.resolve` as ranks 0 and 1 of one job (rank 1 in a thread): each rank's RunDirError."""
    errors = {}

    def rank(r):
        try:
            resolve_run_dir(cfgs[r], r, 2, store)
        except rundir.RunDirError as e:
            errors[r] = str(e)

    t = threading.Thread(target=rank, args=(1,))
    t.start()
    rank(0)
    t.join(10)
    return errors


def test_default_runs_get_fresh_timestamped_dirs_and_latest_follows(in_tmp):
    t = 1_800_000_000.0  # two runs in the same second, a third later
    a = _decide(_cfg(), now=t)
    b = _decide(_cfg(), now=t)
    c = _decide(_cfg(), now=t + 61)
    root = in_tmp / "runs" / "train"  # no --preset: runs/train
    assert a.parent == b.parent == c.parent == root.resolve()
    assert b.name == a.name + "-2" and c.name != a.name and len({a, b, c}) == 3
    assert (root / "latest").resolve() == c
    assert _decide(_cfg("--train.resume")) == c  # resume without --run-dir: the latest run


def test_resume_without_any_previous_run_names_the_fix(in_tmp):
    with pytest.raises(rundir.RunDirError, match="no previous run to resume.*runs/train/latest.*--run-dir"):
        _decide(_cfg("--train.resume"))


def test_an_explicit_dir_with_a_run_is_refused_then_overwritten_only_where_gyre_wrote(in_tmp):
    run = in_tmp / "mine"
    (run / "executions" / "x").mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    (run / "notes.txt").write_text("the user's own file")
    with pytest.raises(rundir.RunDirError) as e:
        _decide(_cfg("--run-dir", str(run)))
    msg = str(e.value)
    assert "executions" in msg and "summary.json" in msg
    for flag in ("--train.resume", "--overwrite", "--run-dir"):
        assert flag in msg
    assert _decide(_cfg("--run-dir", str(run), "--overwrite")) == run.resolve()
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt", "run.lock"]  # the lock file stays (runlock.py)
    assert _decide(_cfg("--run-dir", str(run))) == run.resolve()  # now fresh: accepted


def test_every_rank_gets_rank_0s_decision_or_its_refusal(in_tmp):
    store = dist.HashStore()
    cfgs = [_cfg("--seed", "3") for _ in range(3)]
    got: dict[int, object] = {}

    def rank(r):
        try:
            got[r] = resolve_run_dir(cfgs[r], r, 3, store).path
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
    assert manifest["attempts"][0]["world_size"] == 3 and manifest["config"]["seed"] == 3

    # A refusal reaches every rank as the same error.
    store2 = dist.HashStore()
    (in_tmp / "taken").mkdir()
    (in_tmp / "taken" / "metrics.jsonl").write_text("")
    cfgs = [_cfg("--run-dir", str(in_tmp / "taken")) for _ in range(2)]
    errors = _refusals_on_two_ranks(cfgs, store2)
    assert errors[0] == errors[1] and "already holds a run" in errors[0]


def _launch(cfg, rank, world, store, **kw):
    """One launch that has ended by the time the next one comes: its rank 0 lets the lock go."""
    run = resolve_run_dir(cfg, rank, world, store, **kw)
    if run.lock is not None:
        run.lock.release()
    return run


def _complete_checkpoint(run, version):
    from gyre import checkpoint

    def save(path):
        for name in ("config.json", "model.safetensors", "optimizer.pt"):
            (Path(path) / name).write_text("x")
        (Path(path) / "gyre_actor.json").write_text(json.dumps({"version": version}))
    return checkpoint.write(run / "checkpoints", version, save)


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_resume_is_a_new_attempt_and_cuts_metrics_and_events_back_to_its_checkpoint(in_tmp):
    run = in_tmp / "run"
    first = _launch(_cfg("--run-dir", str(run), "--train.steps", "9"), 0, 1, dist.HashStore())
    assert (first.attempt, first.start_version, first.checkpoint) == (0, 0, "")
    _complete_checkpoint(run, 4)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "version": s + 1}) + "\n" for s in range(6))
                                       + '{"step": 6, "ver')  # torn: the crash came while writing it
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [
        {"t": 0, "kind": "dispatch"}, {"t": 1, "kind": "step_done", "step": 3},
        {"t": 2, "kind": "claim", "step": 4}, {"t": 3, "kind": "step_done", "step": 4}]))
    for attempt in (1, 2):  # resuming twice from the same checkpoint: two attempts, the same cut
        cfg = _cfg("--run-dir", str(run), "--train.resume", "--train.steps", "9")
        got = _launch(cfg, 0, 2, dist.HashStore())
        assert (got.attempt, got.start_version) == (attempt, 4)
        assert got.checkpoint == str(run / "checkpoints" / "step_000004") == cfg.train.resume_from
        assert [r["step"] for r in _rows(run / "metrics.jsonl")] == [0, 1, 2, 3]
        assert [e["kind"] for e in _rows(run / "events.jsonl")] == ["dispatch", "step_done"]
    attempts = json.loads((run / "run.json").read_text())["attempts"]
    assert [(a["attempt"], a["start_version"], a["world_size"]) for a in attempts] == [(0, 0, 1), (1, 4, 2), (2, 4, 2)]


def test_a_resume_before_the_first_checkpoint_starts_again_and_a_broken_or_finished_one_is_refused(in_tmp, caplog):
    """Issue 53 item 1: a run stopped before its first checkpoint (a preemption before step 1) is
    resumed by starting again from version 0, by hand or by a requeue, instead of being refused
    for ever. Checkpoints that are there but unusable are still refused, naming each, and the
    weights-only hint appears only when some of them has readable weights."""
    run = in_tmp / "run"
    _launch(_cfg("--run-dir", str(run)), 0, 1, dist.HashStore())
    (run / "metrics.jsonl").write_text("")
    again = _launch(_cfg("--run-dir", str(run), "--train.resume"), 0, 1, dist.HashStore())
    assert (again.attempt, again.start_version, again.checkpoint) == (1, 0, "")
    assert "no checkpoint in" in caplog.text and "starting again from version 0" in caplog.text
    broken = run / "checkpoints" / "step_000003"
    broken.mkdir(parents=True)  # a step directory without its files or marker
    with pytest.raises(rundir.RunDirError, match="no complete checkpoint.*step_000003") as e:
        _launch(_cfg("--run-dir", str(run), "--train.resume"), 0, 1, dist.HashStore())
    assert "--train.resume-weights-only" not in str(e.value)  # nothing there it could take
    for name in ("config.json", "model.safetensors"):
        (broken / name).write_text("x")
    with pytest.raises(rundir.RunDirError, match="--train.resume-weights-only accepts"):
        _launch(_cfg("--run-dir", str(run), "--train.resume"), 0, 1, dist.HashStore())
    shutil.rmtree(broken)
    _complete_checkpoint(run, 6)
    with pytest.raises(rundir.RunDirError, match="already at version 6 >= --train.steps 6"):
        _launch(_cfg("--run-dir", str(run), "--train.resume", "--train.steps", "6"), 0, 1, dist.HashStore())


def test_a_restarted_job_finds_the_directory_its_first_attempt_chose(in_tmp):
    elastic = dist.HashStore()  # torchrun's agent store: it outlives the workers
    first = _launch(_cfg("--train.steps", "9"), 0, 2, dist.HashStore(), elastic=elastic)
    assert first.path.parent == (in_tmp / "runs" / "train").resolve()
    # Restart 1 comes before any checkpoint: the same directory, from version 0, a new attempt.
    (first.path / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    again = _launch(_cfg("--train.steps", "9"), 0, 2, dist.HashStore(), restart=1, elastic=elastic)
    assert (again.path, again.attempt, again.start_version) == (first.path, 1, 0)
    assert (first.path / "metrics.jsonl").read_text() == ""
    # Restart 2 after a checkpoint: resumes from it.
    _complete_checkpoint(first.path, 2)
    cfg = _cfg("--train.steps", "9")
    third = _launch(cfg, 0, 2, dist.HashStore(), restart=2, elastic=elastic)
    assert (third.path, third.attempt, third.start_version) == (first.path, 2, 2) and cfg.train.resume
    assert len([p for p in (in_tmp / "runs" / "train").iterdir() if p.name != "latest"]) == 1


def test_a_restart_after_the_final_checkpoint_finds_the_run_finished_on_every_rank(in_tmp):
    """A rank that dies after the last step's checkpoint restarts the job: nothing is left to
    train, which is success (RunFinished, exit 0), not the refusal a resume past the end gets."""
    run = in_tmp / "run"
    _launch(_cfg("--run-dir", str(run), "--train.steps", "6"), 0, 2, dist.HashStore())
    _complete_checkpoint(run, 6)
    store = dist.HashStore()
    with pytest.raises(rundir.RunFinished, match="version 6, --train.steps 6: the run had finished"):
        _launch(_cfg("--run-dir", str(run), "--train.steps", "6"), 0, 2, store, restart=1)
    with pytest.raises(rundir.RunFinished):  # rank 1 reads rank 0's decision
        _launch(_cfg("--run-dir", str(run), "--train.steps", "6"), 1, 2, store, restart=1)
    attempts = json.loads((run / "run.json").read_text())["attempts"]
    assert len(attempts) == 1  # no attempt recorded for a restart with nothing to do


def test_a_requeued_slurm_job_resumes_its_run_dir_from_its_newest_checkpoint(in_tmp):
    run = in_tmp / "runs" / "slurm" / "77"  # what launch.sh gives every requeue of job 77
    _launch(_cfg("--run-dir", str(run), "--train.steps", "9"), 0, 2, dist.HashStore())
    _complete_checkpoint(run, 3)
    cfg = _cfg("--run-dir", str(run), "--train.steps", "9")  # no --train.resume: the restart implies it
    got = _launch(cfg, 0, 2, dist.HashStore(), restart=1)  # a new torchrun: a store of its own
    assert (got.path, got.attempt, got.start_version) == (run.resolve(), 1, 3) and cfg.train.resume


def _journal(run, *rows_):
    (run / "groups.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_))


def _result(run, execution_id, reward):
    (run / "executions" / execution_id).mkdir(parents=True)
    (run / "executions" / execution_id / "result.json").write_text(json.dumps({"reward": reward}))


def test_groups_in_flight_are_lost_or_carried_over_and_counted_once(in_tmp):
    run = in_tmp / "run"
    _launch(_cfg("--run-dir", str(run), "--train.steps", "9"), 0, 1, dist.HashStore())
    _complete_checkpoint(run, 2)
    d = lambda g, v: {"kind": "dispatched", "attempt": 0, "group_id": g, "task_id": g.split(".")[0], "version": v,
                      "executions": [f"{g}.0", f"{g}.1"]}
    _journal(run, d("t0.a0.g0", 0), d("t1.a0.g1", 1), d("t2.a0.g2", 2), d("t3.a0.g3", 2), d("t4.a0.g4", 3),
             {"kind": "trained", "group_id": "t0.a0.g0", "step": 0},  # in the checkpoint
             {"kind": "trained", "group_id": "t1.a0.g1", "step": 2},  # trained after it: not in it
             d("t5.a0.g5", 1), {"kind": "closed", "group_id": "t5.a0.g5"})  # ended cleanly untrained
    for g in ("t1.a0.g1", "t2.a0.g2", "t4.a0.g4"):  # evaluated: results with rewards on disk
        for i in (0, 1):
            _result(run, f"{g}.{i}", {"status": "valid", "reward": 1.0})
    _result(run, "t3.a0.g3.0", {"status": "valid", "reward": 0.0})  # one of two evaluated: not whole
    got = _launch(_cfg("--run-dir", str(run), "--train.resume", "--train.steps", "9"), 0, 1, dist.HashStore())
    # g1, g2: evaluated at versions the checkpoint holds → carried; g3 half-run → lost;
    # g4 sampled at version 3 > 2 (a discarded branch) → lost, its task run again.
    assert [r["group_id"] for r in got.carried] == ["t1.a0.g1", "t2.a0.g2"]
    assert got.redo_tasks == ("t3", "t4") and got.lost_in_flight == 4
    # The next resume does not count the lost ones again; the carried ones are lost again only if
    # that attempt never dispatched them (here it did not: nothing ran).
    again = _launch(_cfg("--run-dir", str(run), "--train.resume", "--train.steps", "9"), 0, 1,
                           dist.HashStore())
    assert again.redo_tasks == () and again.lost_in_flight == 0
    assert [r["group_id"] for r in again.carried] == ["t1.a0.g1", "t2.a0.g2"]


def _holder(run):
    """Another process that locks `run` as a job's rank 0 does (gyre.runtime.runlock) and keeps it."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                             "from gyre.runtime.runlock import RunLock; l = RunLock(); l.acquire(Path(sys.argv[1])); "
                             "print('locked', flush=True); time.sleep(120)", str(run)],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_run_directory_in_use_by_another_job_is_refused_on_every_rank_before_anything_is_written(in_tmp):
    """Two `--train.resume` of one directory at once: the second is refused, naming the first's
    pid and host, with the directory untouched (metrics not cut back, no attempt recorded, no
    --overwrite deletion); once the holder is gone (SIGKILL too: the kernel drops the lock) it goes ahead."""
    run = in_tmp / "run"
    _launch(_cfg("--run-dir", str(run), "--train.steps", "9"), 0, 1, dist.HashStore())
    _complete_checkpoint(run, 2)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(4)))
    holder = _holder(run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    try:
        for args in (("--train.resume",), ("--overwrite",)):
            cfgs = [_cfg("--run-dir", str(run), "--train.steps", "9", *args) for _ in range(2)]  # tyro: not in threads
            errors = _refusals_on_two_ranks(cfgs, dist.HashStore())
            assert errors[0] == errors[1], errors
            assert f"in use by another Gyre job (pid {holder.pid} on host " in errors[0]
            assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
            assert (run / "checkpoints").is_dir()
    finally:
        holder.kill()
        holder.wait()
    got = _launch(_cfg("--run-dir", str(run), "--train.resume", "--train.steps", "9"), 0, 1, dist.HashStore())
    assert (got.attempt, got.start_version) == (1, 2)
    assert [r["step"] for r in _rows(run / "metrics.jsonl")] == [0, 1]


def test_rank_0_holds_the_lock_while_its_run_lives_and_a_fresh_default_run_is_locked_too(in_tmp):
    run = in_tmp / "run"
    first = resolve_run_dir(_cfg("--run-dir", str(run)), 0, 1, dist.HashStore())
    assert first.lock.held
    holder = json.loads((run / "run.lock").read_text())
    import os
    import socket
    assert (holder["pid"], holder["host"]) == (os.getpid(), socket.gethostname())
    with pytest.raises(rundir.RunDirError, match="in use by another Gyre job"):
        resolve_run_dir(_cfg("--run-dir", str(run), "--overwrite"), 0, 1, dist.HashStore())
    first.lock.release()
    resolve_run_dir(_cfg("--run-dir", str(run), "--overwrite"), 0, 1, dist.HashStore()).lock.release()
    fresh = resolve_run_dir(_cfg(), 0, 1, dist.HashStore())  # a timestamped directory: locked as well
    with pytest.raises(rundir.RunDirError, match="in use by another Gyre job"):
        resolve_run_dir(_cfg("--train.resume"), 0, 1, dist.HashStore())  # resume of latest while it runs
    del fresh  # dropping the decision drops the lock (an in-process caller; a job exits)
    resumed = _launch(_cfg("--train.resume"), 0, 1, dist.HashStore())  # no checkpoint yet: from version 0
    assert (resumed.attempt, resumed.start_version) == (1, 0)
