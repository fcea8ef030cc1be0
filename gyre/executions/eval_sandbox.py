"""What an evaluator may see and where it runs (`EvaluatorConfig.sandbox`; docs/security.md).

The evaluator scores a workspace an untrusted harness wrote, and it runs as the controller's
user. So two things are checked or contained here:

  - The workspace path. A harness can replace `<execution_id>/workspace` (or, unsandboxed, its
    execution directory) with a symbolic link to any path: a sibling's workspace (its reward),
    the repository, the home directory. `workspace_refusal` says why such a workspace is not
    scored: both must be real directories (lstat, no link followed) and the workspace's real
    path must be the path itself. A refused workspace is never evaluated: the execution is
    excluded with the reason in `result.json`.
  - The evaluator process. `inherit` (the default) runs command and `module:function`
    evaluators in the harness's sandbox backend: under bubblewrap the workspace read-write, the
    rest of its execution directory read-only, the evaluator's own package or script
    (`beside_modules`) and gyre read-only, no network; so an evaluator that runs the workspace's
    tests runs harness-written code sandboxed too. A harness in a container: its evaluators run
    under bubblewrap on this node. `none` runs them unsandboxed (logged). A Python callable
    given directly (`EvaluatorSpec("python", fn)`, tests) is never sandboxed: it must not
    execute workspace code.

`open_beneath` / `read_beneath` read a file inside a workspace without following any link
(every component opened with O_NOFOLLOW), for the files Gyre reads itself (`expected_files`)
and for Python evaluators that want the same guarantee.
"""

from __future__ import annotations

import importlib.machinery
import logging
import os
import re
import stat
import sys
from pathlib import Path, PurePosixPath

from gyre.executions import sandbox
from gyre.executions.config import EvaluatorConfig, RunnerConfig
from gyre.executions.tasks import EvaluatorSpec

logger = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def workspace_refusal(ws: str | Path) -> str | None:
    """Why the workspace at `ws` must not be scored (a link made by the harness), else None.
    A missing workspace is not refused (the evaluator scores what is there: nothing)."""
    ws = Path(os.path.abspath(ws))
    for path, what in ((ws.parent, "execution directory"), (ws, "workspace")):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None if path == ws else f"the {what} {path} is missing"
        if stat.S_ISLNK(st.st_mode):
            return f"the {what} {path} was replaced by a symbolic link to {os.readlink(path)!r} (not followed)"
        if not stat.S_ISDIR(st.st_mode):
            return f"the {what} {path} is not a directory"
    real = os.path.realpath(ws)
    if real != str(ws):  # a link higher up the path, made after the runner resolved it
        return f"the workspace {ws} resolves to {real} through a symbolic link (not followed)"
    return None


def open_beneath(root: str | Path, rel: str) -> int:
    """A read-only descriptor of the regular file `rel` inside directory `root`, no link
    followed on the way (root itself included): OSError (ELOOP, ENOTDIR, ...) otherwise.
    `rel` must be relative and free of '..' (ValueError). The caller closes it."""
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise ValueError(f"{rel!r} is not a path inside the workspace")
    fd = os.open(root, _DIR_FLAGS)
    try:
        for name in p.parts[:-1]:
            nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
        # O_NONBLOCK: a FIFO planted by the harness does not block the open
        out = os.open(p.parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(out).st_mode):
        os.close(out)
        raise IsADirectoryError(f"{rel!r} in the workspace is not a regular file")
    return out


def read_beneath(root: str | Path, rel: str, max_bytes: int = 64 << 20) -> bytes:
    """The bytes of `rel` inside `root` (see `open_beneath`); ValueError past `max_bytes`."""
    with os.fdopen(open_beneath(root, rel), "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{rel!r} in the workspace is larger than {max_bytes} bytes")
    return data


def resolve(cfg: EvaluatorConfig, runner: RunnerConfig) -> str:
    """The backend evaluator processes run in: `bwrap`, `unshare` or `none`."""
    if cfg.sandbox == "none":
        return "none"
    if cfg.sandbox != "inherit":
        raise ValueError(f"--executions.evaluator.sandbox must be inherit or none, got {cfg.sandbox!r}")
    kind = sandbox.resolve(runner.sandbox)
    if kind == "container":
        if not sandbox.bwrap_works():
            raise ValueError("--executions.evaluator.sandbox inherit: harnesses run in containers and evaluators run "
                             "under bubblewrap on this node, which is not usable here (apt-get install bubblewrap); "
                             "or set --executions.evaluator.sandbox none to run evaluators unsandboxed")
        return "bwrap"
    return kind


