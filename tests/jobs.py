"""Tiny real Gyre jobs for the tests that run `torchrun -m gyre.run` (the runtime, the fault
injection): task files for the tiny harness, the one command-line builder (2 gloo ranks by default, the
`tiny` model, groups of 2 executions, one group a step, one step a burst), and the process
helpers the fault cases use to find, signal and reap what a job started. Every test asserts on
the run directory afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "runtime" / "tiny_harness.py"
FAULTS = ROOT / "tests" / "faults"
SLEEPER = FAULTS / "sleeper_harness.py"
# The tiny harness's reward (fraction of even-length answer lines) as a cheap command evaluator.
AWK_EVALUATOR = ["awk", "{n++; if (length($0) % 2 == 0) e++} END {print (n ? e / n : 0)}", "answer.txt"]


def write_task_rows(path: Path, tasks: list[dict]) -> Path:
    """One task a row: ids t0, t1, ... and `tasks[i]`'s fields (harness, evaluator, ...)."""
    with path.open("w") as f:
        for i, t in enumerate(tasks):
            f.write(json.dumps({"task_id": f"t{i}", "instruction": "say words", **t}) + "\n")
    return path


def tiny_task(turns: int = 1, tokens: int = 8, sdk: bool = False) -> dict:
    """A task for the tiny harness: `turns` chat turns of at most `tokens` tokens each (`sdk`:
    through the openai SDK instead of urllib)."""
    return {"harness": [sys.executable, str(HARNESS), str(turns), str(tokens), *(["sdk"] if sdk else [])],
            "evaluator": {"command": AWK_EVALUATOR}}


def write_tasks(path: Path, harness: list[str] | None = None, n: int = 4) -> Path:
    """`n` tasks, all running `harness` (default: the tiny harness, 1 turn of 8 tokens)."""
    task = {**tiny_task(), **({"harness": harness} if harness else {})}
    return write_task_rows(path, [task] * n)


def launcher(nproc: int = 2, *args: str) -> list[str]:
    """The launcher prefix every real job in the tests uses: torchrun (standalone), `nproc` ranks,
    then `args` (torchrun's own flags, e.g. `--max-restarts 1`), then `-m gyre.run`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args,
            "-m", "gyre.run"]


def command(tasks: Path, *extra: str, steps: int = 2, nproc: int = 2, torchrun: tuple[str, ...] = (),
            timeout_s: float = 120, sandbox: str | None = "none", run_dir: Path | None = None, seed: int | None = None,
            n: int = 2, groups: int = 1, mu: int = 1, phi: float = 0.0, tau: int | None = None,
            max_tokens: int = 512, drain_s: float = 5) -> list[str]:
    """The torchrun command line of a tiny training job: the one builder of the tests.

    The defaults are the cheap ones: groups of `n` 2, `groups` (B) 1 a step, one step a burst
    (μ 1, φ 0), a 0.1 s tick, τ at the scheduler's default unless a test that asserts reroutes
    asks for more, and a 5 s drain at the end (the 60 s default waits for executions the run will
    never train). `sandbox` None: the default sandbox. `extra` comes last, so a flag in it wins."""
    return [*launcher(nproc, *torchrun), "--job", "train", "--model.preset", "tiny",
            *(("--run-dir", str(run_dir)) if run_dir is not None else ()),
            *(("--seed", str(seed)) if seed is not None else ()),
            "--executions.dataset.path", str(tasks), "--executions.runner.timeout-s", f"{timeout_s:g}",
            *(("--executions.runner.sandbox", sandbox) if sandbox else ()),
            "--scheduler.n-per-group", str(n), "--scheduler.batch-groups", str(groups), "--scheduler.mu", str(mu),
            "--scheduler.phi", f"{phi:g}", "--scheduler.tick-s", "0.1", *(("--scheduler.tau", str(tau)) if tau else ()),
            "--train.steps", str(steps), "--train.max-tokens", str(max_tokens), "--train.drain-at-end-s", f"{drain_s:g}",
            *extra]


@dataclass(frozen=True)
class Run:
    """A named tiny run (the shape of torchtitan's OverrideDefinitions): what it is for, and the
    `command` settings and flags that make it. `RUNS` holds every run a test file builds more
    than ad hoc, so a reader finds each job's knobs in one table."""

    purpose: str
    settings: dict
    flags: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)

    def command(self, tasks: Path, run_dir: Path, *extra: str, **overrides) -> list[str]:
        return command(tasks, *self.flags, *extra, run_dir=run_dir, **{**self.settings, **overrides})


def command_in(tasks: Path, run_dir: Path, *extra: str, steps: int = 2, nproc: int = 2) -> list[str]:
    """A tiny job in `run_dir` taking its tasks in file order, with the default sandbox and a
    300 s harness timeout (the signal, frozen-rank and accounting cases)."""
    return command(tasks, "--executions.dataset.no-shuffle", *extra, run_dir=run_dir, steps=steps, nproc=nproc,
                   timeout_s=300, sandbox=None)


