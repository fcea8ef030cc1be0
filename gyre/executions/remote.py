"""Remote sandbox hosts for the harness runner (`RunnerConfig.sandbox_hosts`).

The workspace is prepared on the controller, pushed to `<remote_root>/<execution_id>/workspace`
on the chosen host with `remote_push`, the harness runs there through `remote_shell` as

    ssh -o BatchMode=yes HOST 'cd WS && exec env -i sh -c ". ./.gyre-env && rm -f ./.gyre-env && exec timeout -k GRACE LIMIT ARGV"'

The environment (the execution key included) travels in `.gyre-env`, a 0600 file pushed with
the workspace and deleted before the harness starts: never on the ssh command line, where `ps`
on either host shows it to every user.

(the remote `timeout` enforces the wall-clock limit even if the link dies; killing the local
ssh client ends the session), and after it ends the workspace is pulled back with
`remote_pull`, so the evaluator scores the preserved workspace on the controller.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
from pathlib import Path

from gyre.executions.config import RunnerConfig
from gyre.executions.procs import kill_tree
from gyre.executions.tasks import ExecutionSpec

logger = logging.getLogger(__name__)

ENV_FILE = ".gyre-env"


def remote_workspace(cfg: RunnerConfig, spec: ExecutionSpec) -> str:
    return f"{cfg.remote_root.rstrip('/')}/{spec.execution_id}/workspace"


def fill(template: list[str], **kw: str) -> list[str]:
    """Replace `{name}` placeholders in each argv element."""
    out = []
    for a in template:
        for k, v in kw.items():
            a = a.replace("{" + k + "}", v)
        out.append(a)
    return out


async def push_and_wrap(cfg: RunnerConfig, spec: ExecutionSpec, host: str, ws: Path, argv: list[str],
                        env: dict[str, str], timeout: float) -> tuple[list[str], dict[str, str]]:
    """Ship the workspace to `host`; return the local argv/env that run the harness there."""
    remote = remote_workspace(cfg, spec)
    env = {**env, "GYRE_WORKSPACE": remote}
    env.pop("GYRE_INSTRUCTION_FILE", None)  # a controller path; the text travels instead
    env["GYRE_INSTRUCTION"] = spec.task.instruction
    env_file = ws / ENV_FILE
    fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))
    try:
        await check_call(fill(cfg.remote_push, host=host, local=str(ws), remote=remote))
    finally:
        env_file.unlink()  # not left for the evaluator (nor pulled back: the remote copy is removed too)
    argv = [a.replace(str(ws), remote) for a in argv]
    grace = max(1, int(cfg.kill_grace_s))
    start = f". ./{ENV_FILE} && rm -f ./{ENV_FILE} && exec timeout -k {grace} {int(timeout) + 1} " + shlex.join(argv)
    inner = f"cd {shlex.quote(remote)} && exec env -i sh -c {shlex.quote(start)}"
    local_env = {k: os.environ[k] for k in ("PATH", "HOME", "USER", "SSH_AUTH_SOCK") if k in os.environ}
    return fill(cfg.remote_shell, host=host) + [inner], local_env


async def pull(cfg: RunnerConfig, spec: ExecutionSpec, host: str, ws: Path) -> None:
    """Bring the workspace back; on failure the evaluator scores what is local (logged)."""
    try:
        await check_call(fill(cfg.remote_pull, host=host, local=str(ws), remote=remote_workspace(cfg, spec)))
    except Exception as e:  # noqa: BLE001
        logger.warning("execution %s: pulling the workspace back from %s failed: %s", spec.execution_id, host, e)


async def check_call(argv: list[str], timeout_s: float = 600.0) -> None:
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        await kill_tree(proc.pid, 1.0, proc)
        raise TimeoutError(f"{argv[0]} exceeded {timeout_s}s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} exited {proc.returncode}: {err.decode(errors='replace')[-500:]}")
