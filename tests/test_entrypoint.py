"""gyre.run: --help documents every option; a real torchrun smoke run exits 0."""

import subprocess
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from gyre.config import GyreConfig, parse_config
from tests.jobs import RUNS, env

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


def test_help_all_documents_every_option():
    out = subprocess.run([sys.executable, "-m", "gyre.run", "--help-all"], capture_output=True, text=True, cwd=ROOT,
                         check=True, env={"COLUMNS": "200", "PATH": ""}).stdout
    flags = list(_flags(GyreConfig()))
    assert "parallel.cell-size" in flags
    for flag in flags:
        assert f"--{flag}" in out, flag
    assert "cpu-demo" in out  # presets are listed


def test_help_is_one_screen_of_sections_and_the_common_flags_with_the_presets_values():
    from gyre.help import COMMON, field_docs, first_sentence

    out = subprocess.run([sys.executable, "-m", "gyre.run", "--preset", "cpu-demo", "--help"], capture_output=True,
                         text=True, cwd=ROOT, check=True, env={"COLUMNS": "200", "PATH": ""}).stdout
    lines = out.splitlines()
    assert 40 <= len(lines) <= 100, len(lines)  # tyro's full listing is over 1,000 lines
    assert "--help-all" in out
    from gyre.config import PRESETS

    cfg = PRESETS["cpu-demo"]()  # the preset as written (parse_config resolves dtype "auto" afterwards)
    for f in fields(cfg):  # every section, with its own description
        if is_dataclass(getattr(cfg, f.name)):
            assert any(line.split()[:1] == [f.name] for line in lines), f.name
    for dotted in COMMON:  # each common flag with the preset's value and its field's first sentence
        flag = "--" + dotted.replace("_", "-")
        at = next(i for i, line in enumerate(lines) if line.split()[:1] == [flag])
        *path, name = dotted.split(".")
        owner = cfg
        for p in path:
            owner = getattr(owner, p)
        value = getattr(owner, name)
        if not isinstance(value, (list, tuple)) and value != "":
            assert lines[at].rstrip().endswith(f"[{value}]"), (lines[at], value)
        assert lines[at + 1].strip() == first_sentence(field_docs(type(owner))[name])
    assert "[32]" in lines[next(i for i, x in enumerate(lines) if x.split()[:1] == ["--train.steps"])]  # cpu-demo's


@pytest.mark.jobs
@pytest.mark.multirank
def test_a_typo_under_torchrun_is_said_once_and_named_in_torchruns_report(tmp_path):
    """Every rank parses the command line; only rank 0 prints tyro's message, and torchrun's
    failure report names it instead of "To enable traceback see ..."."""
    r = subprocess.run(RUNS["typo"].command(None, None), capture_output=True,
                       text=True, cwd=tmp_path, timeout=180, env=env())
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert out.count("Unrecognized options:") == 1, out[-3000:]
    assert "--train.steps" in out  # tyro's suggestion
    assert "gyre: the command line was refused" in out  # torchrun's root cause, from the error file


def test_the_startup_load_note_by_hand():
    from gyre.run import load_note

    assert load_note(0.9, 2, 4) is None  # under half a core each: quiet
    # 2 cores, 4 ranks: quiet share 0.5 a rank; at load 12, 2 / 16 = 0.125: 4x
    note = load_note(12.0, 2, 4)
    assert "machine load 12.0 on 2 cores (6.0 a core)" in note and "up to 4.0x" in note
    assert "up to 1.5x" in load_note(16.0, 16, 8)  # 16 cores, 8 ranks: a core each when quiet, 16 / 24 at load 16


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
        RUNS["topology"].command(None, None),
        capture_output=True, text=True, cwd=ROOT, timeout=180, env=env(),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("prefix all-reduce ok") == 4
    assert r.stderr.count("topology (gloo backend)") == 1  # logged once