RUNS: dict[str, Run] = {
    "finished": Run("the shared finished run (tests/conftest.py `finished_run`): 2 ranks, 2 steps, a checkpoint "
                    "after each; copied by the resume and damaged-checkpoint tests",
                    dict(steps=2), ("--train.checkpoint-every", "1")),
    "e2e": Run("4 ranks, φ 0.5, μ 2, B 2, N 3, long-tailed executions: reroutes, staleness closed form, resume on a "
               "smaller world (tests/runtime/test_train_e2e.py). τ 30 and a 10 ms decode floor keep calls in flight "
               "at switches, so reroutes are the rule rather than luck",
               dict(nproc=4, steps=6, seed=1, n=3, groups=2, mu=2, phi=0.5, tau=30, max_tokens=1400, timeout_s=300,
                    sandbox=None),
               ("--executions.runner.max-concurrency", "12", "--scheduler.rho-min", "0.5", "--engine.max-batch", "4",
                "--engine.min-decode-step-s", "0.01", "--scheduler.cell-concurrency", "8")),
    "baselines": Run("the Colocate and Async baselines (tests/runtime/test_train_e2e.py, `--scheduler.mode` added): 3 "
                     "ranks, φ 1, μ 1, B 2, no streaming, 2 steps; Async trains on cells 0, 1 and cell 2 only rolls out. "
                     "The e2e run's long-tailed executions without its decode floor: a step's items must take the core "
                     "long enough that cell 1 (whose first actor build takes seconds) joins it; with short executions "
                     "the core trained step 0 alone (1 run in 3, loaded). A lightly paced actor adds margin",
                     dict(nproc=3, steps=2, seed=1, groups=2, mu=1, phi=1.0, max_tokens=1400, timeout_s=300, sandbox=None),
                     ("--scheduler.no-streaming", "--scheduler.async-train-cells", "2", "--actor.min-s-per-ktok", "2")),
    "async": Run("2 ranks, Async with one training cell, B 2, one burst (μ = steps): engine auth",
                 dict(steps=2, seed=1, groups=2, mu=2, phi=0.5, sandbox=None),
                 ("--scheduler.mode", "async", "--scheduler.async-train-cells", "1")),
    "transports": Run("3 ranks, Async with two training cells, a paced actor (~0.5 s a micro-step) so cell 1 joins "
                      "before the core claims every item (tests/runtime/test_transports_job.py; its harness still "
                      "goes through the SDK: with the stdlib one cell 1 did not join)",
                      dict(nproc=3, steps=2, seed=1, groups=2, mu=2, phi=0.5, sandbox=None),
                      ("--scheduler.mode", "async", "--scheduler.async-train-cells", "2", "--actor.min-s-per-ktok", "4")),
    "sglang": Run("3 ranks through the SGLang adapter (fake SGLang API), N 3, B 2, μ 2; τ 30 and a decode floor in "
                  "the fake keep calls in flight at switches, as the test asserts reroutes (tests/runtime/test_sglang_job.py)",
                  dict(nproc=3, steps=4, seed=1, n=3, groups=2, mu=2, phi=0.5, tau=30, max_tokens=1400, timeout_s=300,
                       sandbox=None),
                  ("--backend.engine", "sglang", "--executions.runner.max-concurrency", "12", "--scheduler.rho-min", "0.5",
                   "--scheduler.cell-concurrency", "8")),
}


def nothing_aborted_but_the_cancelled_at_the_end(summary: dict) -> None:
    """No execution was aborted by a role switch: every one completed except those the drain at
    the end cancelled (a call aborted under a tiny harness makes it crash: it retries nothing),
    and no call was aborted beyond one per cancelled execution (a harness makes one call at a
    time). With the builder's 5 s drain, executions still running at the end are cancelled, so
    `execution_outcomes == {"completed"}` no longer holds for runs that dispatch ahead (φ > 0)."""
    outcomes, cancelled = summary["execution_outcomes"], summary["cancelled_at_end"]
    assert set(outcomes) <= {"completed", "cancelled"} and outcomes.get("cancelled", 0) == cancelled, summary
    assert outcomes.get("completed", 0) > 0 and summary["aborted_calls"] <= cancelled, summary


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def gyre(cwd: Path, tasks: Path, *extra: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(command(tasks, *extra, **kw), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env())


def log_of(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def worker_pid(agent: int, rank: int) -> int | None:
    """The pid of torchrun's worker of `rank` in its first attempt (a child of the agent)."""
    try:
        children = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
    except OSError:
        return None
    for pid in children:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RESTART_COUNT=0" in environ:
            return int(pid)
    return None


def start(cmd: list[str], cwd: Path, log: Path, **extra_env: str) -> subprocess.Popen:
    """torchrun in its own session (as a shell job: Ctrl-C reaches its whole process group)."""
    return subprocess.Popen(cmd, cwd=cwd, env={**env(), **extra_env}, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_for(pred, timeout: float, proc: subprocess.Popen | None = None, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the job exited ({proc.returncode}) before {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def marked(marker: str) -> list[int]:
    """Live pids whose command line holds `marker` (by /proc: across pid namespaces)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmd = Path(f"/proc/{name}/cmdline").read_bytes().decode(errors="replace")
                state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker in cmd and state not in ("Z", "X") and int(name) != os.getpid():
                out.append(int(name))
    return out


def reap(proc: subprocess.Popen, marker: str) -> None:
    """After a test: nothing of the job left to disturb the next one."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid in marked(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
