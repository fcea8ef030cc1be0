"""The doctor's checks of one node (every rank runs them; `gyre.doctor.table.merge` folds the ranks):
GPUs, RDMA devices, ports, the sandbox backend, the backends and the checkpoint.

Each check is a function returning one `Line`; what it reads from the machine (the sysfs root,
CUDA's answers) is an argument, so the tests give it a machine of their own.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gyre.doctor.table import FAIL, OK, WARN, Line, skipped

if TYPE_CHECKING:
    from gyre.backends.config import BackendConfig, ModelConfig, Resume, SglangOptions, TransferConfig
    from gyre.config import TrainConfig
    from gyre.executions.config import RunnerConfig
    from gyre.proxy.config import ProxyConfig
    from gyre.topology import ParallelConfig

GIB = 1024 ** 3
# SGLang measures free memory at start and refuses a cell whose GPUs differ by more than 10 %
# (the imbalance check of sglang 0.5.23's model runner); memory another process holds is the usual cause.
BUSY_FRACTION = 0.10


def needs_cuda(backend: BackendConfig) -> str:
    """The flag that makes this job need CUDA ('' when it runs on CPU)."""
    if backend.engine == "sglang":
        return "--backend.engine sglang"
    if backend.actor == "megatron":
        return "--backend.actor megatron"
    if backend.device == "cuda":
        return "--backend.device cuda"
    return ""


def gpu_line(backend: BackendConfig, *, cuda: bool, count: int, mem: dict[int, tuple[int, int]], ranks_here: int) -> Line:
    """GPU count and free memory. `mem`: device → (free, total) bytes of the GPUs this process
    measured (its own under torchrun, all of them alone); `ranks_here`: ranks started on this node."""
    if not cuda:
        need = needs_cuda(backend)
        if need:
            return Line("gpus", FAIL, f"no CUDA, and {need} needs it", "run on a GPU node (torch.cuda.is_available() "
                        "is False here: no GPU visible, CUDA_VISIBLE_DEVICES, or a CPU build of torch)")
        return skipped("gpus", "no CUDA")
    if count < ranks_here:
        return Line("gpus", FAIL, f"{count} GPUs visible for {ranks_here} ranks on this node",
                    f"start at most {count} ranks per node (--nproc-per-node / GYRE_NPROC_PER_NODE): "
                    f"each needs its own GPU")
    parts = [f"cuda:{d} {free / GIB:.1f}/{total / GIB:.1f} GiB free" for d, (free, total) in sorted(mem.items())]
    busy = [d for d, (free, total) in sorted(mem.items()) if total and (total - free) / total > BUSY_FRACTION]
    detail = f"{count} GPUs; " + ", ".join(parts)
    if busy:
        return Line("gpus", WARN, detail + f"; cuda:{','.join(map(str, busy))} more than {BUSY_FRACTION:.0%} in use",
                    "another process holds GPU memory (nvidia-smi): SGLang sizes its cache from free memory and "
                    "refuses a cell whose GPUs differ by more than 10 %")
    return Line("gpus", OK, detail)


def measure_gpus(local_rank: int | None) -> tuple[int, dict[int, tuple[int, int]]]:
    """(count, {device: (free, total)}): this rank's GPU under a launcher (`local_rank`; one CUDA
    context per rank, as the job makes), every GPU alone."""
    import torch

    count = torch.cuda.device_count()
    devices = [local_rank] if local_rank is not None and local_rank < count else list(range(count))
    return count, {d: torch.cuda.mem_get_info(d) for d in devices}


def rdma_devices(root: Path = Path("/sys/class/infiniband")) -> dict[str, list[str]]:
    """{device: [port state, ...]} from sysfs (`ports/<n>/state` reads e.g. '4: ACTIVE')."""
    if not root.is_dir():
        return {}
    out = {}
    for dev in sorted(p.name for p in root.iterdir()):
        ports = sorted((root / dev / "ports").glob("*/state")) if (root / dev / "ports").is_dir() else []
        out[dev] = [p.read_text().strip().split(":", 1)[-1].strip() for p in ports]
    return out


def rdma_line(transfer: TransferConfig, proxy: ProxyConfig, devices: dict[str, list[str]]) -> Line:
    """RDMA devices for Mooncake: needed with --transfer.mooncake-protocol rdma (an ACTIVE port,
    and --transfer.mooncake-device among them when given)."""
    t = transfer
    uses = t.transport == "mooncake" or proxy.migration_transport == "mooncake"
    rdma = uses and t.mooncake_protocol == "rdma"
    found = ", ".join(f"{d} ({'/'.join(s) or 'no ports'})" for d, s in devices.items())
    active = [d for d, s in devices.items() if "ACTIVE" in s]
    if not rdma:
        why = "Mooncake not chosen" if not uses else "--transfer.mooncake-protocol tcp"
        return Line("rdma", OK, f"{found} ({why})") if devices else skipped("rdma", f"no /sys/class/infiniband ({why})")
    if not active:
        return Line("rdma", FAIL,
                    f"--transfer.mooncake-protocol rdma, and no ACTIVE RDMA port ({found or 'no devices'})",
                    "check the HCA (ibstat), load its driver, or use --transfer.mooncake-protocol tcp")
    wanted = [d for d in t.mooncake_device.split(",") if d]
    missing = [d for d in wanted if d not in active]
    if missing:
        return Line("rdma", FAIL, f"--transfer.mooncake-device {t.mooncake_device}: {', '.join(missing)} "
                    f"not ACTIVE here "
                    f"({found})", f"name ACTIVE devices ({', '.join(active)}) or leave it empty")
    return Line("rdma", OK, found)


def port_in_use(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound ('' host: every interface), or None when it can."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: a TIME_WAIT port is free
        try:
            s.bind((host, port))
        except OSError as e:
            return "in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
    return None


def proxy_port_line(proxy: ProxyConfig, *, rank: int) -> Line:
    """--proxy.port on rank 0, where the proxy runs (0: a free port is picked at start)."""
    host, port = proxy.host, proxy.port
    if rank != 0:
        return skipped("proxy port", "the proxy runs on rank 0")
    if port == 0:
        return Line("proxy port", OK, f"--proxy.port 0: a free port on {host} is picked at start")
    why = port_in_use(host, port)
    if why is None:
        return Line("proxy port", OK, f"{host}:{port} bindable")
    return Line("proxy port", FAIL, f"--proxy.port {port} on {host}: {why}",
                f"free it (ss -ltnp 'sport = :{port}') or choose another --proxy.port (0 picks a free one)")


def sandbox_line(rc: RunnerConfig) -> Line:
    """What `--executions.runner.sandbox` means on this node (gyre.executions.sandbox)."""
    from gyre.executions import sandbox

    name = "sandbox"
    if rc.sandbox_hosts:
        return skipped(name, f"harnesses run on --executions.runner.sandbox-hosts ({', '.join(rc.sandbox_hosts)}); "
                             f"isolate those hosts")
    kind = rc.sandbox
    if kind in ("auto", "bwrap"):
        if sandbox.bwrap_works():
            return Line(name, OK, f"{kind}: bubblewrap works here (namespaces: mount, pid, net, user)")
        fix = ("apt-get install bubblewrap, and allow unprivileged user namespaces "
               "(sysctl kernel.unprivileged_userns_clone=1 / kernel.apparmor_restrict_unprivileged_userns=0)")
        if kind == "bwrap":
            return Line(name, FAIL, "bwrap: bubblewrap cannot build a sandbox here", fix)
        return Line(name, WARN, "auto: bubblewrap is not usable here, so harnesses run with no isolation (none)",
                    fix + "; or choose --executions.runner.sandbox none/unshare/container explicitly")
    if kind == "none":
        return Line(name, WARN, "none: harnesses are not isolated (same user, filesystem and network as the rank)",
                    "for untrusted harnesses choose --executions.runner.sandbox bwrap, unshare or container")
    if kind == "unshare":
        exe = shutil.which("unshare")
        if exe is None:
            return Line(name, FAIL, "unshare: the util-linux `unshare` is not installed", "apt-get install util-linux")
        argv = sandbox.unshare_argv(inner=[sys.executable, "-I", "-S", "-c", "pass"], net=True, unshare=exe)
        fix = "allow user namespaces, or choose bwrap / container"
        try:
            r = subprocess.run(argv, capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return Line(name, FAIL, f"unshare: probe failed ({e})", fix)
        if r.returncode != 0:
            err = r.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {r.returncode}"]
            return Line(name, FAIL, f"unshare: probe failed ({err[0]})", fix)
        return Line(name, OK, "unshare: pid/ipc/uts/net namespaces work here (the filesystem is not isolated)")
    # container
    if not rc.container_image:
        return Line(name, FAIL, "container: --executions.runner.container-image is empty",
                    "name the image the harness runs in (it needs python3)")
    if shutil.which(rc.container_cli) is None:
        return Line(name, FAIL, f"container: {rc.container_cli} is not installed",
                    "install docker or podman, or set --executions.runner.container-cli")
    return Line(name, OK, f"container: {rc.container_cli} run {rc.container_image} (the image is not pulled here)")


def backends_line(backend: BackendConfig, transfer: TransferConfig, model: ModelConfig, parallel: ParallelConfig,
                  resume: Resume) -> Line:
    """The chosen engine, actor and transport can run here (`gyre.backends.factory.check_backends`,
    the checkpoint left to `checkpoint_lines`)."""
    from gyre.backends.factory import check_backends
    from gyre.errors import ConfigError

    chosen = f"engine {backend.engine}, actor {backend.actor}, transport {transfer.transport}"
    try:
        check_backends(backend, transfer, dataclasses.replace(model, checkpoint=None), parallel, resume)
    except ConfigError as e:
        return Line("backends", FAIL, f"{chosen}: {e}", "install what it names, or choose the backend it suggests")
    return Line("backends", OK, chosen)


def checkpoint_lines(model: ModelConfig, backend: BackendConfig, parallel: ParallelConfig, sglang: SglangOptions,
                     train: TrainConfig) -> list[Line]:
    """--model.checkpoint's architecture (Gyre's registry, `gyre.backends.models.arch`; SGLang's
    name for it; the Megatron layout check) and its dtype against the run's (`--model.dtype`,
    the SGLang refusal of `gyre.config_checks.check_model_dtype`)."""
    from gyre.config_checks import check_megatron_layout, prepared_later
    from gyre.errors import ConfigError

    mc = model.checkpoint
    dtype_line = functools.partial(_dtype_line, model, backend, sglang)
    if not mc:
        preset = f"no --model.checkpoint: --model.preset {model.preset} is built from a config"
        try:
            check_megatron_layout(model, backend, parallel)
        except ConfigError as e:
            return [Line("checkpoint", FAIL, f"{preset}: {e}", "change --parallel.tp/pp/cp/ep"), dtype_line(None)]
        return [skipped("checkpoint", preset), dtype_line(None)]
    if prepared_later(mc, train):
        return [skipped("checkpoint", f"{mc} is written by --train.prepare {train.prepare}"), dtype_line(None)]
    if not Path(mc).is_dir():
        return [Line("checkpoint", FAIL, f"--model.checkpoint {mc}: no such directory on this node",
                     "point it at a checkpoint directory every node can read (a shared filesystem)")]
    from gyre.backends.models.arch import UnsupportedArchitecture, check_checkpoint

    try:
        family = check_checkpoint(mc)
    except (UnsupportedArchitecture, OSError, ValueError) as e:
        return [Line("checkpoint", FAIL, str(e),  # names the directory and the architecture
                     "convert the checkpoint to a supported family, or choose one "
                     "(python -m gyre.backends.models.arch lists them)")]
    arch = f"{family.architectures[0]} ({family.name})"
    try:
        check_megatron_layout(model, backend, parallel)
    except ConfigError as e:
        return [Line("checkpoint", FAIL, f"{arch}: {e}", "change --parallel.tp/pp/cp/ep, or --backend.actor cpu")]
    if backend.actor == "megatron":
        arch += "; Megatron layout ok"
    dtype = dtype_line(stored_dtype(mc))
    if backend.engine == "sglang":
        from gyre.backends.engines.sglang_checkpoint import startable_checkpoint

        arch += f"; SGLang serves it as {family.sglang_architecture}"
        why = startable_checkpoint(mc)
        if why is not None:  # the engine then starts on a copy Gyre writes (sglang_model_dir)
            return [Line("checkpoint", WARN, f"{arch}, but not from this directory ({why}): Gyre writes a "
                         f"safetensors copy for it at start", "save the checkpoint as safetensors "
                         "(save_pretrained(..., safe_serialization=True)) to skip the copy"), dtype]
    return [Line("checkpoint", OK, arch), dtype]


def stored_dtype(path: str) -> str | None:
    """The dtype config.json records (`dtype`, transformers 5, or `torch_dtype`)."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw.get("dtype") or raw.get("torch_dtype")


def _dtype_line(model: ModelConfig, backend: BackendConfig, sglang: SglangOptions, stored: str | None) -> Line:
    from gyre.config_checks import check_model_dtype
    from gyre.errors import ConfigError

    try:
        check_model_dtype(model, backend, sglang)
    except ConfigError as e:
        return Line("dtype", FAIL, str(e), "use --model.dtype bfloat16 (or auto)")
    run = f"runs in {model.dtype} (--model.dtype)"
    if stored is None:
        return Line("dtype", OK, run)
    if {stored, model.dtype} == {"float16", "bfloat16"}:
        return Line("dtype", WARN, f"stored {stored}, {run}: a cast between half types loses precision",
                    f"--model.dtype {stored}")
    return Line("dtype", OK, f"stored {stored}, {run}")
