"""Harness sandboxes: what a black-box harness can see and reach (`RunnerConfig.sandbox`).

A harness is untrusted code: it must not write outside its execution, read or change the
evaluator, see other executions, keep processes alive after its execution, or talk to anything
but the proxy. Backends (what each isolates, in full: docs/security.md, "Sandboxes"):

    none       no isolation ("harness not isolated" is logged); the harness runs under
               `procs.CONTAIN`, a subreaper that kills every process of its tree at its end
    bwrap      bubblewrap: new mount, pid, ipc, uts, user (and network) namespaces; only its
               execution directory is writable, the system and Python prefix read-only
    unshare    pid, ipc, uts and network namespaces; the filesystem is NOT isolated
    container  `docker run` / `podman run`, the execution directory mounted, `--network none`
    auto       bwrap when it works on this machine, else none with a warning (the default)

Network (`sandbox_network proxy`, the default): the harness's own network namespace holds only
loopback; a Unix socket to the proxy (`ProxyRelay`) is bound in and a stdlib relay (`RELAY`)
listens on 127.0.0.1:<proxy port>, so the proxy is the one thing it can reach. `host` keeps the
host network (a documented gap).

The execution key reaches the harness only through its environment: every argv built here
carries names, never values. Every process the runner starts gets PR_SET_PDEATHSIG
(`die_with_runner`), and the sandbox's pid namespace (or CONTAIN) takes the whole tree with it; a
container outlives its CLI, so `cleanup` removes it by name and `reap_containers` removes those
a dead runner on this node left.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

from gyre.executions import procs, scratch

logger = logging.getLogger(__name__)

SOCKET_IN_SANDBOX = "/run/gyre/proxy.sock"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

def die_with_runner() -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child get SIGKILL when the process that starts it dies
    (PR_SET_PDEATHSIG; Linux only, else None). Exits the child at once if that already happened."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import signal

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: nothing is loaded after fork
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec
SANDBOX_UID = 1000  # the harness's uid inside bwrap when the controller runs as root

# Runs inside the sandbox with the sandbox's Python (`-I -S`: stdlib only, no site-packages, no
# environment influence). argv: host port unix_socket -- harness argv...
RELAY = r"""
import os, signal, socket, struct, subprocess, sys, threading, fcntl
host, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
argv = sys.argv[5:]
def lo_up():  # a fresh network namespace (unshare, containers) may start with lo down
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, req))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | 1))  # SIOCSIFFLAGS |= IFF_UP
    except OSError:
        pass
    finally:
        s.close()
lo_up()  # 127.0.0.1 can be bound with lo down, but nothing connects then
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((host, port))
srv.listen(128)
def pipe(a, b):
    try:
        while True:
            d = a.recv(65536)
            if not d:
                break
            b.sendall(d)
    except OSError:
        pass
    for s, how in ((b, socket.SHUT_WR), (a, socket.SHUT_RD)):
        try:
            s.shutdown(how)
        except OSError:
            pass
def serve():
    while True:
        c, _ = srv.accept()
        u = socket.socket(socket.AF_UNIX)
        try:
            u.connect(path)
        except OSError:
            c.close(); u.close(); continue
        threading.Thread(target=pipe, args=(c, u), daemon=True).start()
        threading.Thread(target=pipe, args=(u, c), daemon=True).start()
threading.Thread(target=serve, daemon=True).start()
child = subprocess.Popen(argv)
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, lambda n, f: child.send_signal(n))
rc = child.wait()
sys.exit(rc if rc >= 0 else 128 - rc)
"""

# Read-only system view for bwrap: enough for Python, git, a shell, TLS and DNS lookups.
_ETC = ["ssl", "ca-certificates", "pki", "resolv.conf", "hosts", "nsswitch.conf", "passwd", "group",
        "localtime", "alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "gitconfig", "mime.types"]
_TOP = ["bin", "sbin", "lib", "lib32", "lib64", "libx32"]
# Controller variables that describe the controller's own install; meaningless (or leaking) in a
# container, where the image's PATH and Python apply.
_NOT_INTO_CONTAINER = {"PATH", "PYTHONPATH", "VIRTUAL_ENV", "PYENV_ROOT", "PYENV_VERSION", "TMPDIR"}


@dataclass
class Launch:
    """What the runner starts: argv/env/cwd of the local process, and what to do after it ended."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    cleanup: Callable[[], Awaitable[None]] = field(default=lambda: _nothing())
    wrapped: bool = False  # a launcher stands between the runner and the harness

    def exit_code(self, rc: int | None) -> int | None:
        """The harness's exit status as the runner reports it (negative = killed by that signal).
        Launchers (bwrap, unshare, the relay, docker) report a signal death as 128 + signal."""
        if self.wrapped and rc is not None and 128 < rc < 128 + 65:
            return -(rc - 128)
        return rc


