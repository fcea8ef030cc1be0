"""A config that cannot work is refused on every rank before any work starts (gyre/config_checks.py,
in-process): one message naming the flag, and nothing left behind (no run directory, no prepared
data, no engine, proxy or harness started).

The messages come from `check_train_config`, which every rank runs before the run directory is
decided: each bad value is proven here (milliseconds). The wiring is proven once, by a real job
(torchrun, 2 ranks; tests/faults/test_config_job.py): a refusal exits 2, said once by rank 0,
nothing started.

Before, these surfaced only after preparation, engine start and proxy bind, and left a
step_000000 checkpoint behind in a run directory of their own.
"""

import pytest

from tests.jobs import write_tasks


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
def test_a_bad_value_is_refused_up_front_naming_the_flag(tmp_path, monkeypatch, case):
    """In-process, what every rank runs before the run directory is decided (gyre/run.py: parse,
    then `check_train_config`); the message starts with the flag and nothing is written. Exit 2
    and "said once by rank 0" are the wiring: the real job in tests/faults/test_config_job.py."""
    make, message = CASES[case]
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    tasks = write_tasks(tmp_path / "tasks.jsonl")
    from gyre.config import ConfigError, parse_config
    from gyre.config_checks import check_train_config

    argv = ["--job", "train", "--model.preset", "tiny", "--executions.dataset.path", str(tasks),
            "--executions.runner.sandbox", "none", *make(tmp_path)]
    with pytest.raises(ConfigError) as e:
        check_train_config(parse_config(argv), 1)
    assert str(e.value).startswith(message.format(tmp=tmp_path)), str(e.value)
    assert list(work.iterdir()) == []  # no runs/, no run directory, no checkpoint


# ----------------------------------------------------------------------------- in-process
# The values that used to fail late (a library's message minutes in, after run.json had claimed
# the run directory so the corrected command was refused until --overwrite): each is refused by
# the checks every rank runs before the run directory is decided, naming the flag.

def _argv(tmp_path, *extra, tasks=None):
    tasks = tasks or write_tasks(tmp_path / "tasks.jsonl")
    return ["--job", "train", "--model.preset", "tiny", "--executions.dataset.path", str(tasks),
            "--executions.runner.sandbox", "none", "--run-dir", str(tmp_path / "run"), *extra]


def _refused(tmp_path, *extra, tasks=None) -> str:
    from gyre.config import ConfigError, parse_config
    from gyre.config_checks import check_train_config

    cfg = parse_config(_argv(tmp_path, *extra, tasks=tasks))
    with pytest.raises(ConfigError) as e:
        check_train_config(cfg, 1)
    assert not (tmp_path / "run").exists()
    return str(e.value)


LATE = {
    "lr negative": (["--actor.lr", "-1e-3"], "--actor.lr must be > 0, got -0.001"),
    "lr nan": (["--actor.lr", "nan"], "--actor.lr must be a finite number, got nan"),
    "lr inf": (["--actor.lr", "inf"], "--actor.lr must be a finite number, got inf"),
    "harness timeout 0": (["--executions.runner.timeout-s", "0"], "--executions.runner.timeout-s must be > 0, got 0"),
    "evaluator attempts 0": (["--executions.evaluator.max-attempts", "0"],
                             "--executions.evaluator.max-attempts must be >= 1, got 0"),
    "evaluator timeout nan": (["--executions.evaluator.timeout-s", "nan"],
                              "--executions.evaluator.timeout-s must be a finite number, got nan"),
    "grad norm 0": (["--actor.max-grad-norm", "0"], "--actor.max-grad-norm must be > 0, got 0"),
    "beta 1": (["--actor.betas", "0.9", "1.0"], "--actor.betas must both be in [0, 1), got 0.9 1"),
    "engine batch 0": (["--engine.max-batch", "0"], "--engine.max-batch must be >= 1, got 0"),
    "C_e 0": (["--scheduler.cell-concurrency", "0"], "--scheduler.cell-concurrency (C_e) must be >= 1, got 0"),
    "proxy wait 0": (["--proxy.engine-wait-s", "0"], "--proxy.engine-wait-s must be > 0, got 0"),
    "proxy gc clock negative": (["--proxy.gc-every-s", "-1"], "--proxy.gc-every-s must be >= 0, got -1"),
    "missing checkpoint": (["--model.checkpoint", "{tmp}/no_model"], "--model.checkpoint {tmp}/no_model: no such directory"),
    "harness log cap under 1 KiB": (["--executions.runner.log-cap-bytes", "100"],
                                    "--executions.runner.log-cap-bytes must be >= 1024, got 100"),
    "steps 0": (["--train.steps", "0"], "--train.steps must be >= 1, got 0 (a run of no steps trains nothing)"),
}


