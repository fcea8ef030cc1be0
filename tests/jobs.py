"""Tiny real Gyre jobs for the tests that run `torchrun -m gyre.run` (the runtime, the fault
injection): `RUNS`, the one table of every real job the tests start and what each proves (a launch
not built by it is refused: tests/conftest.py), the command-line builder under it (2 gloo ranks by
default, the `tiny` model, groups of 2 executions, one group a step, one step a burst), task files
for the tiny harness, and the process helpers the fault cases use to find, signal and reap what a
job started. Every test asserts on the run directory afterwards."""

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


def launcher(nproc: int = 2, *args: str, standalone: bool = True) -> list[str]:
    """The launcher prefix every real job in the tests uses: torchrun (standalone unless the job
    names its own rendezvous), `nproc` ranks, then `args` (torchrun's own flags, e.g.
    `--max-restarts 1`), then `-m gyre.run`."""
    return [sys.executable, "-m", "torch.distributed.run", *(["--standalone"] if standalone else []),
            "--nproc-per-node", str(nproc), *args, "-m", "gyre.run"]


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


_BUILT: set[tuple[str, ...]] = set()  # every command line `Run` built in this process (tests/conftest.py checks launches)


def built_from_runs(args) -> bool:
    """Whether `args` is a command line `RUNS[...]` built, unchanged since (behind a wrapper such as
    `ip netns exec NS` or `unshare ...`, which only prefixes it)."""
    if not isinstance(args, (list, tuple)):
        return False
    argv = tuple(str(a) for a in args)
    return any(argv[i:] in _BUILT for i in range(len(argv)))


@dataclass(frozen=True)
class Run:
    """A named real job (the shape of torchtitan's OverrideDefinitions): what it proves and which
    test launches it, and the settings and flags that make it. Every real job of the tests is a
    `RUNS` entry: tests/conftest.py refuses a launch of `torchrun -m gyre.run` that `Run.command`
    (or `Run.documented`) did not build.

    Three shapes: the tiny job (`command`'s builder: `settings` are its keywords, `flags` follow),
    a preset (`--preset NAME`, then `flags`), or `bare` (only `flags`: a job that sets every knob
    itself). The last two take `nproc`, `torchrun` and `standalone` as settings. A test adds its
    own paths and values as `extra` and `overrides`."""

    purpose: str
    settings: dict = field(default_factory=dict)
    flags: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    preset: str | None = None
    bare: bool = False

    def command(self, tasks: Path | str | None, run_dir: Path | None, *extra: str, **overrides) -> list[str]:
        s = {**self.settings, **overrides}
        if self.preset is None and not self.bare:
            argv = command(tasks, *self.flags, *extra, run_dir=run_dir, **s)
        else:
            nproc, torchrun, standalone = s.pop("nproc", 2), s.pop("torchrun", ()), s.pop("standalone", True)
            if s:
                raise TypeError(f"a preset or bare run takes nproc, torchrun and standalone, not {sorted(s)}")
            argv = [*launcher(nproc, *torchrun, standalone=standalone),
                    *(("--preset", self.preset) if self.preset else ()),
                    *(("--run-dir", str(run_dir)) if run_dir is not None else ()),
                    *(("--executions.dataset.path", str(tasks)) if tasks is not None else ()), *self.flags, *extra]
        _BUILT.add(tuple(argv))
        return argv

    def documented(self, argv: list[str]) -> list[str]:
        """A command line read from a document (an example's README), launched as written."""
        _BUILT.add(tuple(str(a) for a in argv))
        return argv


# `command`'s harness settings for the fault cases: tasks in file order, the default sandbox, a
# 300 s harness timeout.
_IN_ORDER = dict(timeout_s=300, sandbox=None)
_NO_SHUFFLE = "--executions.dataset.no-shuffle"

