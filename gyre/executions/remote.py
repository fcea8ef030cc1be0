"""Remote sandbox hosts for the harness runner (`RunnerConfig.sandbox_hosts`).

The workspace is prepared on the controller, pushed to `<remote_root>/<execution_id>/workspace`
on the chosen host with `remote_push`, the harness runs there through `remote_shell` as

    ssh -o BatchMode=yes HOST 'cd WS && exec env -i K=V ... timeout -k GRACE LIMIT ARGV'

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
    await check_call(fill(cfg.remote_push, host=host, local=str(ws), remote=remote))
    env = {**env, "GYRE_WORKSPACE": remote}
    env.pop("GYRE_INSTRUCTION_FILE", None)  # a controller path; the text travels instead
    env["GYRE_INSTRUCTION"] = spec.task.instruction
    argv = [a.replace(str(ws), remote) for a in argv]
    grace = max(1, int(cfg.kill_grace_s))
    inner = (f"cd {shlex.quote(remote)} && exec env -i "
             + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
             + f" timeout -k {grace} {int(timeout) + 1} " + shlex.join(argv))
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
