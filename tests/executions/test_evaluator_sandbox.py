"""Evaluators cannot be steered by the harness (issue 36, item 3): a workspace replaced by a
link is never scored, Gyre's own reads follow no link, and under `--executions.evaluator.sandbox
inherit` (the default) a command or module evaluator sees the workspace read-write and nothing
else of the run; `none` is the logged opt-out. Asserts on the files on the host, not on what the
evaluator says it did."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from gyre.executions import eval_sandbox, sandbox
from gyre.executions.config import EvaluatorConfig, RunnerConfig
from gyre.executions.evaluator import Evaluator, Outcome, RewardStatus, expected_files
from gyre.executions.tasks import EvaluatorSpec, Task

from tests.jobs import marked

needs_bwrap = pytest.mark.skipif(not sandbox.bwrap_works(), reason="bubblewrap not usable here")

# Marks the workspace it was run in (named after the execution GYRE_WORKSPACE says it scores),
# then scores answer.txt: 1 when it holds "right".
MARKING = ["sh", "-c", 'touch "evaluated-$(basename "$(dirname "$GYRE_WORKSPACE")")"; '
           'if grep -q right answer.txt 2>/dev/null; then echo 1; else echo 0; fi']


def _evaluate(ws: Path, evaluator: EvaluatorSpec, runner: RunnerConfig | None = None, **cfg):
    ev = Evaluator(EvaluatorConfig(**{"max_attempts": 1, "retry_backoff_s": 0.0, "timeout_s": 30, **cfg}), runner)
    return asyncio.run(ev.evaluate("e0", Task(task_id="t", instruction="x", evaluator=evaluator), ws, Outcome.COMPLETED))


def _execution(run: Path, eid: str, answer: str | None = None) -> Path:
    ws = run / eid / "workspace"
    ws.mkdir(parents=True)
    if answer is not None:
        (ws / "answer.txt").write_text(answer)
    return ws


# ---------------------------------------------------------------- the workspace path

def test_a_workspace_linked_to_a_sibling_is_refused_and_nothing_runs_there(tmp_path):
    run = tmp_path / "run"
    sibling = _execution(run, "g.1", "right\n")
    (run / "g.0").mkdir()
    (run / "g.0" / "workspace").symlink_to("../g.1/workspace")  # as a harness can do
    res = _evaluate(run / "g.0" / "workspace", EvaluatorSpec("command", MARKING))
    assert res.status is RewardStatus.EXCLUDED and res.reward is None
    assert "symbolic link" in res.detail["refused"] and "g.1/workspace" in res.detail["refused"]
    assert res.attempts[-1].error.startswith("workspace refused")
    assert sorted(p.name for p in sibling.iterdir()) == ["answer.txt"]  # the evaluator never ran there


def test_a_workspace_linked_to_a_host_directory_is_refused_for_every_evaluator_form(tmp_path):
    host = tmp_path / "host"
    host.mkdir()
    (host / "answer.txt").write_text("right\n")
    run = tmp_path / "run"
    (run / "g.0").mkdir(parents=True)
    (run / "g.0" / "workspace").symlink_to(host)
    forms = [EvaluatorSpec("command", MARKING),
             EvaluatorSpec("python", "gyre.executions.evaluator:expected_files", {"files": {"answer.txt": "right"}}),
             EvaluatorSpec("python", lambda ws, task: 1.0)]
    for form in forms:
        res = _evaluate(run / "g.0" / "workspace", form)
        assert res.status is RewardStatus.EXCLUDED and "refused" in res.detail, form
    assert sorted(p.name for p in host.iterdir()) == ["answer.txt"]


def test_links_higher_up_and_things_that_are_not_directories_are_refused(tmp_path):
    run = tmp_path / "run"
    _execution(run, "real", "right\n")
    (run / "e0").symlink_to(run / "real")  # the execution directory itself (a harness under `none`)
    assert "execution directory" in eval_sandbox.workspace_refusal(run / "e0" / "workspace")
    (tmp_path / "alias").symlink_to(run)  # a link higher up than the runner's resolved run_dir
    assert "resolves to" in eval_sandbox.workspace_refusal(tmp_path / "alias" / "real" / "workspace")
    (run / "f").mkdir()
    (run / "f" / "workspace").write_text("not a directory")
    assert "not a directory" in eval_sandbox.workspace_refusal(run / "f" / "workspace")
    os.mkfifo(run / "real" / "fifo")
    assert "not a directory" in eval_sandbox.workspace_refusal(run / "real" / "fifo")
    assert eval_sandbox.workspace_refusal(run / "real" / "workspace") is None
    (run / "gone").mkdir()
    assert eval_sandbox.workspace_refusal(run / "gone" / "workspace") is None  # missing: scored as it is


def test_expected_files_follows_no_link_inside_the_workspace(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "a.txt").write_text("right")
    ws = _execution(tmp_path / "run", "e0")
    (ws / "a.txt").symlink_to(outside / "a.txt")
    (ws / "d").symlink_to(outside)  # a linked directory on the way
    os.mkfifo(ws / "fifo")  # would block a plain open
    files = {"a.txt": "right", "d/a.txt": "right", "fifo": "right", "../outside/a.txt": "right"}
    got: list[float] = []  # in a daemon thread: a blocking open must fail the test, not hang the suite
    reader = threading.Thread(target=lambda: got.append(expected_files(ws, None, files)["reward"]), daemon=True)
    reader.start()
    reader.join(10)
    assert got == [0.0]
    (ws / "real.txt").write_text("right\n")
    (ws / "sub").mkdir()
    (ws / "sub" / "b.txt").write_text("right")
    assert expected_files(ws, None, {"real.txt": "right", "sub/b.txt": "right", "./sub/b.txt": "right"})["reward"] == 1.0
    with pytest.raises(OSError):
        eval_sandbox.read_beneath(ws, "a.txt")
    with pytest.raises(ValueError):
        eval_sandbox.read_beneath(ws, "/etc/passwd")


# ---------------------------------------------------------------- the evaluator process

PROBE = textwrap.dedent("""
    import json, os, socket, sys
    out = {}
    def attempt(name, fn):
        try:
            fn(); out[name] = True
        except OSError:
            out[name] = False
    for i, path in enumerate(sys.argv[1:4]):
        attempt(f"write{i}", lambda: open(path, "w").write("evaluator was here"))
    attempt("read_sibling", lambda: open(sys.argv[4]).read())
    attempt("connect", lambda: socket.create_connection(("127.0.0.1", int(sys.argv[5])), timeout=2).close())
    attempt("write_workspace", lambda: open("inside.txt", "w").write("ok"))
    attempt("read_log", lambda: open(sys.argv[2]).read())  # its own execution's log: read-only
    out["secret"] = os.environ.get("GYRE_TEST_CONTROLLER_SECRET")
    print("GYRE_REWARD " + json.dumps({"reward": 1, **out}))
