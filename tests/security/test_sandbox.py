"""A hostile harness cannot hurt the run (issue 20): real probe harnesses in the runner's sandbox.

Each property is checked from both sides: the probe reports what it could do, and the test looks
at the host afterwards (files outside the workspace, live pids, /proc/*/cmdline). Skipped with
the reason where this machine cannot build the namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import stat
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from gyre.executions import evaluator as evaluator_module
from gyre.executions import sandbox, scratch
from gyre.executions.config import EvaluatorConfig, RunnerConfig
from gyre.executions.evaluator import Evaluator, Outcome, RewardStatus
from gyre.executions.runner import HarnessRunner
from gyre.runtime.proxy_access import GyreProxyAccess
from gyre.executions.tasks import EvaluatorSpec, ExecutionSpec, Task

REPO = Path(__file__).resolve().parents[2]

needs_bwrap = pytest.mark.skipif(not sandbox.bwrap_works(), reason="bubblewrap missing or no user/pid/net namespaces here")


def _unshare_works() -> bool:
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        return False
    argv = sandbox.unshare_argv(inner=[sys.executable, "-c", "pass"], net=True)
    return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0


needs_unshare = pytest.mark.skipif(not _unshare_works(), reason="unshare cannot create pid/net namespaces here")
BACKENDS = [pytest.param("bwrap", marks=needs_bwrap), pytest.param("unshare", marks=needs_unshare)]


@pytest.fixture
def proxy_server():
    from gyre.backends.engines.det_engine import DeterministicEngine
    from gyre.proxy import MemorySink, Proxy, ProxyConfig, serve_proxy

    handles = []

    def make():
        sink = MemorySink()
        proxy = Proxy(ProxyConfig(), sink=sink)
        proxy.router.add_engine(DeterministicEngine("det", eos_prob=0.3), kind="cell", index=0)
        h = serve_proxy(proxy)
        handles.append(h)
        return proxy, h, sink

    yield make
    for h in handles:
        h.stop()


def _task(tid: str, script: Path, *args: str, reward=lambda ws, t: 1.0) -> Task:
    return Task(task_id=tid, instruction="probe", harness=["{python}", str(script), *args],
                evaluator=EvaluatorSpec("python", reward))


def _script(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "probe.py"
    p.write_text(textwrap.dedent(body))
    return p


def _run(runner: HarnessRunner, *specs: ExecutionSpec):
    async def main():
        return await asyncio.gather(*(runner.dispatch(s) for s in specs))

    return asyncio.run(main())


def _stderr(res) -> str:
    return (res.exec_dir / "stderr.log").read_text()[-3000:]


# ---------------------------------------------------------------------------- filesystem
@needs_bwrap
def test_probe_cannot_write_outside_or_read_evaluator_repo_or_other_workspace(tmp_path):
    run_dir = tmp_path / "runs"
    other = run_dir / "other-exec" / "workspace"
    other.mkdir(parents=True)
    (other / "secret.txt").write_text("other execution's work")
    outside = tmp_path / "outside.txt"
    evaluator_py = Path(evaluator_module.__file__).resolve()
    before = evaluator_py.read_bytes()
    probe = _script(tmp_path, """
        import json, os, sys
        out = {}
        def attempt(name, fn):
            try:
                fn()
                out[name] = "ok"
            except OSError as e:
                out[name] = type(e).__name__
        attempt("write_relative", lambda: open("../../x.txt", "w").write("x"))
        attempt("write_absolute", lambda: open(sys.argv[1], "w").write("x"))
        attempt("read_evaluator", lambda: open(sys.argv[2]).read())
        attempt("append_evaluator", lambda: open(sys.argv[2], "a").write("# hacked"))
        attempt("read_repo", lambda: os.listdir(sys.argv[3]))
        attempt("read_other_workspace", lambda: open(sys.argv[4]).read())
        attempt("write_repo", lambda: open(os.path.join(sys.argv[3], "pwned.txt"), "w").write("x"))
        try:
            out["run_dir_listing"] = sorted(os.listdir(sys.argv[5]))
        except OSError as e:
            out["run_dir_listing"] = type(e).__name__
        attempt("write_tmp", lambda: open("/tmp/scratch", "w").write("x"))  # private /tmp: allowed
        attempt("write_own_workspace", lambda: open("mine.txt", "w").write("x"))
        json.dump(out, open("probe.json", "w"))
    """)
    args = (str(outside), str(evaluator_py), str(REPO), str(other / "secret.txt"), str(run_dir))
    runner = HarnessRunner(RunnerConfig(run_dir=str(run_dir), sandbox="bwrap"))
    (res,) = _run(runner, ExecutionSpec("probe-fs", _task("t", probe, *args), "g"))
    assert res.outcome is Outcome.COMPLETED, _stderr(res)
    out = json.loads((res.workspace / "probe.json").read_text())
    for denied in ("read_evaluator", "append_evaluator", "read_repo", "read_other_workspace", "write_repo"):
        assert out[denied] != "ok", (denied, out)
    assert out["write_tmp"] == "ok" and out["write_own_workspace"] == "ok"
    # Other executions are not in its view of the run directory (at most its own mount point).
    assert "other-exec" not in out["run_dir_listing"], out
    # Writes outside the workspace either fail or land in the sandbox's private /tmp: seen from
    # the host, nothing landed outside, and the evaluator and the repository are unchanged.
    assert not outside.exists() and not (run_dir / "x.txt").exists() and not (tmp_path / "x.txt").exists()
    assert not (REPO / "pwned.txt").exists()
    assert evaluator_py.read_bytes() == before
    assert (res.workspace / "mine.txt").exists()


# ---------------------------------------------------------------------------- processes
DAEMON_PROBE = """
    import os, sys, time
    marker = sys.argv[1]
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:  # a classic daemon: its own session, re-parented away from the harness
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(300)", marker])
        os._exit(0)
    time.sleep(1.0)  # the test finds the daemon's pid meanwhile
