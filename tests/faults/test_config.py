"""A config that cannot work is refused on every rank before any work starts (real torchrun, 2
ranks): exit 2, one message naming the flag, said once by rank 0, and nothing left behind (no
run directory, no prepared data, no engine, proxy or harness started).

Before, these surfaced only after preparation, engine start and proxy bind, and left a
step_000000 checkpoint behind in a run directory of their own.
"""


import pytest

from tests.jobs import gyre, log_of, write_tasks

pytestmark = pytest.mark.multirank


def _bad_tasks(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "t0", "instruction": "x"\n')
    return ["--executions.dataset.path", str(bad)]


def _unwritable_parent(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    return ["--run-dir", str(tmp_path / "a_file" / "run")]


CASES = {
    "steps 0": (lambda tmp: ["--train.steps", "0"], "--train.steps must be >= 1, got 0"),
    "N 0": (lambda tmp: ["--scheduler.n-per-group", "0"], "--scheduler.n-per-group must be >= 1, got 0"),
    "B 0": (lambda tmp: ["--scheduler.batch-groups", "0"], "--scheduler.batch-groups must be >= 1, got 0"),
    "no dataset": (lambda tmp: ["--executions.dataset.path", str(tmp / "nope.jsonl")],
                   "--executions.dataset.path " + "{tmp}/nope.jsonl: no such file"),
    "broken dataset": (_bad_tasks, "--executions.dataset.path {tmp}/bad.jsonl: {tmp}/bad.jsonl:1: invalid JSON"),
    "run dir under a file": (_unwritable_parent, "--run-dir {tmp}/a_file/run: {tmp}/a_file is not a directory"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_value_is_refused_up_front_with_exit_2_naming_the_flag(tmp_path, case):
    make, message = CASES[case]
    tasks = write_tasks(tmp_path / "tasks.jsonl")
    work = tmp_path / "cwd"
    work.mkdir()
    proc = gyre(work, tasks, *make(tmp_path), timeout=120)
    log = log_of(proc)
    assert proc.returncode != 0 and "exitcode  : 2" in log, log[-3000:]
    assert log.count(message.format(tmp=tmp_path)) == 1, log[-3000:]  # once: rank 0 says it
    for started in ("run directory:", "proxy listening", "dispatched", "preparing"):
        assert started not in log
    assert list(work.iterdir()) == []  # no runs/, no run directory, no checkpoint