""")


def _probe_setup(tmp_path):
    run = tmp_path / "run"
    ws = _execution(run, "g.0")
    sibling = _execution(run, "g.1", "right\n")
    (run / "g.0" / "stdout.log").write_text("harness log\n")
    outside = tmp_path / "outside.txt"
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    targets = [str(outside), str(run / "g.0" / "stdout.log"), str(sibling / "planted.txt")]
    argv = [sys.executable, str(probe), *targets, str(sibling / "answer.txt"), str(srv.getsockname()[1])]
    return ws, sibling, outside, run, srv, argv


@needs_bwrap
def test_a_sandboxed_command_evaluator_writes_only_its_workspace(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("GYRE_TEST_CONTROLLER_SECRET", "s3cret")
    ws, sibling, outside, run, srv, argv = _probe_setup(tmp_path)
    with caplog.at_level(logging.INFO, logger="gyre.executions.eval_sandbox"), srv:
        res = _evaluate(ws, EvaluatorSpec("command", argv), RunnerConfig(sandbox="bwrap"))
    assert "evaluators run in sandbox bwrap (--executions.evaluator.sandbox inherit)" in caplog.text
    assert res.status is RewardStatus.VALID, res.attempts
    # Independent facts on the host: nothing outside the workspace changed, the workspace did.
    assert not outside.exists() and not (sibling / "planted.txt").exists()
    assert (run / "g.0" / "stdout.log").read_text() == "harness log\n"
    assert (ws / "inside.txt").read_text() == "ok"
    assert res.detail["read_sibling"] is False and res.detail["connect"] is False and res.detail["read_log"] is True
    assert res.detail["secret"] is None  # the controller's variables stay out, as for harnesses


def test_opting_out_runs_the_evaluator_unsandboxed_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("GYRE_TEST_CONTROLLER_SECRET", "s3cret")
    ws, sibling, outside, run, srv, argv = _probe_setup(tmp_path)
    with caplog.at_level(logging.INFO, logger="gyre.executions.eval_sandbox"), srv:
        res = _evaluate(ws, EvaluatorSpec("command", argv), RunnerConfig(sandbox="bwrap"), sandbox="none")
    assert "evaluators not sandboxed (--executions.evaluator.sandbox none)" in caplog.text
    assert res.status is RewardStatus.VALID
    assert outside.read_text() == "evaluator was here"  # what the default prevents
    assert res.detail["read_sibling"] is True and res.detail["secret"] == "s3cret"


@needs_bwrap
def test_a_sandboxed_module_evaluator_runs_and_cannot_write_outside(tmp_path, monkeypatch):
    mod = tmp_path / "mods"
    mod.mkdir()
    (mod / "steer_eval_mod.py").write_text(textwrap.dedent("""
        from pathlib import Path
        def score(workspace, task, outside):
            try:
                Path(outside).write_text("evaluator was here")
                wrote = True
            except OSError:
                wrote = False
            return {"reward": 0.5 if (Path(workspace) / "answer.txt").read_text().strip() == "right" else 0.0,
                    "wrote": wrote}
    """))
    monkeypatch.syspath_prepend(str(mod))
    ws = _execution(tmp_path / "run", "g.0", "right\n")
    outside = tmp_path / "outside.txt"
    res = _evaluate(ws, EvaluatorSpec("python", "steer_eval_mod:score", {"outside": str(outside)}),
                    RunnerConfig(sandbox="bwrap"))
    assert res.status is RewardStatus.VALID and res.reward == 0.5, res.attempts
    assert not outside.exists()  # (its write, if any, went to the sandbox's private /tmp)


@needs_bwrap
def test_a_hung_sandboxed_evaluator_is_killed_with_everything_it_started(tmp_path):
    token = f"gyre-hung-eval-{os.getpid()}-{time.monotonic_ns()}"
    ws = _execution(tmp_path / "run", "g.0")
    hang = ["sh", "-c", f"setsid {sys.executable} -c 'import time; time.sleep(300)' {token} & exec sleep 300"]
    t0 = time.monotonic()
    res = _evaluate(ws, EvaluatorSpec("command", hang), RunnerConfig(sandbox="bwrap"), timeout_s=1.0)
    assert res.status is RewardStatus.EXCLUDED and "exceeded" in res.attempts[0].error
    assert "evaluator sh exceeded" in res.attempts[0].error  # names the evaluator, not bwrap
    assert time.monotonic() - t0 < 20
    deadline = time.monotonic() + 5
    while marked(token) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marked(token) == []


def test_inherit_follows_the_harness_sandbox(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="gyre.executions.eval_sandbox"):
        assert Evaluator(EvaluatorConfig(), RunnerConfig(sandbox="none")).sandbox == "none"
    assert "inherit the harness sandbox, none" in caplog.text
    assert Evaluator(EvaluatorConfig(sandbox="none"), RunnerConfig(sandbox="bwrap")).sandbox == "none"
    assert Evaluator(EvaluatorConfig(), RunnerConfig(sandbox="unshare")).sandbox == "unshare"
    monkeypatch.setattr(sandbox, "bwrap_works", lambda *a: True)
    assert Evaluator(EvaluatorConfig(), RunnerConfig(sandbox="container")).sandbox == "bwrap"
    monkeypatch.setattr(sandbox, "bwrap_works", lambda *a: False)
    with pytest.raises(ValueError, match="--executions.evaluator.sandbox"):
        Evaluator(EvaluatorConfig(), RunnerConfig(sandbox="container"))
    assert Evaluator(EvaluatorConfig(sandbox="none"), RunnerConfig(sandbox="container")).sandbox == "none"


def test_the_bwrap_command_line_binds_the_workspace_alone_writable(tmp_path):
    ws = tmp_path / "run" / "g.0" / "workspace"
    argv = eval_sandbox.wrap("bwrap", inner=["true"], ws=ws, ro_paths=["/opt/x"], runner=RunnerConfig())
    writable = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
    assert writable == [str(ws)] and "--unshare-net" in argv
    read_only = [argv[i + 1] for i, a in enumerate(argv) if a == "--ro-bind-try"]
    assert str(ws.parent) in read_only and "/opt/x" in read_only and str(ws.parent.parent) not in read_only
    assert argv[argv.index("--chdir") + 1] == str(ws)
    host_net = eval_sandbox.wrap("bwrap", inner=["true"], ws=ws, ro_paths=[], runner=RunnerConfig(sandbox_network="host"))
    assert "--unshare-net" not in host_net
    assert json.dumps(eval_sandbox.wrap("none", inner=["true"], ws=ws, ro_paths=[], runner=RunnerConfig())) == '["true"]'


@needs_bwrap
def test_an_example_evaluator_reading_its_execution_directory_scores_the_same_sandboxed(tmp_path):
    """examples/claude_code's evaluator reads `<exec dir>/stdout.log` when there is no answer.txt."""
    ws = _execution(tmp_path / "run", "g.0")
    (ws.parent / "stdout.log").write_text(json.dumps({"type": "result", "result": "I think it is apple."}) + "\n")
    form = EvaluatorSpec("python", "examples.claude_code.task:evaluate", {"expected": "apple"})
    boxed = _evaluate(ws, form, RunnerConfig(sandbox="bwrap"))
    free = _evaluate(ws, form, RunnerConfig(sandbox="bwrap"), sandbox="none")
    assert boxed.status is RewardStatus.VALID and boxed.reward == free.reward > 0, (boxed, free)