async def _nothing() -> None:
    return None


@functools.lru_cache(maxsize=None)
def bwrap_works(bwrap: str = "bwrap") -> bool:
    """Whether bubblewrap can build a sandbox here (user, pid and net namespaces, /proc)."""
    exe = shutil.which(bwrap)
    if exe is None:
        return False
    probe = [exe, *_bwrap_user_flags(), "--unshare-pid", "--unshare-net", "--ro-bind", "/", "/", "--proc", "/proc",
             "--dev", "/dev", "--die-with-parent", sys.executable, "-I", "-S", "-c", "import os; os.listdir('/proc')"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def resolve(kind: str) -> str:
    """The backend that `kind` means on this machine (`auto` → bwrap or none)."""
    if kind != "auto":
        return kind
    if bwrap_works():
        return "bwrap"
    _warn_once("sandbox auto: bubblewrap is not usable here (apt-get install bubblewrap); harness not isolated")
    return "none"


@functools.lru_cache(maxsize=None)
def _warn_once(msg: str) -> None:
    logger.warning(msg)


def proxy_endpoint(url: str) -> tuple[str, int]:
    """(host, port) the proxy URL points at."""
    u = urlsplit(url)
    if not u.hostname:
        raise ValueError(f"proxy URL {url!r} has no host")
    return u.hostname, u.port or (443 if u.scheme == "https" else 80)


def inside_port(url: str) -> int:
    """The relay's port inside the sandbox: the proxy's own, unless that is privileged (the
    harness's uid may not bind it)."""
    port = proxy_endpoint(url)[1]
    return port if port >= 1024 else 18080


def loopback_url(url: str) -> str:
    """The proxy URL as the harness sees it inside its network namespace: 127.0.0.1, the relay's port."""
    u = urlsplit(url)
    return urlunsplit((u.scheme, f"127.0.0.1:{inside_port(url)}", u.path, u.query, u.fragment))


class ProxyRelay:
    """A Unix socket that forwards every connection to the proxy's TCP address. One per
    sandboxed execution, bound into its sandbox only; closed when the execution ends."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._dir = scratch.mkdtemp("sb-")  # removed by the next run should this process be killed
        self.path = os.path.join(self._dir, "proxy.sock")
        if len(self.path.encode()) > 104:  # a long $TMPDIR: a socket path has at most 107 bytes
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = tempfile.mkdtemp(prefix="gyre-sb-", dir="/tmp")
            self.path = os.path.join(self._dir, "proxy.sock")
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self) -> "ProxyRelay":
        self._server = await asyncio.start_unix_server(self._handle, self.path)
        os.chmod(self.path, 0o777)  # the sandbox's uid may differ from ours
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            up_r, up_w = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            self._conns.discard(task)
            return

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
                if w.can_write_eof():
                    w.write_eof()
            except (OSError, asyncio.IncompleteReadError):
                pass

        try:
            await asyncio.gather(pump(reader, up_w), pump(up_r, writer))
        finally:
            for w in (writer, up_w):
                w.close()
            self._conns.discard(task)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for t in list(self._conns):
                t.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)
            self._server = None
        shutil.rmtree(self._dir, ignore_errors=True)


def _bwrap_user_flags() -> list[str]:
    # As root, bwrap would keep every capability inside (it could remount the read-only binds):
    # give the harness an unprivileged uid in a user namespace instead.
    if os.geteuid() == 0:
        return ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--cap-drop", "ALL"]
    return ["--unshare-user"]


def python_paths() -> list[str]:
    """The controller's interpreter and its prefixes (stdlib + site-packages), read-only."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             str(Path(sys.executable).parent), str(Path(os.path.realpath(sys.executable)).parent)}
    return sorted(p for p in paths if p and not _under_system(p))


def _under_system(p: str) -> bool:
    return any(p == d or p.startswith(d + "/") for d in ("/usr", "/bin", "/lib", "/lib64"))


def bwrap_argv(*, exec_dir: Path, ws: Path, inner: list[str], ro_paths: list[str], net: bool,
               socket: str | None, bwrap: str = "bwrap") -> list[str]:
    """The bubblewrap command line (pure: no filesystem writes). `inner` runs in `ws`."""
    a = [bwrap, *_bwrap_user_flags(), "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
         "--die-with-parent", "--new-session", "--hostname", "gyre-sandbox"]
    if net:
        a.append("--unshare-net")
    a += ["--ro-bind", "/usr", "/usr"]
    for top in _TOP:
        p = Path("/") / top
        if p.is_symlink():
            a += ["--symlink", os.readlink(p), str(p)]
        elif p.is_dir():
            a += ["--ro-bind", str(p), str(p)]
    for name in _ETC:
        a += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    a += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/run"]
    bound: list[str] = []
    for p in [*python_paths(), *ro_paths]:
        # a path inside a directory bound already is visible: binding it again would need a mount
        # point inside a read-only bind (a virtualenv's bin/python under the bound venv/bin)
        if any(p == d or p.startswith(d.rstrip("/") + "/") for d in bound):
            continue
        a += ["--ro-bind-try", p, p]
        bound.append(p)
    a += ["--bind", str(exec_dir), str(exec_dir)]
    if socket is not None:
        a += ["--bind", socket, SOCKET_IN_SANDBOX]
    # The skeleton bwrap made for the mount points (/, /run/gyre, parents of binds) is read-only:
    # the harness writes only its execution directory, /tmp and /run (private tmpfs).
    a += ["--remount-ro", "/", "--chdir", str(ws), "--", *inner]
    return a


def unshare_argv(*, inner: list[str], net: bool, unshare: str = "unshare") -> list[str]:
    """util-linux unshare: private pid/ipc/uts (and net) namespaces and /proc; the filesystem is
    shared. `--kill-child` ends everything in the pid namespace with the launcher."""
    a = [unshare, "--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--ipc", "--uts"]
    if os.geteuid() != 0:
        a.append("--map-root-user")
    if net:
        a.append("--net")
    return [*a, "--", *inner]


# Labels on every container an execution runs in: the node and the runner's scratch root (see
# gyre/executions/scratch.py), whose lock says whether the runner that started it still lives.
HOST_LABEL, OWNER_LABEL = "gyre.host", "gyre.owner"


def container_argv(*, cli: str, image: str, name: str, exec_dir: Path, ws: Path, env_names: list[str],
                   inner: list[str], ro_paths: list[str], net: bool, socket: str | None,
                   extra: list[str]) -> list[str]:
    """`docker run` / `podman run`: environment by name only (values come from the client's
    environment, so the key is on no command line)."""
    a = [cli, "run", "--rm", "--init", "--name", name, "--network", "none" if net else "host",
         "--label", f"{HOST_LABEL}={platform.node()}", "--label", f"{OWNER_LABEL}={scratch.root()}",
         "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
         "-v", f"{exec_dir}:{exec_dir}", "-w", str(ws)]
    if socket is not None:
        a += ["-v", f"{socket}:{SOCKET_IN_SANDBOX}"]
    for p in ro_paths:
        a += ["-v", f"{p}:{p}:ro"]
    for n in env_names:
        a += ["-e", n]
    return [*a, *extra, image, *inner]


def argv_files(argv: list[str]) -> list[str]:
    """The harness's program and script: argv[0] and argv[1] when they are absolute paths of files
    (`{python} examples/x/run.py`, `/opt/agent/run.sh`). Bound read-only one file each, so the
    harness runs its script from the repository without seeing the directory around it (nor the
    evaluator next to it). Other arguments are data, never bound: a path the harness needs goes
    in `sandbox_ro_paths`."""
    return [x for x in argv[:2] if os.path.isabs(x) and not _under_system(x) and os.path.isfile(x)]


async def _cli(argv: list[str], env: dict[str, str], timeout_s: float = 60.0) -> str:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                env=env)
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:2])} exited with status {proc.returncode}: {err.decode()[-300:]}")
    return out.decode()


