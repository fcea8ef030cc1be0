"""The experiment trackers (`--tracking.tensorboard`, `--tracking.wandb`) are copies of
metrics.jsonl: the shared finished run (tests/conftest.py; torchrun, 2 gloo ranks, tiny model, 2
steps) writes TensorBoard event files, read back with TensorBoard's own reader, whose scalars equal metrics.jsonl's rows;
where `wandb` is installed the same job also writes an offline W&B run, whose history is read back
from its `.wandb` log. Plus the pure parts: flattening a row, the fan-out, the config check.
"""

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gyre.config import ConfigError, TrackingConfig
from gyre.config_checks import check_tracking
from gyre.runtime.outputs import Trackers, flatten_numeric

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def _have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# ----------------------------------------------------------------------------- pure parts
def test_flatten_numeric_joins_nested_fields_and_skips_lists_and_nulls():
    row = {"step": 3, "loss": -0.5, "version": 4, "final_in_burst": True, "reward_mean": None,
           "rewards": [1.0, 0.0], "cell_time_s": {"0": {"train": 1.5, "rollout": 2}, "1": {}},
           "clip_frac": float("nan"), "mode": "gyre"}
    assert flatten_numeric(row) == {"loss": -0.5, "version": 4.0, "final_in_burst": 1.0,
                                    "cell_time_s/0/train": 1.5, "cell_time_s/0/rollout": 2.0}


class _Recorder:
    def __init__(self, fail_on: str = "") -> None:
        self.calls, self.fail_on = [], fail_on

    def log(self, row, step):
        self._call("log", step)

    def image(self, name, png_path, step):
        self._call("image", name)

    def close(self, failed):
        self._call("close", failed)

    def _call(self, what, arg):
        if what == self.fail_on:
            raise OSError("disk full")
        self.calls.append((what, arg))


def test_trackers_fan_out_drop_a_failing_tracker_and_close_once():
    good, bad = _Recorder(), _Recorder(fail_on="log")
    t = Trackers([good, bad])
    t.log({"loss": 1.0}, 0)  # bad raises: logged and dropped, the run goes on
    t.image("role_timeline", "x.png", 1)
    t.close(failed=True)
    t.close(failed=False)  # every exit path may call it; only the first counts
    assert good.calls == [("log", 0), ("image", "role_timeline"), ("close", True)]
    assert bad.calls == []
    Trackers().log({"loss": 1.0}, 0)  # the null object


@pytest.mark.parametrize("fails", [False, True])
def test_the_controller_closes_its_trackers_on_every_path(fails):
    """Controller._main closes the trackers once, as failed when the run raised (the job test
    cannot see this: TensorBoard is flushed every step, and wandb's atexit hook would finish it)."""
    from gyre.runtime.controller import Controller

    from gyre.runtime.stop import Ending

    c = Controller.__new__(Controller)  # only what _main touches
    c.ending = Ending(stop_sent=True)
    rec = _Recorder()
    c.records = SimpleNamespace(trackers=Trackers([rec]))

    async def run():
        if fails:
            raise RuntimeError("the run broke")

    c._run = run
    c._main()
    assert rec.calls == [("close", fails)]
    assert isinstance(c.ending.error, RuntimeError) == fails


def test_wandb_close_records_the_exit_code(tmp_path, monkeypatch):
    if not _have("wandb"):
        pytest.skip("wandb is not installed (pip install -e '.[tracking]')")
    from gyre.runtime.outputs import WandbTracker

    monkeypatch.setenv("WANDB_SILENT", "true")
    t = WandbTracker(project="p", name="failing", group="g", run_dir=str(tmp_path), config={"a": 1}, mode="offline")
    t.log({"step": 0, "loss": 2.5}, 0)
    t.close(failed=True)
    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    # wandb's service process writes the file; on a loaded machine the exit record lands a moment
    # after finish() returns
    deadline = time.monotonic() + 60
    while not (exits := [r.exit for r in _wandb_records(log) if r.WhichOneof("record_type") == "exit"]):
        assert time.monotonic() < deadline, "no exit record in the wandb log after 60 s"
        time.sleep(0.5)
    (exit_rec,) = exits
    assert exit_rec.exit_code == 1


@pytest.mark.parametrize("flag", ["tensorboard", "wandb"])
def test_a_tracker_without_its_package_is_a_config_error(monkeypatch, flag):
    monkeypatch.setitem(sys.modules, flag, None)  # as if not installed: find_spec and import fail
    with pytest.raises(ConfigError, match=rf"--tracking.{flag} needs the `{flag}` package.*pip install {flag}"):
        check_tracking(TrackingConfig(**{flag: True}))
    check_tracking(TrackingConfig())  # off: nothing is needed


