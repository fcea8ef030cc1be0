"""Atomic checkpoints (gyre/checkpoint.py), in-process: the marker is written last and records
sizes; a crash inside `write` leaves no `step_*`; leftovers are removed; the newest complete
checkpoint is chosen among random sets of complete and broken directories (hypothesis), with every
newer one named with its reason; a weights-only checkpoint is refused unless asked for. What a
resume does with broken ones (rundir's decision, the actor's load, a real job) is in
tests/faults/test_checkpoints.py."""

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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

