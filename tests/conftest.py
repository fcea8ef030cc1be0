"""What every test shares: the `jobs` marker kept truthful, and the finished tiny run.

* A test that starts a real job (torchrun running `gyre.run --job train` or a preset) without
  `@pytest.mark.jobs` fails at the launch, naming the marker: the tiers in README "Tests" select
  on it (`-m "not jobs"` is the inner loop), so a job without it would silently make that tier
  slow again.
* a real job is launched as `tests/jobs.py` `RUNS[name]` built it (`Run.command`, unchanged):
  any other launch fails, so RUNS is the one list of the jobs and what each proves.
* every `multirank` test (a multi-process gloo world) is a `jobs` test too: measured, the gloo
  worlds were about a third of the `-m "not jobs"` tier's time.
* every real job gets `xdist_group("jobs")`: under README command 2 (`-n 2`, pytest.ini's
  `--dist loadgroup`) they all run on one worker, one at a time, while the other worker runs the
  in-process tests. Two jobs at once on a 2-core machine would make their timings (a cell joining
  before the core claims every item, a drain's bound) the machine's rather than the code's.
  A gloo world alone (`multirank`, no torchrun job; ~2 min in all) is its own group, `gloo`: none
  times a run, and with the jobs' group that one worker was the suite's whole length.
* `slow` tests run only when the `-m` expression names `slow`: pytest.ini's `-m "not slow"` is
  replaced by any `-m` on the command line, and `-m "not jobs"` (the inner loop) must not bring
  the slow tier back.
* no two `jobs` tests overlap (`_jobs_never_overlap`): each records its start and end in a file
  the whole session shares, and fails at teardown if another job ran meanwhile. That grouping
  rests on pytest-xdist renaming `item._nodeid`, which pytest 9.2 ignores (setup.py bounds pytest
  below 9.2): this check, not a comment, is what says the suite still runs one job at a time.
* `finished_run`: one finished tiny run (tests/jobs.py `RUNS["finished"]`: 2 ranks, 2 steps, a
  checkpoint after each, TensorBoard on, and W&B offline where wandb is installed), built once per
  test session on first use. Resume and damaged-checkpoint tests copy it (`copy_of`) instead of
  each starting their own first run; the tracking tests read its tracker files.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings

from tests.jobs import built_from_runs

# No hypothesis test has a speed goal: its per-example deadline (200 ms) only measures the
# machine's load (a FlakyFailure at load 15 on 2 cores). Speed lives in benchmarks/.
settings.register_profile("gyre", deadline=None)
settings.load_profile("gyre")

_current: list[pytest.Item] = []


def _is_job(args) -> bool:
    argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
    launcher = "torch.distributed.run" in argv or any(Path(a).name == "torchrun" for a in argv[:1])
    return launcher and "gyre.run" in argv


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the xdist_group marks added here
def pytest_collection_modifyitems(config, items):
    for item in items:  # a gloo world is a job too: the inner loop (-m "not jobs") leaves both out
        gloo_only = item.get_closest_marker("multirank") is not None and item.get_closest_marker("jobs") is None
        if gloo_only:
            item.add_marker(pytest.mark.jobs)
        if item.get_closest_marker("jobs") is not None:  # `-n 2 --dist loadgroup`: one job at a time
            item.add_marker(pytest.mark.xdist_group("gloo" if gloo_only else "jobs"))
    if "slow" in (config.option.markexpr or ""):
        return
    slow = [i for i in items if i.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [i for i in items if i.get_closest_marker("slow") is None]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current.append(item)
    try:
        return (yield)
    finally:
        _current.pop()


def launch_refusal(nodeid: str, marked_jobs: bool, args) -> str | None:
    """Why the test `nodeid` may not start `args`, or None: a real job needs `@pytest.mark.jobs`
    and a command line that tests/jobs.py RUNS built. Pure."""
    if not _is_job(args):
        return None
    if not marked_jobs:
        return (f"{nodeid} starts a real job (torchrun -m gyre.run) without @pytest.mark.jobs; README "
                "'Tests' tiers select on it")
    if not built_from_runs(args):
        return (f"{nodeid} starts a real job that tests/jobs.py RUNS did not build: name it there (what it "
                "proves) and launch RUNS[name].command(...) unchanged")
    return None


@pytest.fixture(scope="session", autouse=True)
def _jobs_are_marked():
    real = subprocess.Popen.__init__

    def init(self, args, *a, **kw):
        item = _current[-1] if _current else None
        why = item and launch_refusal(item.nodeid, item.get_closest_marker("jobs") is not None, args)
        if why:
            raise AssertionError(why)
        real(self, args, *a, **kw)

    subprocess.Popen.__init__ = init
    yield
    subprocess.Popen.__init__ = real


def overlapping(mine: dict, records: list[dict]) -> list[str]:
    """The other jobs whose recorded interval meets `mine` ({"id", "start", "end"}); a record
    with no end yet is still running. Pure."""
    spans: dict[str, list[float | None]] = {}
    for r in records:
        if r["id"] == mine["id"]:
            continue
        span = spans.setdefault(r["id"], [None, None])
        span[0 if r["event"] == "start" else 1] = r["t"]
    return sorted(i for i, (start, end) in spans.items()
                  if start is not None and start < mine["end"] and (end is None or end > mine["start"]))


def _jobs_log(tmp_path_factory) -> Path:
    base = tmp_path_factory.getbasetemp()  # under xdist: <session>/popen-gwN, the session's is its parent
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "jobs-intervals.jsonl"


def _append(path: Path, row: dict) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # one write: lines never interleave
    try:
        os.write(fd, (json.dumps(row) + "\n").encode())
    finally:
        os.close(fd)


@pytest.fixture(autouse=True)
def _jobs_never_overlap(request, tmp_path_factory):
    groups = {m.args[0] if m.args else m.kwargs.get("name") for m in request.node.iter_markers("xdist_group")}
    if "jobs" not in groups:
        yield
        return
    log, me = _jobs_log(tmp_path_factory), request.node.nodeid
    start = time.time()
    _append(log, {"id": me, "event": "start", "t": start})
    yield
    end = time.time()
    _append(log, {"id": me, "event": "end", "t": end})
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    others = overlapping({"id": me, "start": start, "end": end}, records)
    if others:
        pytest.fail(f"{me} ran at the same time as the jobs test(s) {others}: the `jobs` group is not "
                    "one worker's (pytest-xdist's --dist loadgroup ignored? setup.py bounds pytest < 9.2)")


@dataclass(frozen=True)
class FinishedRun:
    dir: Path  # the run directory: checkpoints/step_000001, step_000002, metrics.jsonl, run.json, ...
    tasks: Path  # the tasks file it trained on (4 tiny-harness tasks)
    steps: int
    log: str = ""  # what torchrun printed (every rank's log lines), for the tests that read the log

    def copy_of(self, dest: Path) -> Path:
        """A private copy of the run directory at `dest` (symlinks kept as links)."""
        shutil.copytree(self.dir, dest, symlinks=True)
        return dest


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory) -> FinishedRun:
    import importlib.util

    from tests.jobs import RUNS, env, log_of, write_tasks

    base = tmp_path_factory.mktemp("finished_run")
    tasks, run = write_tasks(base / "tasks.jsonl"), base / "run"
    spec = RUNS["finished"]
    tracking = []  # tests/runtime/test_tracking.py reads them (it skips without the packages)
    if importlib.util.find_spec("tensorboard") is not None:
        tracking += ["--tracking.tensorboard"]
    if importlib.util.find_spec("wandb") is not None:
        tracking += ["--tracking.wandb", "--tracking.wandb-project", "gyre-test", "--tracking.wandb-mode", "offline"]
    proc = subprocess.run(spec.command(tasks, run, *tracking), cwd=base, capture_output=True, text=True, timeout=300,
                          env={**env(), "WANDB_SILENT": "true", "WANDB_DISABLE_CODE": "true"})
    assert proc.returncode == 0, log_of(proc)[-4000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    return FinishedRun(run, tasks, spec.settings["steps"], log_of(proc))
