"""A real two-node Slurm cluster on this machine, for the operator's `sbatch launch.sh` path.

Each node is a network namespace of its own (a veth pair to a bridge) with its own address,
hostname (a UTS namespace) and /etc/hosts (a mount namespace binding one file that names every
node), and runs its own `slurmd -N <node>`; slurmctld runs in a third namespace holding the
bridge, which the test's clients (sbatch, squeue, scontrol, scancel) enter too. Jobs go to
partition `main` (preemptable: PreemptMode=REQUEUE, GraceTime=120); a job in `urgent` preempts.
Job credentials live 10 s (AuthInfo cred_expire; 120 by default): Slurm holds a requeued job that
long plus one second, so a requeue restarts in seconds. (Releasing it earlier with
`scontrol update StartTime=now` races the node's revoked credential: "Job credential revoked",
FAILED.) munged runs with
a key generated here, its socket shared through the filesystem; the run directory is on the
same filesystem for every node, as a cluster's shared filesystem is. Nothing touches the host's
own network namespace, /etc or Slurm configuration.

Needs root, `ip` (iproute2), `unshare`, and Debian's `slurm-wlm` and `munge` (.ci/run installs
them); the fixture skips with the reason when one is missing or a namespace cannot be made.

`Cluster` is reusable by other tests: `slurm_cluster.sbatch([...])`, `.job(id)`, `.wait(...)`,
`.client([...])`, and `.node_exec(node, [...])` runs a command on a node (its netns, hostname
and hosts file), e.g. a server the other node's job reaches.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NODES = ("n1", "n2")
SUBNET = "10.231.7"  # inside our own namespaces only
CTL_ADDR = f"{SUBNET}.1"


def _addr(i: int) -> str:
    return f"{SUBNET}.{11 + i}"


def _run(*argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, **kw)


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, slurmd)"
    for tool in ("ip", "unshare", "nsenter", "slurmctld", "slurmd", "munged", "sbatch", "scontrol", "scancel"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install slurm-wlm munge iproute2; .ci/run does)"
    return None


SLURM_CONF = """\
ClusterName=gyretest
SlurmctldHost=ctl({ctl})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire=10
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctl_port}
SlurmdPort=6818
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/linear
SchedulerType=sched/builtin
ReturnToService=2
SlurmctldTimeout=60
SlurmdTimeout=60
InactiveLimit=0
MinJobAge=600
KillWait={kill_wait}
JobRequeue=1
{nodes}
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=main Nodes={node_names} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=120
PartitionName=urgent Nodes={node_names} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""