@pytest.mark.parametrize("case", sorted(LATE))
def test_a_value_that_used_to_fail_late_is_refused_before_the_run_directory_naming_the_flag(tmp_path, case):
    extra, message = LATE[case]
    got = _refused(tmp_path, *(a.format(tmp=tmp_path) for a in extra))
    assert got.startswith(message.format(tmp=tmp_path)), got


def test_every_float_of_the_config_is_checked_for_nan_without_a_line_of_its_own(tmp_path):
    """check_numbers walks the whole config tree: NaN in any float field is refused by its flag."""
    from gyre.config import ConfigError, parse_config
    from gyre.config_checks import _numbers, check_numbers

    cfg = parse_config(_argv(tmp_path))
    floats = [flag for flag, v in _numbers(cfg) if isinstance(v, float) and "[" not in flag]
    assert len(floats) > 20 and "proxy.close-wait-s" in floats and "sglang.mem-fraction-static" in floats
    for flag in floats:  # set on the parsed config: some fields' own __post_init__ refuse NaN already at parse
        bad = parse_config(_argv(tmp_path))
        *parents, name = flag.replace("-", "_").split(".")
        obj = bad
        for part in parents:
            obj = getattr(obj, part)
        setattr(obj, name, float("nan"))
        with pytest.raises(ConfigError, match=f"^--{flag} must be a finite number"):
            check_numbers(bad)


def test_a_missing_harness_program_is_refused_before_any_execution_starts(tmp_path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", harness=["no-such-agent-cli", "--go"])
    got = _refused(tmp_path, tasks=tasks)
    assert "task t0: harness program 'no-such-agent-cli' not found (the task's 'harness': no-such-agent-cli --go)" in got
    tasks = write_tasks(tmp_path / "t2.jsonl", harness=[str(tmp_path / "agent.sh")])
    assert f"harness program '{tmp_path}/agent.sh' not found" in _refused(tmp_path, tasks=tasks)
    tasks = write_tasks(tmp_path / "t3.jsonl", harness=["{python}", str(tmp_path / "agent.py")])
    assert f"harness script {tmp_path}/agent.py not found" in _refused(tmp_path, tasks=tasks)


def test_a_python_evaluator_that_cannot_be_imported_is_refused_up_front(tmp_path):
    from tests.jobs import write_task_rows

    for target, why in (("no_such_module_xyz:score", "No module named 'no_such_module_xyz'"),
                        ("json:no_such_function", "json has no function no_such_function")):
        tasks = write_task_rows(tmp_path / "tasks.jsonl", [{"harness": ["true"], "evaluator": {"python": target}}])
        got = _refused(tmp_path, tasks=tasks)
        assert got == f"task t0: evaluator {target} cannot be imported: {why}" or \
            (got.startswith(f"task t0: evaluator {target} cannot be imported: ") and why in got), got
    tasks = write_task_rows(tmp_path / "ok.jsonl", [{"harness": ["true"], "evaluator": {"python": "json:dumps"}}])
    from gyre.config import parse_config
    from gyre.config_checks import check_train_config

    check_train_config(parse_config(_argv(tmp_path, tasks=tasks)), 1)  # an importable one passes


def test_training_flags_without_job_train_are_refused_naming_it():
    from gyre.config import ConfigError, parse_config
    from gyre.config_checks import check_job

    for argv in (["--train.steps", "3"], ["--train.max-tokens", "64", "--parallel.cell-size", "2"], ["--actor.lr=1e-3"]):
        with pytest.raises(ConfigError, match=r"training flags, .*--job smoke.*add --job train") as e:
            check_job(parse_config(argv), argv)
        assert argv[0].split("=")[0] in str(e.value)
    for argv in (["--parallel.cell-size", "2", "--parallel.tp", "2", "--log-level", "DEBUG"], ["--job", "train", "--train.steps", "3"],
                 ["--preset", "cpu-demo", "--train.steps", "3"], ["--run-dir", "runs/slurm/5"]):
        check_job(parse_config(argv), argv)  # the topology check's own flags (launch.sh adds --run-dir), or a training job
