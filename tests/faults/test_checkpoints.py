"""Atomic checkpoints (gyre/checkpoint.py) and what a resume does with broken ones.

Unit tests: the marker is written last and records sizes; a crash inside `save` leaves no
`step_*`; leftovers are removed; the newest complete checkpoint is chosen among random sets of
complete and broken directories (hypothesis), with every newer one named with its reason; a
missing optimizer or version file is an error unless weights-only; a resume's decision over a
damaged newest checkpoint (rank 0's `rundir.resolve`) and the actor loading what it chose. A real
job at the end damages a copy of the shared finished run and resumes from it; the weights-only
resume through a real job is the resume of tests/runtime/test_newcomer.py (one launch for both).
"""

import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.config import parse_config
from gyre import checkpoint
from gyre.checkpoint import MARKER, CheckpointError


def _save_like_the_cpu_actor(version, optimizer=True):
    def save(path):
        Path(path, "config.json").write_text("{}")
        Path(path, "model.safetensors").write_bytes(b"w" * 100 + bytes([version % 256]))
        if optimizer:
            Path(path, "optimizer.pt").write_bytes(b"o" * 50)
        Path(path, "gyre_actor.json").write_text(json.dumps({"version": version}))
    return save


def test_the_marker_is_written_with_every_files_size_and_the_tmp_dir_is_gone(tmp_path):
    path = checkpoint.write(tmp_path, 8, _save_like_the_cpu_actor(8))
    assert path == tmp_path / "step_000008"
    marker = json.loads((path / MARKER).read_text())
    assert marker["version"] == 8 and marker["weights_only"] is False
    assert marker["files"] == {"config.json": 2, "gyre_actor.json": len(json.dumps({"version": 8})),
                               "model.safetensors": 101, "optimizer.pt": 50}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000008"]
    assert checkpoint.check(path) is None


