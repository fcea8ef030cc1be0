"""The doctor's checks across the allocation: the rendezvous, an all-reduce over every rank (gloo,
and NCCL with CUDA), a broadcast over every prefix group of the layout, and the run directory
written from every rank and seen from rank 0.

Launched three ways, like gyre.run:
    python -m gyre.doctor ...                             one process: a gloo world of one
    torchrun --nproc-per-node 8 -m gyre.doctor ...        torchrun's RANK / WORLD_SIZE / MASTER_*
    srun --ntasks-per-node 8 python -m gyre.doctor ...    Slurm's SLURM_PROCID / SLURM_NTASKS; the
        rendezvous is the first host of the allocation at GYRE_MASTER_PORT (launch.sh's knobs)
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre.doctor.table import FAIL, OK, Line, skipped

if TYPE_CHECKING:
    from gyre.topology import ParallelConfig

# launch.sh's GYRE_MASTER_PORT default, which is torchrun's --master-port default too.
DEFAULT_MASTER_PORT = 29500
PROBE_PREFIX = ".gyre-doctor-probe"


@dataclass(frozen=True)
class Launch:
    """Where this process sits: `launcher` is 'alone', 'torchrun' or 'srun'."""

    launcher: str
    rank: int = 0
    world: int = 1
    local_rank: int | None = None
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    agent_store: bool = False  # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE)


def launch_of(env: dict[str, str]) -> Launch:
    """This process's place, from torchrun's variables, else Slurm's (more than one task), else
    alone. Pure (the environment is an argument).

    >>> launch_of({"SLURM_PROCID": "3", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3", "SLURM_JOB_NODELIST": "gpu[07-08]"})
    Launch(launcher='srun', rank=3, world=16, local_rank=3, master_addr='gpu07', master_port=29500, agent_store=False)
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        return Launch("torchrun", int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")),
                      env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "0")),
                      env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        from gyre.slurm import expand_nodelist

        addr = env.get("GYRE_MASTER_ADDR") or expand_nodelist(env["SLURM_JOB_NODELIST"])[0]
        return Launch("srun", int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", "0")),
                      addr, int(env.get("GYRE_MASTER_PORT", DEFAULT_MASTER_PORT)))
    return Launch("alone")


def init(launch: Launch, backend: str, timeout_s: float) -> None:
    """init_process_group for `launch`, with the doctor's own (short) timeout and key prefix."""
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore

    timeout = timedelta(seconds=timeout_s)
    if launch.launcher == "alone":
        store = TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
    else:
        store = TCPStore(launch.master_addr, launch.master_port, launch.world, timeout=timeout,
                         is_master=launch.rank == 0 and not launch.agent_store, multi_tenant=not launch.agent_store)
    dist.init_process_group(backend, store=PrefixStore("gyre-doctor/", store), rank=launch.rank,
                            world_size=launch.world, timeout=timeout)


def master_port_line(launch: Launch, env: dict[str, str], *, reached: str | None) -> Line:
    """Alone: the rendezvous port a launch will use (MASTER_PORT, else GYRE_MASTER_PORT, else
    launch.sh's default) is free here. Launched: whether the rendezvous was reached (`reached`:
    None when it was, else the error)."""
    if launch.launcher == "alone":
        from gyre.doctor.node import port_in_use

        port = int(env.get("MASTER_PORT") or env.get("GYRE_MASTER_PORT") or DEFAULT_MASTER_PORT)
        why = port_in_use("", port)
        if why is None:
            return Line("master port", OK, f"{port} bindable here (the rendezvous host needs it free)")
        return Line("master port", FAIL, f"{port}: {why} on this node",
                    f"free it (ss -ltnp 'sport = :{port}') or choose another (GYRE_MASTER_PORT for launch.sh, "
                    f"--master-port for torchrun)")
    where = f"{launch.master_addr}:{launch.master_port}"
    if reached is None:
        return Line("master port", OK, f"rendezvous at {where} reached by {launch.world} ranks ({launch.launcher})")
    return Line("master port", FAIL, f"rendezvous at {where} failed: {reached}",
                "every node must resolve and reach the master address on that port (firewall, GLOO_SOCKET_IFNAME; "
                "docs/cluster.md), and the port must be free on the master")


def allreduce_line(*, nccl: bool) -> Line:
    """Every rank: an all-reduce over the world of (rank + 1), on CPU (gloo) and, when `nccl`
    carries the world's CUDA tensors, of 64 MiB on this rank's GPU, each checked against W(W+1)/2."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    expected = world * (world + 1) / 2
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    if t.item() != expected:
        return Line("all-reduce", FAIL, f"gloo sum {t.item()} over {world} ranks, expected {expected}",
                    "a rank joined with a wrong RANK / WORLD_SIZE, or the network corrupts data")
    detail = f"gloo ok over {world} rank{'s' if world > 1 else ''}"
    if nccl:
        x = torch.full((16 * 1024 * 1024,), float(rank + 1), device="cuda")  # 64 MiB of float32
        dist.all_reduce(x.clone())  # warm-up: NCCL builds its communicator on the first call
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        bad = int((x != expected).sum().item())
        if bad:
            return Line("all-reduce", FAIL, f"nccl: {bad} of {x.numel()} elements differ from {expected}",
                        "NCCL returned wrong data: check the driver, NCCL_* settings, the fabric (nccl-tests)")
        busbw = 2 * (world - 1) / world * x.numel() * 4 / dt / 1e9 if world > 1 else 0.0
        detail += f"; nccl ok, 64 MiB in {dt * 1e3:.1f} ms" + (f" (bus {busbw:.1f} GB/s)" if world > 1 else "")
    return Line("all-reduce", OK, detail)


def prefix_line(parallel: ParallelConfig, *, nccl: bool, alone: bool) -> Line:
    """Every rank: the layout (`--parallel.*`) against the world, then a broadcast from the core
    over every prefix group this rank is in (cells 0..k−1 at its position, k = 2..K), the group
    Gyre's weight broadcasts use (on this rank's GPU when `nccl`); each member checks it received
    the core rank's value."""
    import torch
    import torch.distributed as dist

    from gyre.topology import Topology, TopologyError

    rank, world = dist.get_rank(), dist.get_world_size()
    name = "prefix groups"
    try:
        topo = Topology.from_config(parallel, world, rank)
    except TopologyError as e:
        if alone:
            return skipped(name, f"single process, and the layout needs more ranks ({e}); run under torchrun or srun")
        return Line(name, FAIL, str(e), "start a world that fits --parallel.* (or change them)")
    if topo.num_cells == 1:
        return skipped(name, "single process" if world == 1 else "one cell (K = 1): no prefix group")
    groups = topo.create_groups()  # blocking: every rank, every group, one order
    if topo.is_pool:
        return skipped(name, "standalone pool rank: in no prefix group")
    for k in range(2, topo.num_cells + 1):
        if topo.cell >= k:
            continue
        src = topo.prefix_ranks(k, topo.position)[0]
        value = float(src * 1000 + k)
        t = torch.full((1024,), value if rank == src else -1.0, device="cuda" if nccl else "cpu")
        dist.broadcast(t, src=src, group=groups.prefix(k))
        if not bool((t == value).all()):
            return Line(name, FAIL, f"prefix k={k} (ranks {topo.prefix_ranks(k, topo.position)}): received "
                        f"{t[0].item()} from rank {src}, expected {value}",
                        "a prefix group disagrees on its members: every rank must run the same --parallel.* flags")
    return Line(name, OK, f"K={topo.num_cells} cells × S={topo.cell_size}: broadcasts from the core over the prefix "
                f"groups k=2..{topo.num_cells} ok")


