"""Process-tree helpers: stop a harness and everything it started, leaving no orphan.

A harness is started as the leader of a new session (and process group). Stopping it:
  1. SIGTERM to the process group, and to every process whose session id is the leader's
     (this also catches children that moved to another process group with setpgid);
     processes that are descendants by parent pid (found through /proc) are signalled too.
  2. after `grace_s`, SIGKILL to the same set, found again (new children may have appeared).
A process that both calls setsid() and daemonizes (re-parents to init) escapes all three
nets. Two answers: the sandbox's own pid namespace (`gyre.executions.sandbox`: bwrap, unshare,
containers), where the kernel kills every process in it with the launcher; and, under `none`,
`CONTAIN` (`contain_argv`), a stdlib shim that runs the harness as its child and is a *child
subreaper* (PR_SET_CHILD_SUBREAPER): every orphan of the tree, a setsid + double-forked daemon
included, is re-parented to the shim instead of to init, so the tree stays one parent-pid tree
that the shim empties (SIGTERM, grace, SIGKILL until it has no child left) before it exits,
whether the harness ended, the runner stopped it, or the runner died (its parent-death signal).

`watch_parent` is the same promise one level up: a rank started by torchrun kills itself the
moment torchrun is gone (a SIGKILLed torchrun otherwise leaves its ranks, and their harnesses,
running for 5–20 s beside a relaunch).

`child_pids` / `descendant_pids` / `terminate_pids` stop a tree found by parent pid instead: an
embedded engine's subprocesses (SGLang's scheduler and detokenizer), children of the rank itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import sys
import threading
import time

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


# ----------------------------------------------------------------------------- by parent pid
# An embedded engine's own subprocesses (the SGLang adapter, gyre/backends/engines/sglang_engine.py):
# they are this rank's children, not a session of their own, so they are found by parent pid.
def child_pids(pid: int) -> set[int]:
    """Direct children of `pid`, zombies included (Linux /proc)."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4, after "(comm)" and the state
            out.add(int(entry))
    return out


def descendant_pids(pids: set[int]) -> set[int]:
    """`pids` and every process below them by parent pid, as they are now."""
    found, todo = set(), list(pids)
    while todo:
        p = todo.pop()
        if p not in found:
            found.add(p)
            todo.extend(child_pids(p))
    return found


def terminate_pids(pids: set[int], grace_s: float) -> None:
    """SIGTERM `pids`, SIGKILL those left after `grace_s` (blocking; this process's own children
    are reaped as they end)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = {p for p in pids if alive(p)}
            time.sleep(0.05)
        if not pids:
            return


def alive(pid: int) -> bool:
    """The process runs (a zombie does not; one of ours is reaped)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)  # reap our own children
        if done:
            return False
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# Leads a `none` harness's session (the runner starts it with start_new_session). argv: grace_s --
# harness argv. Exits with the harness's status (128 + signal for a signal death, like the other
# launchers). Stdlib only (`python -I -S`). Signals it acts on are blocked and taken with
# sigtimedwait, so no handler runs in the middle of a sweep.
CONTAIN = r"""
import ctypes, os, signal, sys, time
grace, argv = float(sys.argv[1]), sys.argv[3:]
libc = ctypes.CDLL(None, use_errno=True)
runner, me = os.getppid(), os.getpid()
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the tree's orphans come here, not to init
STOP = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
signal.pthread_sigmask(signal.SIG_BLOCK, STOP | {signal.SIGCHLD})
libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG: a SIGTERM when the runner dies
harness, status = None, [None]
def orphaned():
    return os.getppid() != runner
def reap():
    # Reap every ended child; False once none is left (no descendant alive: we are their reaper).
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        if pid == harness:
            status[0] = os.waitstatus_to_exitcode(st)
def tree():
    kids = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/" + name + "/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(name))
    out, todo = [], [me]
    while todo:
        for c in kids.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out
def sweep(sig):
    for p in tree():
        try:
            os.kill(p, sig)
        except OSError:
            pass
if orphaned():
    sys.exit(128 + signal.SIGKILL)
try:
    harness = os.posix_spawnp(argv[0], argv, os.environ, setsigmask=(),
                              setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, *STOP, signal.SIGCHLD))
except OSError as e:
    sys.stderr.write("gyre: cannot start the harness %r: %s\n" % (argv[0], e))
    sys.exit(127)
stopped = False
while status[0] is None and not stopped:
    info = signal.sigtimedwait(STOP | {signal.SIGCHLD}, 1.0)
    stopped = (info is not None and info.si_signo in STOP) or orphaned()
    reap()
if not orphaned():
    # What the harness left behind (and, on a stop, the harness itself) gets SIGTERM and a grace.
    sweep(signal.SIGTERM)
    deadline = time.monotonic() + (grace if stopped else min(grace, 1.0))
    while reap() and not orphaned() and time.monotonic() < deadline:
        signal.sigtimedwait({signal.SIGCHLD}, 0.05)
give_up = time.monotonic() + 30.0
while reap() and time.monotonic() < give_up:
    sweep(signal.SIGKILL)
    time.sleep(0.01)
rc = status[0] if status[0] is not None else -signal.SIGKILL
sys.exit(rc if rc >= 0 else 128 - rc)
"""


def contain_argv(argv: list[str], grace_s: float) -> list[str]:
    """`argv` run under `CONTAIN` (Linux): when the harness ends, is stopped (SIGTERM to the shim)
    or its runner dies, nothing it started outlives it. `grace_s`: SIGTERM → SIGKILL on a stop
    (1 s at most for what a harness that exited left behind)."""
    return [sys.executable, "-I", "-S", "-c", CONTAIN, f"{grace_s:g}", "--", *argv]


def watch_parent(what: str = "the parent process") -> threading.Thread | None:
    """Kill this process (SIGKILL, after one log line) as soon as its parent is gone.

    For a rank under torchrun: when torchrun is SIGKILLed its ranks are re-parented and would run
    on until a collective times out. PR_SET_PDEATHSIG is not used because it fires when the
    parent *thread* that forked us ends, which torchrun does not promise to keep; a pidfd of the
    parent (Linux ≥ 5.3; else a 0.5 s poll of getppid) watched by a daemon thread is exact.
    Our own children then follow: harness shims and launchers have a parent-death signal."""
    parent = os.getppid()
    if parent == 1:
        return None  # already orphaned (or started by init): nothing to watch
    fd = None
    try:
        fd = os.pidfd_open(parent)
    except (AttributeError, OSError):
        fd = None
    if os.getppid() != parent:  # it died while we looked
        _parent_gone(what, parent)

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while os.getppid() == parent:
                threading.Event().wait(0.5)
        _parent_gone(what, parent)

    t = threading.Thread(target=watch, name="gyre-watch-parent", daemon=True)
    t.start()
    return t


def _parent_gone(what: str, parent: int) -> None:
    logger.error("%s (pid %d) is gone; this process (pid %d) stops now with everything it started",
                 what, parent, os.getpid())
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
    os.kill(os.getpid(), signal.SIGKILL)
