"""The wiring of every refusal of tests/test_config_checks.py, proven once by a real job (torchrun,
2 ranks): a refusal exits 2, said once by rank 0, with nothing started and no run directory."""

from pathlib import Path

import pytest

from tests.jobs import RUNS, log_of, run_to_end, write_tasks


def _write_tasks_only(prepare_dir, seed=0, with_checkpoint=True):
    """A --train.prepare hook that writes the tasks file and no starting checkpoint."""
    Path(prepare_dir).mkdir(parents=True, exist_ok=True)
    return str(write_tasks(Path(prepare_dir) / "tasks.jsonl"))


@pytest.mark.multirank
@pytest.mark.jobs
def test_a_checkpoint_the_prepare_hook_does_not_write_is_refused_before_run_json(tmp_path):
    """The one real launch (the wiring of every refusal in tests/test_config_checks.py: exit 2, said once by rank 0,
    nothing started): `--model.checkpoint` under `--train.prepare-dir` is left to the hook;
    one it does not write is refused after it ran, on every rank, before the run directory exists
    (before: a loader's message after run.json, and the corrected command refused)."""
    data, run = tmp_path / "data", tmp_path / "run"
    work = tmp_path / "cwd"
    work.mkdir()
    cmd = RUNS["config_refused"].command(data / "tasks.jsonl", run, "--train.prepare-dir", str(data),
                                         "--model.checkpoint", str(data / "warm_start"))
    proc = run_to_end(cmd, work, timeout=120)
    log = log_of(proc)
    message = f"--model.checkpoint {data}/warm_start: no such directory (--train.prepare"
    assert proc.returncode != 0 and "exitcode  : 2" in log, log[-3000:]
    said = [line for line in log.splitlines() if message in line]
    # once by rank 0, and once in torchrun's report, which names it (gyre.run's tell_torchrun)
    assert len(said) == 2 and sum("traceback : gyre: " in line for line in said) == 1, log[-3000:]
    for started in ("run directory:", "proxy listening", "dispatched"):
        assert started not in log
    assert (data / "tasks.jsonl").is_file()  # the hook ran
    assert not run.exists() and list(work.iterdir()) == []  # no run.json: the corrected command is not refused
