"""The suite's guard that no two `jobs` tests share the machine (tests/conftest.py
`_jobs_never_overlap`): pure on hand-made intervals, then on a real `pytest -n 2` whose grouping is
switched off (`--dist load`, what pytest 9.2 + pytest-xdist 3.8 did to `--dist loadgroup`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import launch_refusal, overlapping
from tests.jobs import RUNS, launcher

ROOT = Path(__file__).resolve().parents[1]


def test_a_launch_is_refused_unless_marked_and_built_from_runs():
    """tests/conftest.py's Popen guard, on command lines (nothing is started)."""
    built = RUNS["typo"].command(None, None)
    assert launch_refusal("t", True, built) is None
    assert launch_refusal("t", True, ["ip", "netns", "exec", "n0", *built]) is None  # a wrapper only prefixes it
    assert "without @pytest.mark.jobs" in launch_refusal("t", False, built)
    by_hand = [*launcher(2), "--preset", "cpu-demo-smoke", "--train.steps", "3"]  # no RUNS entry built it
    assert "RUNS did not build" in launch_refusal("t", True, by_hand)
    changed = list(built)
    changed[-1] = "4"  # built, then edited
    assert "RUNS did not build" in launch_refusal("t", True, changed)
    assert launch_refusal("t", False, ["python", "-m", "gyre.run", "--help"]) is None  # not torchrun: not a job


def _rec(i, event, t):
    return {"id": i, "event": event, "t": t}


def test_overlap_of_hand_made_intervals():
    recs = [_rec("a", "start", 0.0), _rec("a", "end", 10.0), _rec("b", "start", 10.0), _rec("b", "end", 20.0),
            _rec("c", "start", 15.0)]  # c still running
    assert overlapping({"id": "a", "start": 0.0, "end": 10.0}, recs) == []  # b starts as a ends: no overlap
    assert overlapping({"id": "b", "start": 10.0, "end": 20.0}, recs) == ["c"]
    assert overlapping({"id": "d", "start": 5.0, "end": 12.0}, recs) == ["a", "b"]
    assert overlapping({"id": "d", "start": 25.0, "end": 30.0}, recs) == ["c"]  # c never ended


def test_two_jobs_on_two_workers_fail_the_guard(tmp_path):
    """Grouping off: two `jobs` tests meet (each waits until the other has started) and the guard
    fails them; the same tests under `--dist loadgroup` run on one worker and pass."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.conftest import pytest_collection_modifyitems, _jobs_never_overlap  # noqa: F401
    """))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    jobs: x\n    multirank: x\n    slow: x\n")
    (tmp_path / "test_pair.py").write_text(textwrap.dedent("""
        import os, time, pytest
        from pathlib import Path

        @pytest.mark.jobs
        @pytest.mark.parametrize("i", [0, 1])
        def test_job(i, tmp_path_factory):
            here = Path(os.environ["PAIR_DIR"])
            (here / f"started{i}").touch()
            if os.environ.get("MEET") == "1":  # wait for the other, so the two surely overlap
                deadline = time.time() + 60
                while not (here / f"started{1 - i}").exists() and time.time() < deadline:
                    time.sleep(0.05)
    """))

    def run(dist: str, meet: str, name: str):
        pair = tmp_path / name
        pair.mkdir()
        env = {**__import__("os").environ, "PAIR_DIR": str(pair), "MEET": meet}
        env.pop("PYTEST_XDIST_WORKER", None)
        return subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", dist, "-p", "no:cacheprovider",
                               "-q", "--basetemp", str(tmp_path / f"bt-{name}"), str(tmp_path / "test_pair.py")],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    apart = run("load", "1", "apart")
    assert apart.returncode != 0, apart.stdout[-2000:]
    assert "ran at the same time as the jobs test" in apart.stdout, apart.stdout[-2000:]
    together = run("loadgroup", "0", "together")
    assert together.returncode == 0, together.stdout[-2000:]
