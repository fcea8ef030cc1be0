"""Process-tree helpers: stop a harness and everything it started, leaving no orphan.

A harness is started as the leader of a new session (and process group). Stopping it:
  1. SIGTERM to the process group, and to every process whose session id is the leader's
     (this also catches children that moved to another process group with setpgid);
     processes that are descendants by parent pid (found through /proc) are signalled too.
  2. after `grace_s`, SIGKILL to the same set, found again (new children may have appeared).
A process that both calls setsid() and daemonizes (re-parents to init) escapes all three
nets; the sandbox's own pid namespace (`gyre.executions.sandbox`: bwrap, unshare, containers)
is the answer for hostile harnesses: the kernel kills every process in it with the launcher.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

logger = logging.getLogger(__name__)


def _proc_stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, pgid, sid) of a live, non-zombie process, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("utf-8", "replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name is in parentheses and may contain spaces: split after the last ')'.
    rest = data[data.rfind(")") + 2:].split()
    state = rest[0]
    if state in ("Z", "X"):
        return None
    return int(rest[1]), int(rest[2]), int(rest[3])


def tree_pids(leader: int, include_leader: bool = True) -> set[int]:
    """Live processes belonging to the harness led by `leader`: same session, same process
    group, or a descendant by parent pid. Linux /proc only; elsewhere just the group.

    Pass include_leader=False once the leader has been reaped: its pid may then belong to an
    unrelated process. (Linux does not reuse a pid while it is still some live process's
    session or group id, so the session/group matches stay safe while any member lives.)"""
    if not os.path.isdir("/proc"):
        return {leader}
    table: dict[int, tuple[int, int, int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _proc_stat(int(name))
            if st is not None:
                table[int(name)] = st
    found = {pid for pid, (_, pgid, sid) in table.items() if sid == leader or pgid == leader}
    if include_leader and leader in table:
        found.add(leader)
    elif not include_leader:
        found.discard(leader)
    # Close over parent links so children that escaped the session via setsid are included
    # while their parent is still alive.
    changed = True
    while changed:
        changed = False
        for pid, (ppid, _, _) in table.items():
            if ppid in found and pid not in found:
                found.add(pid)
                changed = True
    found.discard(os.getpid())
    return found


def signal_tree(leader: int, sig: int, include_leader: bool = True) -> int:
    """Send `sig` to the harness's process group and every process in `tree_pids`. Returns how
    many processes were signalled."""
    n = 0
    members = tree_pids(leader, include_leader)
    if include_leader or members:  # the group id is only safe to use while the group lives
        try:
            os.killpg(leader, sig)
            n += 1
        except (ProcessLookupError, PermissionError):
            pass
    for pid in members:
        try:
            os.kill(pid, sig)
            n += 1
        except (ProcessLookupError, PermissionError):
            pass
    return n


async def kill_tree(leader: int, grace_s: float, proc: asyncio.subprocess.Process | None = None) -> None:
    """SIGTERM the harness tree, wait up to `grace_s` for it to empty, then SIGKILL what is
    left. Reaps `proc` (the leader) when given; without `proc` the leader is taken as already
    reaped (only its session and group are signalled)."""

    def alive() -> bool:
        return proc is not None and proc.returncode is None

    signal_tree(leader, signal.SIGTERM, alive())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while loop.time() < deadline:
        if proc is not None and proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), timeout=0.05)
            except asyncio.TimeoutError:
                pass
        else:
            await asyncio.sleep(0.05)
        if not tree_pids(leader, alive()):
            break
    left = tree_pids(leader, alive())
    if left:
        logger.info("harness %d: %d process(es) survived SIGTERM, sending SIGKILL", leader, len(left))
    signal_tree(leader, signal.SIGKILL, alive())
    if alive():
        await proc.wait()
    # Give the kernel a moment to reap killed children re-parented to init.
    for _ in range(40):
        if not tree_pids(leader, False):
            return
        await asyncio.sleep(0.025)
    logger.warning("harness %d: processes %s still present after SIGKILL", leader, sorted(tree_pids(leader, False)))