RUNS: dict[str, Run] = {
    # -- the shared run, and the runtime's
    "finished": Run("the shared finished run (tests/conftest.py `finished_run`): 2 ranks, 2 steps, a checkpoint "
                    "after each; copied by the resume and damaged-checkpoint tests, read by tracking, eval, export",
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
                     "the core trained step 0 alone (1 run in 3, loaded). A lightly paced actor adds margin. Async's run "
                     "moves its weights over the store transport and checks its counts (no store job of its own)",
                     dict(nproc=3, steps=2, seed=1, groups=2, mu=1, phi=1.0, max_tokens=1400, timeout_s=300, sandbox=None),
                     ("--scheduler.no-streaming", "--scheduler.async-train-cells", "2", "--actor.min-s-per-ktok", "2")),
    "async": Run("2 ranks, Async with one training cell, B 2, one burst (μ = steps): every engine call needs the "
                 "run's engine token, a harness outside any sandbox reaches none (tests/security/test_engine_auth.py)",
                 dict(steps=2, seed=1, groups=2, mu=2, phi=0.5, sandbox=None),
                 ("--scheduler.mode", "async", "--scheduler.async-train-cells", "1")),
    "transports": Run("the mooncake transport inside a private netns (skipped without one): 3 ranks, Async with two "
                      "training cells, a paced actor (~0.5 s a micro-step) so cell 1 joins before the core claims every "
                      "item; satellites read one-sidedly, a broadcast happened, no parameter byte through the store "
                      "(tests/runtime/test_transports_job.py; its harness still goes through the SDK: with the stdlib "
                      "one cell 1 did not join)",
                      dict(nproc=3, steps=2, seed=1, groups=2, mu=2, phi=0.5, sandbox=None),
                      ("--scheduler.mode", "async", "--scheduler.async-train-cells", "2", "--actor.min-s-per-ktok", "4")),
    "sglang": Run("3 ranks through the SGLang adapter (fake SGLang API), N 3, B 2, μ 2; τ 30 and a decode floor in "
                  "the fake keep calls in flight at switches, as the test asserts reroutes (tests/runtime/test_sglang_job.py)",
                  dict(nproc=3, steps=4, seed=1, n=3, groups=2, mu=2, phi=0.5, tau=30, max_tokens=1400, timeout_s=300,
                       sandbox=None),
                  ("--backend.engine", "sglang", "--executions.runner.max-concurrency", "12", "--scheduler.rho-min", "0.5",
                   "--scheduler.cell-concurrency", "8")),
    "zero_advantage": Run("2 ranks, B 2, seed 0, every reward of a group equal: a step with nothing to learn trains no "
                          "token and says so (tests/runtime/test_zero_advantage.py)",
                          dict(steps=2, groups=2, seed=0)),
    # -- what a newcomer meets (tests/runtime/test_newcomer.py, tests/test_entrypoint.py)
    "harness_cannot_import": Run("2 ranks, 6 steps, every harness fails importing a module: the run stops early with one "
                                 "error naming the module and the harness's stderr log, exit non-zero",
                                 dict(steps=6, sandbox=None)),
    "resume_latest": Run("2 ranks: --train.resume without --run-dir continues the latest of two copies of the finished "
                         "run (its optimizer state lost: weights only) to 3 steps; the other run untouched",
                         dict(steps=3, sandbox=None), ("--train.resume", "--train.resume-weights-only")),
    "smoke_prepare": Run("the smoke preset from a fresh prepare dir (a quick hook, tests/runtime/quick_prepare.py), 2 "
                         "ranks, 1 step: no rank reads --model.checkpoint before rank 0's prepare barrier",
                         dict(nproc=2), ("--train.prepare", "tests.runtime.quick_prepare:prepare", "--train.steps", "1"),
                         preset="cpu-demo-smoke"),
    "typo": Run("a misspelt flag under torchrun, 2 ranks: tyro's refusal said once (rank 0) and named in torchrun's "
                "failure report (tests/test_entrypoint.py)", dict(nproc=2), ("--train.stepz", "3"),
                preset="cpu-demo-smoke"),
    "topology": Run("the topology check (`--preset smoke`), 4 ranks in cells of 2 with TP 2: every rank's prefix "
                    "all-reduce is right, the topology logged once (tests/test_entrypoint.py)",
                    dict(nproc=4), ("--parallel.cell-size", "2", "--parallel.tp", "2"), preset="smoke"),
    "cpu_demo": Run("(slow) README command 1: the cpu-demo preset on 4 ranks from a fresh prepare dir, its 32 steps: "
                    "the reward's fitted rise excludes 0, every cell trains (tests/runtime/test_cpu_demo_run.py)",
                    dict(nproc=4), preset="cpu-demo"),
    "real_checkpoint": Run("`--preset cpu-demo-smoke --model.checkpoint DIR`, 2 ranks, 1 step, DIR a tiny random-init "
                           "checkpoint of a real family: its tokenizer, eos ids and padded vocabulary through a whole job, "
                           "no warm start prepared (tests/runtime/test_real_checkpoint_job.py; ChatML in the default "
                           "tier, the other families slow)", dict(nproc=2), ("--train.steps", "1"),
                           preset="cpu-demo-smoke"),
    "config_refused": Run("2 ranks: --model.checkpoint under --train.prepare-dir that the prepare hook does not write is "
                          "refused after the hook ran, on every rank: exit 2, said once by rank 0, no run directory "
                          "(tests/faults/test_config_job.py: the wiring of every in-process refusal)",
                          dict(), ("--train.prepare", "tests.faults.test_config_job:_write_tasks_only")),
    # -- faults (tests/faults/)
    "resume_truncated": Run("2 ranks: --train.resume of a copy of the finished run whose newest checkpoint is truncated: "
                            "skipped by name, the older one resumed, the group it lacks trained again from its evaluated "
                            "executions, not run again (tests/faults/test_checkpoints.py)",
                            dict(steps=2), ("--train.resume",)),
    "resume_twice": Run("2 ranks: --train.resume-from the same checkpoint of a copy of the finished run, launched "
                        "twice: each attempt runs and scores executions of its own ids, one metrics row per step "
                        "(tests/faults/test_attempts.py)", dict(steps=4)),
    "signals": Run("2 ranks, 4 steps (μ 3), two sleeper harnesses and two slow evaluations in flight, then SIGINT to "
                   "the process group (unsandboxed), SIGTERM to torchrun (sandboxed) or a rank SIGKILLed: a graceful "
                   "stop with summary, events, plot and a checkpoint at the last step, no process or evaluator "
                   "directory left (tests/faults/test_signals.py)",
                   dict(steps=4, **_IN_ORDER), (_NO_SHUFFLE, "--scheduler.mu", "3")),
    "stop_edges": Run("2 ranks, μ 3, a checkpoint every step, a sleeper in flight: SIGTERM inside a checkpoint write "
                      "keeps the step's row and journal and the resume trains nothing twice; (slow) a full disk, 20 "
                      "seeded SIGTERMs (tests/faults/test_stop_edges.py)", dict(_IN_ORDER),
                      (_NO_SHUFFLE, "--executions.runner.sandbox", "none", "--scheduler.mu", "3",
                       "--train.checkpoint-every", "1")),
    "gray": Run("2 ranks, 4 steps, N 4: an engine rank frozen mid-run loses its calls within the progress timeout and "
                "is named, the run goes on (tests/faults/test_gray.py)",
                dict(steps=4, n=4, timeout_s=120, sandbox=None), (_NO_SHUFFLE,)),
    "harness_procs": Run("2 ranks, 3 steps, unsandboxed harnesses that leave daemons and flood their logs: the daemons "
                         "die with their execution, logs are capped, a SIGKILLed torchrun takes everything "
                         "(tests/faults/test_harness_procs.py)",
                         dict(steps=3, **_IN_ORDER), (_NO_SHUFFLE, "--executions.runner.sandbox", "none")),
    "restart": Run("2 ranks, torchrun --max-restarts 1, a checkpoint every step, --executions.plane rank0 (the harnesses "
                   "die with rank 0): a rank SIGKILLed mid-run is restarted and the run finishes its steps, the groups "
                   "in flight run again (slow tier: the comparison tests/faults/test_lossless_restart.py beats) (tests/faults/test_restart.py)",
                   dict(torchrun=("--max-restarts", "1")), ("--train.checkpoint-every", "1", "--executions.plane", "rank0")),
    "restart_plane": Run("2 ranks, torchrun --max-restarts 1, --executions.plane process: a rank SIGKILLed mid-run "
                         "costs no execution; the restart adopts the executions in flight and trains their groups "
                         "(tests/faults/test_lossless_restart.py)",
                         dict(torchrun=("--max-restarts", "1")),
                         ("--train.checkpoint-every", "1", "--executions.plane", "process")),
    "accounting": Run("2 ranks, 2 steps, unsandboxed: a harness SIGKILLed from outside is evaluated and counted, a TITO "
                      "write failure stops the run naming it (tests/faults/test_accounting.py)",
                      dict(steps=2, **_IN_ORDER), (_NO_SHUFFLE, "--executions.runner.sandbox", "none")),
    "evaluator_escape": Run("2 ranks, 2 steps, harnesses that steer their evaluator: those executions are excluded and "
                            "nothing is written where they point (tests/faults/test_evaluator_escape.py)",
                            dict(steps=2, **_IN_ORDER), (_NO_SHUFFLE, "--executions.health.window", "4")),
    "run_lock": Run("(slow) 2 ranks: two resumes of one run directory at once: the second is refused by the run lock "
                    "(tests/faults/test_run_lock.py)", dict(_IN_ORDER), (_NO_SHUFFLE,)),
    # -- examples, real families, clusters
    "own_agent_example": Run("2 ranks, 2 steps, docs/train-your-own-agent.md's example harness and evaluator: the "
                             "documented command trains (tests/executions/test_own_agent_example.py)",
                             dict(steps=2, max_tokens=1024, sandbox=None)),
    "claude_code_example": Run("(slow) examples/claude_code/README.md's CPU command as written, through the stand-in "
                               "claude: two steps (tests/executions/test_claude_code_example.py)"),
    "mini_swe_agent_example": Run("(slow) examples/mini_swe_agent's README command on 2 ranks, 2 steps: mini-swe-agent "
                                  "calls the model, every execution scored (tests/executions/test_mini_swe_agent_example.py)"),
    "arch_run": Run("(slow) 2 ranks on a Qwen3 / Qwen3-MoE checkpoint: the core trains the checkpoint's own class, the "
                    "saved checkpoint reloads in transformers as it (tests/backends/models/test_arch_run.py)",
                    dict(nproc=2), ("--job", "train", "--seed", "1", "--executions.runner.timeout-s", "300",
                                    "--scheduler.n-per-group", "2", "--scheduler.batch-groups", "2",
                                    "--scheduler.tick-s", "0.1", "--train.steps", "2", "--train.max-tokens", "1400",
                                    "--engine.max-batch", "4"), bare=True),
    "cross_node": Run("(slow) two nodes (network namespaces), one rank each: weights and KV cross the node boundary "
                      "(tests/cluster/test_cross_node_transfer.py)",
                      dict(nproc=1, standalone=False),
                      ("--job", "train", "--model.preset", "tiny", "--seed", "1", "--executions.runner.timeout-s", "120",
                       "--executions.runner.sandbox", "none", _NO_SHUFFLE, "--scheduler.mode", "gyre",
                       "--scheduler.n-per-group", "2", "--scheduler.batch-groups", "2", "--scheduler.mu", "1",
                       "--scheduler.phi", "1", "--scheduler.tick-s", "0.1", "--train.max-tokens", "512",
                       "--train.drain-at-end-s", "5", "--engine.min-decode-step-s", "0.04", "--proxy.migration", "always"),
                      bare=True),
    "sbatch": Run("(slow) the tiny job's gyre.run arguments after `sbatch launch.sh` on a two-node Slurm cluster "
                  "(tests/cluster/test_sbatch.py; launch.sh starts torchrun)", dict()),
    "sbatch_restart": Run("(slow) `GYRE_MAX_RESTARTS=1 sbatch --nodes=2 launch.sh` with --executions.plane process: "
                          "the rank on node 2 SIGKILLed mid-run restarts both nodes' ranks, and no execution is "
                          "cancelled or run again; a requeue instead loses the executions in flight "
                          "(tests/cluster/test_cross_node_restart.py)",
                          dict(), ("--train.checkpoint-every", "1", "--executions.plane", "process")),
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


def run_to_end(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """A job built by `RUNS[...].command`, run to its end with its output captured."""
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env())


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


def steps_done(root: Path, proc: subprocess.Popen, n: int, timeout: float) -> Path:
    """The run directory under `root` once its metrics.jsonl has `n` rows (those steps' checkpoints
    are complete); fails if the job exits first or `timeout` passes."""
    found: list[Path] = []

    def done() -> bool:
        found[:] = [m for m in root.glob("*/metrics.jsonl") if len(rows(m)) >= n]
        return bool(found)

    wait_for(done, timeout, proc, f"{n} finished steps")
    return found[0].parent


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