@pytest.mark.jobs  # launches python -m gyre.run (it exits before any rank starts)
def test_the_missing_package_stops_the_run_before_it_starts_with_exit_2(tmp_path):
    """`python -m gyre.run` (a world of one) with the package hidden: rank 0 says it once, exit 2."""
    code = ("import sys; sys.modules['tensorboard'] = None; from gyre.run import main; "
            "sys.exit(main(['--job', 'train', '--tracking.tensorboard', '--run-dir', 'run']))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log[-3000:]
    assert log.count("--tracking.tensorboard needs the `tensorboard` package") == 1, log[-3000:]
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


# ----------------------------------------------------------------------------- a real job
@pytest.fixture
def tracked_run(finished_run) -> Path:
    """The shared finished run (tests/conftest.py: 2 ranks, 2 steps, TensorBoard on, and W&B
    offline where wandb is installed); its run dir."""
    if not _have("tensorboard"):
        pytest.skip("tensorboard is not installed (pip install -e '.[test]')")
    assert finished_run.steps == STEPS
    return finished_run.dir


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    return rows


@pytest.mark.jobs
@pytest.mark.multirank
def test_tensorboard_scalars_equal_the_metrics_rows(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = _rows(tracked_run)
    acc = EventAccumulator(str(tracked_run / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("reward_mean", "loss", "clip_frac", "step_time_s", "cell_time_s/0/rollout"):
        assert tag in tags, sorted(tags)
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [r["step"] for r in rows], tag
        want = [r[tag] if "/" not in tag else r["cell_time_s"]["0"]["rollout"] for r in rows]
        # TensorBoard stores float32.
        assert [e.value for e in events] == pytest.approx(want, rel=1e-6, abs=1e-6), tag
    assert set(flatten_numeric(rows[-1])) <= tags  # every numeric field of a row is there
    assert not any(t.startswith(("rewards", "claim_order", "step")) and t != "step_time_s" for t in tags)
    # The end: each cell's training fraction (as summary.json's) and the timeline image.
    summary = json.loads((tracked_run / "summary.json").read_text())
    for cell, frac in summary["train_fraction"].items():
        (e,) = acc.Scalars(f"train_fraction/{cell}")
        assert e.step == STEPS and e.value == pytest.approx(frac, rel=1e-6, abs=1e-6)
    (img,) = acc.Images("role_timeline")
    assert img.encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n" and img.width > 100


def _wandb_records(path: Path) -> list:
    """The records of a W&B `.wandb` log (wandb-core's LevelDB-style log: a 7-byte file header
    ':W&B' 0xBEE1 v0, then 32 KiB blocks of records, each with a 7-byte header crc32c u32,
    length u16, type u8: 1 full, 2 first, 3 middle, 4 last; a block's tail < 7 bytes is padding)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, chunks, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding up to the block's end
            pos += block - pos % block
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            chunks.append(pending + chunk)
    records = []
    for c in chunks:
        r = pb.Record()
        r.ParseFromString(c)
        records.append(r)
    return records


@pytest.mark.jobs
@pytest.mark.multirank
def test_wandb_offline_history_equals_the_metrics_rows(tracked_run):
    if not _have("wandb"):
        pytest.skip("wandb is not installed (pip install -e '.[tracking]')")
    rows = _rows(tracked_run)
    (log,) = (tracked_run / "wandb").glob("offline-run-*/run-*.wandb")
    records = _wandb_records(log)
    history: dict[int, dict] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history[r.history.step.num] = items
    assert sorted(history) == [*range(STEPS), STEPS]  # a row per step, then the end's image and fractions
    for row in rows:
        got = history[row["step"]]
        for tag, v in flatten_numeric(row).items():
            assert got[tag] == pytest.approx(v), tag
    image = {k.split("/", 1)[1]: v for k, v in history[STEPS].items() if k.startswith("role_timeline/")}
    assert image["_type"] == "image-file" and image["format"] == "png"
    assert (log.parent / "files" / image["path"]).stat().st_size == image["size"]
    summary = json.loads((tracked_run / "summary.json").read_text())
    assert {k: history[STEPS][f"train_fraction/{k}"] for k in summary["train_fraction"]} == \
        pytest.approx(summary["train_fraction"])
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "gyre-test" and run.display_name == "run" and run.run_group == "smoke"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["train"]["steps"] == STEPS and config["tracking"]["wandb_mode"] == "offline"
    (exit_rec,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_rec.exit_code == 0


@pytest.mark.jobs
@pytest.mark.multirank
def test_gyre_report_renders_the_real_run(tracked_run, tmp_path):
    from gyre.report import render

    page = render(tracked_run, tmp_path / "report")
    text = page.read_text()
    assert "finished: 2 steps" in text and "<th>tracking.tensorboard</th><td>true</td>" in text
    for s in range(STEPS):
        assert f"<tr><td>{s}</td><td>{s + 1}</td>" in text
    assert text.count('src="data:image/png;base64,') == 2