"""


def _pids_with(token: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if token.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    found.append(int(name))
            except OSError:
                pass
    return [p for p in found if p != os.getpid()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_setsid_daemon_dies_with_the_execution(tmp_path, backend):
    from tests.executions.helpers import alive, wait_dead

    marker = f"gyre-daemon-{os.getpid()}-{backend}"
    probe = _script(tmp_path, DAEMON_PROBE)
    runner = HarnessRunner(RunnerConfig(run_dir=str(tmp_path / "runs"), sandbox=backend, kill_grace_s=0.5))
    seen: list[int] = []

    async def main():
        t = runner.dispatch(ExecutionSpec("probe-daemon", _task("t", probe, marker), "g"))
        while not t.done():
            seen.extend(p for p in _pids_with(marker) if p not in seen)
            await asyncio.sleep(0.05)
        return await t

    res = asyncio.run(main())
    assert res.outcome is Outcome.COMPLETED, _stderr(res)
    assert seen, "the daemon never showed up"
    left = wait_dead(seen, 3.0)
    assert not left, f"daemon pids {left} outlived the execution"
    assert not any(alive(p) for p in _pids_with(marker))


# ---------------------------------------------------------------------------- network
@pytest.mark.parametrize("backend", BACKENDS)
def test_only_the_proxy_is_reachable(tmp_path, proxy_server, backend):
    proxy, handle, sink = proxy_server()
    host_srv = socket.socket()
    host_srv.bind(("127.0.0.1", 0))
    host_srv.listen(8)
    accepted = []
    threading.Thread(target=lambda: accepted.append(host_srv.accept()), daemon=True).start()
    probe = _script(tmp_path, """
        import json, os, socket, sys, openai
        out = {}
        for name, addr in (("host_port", ("127.0.0.1", int(sys.argv[1]))), ("outside_ip", ("1.1.1.1", 53))):
            try:
                socket.create_connection(addr, timeout=2).close()
                out[name] = "ok"
            except OSError as e:
                out[name] = type(e).__name__
        r = openai.OpenAI(max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        out["proxy"] = r.choices[0].finish_reason
        json.dump(out, open("net.json", "w"))
    """)
    runner = HarnessRunner(RunnerConfig(run_dir=str(tmp_path / "runs"), sandbox=backend),
                           Evaluator(EvaluatorConfig()), GyreProxyAccess(proxy, handle.url))
    (res,) = _run(runner, ExecutionSpec("probe-net", _task("t", probe, str(host_srv.getsockname()[1])), "g"))
    host_srv.close()
    assert res.outcome is Outcome.COMPLETED, _stderr(res)
    out = json.loads((res.workspace / "net.json").read_text())
    assert out["proxy"] in ("stop", "length")
    assert out["host_port"] != "ok" and out["outside_ip"] != "ok", out
    assert not accepted
    assert len(sink.for_execution("probe-net")) == 1


def test_host_network_gap_is_what_it_says(tmp_path):
    """`sandbox_network host` is the documented gap: the harness reaches the host's ports."""
    if not sandbox.bwrap_works():
        pytest.skip("bubblewrap missing or no namespaces here")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    probe = _script(tmp_path, """
        import socket, sys
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2).close()
    """)
    runner = HarnessRunner(RunnerConfig(run_dir=str(tmp_path / "runs"), sandbox="bwrap", sandbox_network="host"))
    (res,) = _run(runner, ExecutionSpec("probe-hostnet", _task("t", probe, str(srv.getsockname()[1])), "g"))
    srv.close()
    assert res.outcome is Outcome.COMPLETED, _stderr(res)


# ---------------------------------------------------------------------------- a normal execution
@pytest.mark.parametrize("backend", BACKENDS)
def test_normal_execution_gets_a_response_and_a_reward_and_keys_stay_off_command_lines(tmp_path, proxy_server, backend):
    proxy, handle, sink = proxy_server()
    access = GyreProxyAccess(proxy, handle.url)
    issued: dict[str, str] = {}
    orig = access.open_execution

    def spy(eid, gid):
        issued[eid] = orig(eid, gid)
        return issued[eid]

    access.open_execution = spy
    probe = _script(tmp_path, """
        import os, time, openai
        r = openai.OpenAI(max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        open("answer.txt", "w").write(r.choices[0].message.content or "")
        time.sleep(1.0)  # the test scans the process table meanwhile
    """)

    def reward(ws, task):
        return 1.0 if (Path(ws) / "answer.txt").exists() else 0.0

    runner = HarnessRunner(RunnerConfig(run_dir=str(tmp_path / "runs"), sandbox=backend),
                           Evaluator(EvaluatorConfig()), access)
    leaks: list[int] = []
    scans = [0]

    async def main():
        tasks = [runner.dispatch(ExecutionSpec(f"ok-{i}", _task("t", probe, reward=reward), "g")) for i in range(2)]
        while not all(t.done() for t in tasks):
            for key in list(issued.values()):
                leaks.extend(_pids_with(key))
            scans[0] += 1
            await asyncio.sleep(0.05)
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    for res in results:
        assert res.outcome is Outcome.COMPLETED, _stderr(res)
        assert res.reward.status is RewardStatus.VALID and res.reward.reward == 1.0
        assert len(sink.for_execution(res.execution_id)) == 1
    assert len(issued) == 2 and scans[0] > 5
    assert not leaks, f"an execution key is on the command line of pids {leaks}"
    # No file of the run holds a key (the environment is the only carrier).
    for p in (tmp_path / "runs").rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            assert not any(k.encode() in data for k in issued.values()), p


# ---------------------------------------------------------------------------- container backend
def test_container_command_line_against_a_fake_docker(tmp_path, proxy_server):
    """No docker daemon is assumed: a fake `docker` records its argv and environment, then runs the
    relay + harness itself (so the proxy call really goes through the Unix socket)."""
    proxy, handle, sink = proxy_server()
    log = tmp_path / "docker.jsonl"
    fake = tmp_path / "bin" / "docker"
    fake.parent.mkdir()
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, os, subprocess, sys
        argv = sys.argv[1:]
        with open({str(log)!r}, "a") as f:
            f.write(json.dumps({{"argv": argv, "key_in_env": "OPENAI_API_KEY" in os.environ}}) + "\\n")
        if argv[0] != "run":
            sys.exit(0)
        inner = argv[argv.index("gyre/harness:test") + 1:]
        sock = [a.split(":")[0] for a in argv if a.endswith(":/run/gyre/proxy.sock")][0]
        inner[inner.index("/run/gyre/proxy.sock")] = sock
        # No network namespace here: the relay takes a free port instead of the proxy's.
        import socket
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = str(s.getsockname()[1]); s.close()
        old = inner[6]
        inner[6] = port
        env = {{k: v.replace("127.0.0.1:" + old, "127.0.0.1:" + port) for k, v in os.environ.items()}}
        # The image's python3 (the relay's and the harness's) -> ours: the one running the tests,
        # whose packages (openai) a `python3` found on PATH need not have (a virtualenv).
        inner = [{sys.executable!r} if a == "python3" else a for a in inner]
        sys.exit(subprocess.call(inner, env=env))
    """))
    fake.chmod(0o755)
    probe = _script(tmp_path, """
        import openai
        r = openai.OpenAI(max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        open("answer.txt", "w").write("x")
    """)
    access = GyreProxyAccess(proxy, handle.url)
    issued = {}
    orig = access.open_execution
    access.open_execution = lambda e, g: issued.setdefault(e, orig(e, g))
    cfg = RunnerConfig(run_dir=str(tmp_path / "runs"), sandbox="container", container_cli=str(fake),
                       container_image="gyre/harness:test", container_args=["--memory", "8g"])
    (res,) = _run(HarnessRunner(cfg, Evaluator(EvaluatorConfig()), access), ExecutionSpec("c0", _task("t", probe), "g"))
    assert res.outcome is Outcome.COMPLETED, _stderr(res)
    assert len(sink.for_execution("c0")) == 1
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[0]["argv"][:2] == ["ps", "-a"]  # containers of dead runners first (none here)
    (launched,) = [c for c in calls if c["argv"][0] == "run"]
    run, rm = launched["argv"], calls[-1]["argv"]
    assert rm == ["rm", "-f", "gyre-c0"]  # the container is removed after the client ends
    assert launched["key_in_env"]
    joined = " ".join(run)
    assert issued["c0"] not in joined
    assert "-e OPENAI_API_KEY" in joined and "-e PATH" not in joined
    assert "--network none" in joined and "--cap-drop ALL" in joined and "--memory 8g" in joined
    ws = res.workspace
    assert f"{res.exec_dir}:{res.exec_dir}" in run and run[run.index("-w") + 1] == str(ws)
    assert run[run.index("gyre/harness:test") + 1] == "python3"  # {python} is the image's
    assert f"{probe}:{probe}:ro" in run


# A stateful fake of the container CLI, as far as the runner uses it (docker's documented forms:
# `run --name N --label K=V ... IMAGE CMD...`, `ps -a --filter label=K=V --format '{{.Names}}'`,
# `inspect --format '{{index .Config.Labels "K"}}' NAME...` (one line per name), `rm -f NAME...`).
# Containers live in a JSON file; `run` records one, runs CMD on the host, and leaves it (as
# SIGKILLing the client would) for `rm`.
STATEFUL_DOCKER = """\
import fcntl, json, re, subprocess, sys
state_path, log_path = {state!r}, {log!r}
argv = sys.argv[1:]
# Concurrent calls (two runs, an rm) read-modify-write the state one at a time: without the lock
# a run that loaded the state before an rm saved it brought the removed container back.
lock = open(state_path + ".lock", "a")
fcntl.flock(lock, fcntl.LOCK_EX)
state = json.load(open(state_path))
open(log_path, "a").write(json.dumps(argv) + "\\n")
def save():
    json.dump(state, open(state_path, "w"))
if argv[0] == "run":
    labels = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--label")
    name = argv[argv.index("--name") + 1]
    state[name] = labels
    save()
    fcntl.flock(lock, fcntl.LOCK_UN)  # while the container runs, others may change the state
    inner = argv[argv.index({image!r}) + 1:]
    inner = [{python!r} if a == "python3" else a for a in inner]  # the image's python3 -> ours
    sys.exit(subprocess.call(inner))
if argv[0] == "ps":
    key, value = argv[argv.index("--filter") + 1][len("label="):].split("=", 1)
    print("\\n".join(n for n, labels in state.items() if labels.get(key) == value))
elif argv[0] == "inspect":
    key = re.search(r'Labels "([^"]+)"', argv[argv.index("--format") + 1]).group(1)
    for n in argv[3:]:
        print(state[n].get(key, ""))
elif argv[0] == "rm":
    for n in argv[2:]:
        state.pop(n, None)
    save()
"""


def test_containers_left_by_a_dead_runner_are_removed_and_no_others(tmp_path):
    """A rank SIGKILLed mid-execution leaves its containers running (the client dies with it;
    the daemon does not). The next runner on the node removes exactly those: their owner's scratch
    root is unlocked (here: gone, and one whose process was SIGKILLed); a live runner's, another
    node's and unlabelled containers stay."""
    from tests.executions.test_scratch import _owner

    state, log, fake = tmp_path / "containers.json", tmp_path / "docker.jsonl", tmp_path / "bin" / "docker"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\n" + STATEFUL_DOCKER.format(state=str(state), log=str(log),
                                                                      image="gyre/harness:test", python=sys.executable))
    fake.chmod(0o755)
    node = sandbox.platform.node()
    live, live_dir, live_child = _owner(tmp_path)
    killed, killed_dir, killed_child = _owner(tmp_path)
    try:
        killed.kill()
        killed.wait()
        state.write_text(json.dumps({
            "gyre-gone": {"gyre.host": node, "gyre.owner": str(tmp_path / "gyre-scratch-1-removed")},
            "gyre-killed": {"gyre.host": node, "gyre.owner": str(killed_dir.parent)},
            "gyre-live": {"gyre.host": node, "gyre.owner": str(live_dir.parent)},
            "gyre-mine": {"gyre.host": node, "gyre.owner": str(scratch.root())},
            "gyre-elsewhere": {"gyre.host": node + "-other", "gyre.owner": str(tmp_path / "gone")},
            "someone-elses": {},
        }))
        probe = _script(tmp_path, """open("answer.txt", "w").write("x")""")
        cfg = RunnerConfig(run_dir=str(tmp_path / "runs"), sandbox="container", container_cli=str(fake),
                           container_image="gyre/harness:test", sandbox_network="host")
        runner = HarnessRunner(cfg, Evaluator(EvaluatorConfig()))
        results = _run(runner, ExecutionSpec("c0", _task("t", probe), "g"), ExecutionSpec("c1", _task("t", probe), "g"))
    finally:
        for p, child in ((live, live_child), (killed, killed_child)):
            p.kill()
            p.wait()
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, 9)
    assert [r.outcome for r in results] == [Outcome.COMPLETED] * 2, [_stderr(r) for r in results]
    assert sorted(json.loads(state.read_text())) == ["gyre-elsewhere", "gyre-live", "gyre-mine", "someone-elses"]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c[0] for c in calls].count("ps") == 1  # once per process, before its first container
    assert ["rm", "-f", "gyre-gone", "gyre-killed"] in calls
    run = next(c for c in calls if c[0] == "run")
    assert f"gyre.owner={scratch.root()}" in run and f"gyre.host={node}" in run


