"""`python -m gyre.doctor [gyre.run's flags]`: the preflight to run before a long job.

Give it the flags of the job it is to check (the same --preset, --model.checkpoint,
--backend.engine, --backend.actor, --run-dir, --parallel.* ... as gyre.run), on one node:

    python -m gyre.doctor --backend.engine sglang --backend.actor megatron --model.checkpoint /ckpt/Qwen3-8B

or on every node of the allocation, launched as the job will be (each rank checks its node and its
GPU; rank 0 prints one table for all of them):

    srun --nodes 4 --ntasks-per-node 8 --gpus-per-node 8 python -m gyre.doctor --parallel.cell-size 8 ...
    torchrun --nproc-per-node 8 -m gyre.doctor --parallel.cell-size 8 ...

It prints one table, a line per check, each `ok`, `warn`, `fail` or `skipped` (with the reason),
and under every line that is not ok the fix. It exits 1 when a line failed, else 0 (2: bad flags).

    torch, cuda, nccl     installed versions; CUDA and NCCL of torch (skipped: no CUDA)
    sglang, megatron-core, mooncake, transformer-engine
                          against the versions setup.py pins (a fail when the chosen backends use
                          the package, a warning otherwise)
    gpus                  GPU count against the ranks on the node, free memory per GPU
    master port           the rendezvous: reached by every rank (launched), or the port free (alone)
    all-reduce            over every rank: gloo, and NCCL (64 MiB, timed) with CUDA
    prefix groups         --parallel.* against the world; a broadcast from the core over every
                          prefix group (the groups weight broadcasts use)
    run dir               every rank writes a probe file where the run directory goes; rank 0 must
                          see them all (one shared filesystem); the probes are removed
    proxy port            --proxy.port bindable on rank 0 (0: picked at start)
    rdma                  /sys/class/infiniband devices and port states (needed with Mooncake over RDMA)
    backends              the chosen --backend.engine / --backend.actor / --transfer.transport can
                          run here (gyre.backends.factory.check_backends)
    checkpoint, dtype     --model.checkpoint's architecture in Gyre's registry (and the Megatron
                          layout, SGLang's name for it); its dtype against --model.dtype
    vocabulary            the run's tokenizer against the checkpoint's embedding rows
    chat format           the chat format the proxy renders with (the template's, or --proxy.chat-format)
    tools                 what a request's tools become (--proxy.tool-format): the template's own
                          rendering, Hermes declarations, or a 400 (a warning when it is one by default)
    sandbox               what --executions.runner.sandbox gives the harnesses on this node

Without --preset it checks README command 1's preset (cpu-demo), not gyre.run's default (smoke).
Doctor's own flag: --timeout-s S (default 120): the rendezvous and collective timeout.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import TYPE_CHECKING

from gyre.doctor.table import FAIL, Line, exit_code, merge, render, skipped

if TYPE_CHECKING:
    from gyre.config import GyreConfig

TIMEOUT_S = 120.0
DEFAULT_PRESET = "cpu-demo"  # README command 1's job: what a newcomer means by "will my run work?"


def _guarded(name: str, fn, *args, **kwargs) -> list[Line]:
    """A check's lines; one that raises is a failed line naming the exception, not a crash."""
    try:
        out = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 — any failure of a check is that check's verdict
        return [Line(name, FAIL, f"the check raised {type(e).__name__}: {e}",
                     "read the error; rerun with the same flags")]
    return out if isinstance(out, list) else [out]


def _local_lines(cfg: GyreConfig, launch, *, cuda: bool, ranks_here: int) -> tuple[list[Line], list[Line]]:
    """The checks of this rank's node that involve no other rank: (those that go before the
    cross-rank lines, those after)."""
    from gyre.doctor import chat, node, versions

    local = launch.rank == 0 if launch.launcher == "alone" else (launch.local_rank or 0) == 0  # once a node
    lines = _guarded("versions", lambda: versions.version_lines(cfg.backend, cfg.transfer, cfg.proxy,
                                                                versions.gyre_requirements(), cuda=cuda))

    def gpus() -> Line:
        count, mem = node.measure_gpus(launch.local_rank) if cuda else (0, {})
        return node.gpu_line(cfg.backend, cuda=cuda, count=count, mem=mem, ranks_here=ranks_here)

    lines += _guarded("gpus", gpus)
    return lines, [
        *_guarded("proxy port", node.proxy_port_line, cfg.proxy, rank=launch.rank),
        *(_guarded("rdma", node.rdma_line, cfg.transfer, cfg.proxy, node.rdma_devices()) if local else []),  # once a node
        *_guarded("backends", node.backends_line, cfg.backend, cfg.transfer, cfg.model, cfg.parallel, cfg.train.resumed()),
        *_guarded("checkpoint", node.checkpoint_lines, cfg.model, cfg.backend, cfg.parallel, cfg.sglang, cfg.train),
        *_guarded("chat format", chat.chat_lines, cfg.model, cfg.proxy, cfg.train),
        *(_guarded("sandbox", node.sandbox_line, cfg.executions.runner) if local else []),
    ]


