"""gyre.run: --help documents every option; a real torchrun smoke run exits 0."""

import subprocess
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from gyre.config import GyreConfig, parse_config
from tests.jobs import env, launcher

ROOT = Path(__file__).resolve().parents[1]


def _flags(obj, prefix=""):
    """Every leaf field of a config instance, as its tyro flag."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        name = prefix + f.name.replace("_", "-")
        if is_dataclass(value):
            yield from _flags(value, name + ".")
        else:
            yield name


def test_help_documents_every_option():
    out = subprocess.run([sys.executable, "-m", "gyre.run", "--help"], capture_output=True, text=True, cwd=ROOT, check=True,
                         env={"COLUMNS": "200", "PATH": ""}).stdout
    flags = list(_flags(GyreConfig()))
    assert "parallel.cell-size" in flags
    for flag in flags:
        assert f"--{flag}" in out, flag
    assert "cpu-demo" in out  # presets are listed


def test_preset_then_overrides():
    cfg = parse_config(["--preset", "cpu-demo", "--parallel.cell-size", "2", "--parallel.tp", "2", "--seed", "5"])
    assert cfg.preset == "cpu-demo" and cfg.run_dir == ""  # a fresh runs/cpu-demo/<timestamp>/ (gyre.runtime.rundir)
    assert cfg.parallel.cell_size == 2 and cfg.seed == 5


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(SystemExit) as e:
        parse_config(["--preset", "nope"])
    assert "nope" in str(e.value) and "cpu-demo" in str(e.value)


def test_a_flag_that_moved_to_its_owners_section_names_where_it_went():
    for argv in (["--train.cell-concurrency", "8"], ["--preset", "cpu-demo", "--train.cell-concurrency=8"]):
        with pytest.raises(SystemExit) as e:
            parse_config(argv)
        assert str(e.value) == "gyre: --train.cell-concurrency is now --scheduler.cell-concurrency"
    assert parse_config(["--scheduler.cell-concurrency", "5"]).scheduler.cell_concurrency == 5
    assert parse_config(["--preset", "cpu-demo"]).scheduler.cell_concurrency == 12  # the preset's C_e kept its value


@pytest.mark.jobs
@pytest.mark.multirank
def test_torchrun_smoke_run_exits_zero():
    r = subprocess.run(
        [*launcher(4), "--preset", "smoke", "--parallel.cell-size", "2", "--parallel.tp", "2"],
        capture_output=True, text=True, cwd=ROOT, timeout=180, env=env(),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("prefix all-reduce ok") == 4
    assert r.stderr.count("topology (gloo backend)") == 1  # logged once