def announce(kind: str, cfg: EvaluatorConfig, runner: RunnerConfig) -> None:
    """The start-up line saying where evaluators run."""
    if kind == "bwrap":
        logger.info("executions: evaluators run in sandbox bwrap (--executions.evaluator.sandbox %s): the workspace "
                    "read-write, its execution directory read-only, nothing else of the run, %s", cfg.sandbox,
                    "no network" if runner.sandbox_network == "proxy" else "the host network")
    elif kind == "unshare":
        logger.warning("executions: evaluators run in sandbox unshare (--executions.evaluator.sandbox %s): process and "
                       "network isolation only, the filesystem is NOT isolated", cfg.sandbox)
    elif cfg.sandbox == "none":
        logger.warning("executions: evaluators not sandboxed (--executions.evaluator.sandbox none): they run as this "
                       "user with this filesystem and network; one that runs workspace code runs harness-written "
                       "code outside any sandbox")
    else:
        logger.warning("executions: evaluators not sandboxed: they inherit the harness sandbox, none "
                       "(--executions.runner.sandbox); one that runs workspace code runs harness-written code as "
                       "this user")


def module_paths(target: str, workspace: Path | None = None) -> list[str]:
    """Where a `module:function` evaluator's top-level package lives, or its module file and the
    Python modules beside it (`beside_modules`), found without importing it (this process's
    directory first, as the child's PYTHONPATH has it)."""
    top = target.partition(":")[0].split(".")[0]
    spec = importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path])
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return [str(p) for p in spec.submodule_search_locations]
    if not (spec.origin and os.path.isabs(spec.origin)):
        return []
    return [spec.origin, *beside_modules(spec.origin, workspace)]


def command_paths(argv: list[str], workspace: Path | None = None) -> list[str]:
    """What a command evaluator sees beyond the workspace: its program and script (argv[0] and
    argv[1] when absolute files, as for harnesses; the script of `python -u /x/check.py` too) and,
    for a Python script, the Python modules beside it (`beside_modules`): `python
    /my/project/check.py` importing `/my/project/helpers.py` runs as it does on the host."""
    files = sandbox.argv_files(argv)
    what, script = python_target(argv) or ("", "")
    if what == "script" and os.path.isabs(script) and os.path.isfile(script) and script not in files:
        files.append(script)
    return [*files, *(m for f in files if f.endswith(".py") for m in beside_modules(f, workspace))]


_PYTHON = re.compile(r"python[0-9.]*")
_FLAGS_WITH_VALUE = {"-W", "-X", "-Q"}


def python_target(argv: list[str]) -> tuple[str, str] | None:
    """("script", path) for `python [flags] path.py ...`, ("module", name) for `python [flags] -m
    name ...`, else None (not a Python interpreter, or `-c`)."""
    if not _PYTHON.fullmatch(os.path.basename(argv[0])):
        return None
    i = 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-m", "-c", "-"):
        i += 2 if argv[i] in _FLAGS_WITH_VALUE else 1
    rest = argv[i:]
    if rest[:1] == ["-m"] and len(rest) > 1:
        return "module", rest[1]
    if rest and rest[0].endswith(".py"):
        return "script", rest[0]
    return None


def beside_modules(entry: str, workspace: Path | None = None) -> list[str]:
    """The Python modules in the directory of a single-file evaluator `entry` (the directory Python
    puts first on sys.path for a script): its module files (`.py`, extension modules) and
    packages (directories with `__init__.py`), bound read-only so the evaluator imports its own
    helpers as on the host. Nothing else of that directory: not its data files (those go in
    `sandbox_ro_paths`), not a `runs/` directory of other executions, not a home directory's
    dotfiles; no package that holds the workspace; nothing from inside the Python installation
    or the system (bound already)."""
    d = os.path.dirname(os.path.abspath(entry))
    if sandbox._under_system(d) or any(d == p or d.startswith(p.rstrip("/") + "/") for p in sandbox.python_paths()):
        return []
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return []
    inside = (str(workspace).rstrip("/") + "/") if workspace is not None else None
    suffixes = tuple(importlib.machinery.all_suffixes())
    out = []
    for name in names:
        p = os.path.join(d, name)
        if p == os.path.abspath(entry):
            continue
        if name.endswith(suffixes) and os.path.isfile(p):
            out.append(p)
        elif os.path.isfile(os.path.join(p, "__init__.py")) and not (inside and inside.startswith(p + "/")):
            out.append(p)
    return out