def check(cfg: GyreConfig, env: dict[str, str], timeout_s: float = TIMEOUT_S) -> tuple[list[Line], int, str | None]:
    """Run every check of `cfg` on this process: (the table's lines, exit code, the table's header
    when this process prints it). Collective when launched: every rank calls it; rank 0's lines
    are the merged ones of all ranks and it prints them; without a process group each rank
    prints its own."""
    import torch
    import torch.distributed as dist

    from gyre.config_checks import run_dir_target
    from gyre.doctor import cluster
    from gyre.errors import ConfigError
    from gyre.run import device_and_backend

    launch = cluster.launch_of(env)
    host = socket.gethostname()
    cuda = torch.cuda.is_available()
    pre: list[Line] = []
    backend, reached = None, None
    try:
        device, backend = device_and_backend(cuda, torch.cuda.device_count() if cuda else 0, launch.local_rank or 0,
                                             cfg.parallel.backend)
        if device.type == "cuda":
            torch.cuda.set_device(device)
    except ConfigError as e:
        pre.append(Line("device", FAIL, str(e), "fix the flag it names, or the ranks per node"))
    if backend is not None:
        try:
            cluster.init(launch, backend, timeout_s)
        except Exception as e:  # noqa: BLE001 — a rendezvous that failed is the master port line's verdict
            reached = f"{type(e).__name__}: {e}".splitlines()[0]
    joined = dist.is_initialized()
    nccl = joined and "nccl" in dist.get_backend()  # CUDA tensors over NCCL (not with --parallel.backend gloo)
    hosts = cluster.gather(host, launch.world) if joined else [host]
    ranks_here = hosts.count(host) if joined else int(env.get("LOCAL_WORLD_SIZE", "1"))
    head, tail = _local_lines(cfg, launch, cuda=cuda, ranks_here=ranks_here)
    lines = pre + head
    if launch.rank == 0 or not joined:  # the other ranks' lines of rank-0 checks are left out of the merge
        lines.append(cluster.master_port_line(launch, env, reached=None if joined else reached or "not started"))
    if joined:
        lines += _guarded("all-reduce", cluster.allreduce_line, nccl=nccl)
        lines += _guarded("prefix groups", cluster.prefix_line, cfg.parallel, nccl=nccl, alone=launch.launcher == "alone")
    else:
        lines += [skipped("all-reduce", "no process group"), skipped("prefix groups", "no process group")]
    # The run directory: every rank writes a probe where it goes; rank 0 reads them all back.
    tag = cluster.probe_tag(launch.rank)
    path, err = cluster.write_probe(cluster.nearest_existing(run_dir_target(cfg.run_dir, cfg.preset)[0]), tag)
    probes = cluster.gather((tag, path, err), launch.world) if joined else [(tag, path, err)]
    if launch.rank == 0 or not joined:
        lines += _guarded("run dir", cluster.run_dir_line, cfg.run_dir, cfg.preset, probes, resume=cfg.train.resume,
                          overwrite=cfg.overwrite)
    if joined:
        cluster.gather(None, launch.world)  # a barrier on gloo: rank 0 has read every probe
    cluster.remove_probe(path)
    lines += tail
    header = f"gyre doctor: {launch.launcher}, rank {launch.rank} of {launch.world}, host {host}, preset {cfg.preset}"
    if joined and launch.world > 1:
        every = cluster.gather(lines, launch.world)
        lines = merge([(f"rank {r} ({hosts[r]})", ls) for r, ls in enumerate(every)])
        header = (f"gyre doctor: {launch.launcher}, {launch.world} ranks on {len(set(hosts))} node(s), "
                  f"preset {cfg.preset}")
    rc = exit_code(lines)
    if joined and launch.rank != 0:
        header = None
    if joined:
        flag = [rc]
        dist.broadcast_object_list(flag, src=0)  # every rank exits as rank 0 does
        rc = flag[0]
        dist.destroy_process_group()
    return lines, rc, header


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from gyre.config import parse_config

    sys.argv[0] = "python -m gyre.doctor"  # tyro's usage and error lines name the program from it
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        print("gyre.run's flags follow (every one is accepted here):\n", flush=True)
        parse_config(["--help"])  # tyro prints them and exits 0
    own = argparse.ArgumentParser(prog="python -m gyre.doctor", add_help=False, allow_abbrev=False)
    own.add_argument("--timeout-s", type=float, default=TIMEOUT_S)
    args, rest = own.parse_known_args(argv)
    if not any(a == "--preset" or a.startswith("--preset=") for a in rest):
        rest = ["--preset", DEFAULT_PRESET, *rest]  # check the job README's command 1 runs, not the smoke run
    try:
        cfg = parse_config(rest)
    except SystemExit as e:  # tyro printed what is wrong
        return 2 if e.code not in (0, None) else 0
    lines, rc, header = check(cfg, dict(os.environ), args.timeout_s)
    if header is not None:
        print(header)
        print(render(lines), flush=True)
    return rc