# ---------------------------------------------------------------- what a sandboxed evaluator sees of its own files

def _kit(root: Path) -> Path:
    """The common layout (issue 53, item 5): a project directory with the evaluator script, a
    helper module and a helper package it imports, a data file and the runs beside them."""
    kit = root / "kit"
    (kit / "helpers_pkg").mkdir(parents=True)
    (kit / "file_eval.py").write_text("def score(ws):\n"
                                      "    return 1.0 if (ws / 'answer.txt').read_text().strip() == 'right' else 0.0\n")
    (kit / "helpers_pkg" / "__init__.py").write_text("SCALE = 1.0\n")
    (kit / "answers.json").write_text('{"secret": "right"}')
    (kit / "check_cmd.py").write_text(textwrap.dedent("""
        import json, os
        from pathlib import Path
        from file_eval import score
        import helpers_pkg
        here = Path(__file__).parent
        ws = Path(os.environ["GYRE_WORKSPACE"])
        print(json.dumps({"reward": score(ws) * helpers_pkg.SCALE,
                          "listing": sorted(p for p in os.listdir(here) if p != "__pycache__"),
                          "executions": sorted(os.listdir(ws.parent.parent))}))
    """))
    return kit


@needs_bwrap
def test_a_command_evaluator_imports_the_modules_beside_its_script_and_sees_nothing_else_there(tmp_path):
    """`python /kit/check_cmd.py` importing `/kit/file_eval.py` and `/kit/helpers_pkg` scores in
    the sandbox as on the host (before: ModuleNotFoundError on every evaluation, every execution
    excluded); the kit's data file and its runs/ (other executions' workspaces) stay invisible."""
    kit = _kit(tmp_path)
    ws = _execution(kit / "runs" / "r1", "g.0", "right\n")  # the run directory inside the project, as runs/<preset>
    _execution(kit / "runs" / "r1", "g.1", "right\n")
    form = EvaluatorSpec("command", [sys.executable, "-u", str(kit / "check_cmd.py")])
    res = _evaluate(ws, form, RunnerConfig(sandbox="bwrap"))
    assert res.status is RewardStatus.VALID and res.reward == 1.0, res.attempts
    # no answers.json; runs/ only as the path down to its own execution directory, no sibling execution
    assert res.detail["listing"] == ["check_cmd.py", "file_eval.py", "helpers_pkg", "runs"]
    assert res.detail["executions"] == ["g.0"]
    free = _evaluate(ws, form, RunnerConfig(sandbox="bwrap"), sandbox="none")
    assert free.reward == 1.0 and "answers.json" in free.detail["listing"] and free.detail["executions"] == ["g.0", "g.1"]