_reaps: dict[tuple[str, int], asyncio.Future] = {}  # (CLI, event loop) -> the one reap, awaited by every launch


async def reap_containers(cli: str, env: dict[str, str]) -> list[str]:
    """Remove the containers on this node whose runner is gone: a rank SIGKILLed while its
    executions ran (PR_SET_PDEATHSIG kills the `docker run` client, and the container lives on).
    Their owner label names the runner's scratch root; its lock is free once the runner is dead
    (`scratch.alive`). Containers of live runners and of other nodes are left alone. Once per
    process and CLI: every launch waits for it, so none of ours is listed half-way; a failure is
    logged, never fatal."""
    key = (cli, id(asyncio.get_running_loop()))
    if key not in _reaps:
        _reaps[key] = asyncio.ensure_future(_reap(cli, env))
    return list(await asyncio.shield(_reaps[key]))


async def _reap(cli: str, env: dict[str, str]) -> list[str]:
    dead = []
    try:
        names = (await _cli([cli, "ps", "-a", "--filter", f"label={HOST_LABEL}={platform.node()}",
                             "--format", "{{.Names}}"], env)).split()
        for name in names:
            try:  # one at a time: a container that ends meanwhile is gone from inspect
                owner = (await _cli([cli, "inspect", "--format", f'{{{{index .Config.Labels "{OWNER_LABEL}"}}}}',
                                     name], env)).strip()
            except RuntimeError:
                continue
            if owner and not scratch.alive(owner):
                dead.append(name)
        if dead:
            await _cli([cli, "rm", "-f", *dead], env)
    except Exception as e:  # noqa: BLE001 - a missing daemon or CLI shows at the launch itself
        logger.warning("could not look for containers left by dead runners (%s)", e)
        return []
    if dead:
        logger.warning("removed %d containers whose runner had died (%s)", len(dead), ", ".join(dead[:5]))
    return dead