def test_a_crash_while_saving_leaves_no_step_dir_and_the_next_write_cleans_up(tmp_path):
    checkpoint.write(tmp_path, 8, _save_like_the_cpu_actor(8))

    def dies_half_way(path):
        Path(path, "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # the process dies here

    with pytest.raises(KeyboardInterrupt):
        checkpoint.write(tmp_path, 16, dies_half_way)
    assert (tmp_path / ".step_000016.tmp").is_dir() and not (tmp_path / "step_000016").exists()
    assert checkpoint.newest_complete(tmp_path).path == tmp_path / "step_000008"
    checkpoint.write(tmp_path, 24, _save_like_the_cpu_actor(24))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000008", "step_000024"]


def test_writing_a_version_again_replaces_it_whole(tmp_path):
    checkpoint.write(tmp_path, 8, _save_like_the_cpu_actor(8, optimizer=False))
    checkpoint.write(tmp_path, 8, _save_like_the_cpu_actor(8))
    assert (tmp_path / "step_000008" / "optimizer.pt").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000008"]


# What can happen to a checkpoint directory after it was written, and what check() must say.
DAMAGE = {
    "none": (lambda p: None, None),
    "no marker": (lambda p: (p / MARKER).unlink(), "no COMPLETE marker"),
    "truncated model": (lambda p: os.truncate(p / "model.safetensors", 10), "model.safetensors is 10 bytes, "),
    "model deleted": (lambda p: (p / "model.safetensors").unlink(), "model.safetensors is missing"),
    "optimizer deleted": (lambda p: (p / "optimizer.pt").unlink(), "optimizer.pt is missing"),
    "version deleted": (lambda p: (p / "gyre_actor.json").unlink(), "gyre_actor.json is missing"),
    "garbled marker": (lambda p: (p / MARKER).write_text("{"), "unreadable COMPLETE marker"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_check_names_what_is_wrong(tmp_path, damage):
    path = checkpoint.write(tmp_path, 3, _save_like_the_cpu_actor(3))
    hurt, expected = DAMAGE[damage]
    hurt(path)
    why = checkpoint.check(path)
    assert (why is None) if expected is None else (expected in why), why


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.integers(0, 300), st.sampled_from(sorted(DAMAGE)), max_size=8))
def test_the_newest_complete_checkpoint_is_chosen_and_every_newer_one_is_named(tmp_path_factory, damages):
    root = tmp_path_factory.mktemp("ck")
    for version, damage in damages.items():
        DAMAGE[damage][0](checkpoint.write(root, version, _save_like_the_cpu_actor(version)))
    (root / ".step_999999.tmp").mkdir()  # an interrupted write is never a candidate
    intact = [v for v, d in damages.items() if d == "none"]
    found = checkpoint.newest_complete(root)
    expected = max(intact) if intact else None
    assert found.path == (None if expected is None else root / checkpoint.step_name(expected))
    newer = sorted((v for v in damages if expected is None or v > expected), reverse=True)
    assert [p.name for p, _ in found.skipped] == [checkpoint.step_name(v) for v in newer]
    for p, why in found.skipped:
        assert DAMAGE[damages[int(p.name[5:])]][1] in why


def test_select_refuses_weights_only_unless_asked_and_names_every_skipped_dir(tmp_path):
    checkpoint.write(tmp_path, 4, _save_like_the_cpu_actor(4, optimizer=False))
    broken = checkpoint.write(tmp_path, 8, _save_like_the_cpu_actor(8))
    os.truncate(broken / "model.safetensors", 5)
    with pytest.raises(CheckpointError, match="step_000004 has no optimizer state.*--train.resume-weights-only"):
        checkpoint.select(tmp_path)
    found = checkpoint.select(tmp_path, weights_only=True)
    assert found.path == tmp_path / "step_000004"
    assert "step_000008: model.safetensors is 5 bytes" in found.describe_skipped()


def test_select_with_nothing_usable_says_what_it_found(tmp_path):
    with pytest.raises(CheckpointError, match="no step_. directories"):
        checkpoint.select(tmp_path)
    legacy = tmp_path / "step_000006"  # written before markers: weights and version, no COMPLETE
    _save_like_the_cpu_actor(6)(str(legacy.mkdir() or legacy))
    with pytest.raises(CheckpointError, match="step_000006: no COMPLETE marker.*--train.resume-weights-only"):
        checkpoint.select(tmp_path)
    assert checkpoint.select(tmp_path, weights_only=True).path == legacy
    assert checkpoint.version_of(legacy) == 6


def _tiny_actor():
    from gyre.backends.actors.cpu_actor import CpuActor
    from gyre.backends.config import OptimizerConfig
    from gyre.backends.models.hf import build_model, model_config

    model = build_model(model_config("tiny", 300), seed=0, dtype=torch.float32)
    return CpuActor(model, is_core=True, config=OptimizerConfig())


@pytest.mark.parametrize("missing", ["optimizer.pt", "gyre_actor.json"])
def test_the_cpu_actor_refuses_a_checkpoint_without_its_optimizer_or_version(tmp_path, missing):
    a = _tiny_actor()
    a.version = 5
    path = tmp_path / "step_000005"
    a.save_checkpoint(str(path))
    (path / missing).unlink()
    b = _tiny_actor()
    with pytest.raises(FileNotFoundError, match=f"{missing}.*--train.resume-weights-only"):
        b.load_checkpoint(str(path))
    assert b.version != 5
    b.load_checkpoint(str(path), weights_only=True)  # the version from the file, else the name
    assert b.version == 5


# ----------------------------------------------------------------------------- resume decisions
# What a resume does with a run whose newest checkpoint is damaged, in-process: rank 0's decision
# (`rundir.resolve`, as gyre/run.py calls it before anything starts) over checkpoints the real
# CpuActor wrote, then the actor loading what was chosen. One real job (the end of this file)
# proves the same through torchrun for one damage; tests/runtime/test_newcomer.py's resume the
# weights-only resume.

def _run_with_two_actor_checkpoints(root: Path) -> tuple[Path, dict]:
    """A run directory (first attempt recorded) with the tiny CpuActor's checkpoints of versions
    1 and 2 (atomic, with their markers) and 2 metrics rows; the weights of version 1."""
    import torch.distributed as dist

    from gyre.run import resolve_run_dir

    run = root / "run"
    resolve_run_dir(parse_config(["--job", "train", "--run-dir", str(run), "--train.steps", "2"]), 0, 1,
                   dist.HashStore()).lock.release()
    a = _tiny_actor()
    weights = {}
    for v in (1, 2):
        with torch.no_grad():
            next(a.model.parameters()).add_(1.0)  # each version's weights differ
        a.version = v
        checkpoint.write(run / "checkpoints", v, a.save_checkpoint)
        weights[v] = {k: t.clone() for k, t in a.model.state_dict().items()}
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "version": s + 1}) + "\n" for s in range(2)))
    return run, weights[1]


