"""The one device check of the GPU path: one H200, no network, one command (benchmarks/gpu_check.sh).

    python benchmarks/gpu_check.py --fetch-wheels benchmarks/wheels     # HERE (network): the carried wheels
    bash benchmarks/gpu_check.sh                                         # on the GPU box (≤ 8 min)
    python benchmarks/gpu_check.py --dry-run                             # on CPU: everything it can check

The wheels directory is gitignored: a device run carries it (the device tool's `carry`:
["benchmarks/wheels"]). `--only STAGE ...` reruns some stages, with the stages they need (install
for megatron_step and run, build for kernel_tests and loss_bench); `--budget-s` bounds the whole:
on a warm machine after a full check, `--only STAGE --budget-s <device seconds left − 30>`.

The box: Python 3.12, torch 2.11 (CUDA 13), nvcc 13, transformers, safetensors, aiohttp, numpy,
tensorboard; no SGLang, Mooncake, Transformer Engine, tyro, megatron-core. What gyre's runtime and
the tests import beyond that travels as pinned wheels (`WHEELS`, < 64 MiB in all), installed with
`pip install --no-index --no-deps --find-links` (a package the box already has is kept).

Stages, each with one timeout for everything it runs, each recorded pass / fail / skip with its
reason even when another failed, all inside one overall budget (`--budget-s`). A stage that cannot
fit the time left (`FIT_S`) is skipped by name, not started; a timed-out stage's log comes back as text:

    install        the carried wheels; then gyre's runtime imports (tyro, megatron.core, openai, ...)
    doctor         python -m gyre.doctor with the run stage's flags: its CUDA, NCCL and per-GPU memory lines
    build          gyre._C with CUDA for sm_90 (TORCH_CUDA_ARCH_LIST=9.0), and the CUDA dispatch
                   key registered (setup.py falls back to the CPU extension on a failed CUDA build:
                   that is a failure here)
    kernel_tests   tests/loss/test_cuda.py (CUDA kernels vs the float64 CPU reference, opcheck) and
                   tests/gpu/test_cuda_paths.py (built-in engine on CUDA = on CPU, actor offload /
                   restore on CUDA bit-exact and the memory freed, NCCL collectives on CUDA tensors)
    megatron_step  tests/gpu/test_backends_gpu.py: a GSPO step through Megatron-core vs the CPU
                   actor, fp32 and bf16 (log-probs, loss, gradients within the test's tolerances)
    run            torchrun --nproc-per-node 1 -m gyre.run (`RUN_ARGS`, bf16 as a user's default
                   dtype gives): one cell flipping between
                   the built-in engine on CUDA and the Megatron actor, ≥ 4 steps, 0 aborted calls,
                   the switch latencies and their actor offload / restore parts
    loss_bench     the fused log-prob kernel fwd+bwd at T=16384, V=151936, bf16 vs eager torch and
                   vs the memory-bandwidth floor (goals: ≥ 3× eager, ≤ 1.3× the floor)
    proxy_scale    no GPU: benchmarks/scale_bench.py's proxy series at 1,024 and 4,096 open
                   executions with the proxy alone on core 0 (`PROXY_SCALE_ARGS`), for issue 33's
                   ≤ 5 ms p99 added latency, which the 2-core machine cannot measure

One JSON of figures: --out, else $OUT/gpu_check.json when $OUT is set; else a dry run prints it as its last
line and a device run writes it into a temporary directory (never into the checkout).
The lent machine returns at most 8 files, two folders deep, from $OUT: everything else (the run
directory, ~230 files; pytest's figures; the scale bench's JSON) is written to a temporary
directory, and only gpu_check.json, <stem>_run_summary.json and <stem>_run_metrics.jsonl are put
next to each other in $OUT.

What one GPU cannot try (NCCL will not put two ranks on one device): TP > 1 inside a cell,
gradient reduction over a multi-cell prefix group, the NCCL parameter broadcast to satellites,
and the torch transport between ranks. Their logic runs on gloo in the CPU tests named in
`ONE_GPU_LIMITS`; on CUDA they need a multi-GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.gpu_wheels import MANIFEST, WHEELS, _older, check_manifest, check_wheels, fetch_wheels  # noqa: E402
CUDA_ARCH = "9.0"  # H200 (sm_90)
BUDGET_S = 470  # the whole check: 8 minutes less the machine's start and the copies

RUNTIME_IMPORTS = ["tyro", "megatron.core", "openai", "matplotlib", "pytest", "transformers", "safetensors", "aiohttp"]

KERNEL_TESTS = ["tests/loss/test_cuda.py", "tests/gpu/test_cuda_paths.py"]
MEGATRON_TESTS = ["tests/gpu/test_backends_gpu.py::test_megatron_step_matches_cpu_actor"]
# --model.dtype auto, a user's default: bfloat16 with the Megatron actor (gyre.backends.config.
# resolve_model_dtype; the preset's own is float32): bf16 parameters with fp32 masters and main_grad,
# their offload and restore, a bf16 snapshot to the engine (the dry run checks it resolves so)
RUN_ARGS = ["--preset", "cpu-demo-smoke", "--backend.actor", "megatron", "--backend.device", "cuda",
            "--model.dtype", "auto", "--train.steps", "4", "--overwrite"]
RUN_DTYPE = "bfloat16"
RUN_MIN_STEPS = 4
RUN_LAUNCHER = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "gyre.run"]
RUN_KEEP = ("summary.json", "metrics.jsonl")  # what comes back of the run directory: small, one each
BENCH_SHAPE = (16384, 151936)
# issue 33's proxy goal where the proxy has a core of its own (cores 1-15: load generator, engines)
PROXY_SCALE_ARGS = ["--only", "proxy", "--open-executions", "1024", "4096", "--engines", "8", "--window-s", "15",
                    "--proxy-cpus", "0", "--load-cpus", "1-15"]
PROXY_SCALE_KEYS = ("engines", "open_executions", "proxy_added_ms_p50", "proxy_added_ms_p99", "proxy_cpu_ms_per_call",
                    "legs_ms_p50_p99", "records_lost", "errors")

ONE_GPU_LIMITS = {
    "TP > 1 inside a cell (Megatron TP groups over NCCL)":
        "tests/backends/test_megatron_actor.py::test_every_rank_initialises_megatron_with_cells_contiguous_and_the_actor_trains_on_gloo, "
        "::test_megatron_forward_and_backward_match_hf_on_cpu_with_tp2 (gloo, -m slow)",
    "gradient reduction over a multi-cell prefix group":
        "tests/test_devices.py::test_cpu_tensors_cross_groups_of_a_multibackend_default, tests/test_topology_multirank.py, "
        "tests/runtime/test_join_in_progress.py",
    "NCCL parameter broadcast to satellites / the torch transport between ranks":
        "tests/backends/test_transfer.py, tests/runtime/test_transports_job.py; device choice: tests/test_devices.py",
}

STAGES = {  # name → timeout s, in the order they run
    "install": 90, "doctor": 60, "build": 240, "kernel_tests": 150, "megatron_step": 180, "run": 300,
    "loss_bench": 120,
    "proxy_scale": 100,
}
# The least time each stage needs on one H100/H200 with 16 cores (the 2026-12-06 audit's lower
# estimates): with less left it cannot finish, so it is skipped by name, not started (`skip_reason`).
FIT_S = {"install": 20, "doctor": 10, "build": 50, "kernel_tests": 30, "megatron_step": 30, "run": 80,
         "loss_bench": 20, "proxy_scale": 90}  # proxy_scale: two 15 s windows per size and their ramps
NEEDS = {"doctor": ("install",), "kernel_tests": ("build",), "megatron_step": ("install",), "run": ("install",), "loss_bench": ("build",)}


@dataclass
class Stage:
    status: str = "skip"  # pass | fail | skip
    reason: str = ""
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    log_tail: str = ""


# ---------------------------------------------------------------------------- helpers
def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "TORCH_CUDA_ARCH_LIST": CUDA_ARCH, "PYTHONUNBUFFERED": "1"}


def _sh(cmd: list[str], timeout: float, **kw) -> tuple[int, str]:
    """Run `cmd` in the repository root; (return code, stdout+stderr). Raises TimeoutExpired."""
    r = subprocess.run(cmd, cwd=ROOT, env=kw.pop("env", _env()), capture_output=True, text=True, timeout=timeout, **kw)
    return r.returncode, r.stdout + r.stderr


def _tail(text: str, n: int = 3000) -> str:
    return text[-n:]


def _now() -> float:
    return time.monotonic()


def timeout_output(e: subprocess.TimeoutExpired) -> str:
    """What a timed-out command printed, as text. `subprocess.run(text=True)` does not decode it:
    on POSIX the exception carries the raw bytes read so far, stdout and stderr apart, either None
    (CPython's Popen._check_timeout: `output=b''.join(stdout_seq) if stdout_seq else None`)."""
    parts = []
    for out in (e.output, e.stderr):
        if isinstance(out, bytes):
            out = out.decode("utf-8", errors="replace")
        parts.append(out or "")
    return "".join(parts)


def _left(deadline: float, what: str, timeout: float) -> float:
    """Seconds left before a stage's deadline for its next command; TimeoutExpired (the stage's
    own timeout) when none are, so a later step never gets a timeout of its own."""
    left = deadline - _now()
    if left <= 0:
        raise subprocess.TimeoutExpired(what, timeout)
    return left


def nvcc_compile_only(timeout: float = 240) -> Stage:
    """Compile gyre/csrc/cuda/*.cu for sm_90 against torch's headers (no link). A CPU torch lacks
    one generated header (c10/cuda/impl/cuda_cmake_macros.h): a stand-in defines what it does."""
    st = Stage()
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        st.reason = "nvcc not found"
        return st
    import sysconfig

    from torch.utils import cpp_extension

    sources = sorted((ROOT / "gyre" / "csrc" / "cuda").glob("*.cu"))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        stub = Path(tmp) / "stub" / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [
            f"-I{sysconfig.get_paths()['include']}", f"-I{ROOT / 'gyre' / 'csrc'}", f"-I{Path(tmp) / 'stub'}"]
        flags = ["-gencode", "arch=compute_90,code=sm_90", "-std=c++20", "-O3", "-DGYRE_WITH_CUDA",
                 "-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H", "--expt-relaxed-constexpr",
                 "-Xcompiler", "-fPIC"]
        procs = [subprocess.Popen([nvcc, "-c", str(s), "-o", f"{tmp}/{s.stem}.o", *flags, *includes],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for s in sources]
        outs = []
        for s, p in zip(sources, procs):
            try:
                out, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                out = None
            outs.append((s.name, p.returncode, out))
    st.seconds = time.perf_counter() - t0
    st.figures = {"sources": [n for n, _, _ in outs], "arch": "sm_90", "nvcc": nvcc}
    slow = [n for n, _, out in outs if out is None]
    if slow:  # not a compile error: a loaded machine (about 30 s a file on a quiet 2-core one)
        st.reason = f"{', '.join(slow)}: nvcc timed out after {timeout:.0f}s (load average {os.getloadavg()[0]:.1f})"
        return st
    bad = [(n, out) for n, rc, out in outs if rc != 0]
    st.status, st.reason = ("fail", f"{bad[0][0]} does not compile") if bad else ("pass", "")
    st.log_tail = _tail("\n".join(out for _, out in bad))
    return st


# ---------------------------------------------------------------------------- device stages
def stage_install(wheels: Path | None, timeout: float) -> Stage:
    from importlib import metadata

    st = Stage()
    deadline = _now() + timeout  # one timeout for the whole stage: pip and the import check share it
    installed, kept = [], []
    if wheels is not None:
        problems, st.figures = check_wheels(wheels, WHEELS)
        if problems:
            return Stage("fail", "; ".join(problems), figures=st.figures)
        need = []
        for spec in WHEELS:  # the box's own version is kept unless it is older than the pin
            name, pin = spec.split("==")
            try:
                have = metadata.version(name)
            except metadata.PackageNotFoundError:
                need.append(spec)
                continue
            if _older(have, pin):
                need.append(spec)
            else:
                kept.append(f"{name}=={have}")
        if need:
            rc, out = _sh([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--find-links",
                           str(wheels), *need], timeout)
            st.log_tail = _tail(out)
            if rc != 0:
                return Stage("fail", f"pip install exited {rc}", figures=st.figures, log_tail=st.log_tail)
        installed = need
    rc, out = _sh([sys.executable, "-c", "import importlib,sys; [importlib.import_module(m) for m in sys.argv[1:]]",
                   *RUNTIME_IMPORTS], _left(deadline, "the runtime import check", timeout))
    st.figures.update(installed=installed, kept_from_the_box=kept)
    if rc != 0:
        return Stage("fail", "a runtime import fails: " + out.strip().splitlines()[-1], figures=st.figures, log_tail=_tail(out))
    return Stage("pass", "" if wheels else "no --wheels given: using what is installed", figures=st.figures)


def stage_build(timeout: float) -> Stage:
    deadline = _now() + timeout  # the probe runs inside the stage's timeout
    rc, out = _sh([sys.executable, "setup.py", "build_ext", "--inplace"], timeout,
                  env={**_env(), "MAX_JOBS": str(os.cpu_count() or 8)})
    if rc != 0:
        return Stage("fail", f"setup.py build_ext exited {rc}", log_tail=_tail(out))
    probe = ("import torch, gyre.loss as L; L.extension_available(); print('CUDA_DISPATCH', "
             "torch._C._dispatch_has_kernel_for_dispatch_key('gyre::logprobs_fwd', 'CUDA'))")
    rc2, out2 = _sh([sys.executable, "-c", probe], min(60.0, _left(deadline, "the CUDA dispatch probe", timeout)))
    cuda = rc2 == 0 and "CUDA_DISPATCH True" in out2
    fell_back = "CUDA build of gyre._C failed" in out
    figures = {"arch_list": CUDA_ARCH, "cuda_dispatch_registered": cuda, "fell_back_to_cpu": fell_back}
    if not cuda:
        return Stage("fail", "gyre._C has no CUDA kernels" + (" (the CUDA build failed; CPU fallback)" if fell_back else ""),
                     figures=figures, log_tail=_tail(out + out2))
    return Stage("pass", figures=figures, log_tail=_tail(out, 800))


def _pytest(paths: list[str], timeout: float, figures_file: Path | None = None) -> Stage:
    env = _env()
    if figures_file is not None:
        env["GYRE_GPU_CHECK_FIGURES"] = str(figures_file)
    rc, out = _sh([sys.executable, "-m", "pytest", "-q", "-rs", "-o", "addopts=", "-m", "gpu or not gpu", "-p",
                   "no:cacheprovider", *paths],
                  timeout, env=env)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    figures: dict[str, Any] = {"summary": last}
    if figures_file is not None and figures_file.exists():
        figures.update(json.loads(figures_file.read_text()))
    if rc == 0 and "skipped" in last and "passed" not in last:
        return Stage("fail", f"every test skipped: {last}", figures=figures, log_tail=_tail(out))
    return Stage("pass" if rc == 0 else "fail", "" if rc == 0 else f"pytest exited {rc}: {last}", figures=figures,
                 log_tail=_tail(out, 1500 if rc == 0 else 4000))


def run_copy(out_json: Path, name: str) -> Path:
    """Where a kept file of the run directory comes back: next to the JSON, `<stem>_run_<name>`."""
    return out_json.with_name(f"{out_json.stem}_run_{name}")


def stage_run(out_json: Path, work: Path, timeout: float, launcher: list[str] | None = None) -> Stage:
    """The run directory lives in `work` (outside the output folder); `RUN_KEEP` come back."""
    run_dir = work / "run"
    rc, out = _sh([*(launcher or RUN_LAUNCHER), *RUN_ARGS, "--run-dir", str(run_dir)], timeout)
    for name in RUN_KEEP:
        if (run_dir / name).is_file():
            shutil.copyfile(run_dir / name, run_copy(out_json, name))
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        return Stage("fail", f"no summary.json (torchrun exited {rc})", log_tail=_tail(out))
    s = json.loads(summary_path.read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    figures = {"steps": s.get("steps"), "wall_s": s.get("wall_s"), "aborted_calls": s.get("aborted_calls"),
               "calls": s.get("calls"), "switch_latency_s": s.get("switch_latency_s"), "handover_s": s.get("handover_s"),
               "execution_outcomes": s.get("execution_outcomes"),
               "loss_by_step": [r.get("loss") for r in rows], "reward_by_step": [r.get("reward_mean") for r in rows],
               "command": " ".join(["torchrun", "--standalone", "--nproc-per-node", "1", "-m", "gyre.run", *RUN_ARGS])}
    problems = []
    if rc != 0:
        problems.append(f"torchrun exited {rc}")
    if (s.get("steps") or 0) < RUN_MIN_STEPS:
        problems.append(f"{s.get('steps')} steps, fewer than {RUN_MIN_STEPS}")
    if s.get("aborted_calls") != 0:
        problems.append(f"{s.get('aborted_calls')} aborted calls")
    ho = s.get("handover_s") or {}
    if not (ho.get("actor_offload", {}).get("count") and ho.get("actor_restore", {}).get("count")):
        problems.append("no actor offload / restore was measured (the cell never flipped?)")
    return Stage("fail" if problems else "pass", "; ".join(problems), figures=figures, log_tail=_tail(out, 2000))


DOCTOR = [sys.executable, "-m", "gyre.doctor"]


def stage_doctor(work: Path, timeout: float, args: list[str] | None = None) -> Stage:
    """`python -m gyre.doctor` with the run stage's flags (or `args`): its GPU lines (CUDA, NCCL,
    free memory per GPU, the NCCL all-reduce) run only here. Its table comes back in the figures."""
    args = RUN_ARGS if args is None else args
    rc, out = _sh([*DOCTOR, *args, "--run-dir", str(work / "doctor_run")], timeout)
    rows = [ln for ln in out.splitlines() if ln.split(" ", 1)[0] in ("ok", "warn", "fail", "skipped")]
    figures = {"lines": out.splitlines()[-60:], "command": " ".join(["python", "-m", "gyre.doctor", *args])}
    if rc != 0 or not rows:
        return Stage("fail", f"gyre.doctor exited {rc}: " + "; ".join(r for r in rows if r.startswith("fail")),
                     figures=figures, log_tail=_tail(out))
    return Stage("pass", figures=figures)


def proxy_scale_figures(record: dict) -> dict[str, Any]:
    """The proxy series' figures of a scale_bench record, and issue 33's goal at each size."""
    rows = [{k: r.get(k) for k in PROXY_SCALE_KEYS} for r in record["series"]["proxy"]]
    return {"rows": rows, "goal": "proxy_added_ms_p99 <= 5 at every size",
            "goal_met": all(r["proxy_added_ms_p99"] is not None and r["proxy_added_ms_p99"] <= 5 for r in rows),
            "calibration_loop_ns_max": record.get("figures", {}).get("calibration_loop_ns_max")}


def proxy_scale_command(out: Path) -> list[str]:
    return [sys.executable, str(ROOT / "benchmarks" / "scale_bench.py"), *PROXY_SCALE_ARGS, "--out", str(out)]


# Runs a script with its parse_args stopped after parsing: the arguments are checked, nothing runs.
PARSE_ONLY = """import argparse, json, runpy, sys
real = argparse.ArgumentParser.parse_args
def parse_only(self, args=None, namespace=None):
    ns = real(self, args, namespace)  # exits 2 naming a bad argument, as the real run would
    print("PARSED " + json.dumps(vars(ns), default=str))
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parse_only
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def check_proxy_scale_args(args: list[str] | None = None) -> Stage:
    """Dry run: scale_bench.py's own parser accepts the proxy_scale stage's arguments."""
    cmd = proxy_scale_command(Path(tempfile.gettempdir()) / "scale.json")
    argv = [cmd[1], *(cmd[2:] if args is None else args)]
    rc, text = _sh([sys.executable, "-c", PARSE_ONLY, *argv], 120)
    parsed = [ln[len("PARSED "):] for ln in text.splitlines() if ln.startswith("PARSED ")]
    if rc != 0 or not parsed:
        return Stage("fail", f"scale_bench.py refuses {' '.join(argv[1:])}: {(text.strip().splitlines() or [''])[-1]}")
    ns = json.loads(parsed[-1])
    keys = ("only", "open_executions", "engines", "window_s", "proxy_cpus", "load_cpus")
    return Stage("pass", figures={k: ns.get(k) for k in keys} | {"timeout_s": STAGES["proxy_scale"]})


def stage_proxy_scale(work: Path, timeout: float) -> Stage:
    out = work / "scale.json"
    rc, text = _sh(proxy_scale_command(out), timeout)
    if rc != 0 or not out.exists():
        return Stage("fail", f"scale_bench exited {rc}", log_tail=_tail(text))
    figures = proxy_scale_figures(json.loads(out.read_text()))
    figures["command"] = " ".join(["python", "benchmarks/scale_bench.py", *PROXY_SCALE_ARGS])
    lost = sum(r["records_lost"] or 0 for r in figures["rows"]) + sum(r["errors"] or 0 for r in figures["rows"])
    if lost:
        return Stage("fail", f"{lost} records lost or calls failed", figures=figures, log_tail=_tail(text))
    return Stage("pass", "" if figures["goal_met"] else "measured; the p99 goal is not met (see figures.rows)",
                 figures=figures, log_tail=_tail(text, 1500))


def stage_loss_bench(timeout: float) -> Stage:
    rc, out = _sh([sys.executable, str(ROOT / "benchmarks" / "gpu_check_loss_bench.py"), *map(str, BENCH_SHAPE)], timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if rc != 0 or not lines:
        return Stage("fail", f"loss bench exited {rc}", log_tail=_tail(out))
    figures = json.loads(lines[-1])
    met = all(figures["goals"].values())
    return Stage("pass", "" if met else "measured; goals not all met (see figures.goals)", figures=figures)


# ---------------------------------------------------------------------------- dry run (CPU)
def dry_run(wheels: Path | None, *, nvcc: bool = True, kernel_tests: list[str] | None = None,
            megatron_tests: list[str] | None = None, run_args: list[str] | None = None,
            wheel_specs: list[str] | None = None, manifest: Path = MANIFEST) -> dict[str, Stage]:
    """What can be checked without a GPU: the wheel set, the build plan, the test selection, the
    run's config, the proxy_scale command's arguments, and (when nvcc is here) a compile-only
    check of the CUDA sources."""
    out: dict[str, Stage] = {}
    kernel_tests = KERNEL_TESTS if kernel_tests is None else kernel_tests
    megatron_tests = MEGATRON_TESTS if megatron_tests is None else megatron_tests
    run_args = RUN_ARGS if run_args is None else run_args
    # wheels: the committed manifest always; the files themselves when fetched here
    problems, figures = check_manifest(manifest, WHEELS if wheel_specs is None else wheel_specs)
    if wheels is not None:
        more, on_disk = check_wheels(wheels, WHEELS if wheel_specs is None else wheel_specs)
        problems += more
        figures["on_disk"] = on_disk
    else:
        figures["on_disk"] = "not fetched here (the manifest is checked)"
    out["wheels"] = Stage("fail" if problems else "pass", "; ".join(problems), figures=figures)
    # build plan: setup.py would compile the CUDA kernels on the box, for sm_90
    sys.path.insert(0, str(ROOT))
    import importlib.util

    spec = importlib.util.spec_from_file_location("gyre_setup_plan", ROOT / "setup.py")
    setup_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_mod)
    cu = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "gyre" / "csrc" / "cuda").glob("*.cu"))
    why = setup_mod.cuda_build_plan(bool(cu), "13.0", "/usr/local/cuda", {"TORCH_CUDA_ARCH_LIST": CUDA_ARCH})
    out["build_plan"] = Stage("pass" if why is None and cu else "fail", why or ("" if cu else "no CUDA sources"),
                              figures={"cuda_sources": cu, "TORCH_CUDA_ARCH_LIST": CUDA_ARCH,
                                       "command": f"TORCH_CUDA_ARCH_LIST={CUDA_ARCH} python setup.py build_ext --inplace"})
    out["nvcc_compile_only"] = nvcc_compile_only() if nvcc else Stage("skip", "not asked (--no-nvcc)")
    # test selection: every file exists and collects at least one test
    sel, t0 = Stage(), time.perf_counter()
    missing = [p for p in kernel_tests + megatron_tests if not (ROOT / p.split("::")[0]).exists()]
    if not kernel_tests and not megatron_tests:  # (pytest given no file would collect the whole suite)
        sel.status, sel.reason = "skip", "no tests asked"
    elif missing:
        sel.status, sel.reason = "fail", f"missing test files: {missing}"
    else:
        rc, text = _sh([sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=", "-m", "gpu or not gpu",
                        "-p", "no:cacheprovider", *kernel_tests, *megatron_tests], 180)
        ids = [ln for ln in text.splitlines() if "::" in ln]
        per = {p: sum(1 for i in ids if i.startswith(p.split("::")[0]) and (("::" not in p) or i.startswith(p)))
               for p in kernel_tests + megatron_tests}
        empty = [p for p, n in per.items() if n == 0]
        sel.figures = {"collected": per}
        if rc != 0 or empty:
            sel.status, sel.reason = "fail", f"collection failed (rc {rc}) or collected nothing from {empty}"
            sel.log_tail = _tail(text)
        else:
            sel.status = "pass"
    sel.seconds = time.perf_counter() - t0
    out["test_selection"] = sel
    # the run's config: parses, and passes the up-front check as it would on a CUDA box
    cfg_stage = Stage()
    try:
        import torch

        from gyre.config import parse_config
        from gyre.config_checks import check_train_config

        cfg = parse_config(list(run_args))
        real = torch.cuda.is_available
        torch.cuda.is_available = lambda: True  # as on the box (megatron and --backend.device cuda need it)
        try:
            check_train_config(cfg, num_cells=1)
        finally:
            torch.cuda.is_available = real
        from gyre.backends.config import resolve_model_dtype

        dtype = resolve_model_dtype(cfg.model, cfg.backend)
        cfg_stage.status = "pass"
        cfg_stage.figures = {"actor": cfg.backend.actor, "engine": cfg.backend.engine, "device": cfg.backend.device,
                             "steps": cfg.train.steps, "model_dtype": cfg.model.dtype, "resolved_dtype": dtype,
                             "offload_actor": cfg.backend.offload_actor}
        if cfg.train.steps < RUN_MIN_STEPS:
            cfg_stage.status, cfg_stage.reason = "fail", f"train.steps {cfg.train.steps} < {RUN_MIN_STEPS}"
        elif dtype != RUN_DTYPE:
            cfg_stage.status, cfg_stage.reason = "fail", f"the run trains in {dtype}, not {RUN_DTYPE} (what users get)"
    except (Exception, SystemExit) as e:  # noqa: BLE001 — reported, not raised: the dry run says what fails
        cfg_stage.status, cfg_stage.reason = "fail", f"{type(e).__name__}: {e}"
    out["run_config"] = cfg_stage
    out["proxy_scale_args"] = check_proxy_scale_args()
    return out


# ---------------------------------------------------------------------------- main
def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch

        info.update(torch=torch.__version__, cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(0)
                    if torch.cuda.is_available() else None)
    except Exception as e:  # noqa: BLE001
        info["torch"] = f"not importable: {e}"
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    return info


def _write(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")


def selected(only: list[str] | None) -> list[str]:
    """The stages a run goes through: all, or `only` with what they need, in `STAGES` order."""
    if not only:
        return list(STAGES)
    want = set(only) | {n for o in only for n in NEEDS.get(o, ())}
    return [n for n in STAGES if n in want]


def skip_reason(name: str, stages: dict[str, Stage], chosen: list[str], left_s: float, budget_s: float) -> str | None:
    """Why stage `name` is not started, or None to start it: not chosen, a stage it needs failed, or
    it cannot fit the time left (less than its `FIT_S`). The reason names the stage."""
    if name not in chosen:
        return "not selected (--only)"
    failed = [n for n in NEEDS.get(name, ()) if stages.get(n) is not None and stages[n].status == "fail"]
    if failed:
        return f"needs {', '.join(failed)}, which failed"
    if left_s < FIT_S[name]:
        return (f"out of time: {name} needs at least {FIT_S[name]}s, {max(left_s, 0):.0f}s of the {budget_s:.0f}s "
                f"budget left (not started; rerun it with --only {name})")
    return None


def run_stage(name: str, fn: Callable[[float], Stage], timeout: float) -> Stage:
    """One stage under its timeout: a stage that times out (or raises) is a failure with its log as
    text (`timeout_output`), and never hides the stages after it."""
    t0 = time.perf_counter()
    try:
        st = fn(timeout)
    except subprocess.TimeoutExpired as e:
        st = Stage("fail", f"timed out after {timeout:.0f}s", log_tail=_tail(timeout_output(e)))
    except Exception as e:  # noqa: BLE001 — one stage's failure must not hide the others
        st = Stage("fail", f"{type(e).__name__}: {e}")
    st.seconds = time.perf_counter() - t0
    return st


def run_device(wheels: Path | None, out_json: Path, budget_s: float, only: list[str] | None) -> dict[str, Stage]:
    start = _now()
    stages: dict[str, Stage] = {}
    chosen = selected(only)
    work = Path(tempfile.mkdtemp(prefix="gyre_gpu_check_"))  # never under the output folder
    figures_file = work / "megatron_figures.json"

    def go(name: str, fn: Callable[[float], Stage]) -> None:
        left = budget_s - (_now() - start)
        why = skip_reason(name, stages, chosen, left, budget_s)
        if why is not None:
            stages[name] = Stage("skip", why)
            if name in chosen:
                print(f"[gpu_check] {name}: skip {why}", flush=True)
            return
        stages[name] = st = run_stage(name, fn, min(STAGES[name], left))
        print(f"[gpu_check] {name}: {st.status} ({st.seconds:.0f}s) {st.reason}", flush=True)

    try:
        go("install", lambda t: stage_install(wheels, t))
        go("doctor", lambda t: stage_doctor(work, t))
        go("build", stage_build)
        go("kernel_tests", lambda t: _pytest(KERNEL_TESTS, t))
        go("megatron_step", lambda t: _pytest(MEGATRON_TESTS, t, figures_file))
        go("run", lambda t: stage_run(out_json, work, t))
        go("loss_bench", stage_loss_bench)
        go("proxy_scale", lambda t: stage_proxy_scale(work, t))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return stages


def rerun_hint(stages: dict[str, Stage]) -> dict[str, Any] | None:
    """For the stages that failed or ran out of time: the command that reruns them alone, and the
    seconds they and what they need took this time (a stage cut short counts its timeout)."""
    redo = [n for n, st in stages.items()  # failed, cut short, or skipped for a needed stage that failed
            if st.status == "fail" or st.reason.startswith(("out of time", "needs "))]
    if not redo:
        return None
    took = {n: stages[n].seconds if stages[n].status != "skip" else STAGES[n] for n in selected(redo)}
    return {"command": f"bash benchmarks/gpu_check.sh --only {' '.join(redo)} --budget-s <device seconds left - 30>",
            "stages": list(took), "seconds_last_time": round(sum(took.values()), 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="check on CPU what can be checked; no GPU needed")
    p.add_argument("--no-nvcc", action="store_true", help="dry run: skip the nvcc compile-only check")
    p.add_argument("--wheels", type=Path, default=None, help="the carried wheels (default benchmarks/wheels if present)")
    p.add_argument("--fetch-wheels", type=Path, default=None, metavar="DIR", help="download the pinned wheels into DIR")
    p.add_argument("--out", type=Path, default=None, help="the JSON (default $OUT/gpu_check.json; without $OUT a dry run prints it)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole check's time budget")
    p.add_argument("--only", nargs="*", default=None, choices=list(STAGES), help="run only these stages")
    a = p.parse_args(argv)
    if a.fetch_wheels is not None:
        return fetch_wheels(a.fetch_wheels)
    wheels = a.wheels if a.wheels is not None else (ROOT / "benchmarks" / "wheels")
    wheels = wheels if wheels.is_dir() or a.wheels is not None else None
    out_json = a.out or (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else None)
    if out_json is None and not a.dry_run:  # the run's copies go beside the JSON
        out_json = Path(tempfile.mkdtemp(prefix="gyre-gpu-check-")) / "gpu_check.json"
    t0 = time.time()
    if a.dry_run:
        stages = dry_run(wheels, nvcc=not a.no_nvcc)
    else:
        out_json.parent.mkdir(parents=True, exist_ok=True)
        stages = run_device(wheels, out_json, a.budget_s, a.only)
    result = {"mode": "dry-run" if a.dry_run else "device", "machine": _machine(), "wall_s": time.time() - t0,
              "stages": {k: asdict(v) for k, v in stages.items()},
              "ok": all(s.status != "fail" for s in stages.values()),
              "rerun": rerun_hint(stages),
              "one_gpu_cannot_try": ONE_GPU_LIMITS}
    for name, st in stages.items():
        print(f"{name:18s} {st.status:5s} {st.seconds:6.1f}s  {st.reason}")
    if out_json is None:
        print(json.dumps(result, default=str))
    else:
        _write(result, out_json)
        print(f"wrote {out_json}; ok = {result['ok']}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