async def prepare(kind: str, *, cfg, execution_id: str, exec_dir: Path, ws: Path, argv: list[str],
                  env: dict[str, str]) -> Launch:
    """Wrap the harness `argv`/`env` for backend `kind` (already resolved). `cfg` is the
    RunnerConfig. Starts the execution's proxy relay when the network is restricted."""
    if kind == "none":
        if not sys.platform.startswith("linux"):
            return Launch(argv, env, str(ws))
        prog = argv[0]  # a path is relative to the workspace, where the harness starts
        found = os.access(os.path.join(ws, prog), os.X_OK) if os.sep in prog else shutil.which(prog, path=env.get("PATH", os.defpath))
        if not found:
            raise FileNotFoundError(f"harness program {prog!r} not found")  # a launch failure, as without the shim
        return Launch(procs.contain_argv(argv, cfg.kill_grace_s), env, str(ws), wrapped=True)
    if kind != "container" and shutil.which(argv[0], path=env.get("PATH", os.defpath)) is None:
        # Found here, a missing program is a launch failure, as without a sandbox (not a crash).
        raise FileNotFoundError(f"harness program {argv[0]!r} not found")
    net = cfg.sandbox_network == "proxy"
    relay: ProxyRelay | None = None
    env = dict(env)
    env["HOME"] = str(exec_dir / "home")  # the controller's home is not in the sandbox
    (exec_dir / "home").mkdir(exist_ok=True)
    inner = list(argv)
    if net:
        url = env["GYRE_PROXY_URL"]
        relay = await ProxyRelay(*proxy_endpoint(url)).start()
        inside = loopback_url(url)
        env.update(GYRE_PROXY_URL=inside, OPENAI_BASE_URL=f"{inside}/v1", ANTHROPIC_BASE_URL=inside)
        py = cfg.container_python if kind == "container" else sys.executable
        inner = [py, "-I", "-S", "-c", RELAY, "127.0.0.1", str(inside_port(url)), SOCKET_IN_SANDBOX, "--", *argv]
    ro = [*argv_files(argv), *cfg.sandbox_ro_paths]

    async def stop_relay() -> None:
        if relay is not None:
            await relay.stop()

    if kind == "bwrap":
        out = bwrap_argv(exec_dir=exec_dir, ws=ws, inner=inner, ro_paths=ro, net=net,
                         socket=relay.path if relay else None)
        return Launch(out, env, str(ws), stop_relay, wrapped=True)
    if kind == "unshare":
        _warn_once("sandbox unshare: process and network isolation only; the filesystem is NOT isolated "
                   "(install bubblewrap, or use a container)")
        if relay is not None:
            inner[inner.index(SOCKET_IN_SANDBOX)] = relay.path  # same filesystem: no bind needed
        return Launch(unshare_argv(inner=inner, net=net), env, str(ws), stop_relay, wrapped=True)
    if kind == "container":
        if not cfg.container_image:
            await stop_relay()
            raise ValueError("sandbox container needs --executions.runner.container-image")
        name = f"gyre-{execution_id}"
        env_names = sorted(k for k in env if k not in _NOT_INTO_CONTAINER)
        out = container_argv(cli=cfg.container_cli, image=cfg.container_image, name=name, exec_dir=exec_dir, ws=ws,
                             env_names=env_names, inner=inner, ro_paths=ro, net=net,
                             socket=relay.path if relay else None, extra=cfg.container_args)
        client_env = {k: os.environ[k] for k in ("PATH", "HOME", "DOCKER_HOST", "DOCKER_CONFIG", "XDG_RUNTIME_DIR",
                                                 "CONTAINER_HOST") if k in os.environ}
        client_env.update({k: env[k] for k in env_names})
        await reap_containers(cfg.container_cli, client_env)

        async def cleanup() -> None:
            # Killing the client does not stop the container: remove it by name.
            with contextlib.suppress(Exception):
                proc = await asyncio.create_subprocess_exec(cfg.container_cli, "rm", "-f", name,
                                                            stdout=asyncio.subprocess.DEVNULL,
                                                            stderr=asyncio.subprocess.DEVNULL, env=client_env)
                await asyncio.wait_for(proc.wait(), 60)
            await stop_relay()

        return Launch(out, client_env, str(ws), cleanup, wrapped=True)
    await stop_relay()
    raise ValueError(f"unknown sandbox {kind!r}")