@needs_bwrap
def test_a_module_evaluator_in_a_single_file_imports_the_module_beside_it(tmp_path, monkeypatch):
    mods = tmp_path / "project"
    mods.mkdir()
    (mods / "beside_helper_53.py").write_text("WANT = 'right'\n")
    (mods / "beside_reward_53.py").write_text(textwrap.dedent("""
        from pathlib import Path
        from beside_helper_53 import WANT
        def score(workspace, task):
            return 1.0 if (Path(workspace) / "answer.txt").read_text().strip() == WANT else 0.0
    """))
    monkeypatch.syspath_prepend(str(mods))
    ws = _execution(tmp_path / "run", "g.0", "right\n")
    res = _evaluate(ws, EvaluatorSpec("python", "beside_reward_53:score"), RunnerConfig(sandbox="bwrap"))
    assert res.status is RewardStatus.VALID and res.reward == 1.0, res.attempts


def test_the_modules_beside_an_evaluator_are_its_python_files_and_packages_only(tmp_path):
    kit = _kit(tmp_path)
    (kit / "native.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    (kit / "not_a_package").mkdir()
    ws = _execution(kit / "pkg_with_runs", "g.0")
    (kit / "pkg_with_runs" / "__init__.py").write_text("")  # a package that holds the workspace: never bound
    got = eval_sandbox.beside_modules(str(kit / "check_cmd.py"), ws)
    assert got == [str(kit / n) for n in ("file_eval.py", "helpers_pkg", "native.cpython-311-x86_64-linux-gnu.so")]
    assert eval_sandbox.beside_modules(sys.executable) == []  # nothing from inside the Python installation
    assert eval_sandbox.command_paths(["awk", "{print 1}", str(kit / "check_cmd.py")]) == []  # data, not a script
    assert eval_sandbox.command_paths(["python3", "-W", "ignore", str(kit / "check_cmd.py")], ws) == \
        [str(kit / "check_cmd.py"), *got]
