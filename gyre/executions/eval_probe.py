"""The up-front check of an evaluator, run where the evaluator will run.

Before any execution starts (`gyre.config_checks.check_tasks`), each distinct evaluator is
started once in its own sandbox (`--executions.evaluator.sandbox`: the same backend, binds,
environment and working directory as a real evaluation, `eval_sandbox.launch`), on an empty
scratch workspace, with its own command replaced by a probe that does everything the evaluator
does before it looks at a workspace:

    "module:function"             import the module, find the function (in the evaluator's child
                                  Python, with its PYTHONPATH)
    [python, (flags), script.py]  with that interpreter: read the script, compile it, import
                                  every module its top level imports (unconditionally: not
                                  inside `try`/`if`), from the script's directory as Python does
    [python, -m, module]          find the module
    [program, ...]                the program resolves (on PATH, or an executable file)

A probe that fails refuses the run, naming the task, the evaluator, where it runs and the last
line the probe printed (`ModuleNotFoundError: No module named 'file_eval'`). The contract an
evaluator keeps: docs/train-your-own-agent.md, (c) and (g).

Relative programs and scripts come from the task's workspace files; they are left to the run
(and to `gyre.executions.health`: an evaluator whose first evaluations all fail stops it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gyre.executions import eval_sandbox
from gyre.executions.config import EvaluatorConfig, RunnerConfig
from gyre.executions.tasks import EvaluatorSpec, Task

# Run with `-c` by the evaluator's own interpreter: argv[1] says what to probe.
_PROBE = r'''
import ast, importlib, importlib.util, os, shutil, sys
what, args = sys.argv[1], sys.argv[2:]
if what == "function":
    m = importlib.import_module(args[0])
    callable(getattr(m, args[1], None)) or sys.exit(f"{args[0]} has no function {args[1]}")
elif what == "script":
    script = args[0]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # what `python script.py` puts first
    with open(script, "rb") as f:
        tree = compile(f.read(), script, "exec", ast.PyCF_ONLY_AST)
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                importlib.import_module(a.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            m = importlib.import_module(node.module)
            for a in node.names:
                if a.name != "*" and not hasattr(m, a.name):
                    try:
                        importlib.import_module(f"{node.module}.{a.name}")
                    except ImportError:
                        raise ImportError(f"cannot import name {a.name!r} from {node.module!r}") from None
elif what == "module":
    importlib.util.find_spec(args[0]) is not None or sys.exit(f"No module named {args[0]!r}")
elif what == "program":
    p = args[0]
    (shutil.which(p) if os.sep not in p else os.access(p, os.X_OK)) or \
        sys.exit(f"{p!r} not found (not on PATH, or not an executable file)")
'''

def probe_argv(spec: EvaluatorSpec) -> list[str] | None:
    """The probe that takes the evaluator's place (None: nothing to check before the run)."""
    if spec.kind == "python":
        module, _, fn = spec.target.partition(":")
        return [sys.executable, "-c", _PROBE, "function", module, fn]
    argv = list(spec.target)
    prog = argv[0]
    if os.sep in prog and not os.path.isabs(prog):
        return None  # in the workspace: the task's files make it
    what, name = eval_sandbox.python_target(argv) or ("", "")
    if what == "module" or (what == "script" and os.path.isabs(name)):
        return [prog, "-c", _PROBE, what, name]
    return [sys.executable, "-c", _PROBE, "program", prog]


def probe(spec: EvaluatorSpec, task: Task, cfg: EvaluatorConfig, runner: RunnerConfig,
          timeout_s: float = 120.0) -> str | None:
    """Start evaluator `spec`'s probe where the evaluator runs; what it printed last when it
    failed (or that it hung), else None. Raises ValueError when that sandbox cannot be used."""
    inner = probe_argv(spec)
    if inner is None:
        return None
    kind = eval_sandbox.resolve(cfg, runner)
    # A plain temporary directory, not this process's scratch root: the probe runs at start-up on
    # every rank, and a root made for it outlived a rank killed later in the run (the next sweep
    # would take it, but a run that ends then leaves it behind).
    with tempfile.TemporaryDirectory(prefix="gyre-evalcheck-") as tmp:
        ws = Path(tmp) / "execution" / "workspace"
        ws.mkdir(parents=True)
        task_file = Path(tmp) / "task.json"
        task_file.write_text(json.dumps(task.to_json()))
        argv, cwd, env = eval_sandbox.launch(kind, cfg, runner, spec, workspace=ws, task_file=task_file,
                                             scratch_dir=tmp, inner=inner)
        try:
            out = subprocess.run(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                 timeout=timeout_s, start_new_session=True)
        except subprocess.TimeoutExpired:
            return f"starting it took over {timeout_s:.0f} s"
        except OSError as e:
            return f"{type(e).__name__}: {e}"
    if out.returncode == 0:
        return None
    lines = out.stderr.strip().splitlines() or out.stdout.strip().splitlines()
    return lines[-1] if lines else f"exit status {out.returncode}"


def place(cfg: EvaluatorConfig, runner: RunnerConfig) -> str:
    """Where evaluators run, for a refusal: the sandbox and what it shows them."""
    kind = eval_sandbox.resolve(cfg, runner)
    if kind == "none":
        return "run unsandboxed, as here"
    if kind != "bwrap":
        return f"run in the evaluator sandbox {kind}"
    return ("run in the evaluator sandbox bwrap (--executions.evaluator.sandbox inherit), which shows it the workspace, "
            "its own module or script with the Python modules beside it, and --executions.evaluator.sandbox-ro-paths; "
            "docs/train-your-own-agent.md (g)")