# ---------------------------------------------------------------------------- harness scripts
def test_run_mini_passes_the_key_by_environment_only(tmp_path, monkeypatch):
    from examples.mini_swe_agent.run_mini import mini_argv

    (tmp_path / "instruction.md").write_text("do it")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:1/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "gyre-secret-key-123")
    monkeypatch.setenv("GYRE_INSTRUCTION_FILE", str(tmp_path / "instruction.md"))
    argv = mini_argv(step_limit=3, command_timeout=5, temperature=1.0, max_tokens=16)
    assert not any("gyre-secret-key-123" in a for a in argv)
    assert not any("api_key" in a for a in argv)


def test_auto_resolves_to_bwrap_when_it_works():
    assert sandbox.resolve("auto") == ("bwrap" if sandbox.bwrap_works() else "none")


def test_result_json_replaces_a_planted_symlink(tmp_path):
    """Under a sandbox the execution directory is writable by the harness: a symlink it plants at
    result.json must not make the runner write outside."""
    target = tmp_path / "victim.txt"
    target.write_text("keep")
    probe = _script(tmp_path, """
        import os
        os.symlink(os.environ["VICTIM"], os.path.join(os.path.dirname(os.getcwd()), "result.json"))
    """)
    cfg = RunnerConfig(run_dir=str(tmp_path / "runs"), sandbox="none", env={"VICTIM": str(target)})
    (res,) = _run(HarnessRunner(cfg), ExecutionSpec("sym", _task("t", probe), "g"))
    assert res.outcome is Outcome.COMPLETED, _stderr(res)
    assert target.read_text() == "keep"
    p = res.exec_dir / "result.json"
    assert not p.is_symlink() and json.loads(p.read_text())["execution_id"] == "sym"
    assert stat.S_ISREG(p.lstat().st_mode)