class Cluster:
    def __init__(self, root: Path, tag: str):
        self.root, self.tag = root, tag
        self.ctl_ns = f"{tag}c"
        self.node_ns = {n: f"{tag}{i}" for i, n in enumerate(NODES)}
        self.procs: list[subprocess.Popen] = []
        self.conf = root / "slurm.conf"
        self.hosts = root / "hosts"
        self.munge_socket = root / "munge" / "munge.socket"
        # The job's environment (sbatch propagates the submitter's): this Python's tools first, and
        # this checkout on PYTHONPATH, so the job imports the code under test.
        self.env = {
            "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "/usr/bin:/bin")]),
            "HOME": os.environ.get("HOME", "/root"),
            "PYTHONPATH": str(ROOT),
            "SLURM_CONF": str(self.conf),
            "LANG": "C.UTF-8",
        }

    # ------------------------------------------------------------------ setup / teardown
    def start(self, kill_wait: int = 30) -> None:
        (self.root / "munge").mkdir()
        (self.root / "state").mkdir()
        for n in NODES:
            (self.root / "spool" / n).mkdir(parents=True)
        key = self.root / "munge" / "munge.key"
        _run("mungekey", "--create", "--keyfile", str(key), "--force")
        key.chmod(0o600)
        self._daemon(["munged", "--foreground", "--force", "--key-file", str(key), "--socket", str(self.munge_socket),
                      "--pid-file", str(self.root / "munge" / "munged.pid"),
                      "--log-file", str(self.root / "munge" / "munged.log"),
                      "--seed-file", str(self.root / "munge" / "seed")], self.root / "munge" / "out.log")
        self._wait(lambda: self.munge_socket.exists(), 10, "munged's socket")

        self._netns()
        self.hosts.write_text("127.0.0.1 localhost\n" + f"{CTL_ADDR} ctl\n"
                              + "".join(f"{_addr(i)} {n}\n" for i, n in enumerate(NODES)))
        cpus = os.cpu_count() or 1
        self.conf.write_text(SLURM_CONF.format(
            ctl=CTL_ADDR, munge_socket=self.munge_socket, ctl_port=6817, root=self.root, kill_wait=kill_wait,
            nodes="\n".join(f"NodeName={n} NodeAddr={_addr(i)} CPUs={cpus} State=UNKNOWN" for i, n in enumerate(NODES)),
            node_names=",".join(NODES)))
        self._daemon(self._in(self.ctl_ns, "ctl", ["slurmctld", "-D", "-c", "-f", str(self.conf)]),
                     self.root / "slurmctld.out")
        self._wait(lambda: self.client(["scontrol", "ping"], check=False).stdout.count("UP") >= 1, 30,
                   "slurmctld answering", log=self.root / "slurmctld.log")
        for n in NODES:
            self._slurmd(n)
        self._wait(lambda: self.idle_nodes() == len(NODES), 60, "both nodes idle",
                   log=self.root / "slurmctld.log")

    def _slurmd(self, n: str) -> None:
        # The spool (where sbatch's copy of the batch script lands) is node-local, as on a real
        # cluster: a script that hands other nodes its own path ($0) fails here as it does there.
        spool = self.root / "spool" / n
        self._daemon(self._in(self.node_ns[n], n, ["slurmd", "-D", "-N", n, "-f", str(self.conf)], private=spool),
                     self.root / f"slurmd-{n}.out", mode="a")

    def fail_node(self, node: str) -> None:
        """The node is lost: every process in its namespace (slurmd, the job's) is SIGKILLed, and
        the controller is told it is DOWN (as it would conclude after SlurmdTimeout)."""
        self._kill_ns(self.node_ns[node])
        self.client(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=gyre-test-node-lost"])

    def restore_node(self, node: str) -> None:
        """The node is back: its slurmd starts again (a fresh spool) and the node is resumed."""
        self._slurmd(node)

        def idle() -> bool:
            self.client(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)
            return "idle" in self.client(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], check=False).stdout

        self._wait(idle, 60, f"{node} idle", log=self.root / f"slurmd-{node}.log")

    def pids(self, node: str) -> list[int]:
        """The processes running on `node` (in its network namespace)."""
        return [int(p) for p in _run("ip", "netns", "pids", self.node_ns[node], check=False).stdout.split()]

    def _kill_ns(self, ns: str) -> None:
        for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    def _netns(self) -> None:
        c = self.ctl_ns
        _run("ip", "netns", "add", c)
        _run("ip", "-n", c, "link", "set", "lo", "up")
        _run("ip", "-n", c, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", c, "addr", "add", f"{CTL_ADDR}/24", "dev", "br0")
        _run("ip", "-n", c, "link", "set", "br0", "up")
        for i, n in enumerate(NODES):
            ns = self.node_ns[n]
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", c, "link", "add", f"v{n}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "-n", c, "link", "set", f"v{n}", "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{_addr(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")

    def _in(self, ns: str, hostname: str, argv: list[str], private: Path | None = None) -> list[str]:
        """argv run in namespace `ns` with its own hostname and /etc/hosts (and `private`, a
        directory only this node sees: a tmpfs mounted over it)."""
        inner = f"hostname {hostname} && mount --bind {self.hosts} /etc/hosts"
        if private is not None:
            inner += f" && mount -t tmpfs tmpfs {private}"
        inner += " && exec \"$@\""
        # nsenter, not `ip netns exec`: that remounts /sys, hiding /sys/fs/cgroup, which slurmd reads.
        return ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount", "--propagation", "private",
                "bash", "-c", inner, "node", *argv]

    def _daemon(self, argv: list[str], out: Path, mode: str = "w") -> None:
        with open(out, mode) as f:
            self.procs.append(subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                               env={**os.environ, "SLURM_CONF": str(self.conf)}))

    def _wait(self, pred, timeout: float, what: str, log: Path | None = None) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if pred():
                return
            for p in self.procs:
                if p.poll() is not None:
                    break
            time.sleep(0.2)
        tail = log.read_text()[-3000:] if log and log.exists() else ""
        raise RuntimeError(f"cluster: timed out waiting for {what}\n{tail}")

    def stop(self) -> None:
        self.client(["scancel", "--full", "--signal=KILL", "--state=RUNNING", "--partition=main"], check=False)
        self.client(["scancel", "--partition=main"], check=False)
        self.client(["scancel", "--partition=urgent"], check=False)
        for p in reversed(self.procs):  # slurmds, slurmctld, munged; each by its own process group
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        for ns in (*self.node_ns.values(), self.ctl_ns):
            self._kill_ns(ns)  # what a job left behind in a node's namespace (slurmd is gone)
            _run("ip", "netns", "del", ns, check=False)

    # ------------------------------------------------------------------ clients
    def client(self, argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
        """A Slurm client command (sbatch, scontrol, ...) from the controller's namespace."""
        r = subprocess.run(["ip", "netns", "exec", self.ctl_ns, *argv], capture_output=True, text=True,
                           env={**os.environ, **self.env, **kw.pop("env", {})}, **kw)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr}")
        return r

    def node_exec(self, node: str, argv: list[str], **kw) -> subprocess.Popen:
        """Start argv on `node` (its namespace, hostname and hosts file)."""
        return subprocess.Popen(self._in(self.node_ns[node], node, argv), env={**os.environ, **self.env}, **kw)

    def idle_nodes(self) -> int:
        out = self.client(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout
        return len({line.split()[0] for line in out.splitlines() if line.split()[-1:] == ["idle"]})  # once per partition

    def sbatch(self, argv: list[str], cwd: Path, **env: str) -> str:
        out = self.client(["sbatch", "--parsable", *argv], cwd=cwd, env=env).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        out = self.client(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: str, pred, timeout: float, what: str) -> dict[str, str]:
        t0 = time.monotonic()
        info = {}
        while time.monotonic() - t0 < timeout:
            info = self.job(job_id)
            if pred(info):
                return info
            time.sleep(0.5)
        raise AssertionError(f"job {job_id}: timed out after {timeout:.0f}s waiting for {what}; last {info}\n"
                             + self.logs())

    def logs(self) -> str:
        return "".join(f"--- {p.name}\n{p.read_text()[-2500:]}\n" for p in
                       [self.root / "slurmctld.log", *(self.root / f"slurmd-{n}.log" for n in NODES)] if p.exists())


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    why = _missing()
    if why:
        pytest.skip(f"no Slurm cluster: {why}")
    root = tmp_path_factory.mktemp("slurm")
    cluster = Cluster(root, tag=f"gsl{os.getpid() % 100000}")
    try:
        try:
            cluster.start()
        except subprocess.CalledProcessError as e:  # a namespace or munge key cannot be made here
            pytest.skip(f"no Slurm cluster: `{' '.join(e.cmd)}` failed: {e.stderr.strip()}")
        yield cluster
    finally:
        cluster.stop()