# ----------------------------------------------------------------------------- the run directory
def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest existing ancestor (where gyre.run's mkdir starts)."""
    while not path.exists():
        path = path.parent
    return path


def filesystem_of(path: Path, mounts: str | None = None) -> str:
    """The filesystem type of the mount holding `path` (/proc/mounts; '' when unknown)."""
    try:
        mounts = Path("/proc/mounts").read_text() if mounts is None else mounts
    except OSError:
        return ""
    best, kind, p = -1, "", str(path.resolve())
    for row in mounts.splitlines():
        parts = row.split()
        if len(parts) >= 3:
            point = parts[1].replace("\\040", " ")
            if (p == point or p.startswith(point.rstrip("/") + "/")) and len(point) > best:
                best, kind = len(point), parts[2]
    return kind


def write_probe(directory: Path, tag: str) -> tuple[str | None, str]:
    """Create `directory/.gyre-doctor-probe-<tag>` holding `tag` (exclusive create, fsync):
    (its path, '') or (None, why not)."""
    if not directory.is_dir():
        return None, f"{directory} is not a directory"
    path = directory / f"{PROBE_PREFIX}-{tag}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, tag.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        return None, f"{directory} is not writable ({e.strerror or e})"
    return str(path), ""


def remove_probe(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


def probe_tag(rank: int) -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{rank}"


def run_dir_refusal(run_dir: str, *, resume: bool, overwrite: bool) -> str | None:
    """What gyre.run's choice of the directory (`gyre.runtime.rundir`) would refuse: --train.resume
    of a directory that is not there, or a --run-dir that already holds a run without --overwrite."""
    from gyre.runtime.rundir import previous_outputs

    if not run_dir:
        return None
    path = Path(run_dir)
    if resume:
        return None if path.is_dir() else f"--train.resume: run directory {path} does not exist"
    found = previous_outputs(path) if path.is_dir() else []
    if found and not overwrite:
        return f"--run-dir {path} already holds a run ({', '.join(found)})"
    return None


def run_dir_line(run_dir: str, preset: str, probes: list[tuple[str, str | None, str]], *, resume: bool,
                 overwrite: bool) -> Line:
    """Rank 0's verdict on the run directory from every rank's probe (`(tag, path, error)`, rank
    order): each rank could write its probe, and rank 0 reads every probe back with the tag that
    rank wrote (a directory local to each node fails here: rank 0 does not see the others'); then
    what gyre.run would refuse of it (`run_dir_refusal`)."""
    from gyre.config_checks import run_dir_target

    target, flag = run_dir_target(run_dir, preset)
    fix_write = "choose a --run-dir under a directory every rank can write"
    broken = [(r, err) for r, (_, path, err) in enumerate(probes) if path is None]
    if broken:
        shown = "; ".join(f"rank {r}: {err}" for r, err in broken[:4])
        shown += f"; and {len(broken) - 4} more" if len(broken) > 4 else ""
        return Line("run dir", FAIL, f"{flag}: {shown}", fix_write)
    unseen = []
    for r, (tag, path, _) in enumerate(probes):
        try:
            seen = Path(path).read_text() == tag
        except OSError:
            seen = False
        if not seen:
            unseen.append(r)
    fs = filesystem_of(nearest_existing(target))
    where = f"{nearest_existing(target)}" + (f" ({fs})" if fs else "")
    if unseen:
        return Line("run dir", FAIL, f"{flag}: rank 0 does not see the probes of ranks {unseen} in {where}: "
                    "not one shared filesystem", "put --run-dir on a filesystem every node mounts at the same path "
                    "(NFS, Lustre, GPFS; docs/cluster.md)")
    refused = run_dir_refusal(run_dir, resume=resume, overwrite=overwrite)
    if refused:
        return Line("run dir", FAIL, refused, "pass --train.resume to continue it, --overwrite to start over, or "
                    "another --run-dir")
    hosts = len({tag.rsplit("-", 2)[0] for tag, _, _ in probes})
    if len(probes) == 1:
        return Line("run dir", OK, f"{flag}: writable at {where}; other nodes not checked (run under srun for that)")
    return Line("run dir", OK, f"{flag}: {len(probes)} ranks on {hosts} node(s) write to {where}, all seen by rank 0")


def gather(obj: Any, world: int) -> list[Any]:
    """all_gather_object over the default group (gloo carries objects)."""
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out