def test_remote_mode_keeps_the_key_off_the_ssh_command_line(tmp_path):
    """Remote hosts (bash stands in for ssh/rsync): the environment travels in a 0600 file that is
    gone before the harness starts, so no command line on either side carries the key."""
    from gyre.executions.runner import LocalKeys

    remote_root = tmp_path / "remote"
    probe = _script(tmp_path, """
        import os, time
        open("seen.txt", "w").write(os.environ["OPENAI_API_KEY"] + "|" + str(os.path.exists(".gyre-env")))
        time.sleep(1.0)
    """)
    cfg = RunnerConfig(
        run_dir=str(tmp_path / "runs"), sandbox_hosts=["hostA"], remote_root=str(remote_root),
        # Like ssh, the stand-in stays alive for the whole run with the remote command in its argv.
        remote_shell=[sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.call(['bash', '-c', sys.argv[1]]))"],
        remote_push=["bash", "-c", "mkdir -p {remote} && cp -a {local}/. {remote}/ && stat -c %a {remote}/.gyre-env > {remote}/mode"],
        remote_pull=["bash", "-c", "cp -a {remote}/. {local}/"],
    )
    keys = LocalKeys()
    runner = HarnessRunner(cfg, None, keys)
    issued: list[str] = []
    orig = keys.open_execution
    keys.open_execution = lambda e, g: issued.append(orig(e, g)) or issued[-1]
    leaks: list[int] = []

    async def main():
        t = runner.dispatch(ExecutionSpec("r0", _task("t", probe), "g"))
        while not t.done():
            for k in issued:
                leaks.extend(_pids_with(k))
            await asyncio.sleep(0.05)
        return await t

    res = asyncio.run(main())
    assert res.outcome is Outcome.COMPLETED, _stderr(res)
    key, env_file_there = (res.workspace / "seen.txt").read_text().split("|")
    assert key == issued[0] and env_file_there == "False"
    assert (res.workspace / "mode").read_text().strip() == "600"
    assert not leaks, leaks
    assert not (res.workspace / ".gyre-env").exists()