def python_path() -> str:
    """PYTHONPATH of a `module:function` evaluator's child: the launch directory, then this
    process's sys.path (what it can see of them is what the sandbox binds)."""
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    paths.insert(0, os.getcwd())
    return os.pathsep.join(dict.fromkeys(paths))


def gyre_paths() -> list[str]:
    """The gyre package this process runs (the child runs `-m gyre.executions.evaluator`)."""
    import gyre

    return [str(Path(gyre.__file__).resolve().parent)]


def wrap(kind: str, *, inner: list[str], ws: Path, ro_paths: list[str], runner: RunnerConfig) -> list[str]:
    """`inner` as run in backend `kind`, in `ws` (pure: builds the command line)."""
    net = runner.sandbox_network == "proxy"
    if kind == "none":
        return inner
    if kind == "bwrap":
        # The workspace is the one writable path; the rest of its execution directory (the logs,
        # files a harness keeps beside its workspace: what examples/claude_code's evaluator reads)
        # is read-only. Both bound where the evaluator expects them.
        return sandbox.bwrap_argv(exec_dir=ws, ws=ws, inner=inner, ro_paths=[*ro_paths, str(ws.parent)], net=net,
                                  socket=None)
    if kind == "unshare":
        return sandbox.unshare_argv(inner=inner, net=net)
    raise ValueError(f"unknown evaluator sandbox {kind!r}")


def environment(kind: str, runner: RunnerConfig) -> dict[str, str]:
    """The evaluator's base environment: in a sandbox the harness's passthrough list and
    `runner.env` (the controller's credentials stay out, as for harnesses) with HOME on the
    private /tmp; unsandboxed, this process's."""
    if kind == "none":
        return dict(os.environ)
    env = {k: os.environ[k] for k in runner.env_passthrough if k in os.environ}
    env.update(runner.env)
    if kind == "bwrap":
        env["HOME"] = env["TMPDIR"] = "/tmp"
    return env


def launch(kind: str, cfg: EvaluatorConfig, runner: RunnerConfig, spec: EvaluatorSpec, *, workspace: Path,
           task_file: Path, scratch_dir: str, inner: list[str] | None = None) -> tuple[list[str], str, dict[str, str]]:
    """(argv, cwd, env) of the process that runs evaluator `spec` (a command or a
    "module:function") on `workspace` in backend `kind`. `inner` replaces the evaluator's own
    command with the same binds, environment and directory: the up-front check
    (`gyre.executions.eval_probe`) runs exactly where the evaluator will. `scratch_dir`: a
    private directory of the caller's (holding `task_file`), the launcher's cwd under bwrap."""
    env = environment(kind, runner)
    ro = [str(task_file), *runner.sandbox_ro_paths, *cfg.sandbox_ro_paths]
    if spec.kind == "python":
        argv = inner or [sys.executable, "-m", "gyre.executions.evaluator", str(workspace), str(task_file)]
        env["PYTHONPATH"] = python_path()
        cwd = os.getcwd()
        ro += [*gyre_paths(), *module_paths(spec.target, workspace)]
    else:
        argv = inner or list(spec.target)
        cwd = str(workspace)
        ro += command_paths(list(spec.target), workspace)
    env.update(GYRE_WORKSPACE=str(workspace), GYRE_TASK_FILE=str(task_file))
    if kind != "none":
        argv = wrap(kind, inner=argv, ws=workspace, ro_paths=ro, runner=runner)
        if kind == "bwrap":
            cwd = scratch_dir  # the launcher's; bwrap enters the workspace itself (--chdir)
    return argv, cwd, env
