"""The up-front check of evaluators runs where they will run (issue 53, item 5): an evaluator
that starts on the host but not in its sandbox is refused before the run, naming the task, the
evaluator and the error it printed; one that starts there passes. Each case is also evaluated for
real, in and out of the sandbox: the check must predict what the evaluations do."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path

import pytest

from gyre.config import ConfigError, parse_config
from gyre.config_checks import check_tasks
from gyre.executions import sandbox
from gyre.executions.config import EvaluatorConfig, RunnerConfig
from gyre.executions.evaluator import Evaluator, Outcome, RewardStatus
from gyre.executions.tasks import Dataset

needs_bwrap = pytest.mark.skipif(not sandbox.bwrap_works(), reason="bubblewrap not usable here")


def _dataset(tmp_path: Path, evaluator: dict) -> Dataset:
    path = tmp_path / "tasks.jsonl"
    rows = [{"task_id": "plain", "instruction": "x", "harness": ["true"], "evaluator": {"command": ["awk", "BEGIN{print 1}"]}},
            {"task_id": "mine", "instruction": "x", "harness": ["true"], "evaluator": evaluator}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Dataset.from_jsonl(path)


def _check(tmp_path: Path, dataset: Dataset, sandbox_kind: str) -> str | None:
    cfg = parse_config(["--job", "train", "--model.preset", "tiny", "--executions.dataset.path", "unused.jsonl",
                        "--executions.runner.sandbox", sandbox_kind])
    try:
        check_tasks(cfg.executions, dataset)
    except ConfigError as e:
        return str(e)
    return None


def _scored(tmp_path: Path, dataset: Dataset, sandbox_kind: str) -> RewardStatus:
    """What a real evaluation of task `mine` gives (an empty workspace is a reward of 0)."""
    ws = tmp_path / "run" / sandbox_kind / "workspace"
    ws.mkdir(parents=True)
    ev = Evaluator(EvaluatorConfig(max_attempts=1, timeout_s=60), RunnerConfig(sandbox=sandbox_kind))
    return asyncio.run(ev.evaluate("e0", dataset[1], ws, Outcome.COMPLETED)).status


def _lib(tmp_path: Path) -> Path:
    """A helper module reachable on the host only through PYTHONPATH / sys.path: a directory the
    sandbox does not bind (the variable itself is passed through)."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "probe_lib_53.py").write_text("WANT = 'right'\n")
    return lib


@needs_bwrap
def test_a_command_evaluator_that_starts_only_outside_its_sandbox_is_refused_up_front(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(_lib(tmp_path)))
    script = tmp_path / "kit" / "check_lib.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent("""
        import os
        from probe_lib_53 import WANT
        p = os.path.join(os.environ["GYRE_WORKSPACE"], "answer.txt")
        print(1.0 if os.path.exists(p) and open(p).read().strip() == WANT else 0.0)
    """))
    data = _dataset(tmp_path, {"command": [sys.executable, str(script)]})
    assert _check(tmp_path, data, "none") is None and _scored(tmp_path, data, "none") is RewardStatus.VALID
    got = _check(tmp_path, data, "bwrap")
    assert got is not None and got.startswith(f"task mine: evaluator command '{sys.executable} {script}' cannot start: "
                                              f"ModuleNotFoundError: No module named 'probe_lib_53' "
                                              f"(run in the evaluator sandbox bwrap"), got
    assert _scored(tmp_path, data, "bwrap") is RewardStatus.EXCLUDED  # what the check foresaw


@needs_bwrap
def test_a_module_evaluator_that_imports_only_outside_its_sandbox_is_refused_up_front(tmp_path, monkeypatch):
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "probe_reward_53.py").write_text("from probe_lib_53 import WANT\ndef score(workspace, task):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(mods))
    monkeypatch.syspath_prepend(str(_lib(tmp_path)))  # another directory: not beside the module
    data = _dataset(tmp_path, {"python": "probe_reward_53:score"})
    assert _check(tmp_path, data, "none") is None and _scored(tmp_path, data, "none") is RewardStatus.VALID
    got = _check(tmp_path, data, "bwrap")
    assert got is not None and got.startswith("task mine: evaluator probe_reward_53:score cannot be imported: "
                                              "ModuleNotFoundError: No module named 'probe_lib_53' (run in the "
                                              "evaluator sandbox bwrap"), got
    assert _scored(tmp_path, data, "bwrap") is RewardStatus.EXCLUDED


@needs_bwrap
def test_the_kit_layout_passes_the_check_in_the_sandbox_and_scores_there(tmp_path):
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "file_eval.py").write_text("def score(ws):\n    return 0.0\n")
    (kit / "check_cmd.py").write_text("import os\nfrom file_eval import score\nprint(score(os.environ['GYRE_WORKSPACE']))\n")
    data = _dataset(tmp_path, {"command": ["python3", str(kit / "check_cmd.py")]})
    assert _check(tmp_path, data, "bwrap") is None
    assert _scored(tmp_path, data, "bwrap") is RewardStatus.VALID


@pytest.mark.parametrize("kind", ["none", pytest.param("bwrap", marks=needs_bwrap)])
def test_what_cannot_start_anywhere_is_refused_with_what_it_printed(tmp_path, kind):
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "file_eval.py").write_text("def score(ws):\n    return 0.0\n")
    (kit / "bad_name.py").write_text("from file_eval import no_such_name\n")
    (kit / "bad_syntax.py").write_text("import os\ndef (:\n")
    cases = {
        "bad_name": ({"command": [sys.executable, str(kit / "bad_name.py")]},
                     "ImportError: cannot import name 'no_such_name' from 'file_eval'"),
        "bad_syntax": ({"command": [sys.executable, str(kit / "bad_syntax.py")]}, "SyntaxError: invalid syntax"),
        "no_program": ({"command": ["no-such-checker-53", "x"]},
                       "'no-such-checker-53' not found (not on PATH, or not an executable file)"),
        "no_module": ({"command": [sys.executable, "-m", "no_such_mod_53"]}, "No module named 'no_such_mod_53'"),
        "no_function": ({"python": "json:no_such_function"}, "json has no function no_such_function"),
    }
    for name, (evaluator, printed) in cases.items():
        got = _check(tmp_path / name, _dataset(tmp_path, evaluator), kind)
        assert got is not None and got.startswith("task mine: evaluator ") and printed in got, (name, got)
    # a relative script comes from the task's workspace files: left to the run
    assert _check(tmp_path, _dataset(tmp_path, {"command": ["python3", "./check.py"]}), kind) is None