@needs_bwrap
def test_sandboxed_launch_failure_and_signal_death_read_as_without_a_sandbox(tmp_path):
    probe = _script(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    runner = HarnessRunner(RunnerConfig(run_dir=str(tmp_path / "runs"), sandbox="bwrap"))
    missing = Task(task_id="m", instruction="x", harness=["/nonexistent/harness"], evaluator=EvaluatorSpec("python", lambda ws, t: 1.0))
    crash, nolaunch = _run(runner, ExecutionSpec("sig", _task("t", probe), "g"), ExecutionSpec("missing", missing, "g"))
    assert crash.outcome is Outcome.CRASHED and crash.exit_code == -11
    assert nolaunch.outcome is Outcome.LAUNCH_FAILED and "not found" in nolaunch.error


VENV_RUN = """
import asyncio, sys
from pathlib import Path
from gyre.executions.config import EvaluatorConfig, RunnerConfig
from gyre.executions.evaluator import Evaluator
from gyre.executions.runner import HarnessRunner
from gyre.executions.tasks import ExecutionSpec, Task
tmp = Path(sys.argv[1])
(tmp / "h.py").write_text("open('answer.txt', 'w').write('ok')\\n")
task = Task.from_json({"task_id": "t", "instruction": "x", "harness": ["{python}", str(tmp / "h.py")],
                       "evaluator": {"command": ["grep", "-c", "ok", "answer.txt"]}})
runner = HarnessRunner(RunnerConfig(run_dir=str(tmp / "runs"), sandbox="bwrap"), Evaluator(EvaluatorConfig()))
async def main():
    return await runner.dispatch(ExecutionSpec("e0", task, "g"))
res = asyncio.run(main())
print("OUTCOME", res.outcome.value, (res.exec_dir / "stderr.log").read_text()[-300:])
"""


@needs_bwrap
def test_a_harness_runs_sandboxed_from_a_virtualenv_under_tmp(tmp_path):
    """README command 1 in a fresh virtualenv (what CI does): `{python}` is the venv's bin/python, a
    symlink under /tmp, inside a directory the sandbox binds already. Binding the file again needed
    a mount point inside a read-only bind, and every harness crashed at launch."""
    import subprocess

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    root = str(Path(__file__).resolve().parents[2])
    r = subprocess.run([str(venv / "bin" / "python"), "-c", VENV_RUN, str(tmp_path)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert "OUTCOME completed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