@pytest.mark.parametrize("damage", ["truncated model", "model deleted", "optimizer deleted", "version deleted"])
def test_a_damaged_newest_checkpoint_is_skipped_by_name_and_the_older_one_chosen_and_loaded(tmp_path, damage):
    import torch.distributed as dist

    from gyre.run import resolve_run_dir

    run, weights = _run_with_two_actor_checkpoints(tmp_path)
    DAMAGE[damage][0](run / "checkpoints" / "step_000002")
    got = resolve_run_dir(parse_config(["--job", "train", "--run-dir", str(run), "--train.resume", "--train.steps", "3"]),
                         0, 1, dist.HashStore())
    got.lock.release()
    assert (got.attempt, got.start_version) == (1, 1) and got.checkpoint.endswith("step_000001"), got
    attempt = json.loads((run / "run.json").read_text())["attempts"][-1]
    assert attempt["resumed_from"] == got.checkpoint
    assert [why.split(":")[0] for why in attempt["skipped_checkpoints"]] == ["step_000002"]  # the lineage names it
    assert DAMAGE[damage][1] in attempt["skipped_checkpoints"][0], attempt
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0]  # step 1's row cut
    b = _tiny_actor()
    b.load_checkpoint(got.checkpoint)  # the chosen one loads whole: weights, optimizer state, version
    assert b.version == 1
    assert all(torch.equal(t, weights[k]) for k, t in b.model.state_dict().items())


def test_without_any_complete_checkpoint_the_resume_is_refused_before_anything_is_written(tmp_path):
    """Rank 0's decision refuses (RunDirError: gyre/run.py exits 2 with it, said once; the wiring
    is the real job in tests/faults/test_config.py), naming every checkpoint and the flag that
    takes weights alone; nothing in the run directory changes. With the flag, the newest
    readable weights are chosen."""
    import torch.distributed as dist

    from gyre.run import resolve_run_dir
    from gyre.runtime import rundir

    run, _ = _run_with_two_actor_checkpoints(tmp_path)
    for step in (run / "checkpoints").iterdir():
        (step / "optimizer.pt").unlink()
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    argv = ["--job", "train", "--run-dir", str(run), "--train.resume", "--train.steps", "3"]
    with pytest.raises(rundir.RunDirError) as e:
        resolve_run_dir(parse_config(argv), 0, 1, dist.HashStore())
    assert "no complete checkpoint" in str(e.value) and "step_000002: optimizer.pt is missing" in str(e.value)
    assert "--train.resume-weights-only" in str(e.value)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "run.lock"} == \
        {p: b for p, b in before.items() if p.name != "run.lock"}  # refused: nothing touched
    got = resolve_run_dir(parse_config([*argv, "--train.resume-weights-only"]), 0, 1, dist.HashStore())
    got.lock.release()
    assert got.checkpoint.endswith("step_000002") and got.start_version == 2


# ----------------------------------------------------------------------------- real runs
# The shared finished run (tests/conftest.py: 2 steps, a checkpoint after each), copied and damaged.

@pytest.mark.multirank
@pytest.mark.jobs
def test_a_real_resume_skips_a_truncated_newest_checkpoint_and_trains_the_evaluated_group_again_without_running_it(
        finished_run, tmp_path):
    """Two properties of one resume from version 1 (of a run that trained 2 steps):
    * the newest checkpoint (step_000002, its model truncated) is skipped by name, in the log and
      in the run's lineage, and the older one resumed;
    * the group step 1 trained is not in that checkpoint, but its executions were evaluated
      (results and TITO are in the run directory): it is trained again from them, not run again
      (issue 19; before, as tests/faults/test_attempts.py tells, a relaunch reused ids)."""
    from tests.jobs import gyre, log_of, rows

    run = finished_run.copy_of(tmp_path / "run")
    step1 = rows(run / "metrics.jsonl")[1]
    DAMAGE["truncated model"][0](run / "checkpoints" / "step_000002")
    proc = gyre(tmp_path, finished_run.tasks, "--run-dir", str(run), "--train.resume", steps=2)
    log = log_of(proc)
    assert proc.returncode == 0, log[-4000:]
    assert f"step_000002 skipped: {DAMAGE['truncated model'][1]}" in log, log[-4000:]
    assert "SafetensorError" not in log
    attempt = json.loads((run / "run.json").read_text())["attempts"][-1]
    assert attempt["start_version"] == 1 and attempt["resumed_from"].endswith("step_000001")
    assert [why.split(":")[0] for why in attempt["skipped_checkpoints"]] == ["step_000002"]  # the lineage says so too
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2
    # Step 1 again, from the group it trained before: nothing ran again, its old row cut.
    assert not [p for p in (run / "executions").iterdir() if ".a1." in p.name]
    assert summary["carried_over_groups"] == 1 and summary["lost_in_flight"] == 0
    redo = rows(run / "metrics.jsonl")
    assert [r["step"] for r in redo] == [0, 1]
    assert redo[1]["rewards"] == step1["rewards"] and len(step1["rewards"]) == 2  # the same two executions
    assert redo[1]["staleness"] == step1["staleness"] == [0]  # v_d kept: sampled at version 1, trained at step 1
