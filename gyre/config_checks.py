"""Every up-front refusal of a run configuration, run on every rank before run.json.

The entries (`check_job`, `check_train_config`, `check_prepared`; `python -m gyre.config_checks
ARGS` for launch.sh's preflight) take the whole config and hand each `check_*` the sections it
reads. Each raises a `ConfigError` that names the flag. `BOUNDS` holds every number's range.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from gyre.backends.config import resolve_model_dtype
from gyre.config import runs_root
from gyre.errors import ConfigError

if TYPE_CHECKING:
    from gyre.backends.config import BackendConfig, ModelConfig, SglangOptions
    from gyre.config import GyreConfig, TrackingConfig, TrainConfig
    from gyre.executions.config import ExecutionsConfig
    from gyre.proxy.config import ProxyConfig
    from gyre.topology import ParallelConfig


def check_train_config(cfg: GyreConfig, num_cells: int) -> None:
    """Every check of a training config that needs no files (and of the files already there):
    run on every rank before anything starts, each check given the sections it reads."""
    try:
        cfg.scheduler.validate(num_cells)
    except ValueError as e:  # "scheduler.n_per_group must be ..." → the flag: "--scheduler.n-per-group must be ..."
        field_name, _, rest = str(e).partition(" ")
        raise ConfigError(f"--{field_name.replace('_', '-')} {rest}" if field_name.startswith("scheduler.")
                          else str(e)) from None
    hc = cfg.executions.health
    if hc.window < 0:
        raise ConfigError(f"executions.health.window must be >= 0 (0 = one step's executions), got {hc.window}")
    if not hc.stop_fraction > 0:
        raise ConfigError(f"executions.health.stop_fraction must be > 0, got {hc.stop_fraction}")
    tc = cfg.train
    check_numbers(cfg)
    if tc.resume_from and not Path(tc.resume_from).is_dir():
        raise ConfigError(f"--train.resume-from {tc.resume_from}: no such checkpoint directory")
    check_tracking(cfg.tracking)
    check_model_dtype(cfg.model, cfg.backend, cfg.sglang)
    mc = cfg.model.checkpoint
    later = prepared_later(mc, tc)  # what reads it runs in the job, once it is written (check_prepared)
    if mc and not Path(mc).is_dir() and not later:  # before the backends read it
        raise ConfigError(f"--model.checkpoint {mc}: no such directory")
    _check_model(cfg, files=not later)
    check_dataset(cfg.executions, tc)  # the files last: a wrong setting above is the message even when files are missing too
    check_run_dir(cfg.run_dir, cfg.preset)


def _check_model(cfg: GyreConfig, *, files: bool = True) -> None:
    """The backends; with `files` (the checkpoint is there, or none is given), the vocabulary and
    chat format, and the Megatron layout."""
    from gyre.backends.factory import check_backends

    check_backends(cfg.backend, cfg.transfer, cfg.model, cfg.parallel, cfg.train.resumed())
    if files:
        check_model_vocab(cfg.model, cfg.proxy)
        check_megatron_layout(cfg.model, cfg.backend, cfg.parallel)


# Every number of the config that has a bound, by flag: (lowest, whether the lowest is allowed,
# highest or None). Floats are also refused when NaN or infinite (check_numbers).
BOUNDS: dict[str, tuple[float, bool, float | None]] = {
    "train.steps": (1, True, None), "train.max-tokens": (1, True, None), "train.j-max": (1, True, None),
    "train.checkpoint-every": (0, True, None),
    "train.torch-threads": (0, True, None), "train.drain-at-end-s": (0, True, None),
    "train.shutdown-timeout-s": (0, False, None), "train.control-timeout-s": (0, True, None),
    "actor.lr": (0, False, None), "actor.eps": (0, False, None), "actor.weight-decay": (0, True, None),
    "actor.max-grad-norm": (0, False, None), "actor.lr-decay-steps": (0, True, None),
    "actor.min-lr-ratio": (0, True, 1), "actor.min-s-per-ktok": (0, True, None),
    "loss.eps-low": (0, True, None), "loss.eps-high": (0, True, None), "loss.cap": (0, False, None),
    "executions.runner.max-concurrency": (1, True, None), "executions.runner.timeout-s": (0, False, None),
    "executions.runner.kill-grace-s": (0, True, None), "executions.runner.log-cap-bytes": (1024, True, None),
    "executions.evaluator.timeout-s": (0, False, None), "executions.evaluator.max-attempts": (1, True, None),
    "executions.evaluator.retry-backoff-s": (0, True, None), "executions.evaluator.concurrency": (1, True, None),
    "executions.health.window": (0, True, None), "executions.health.stop-fraction": (0, False, None),
    "executions.health.evaluator-window": (0, True, None), "executions.plane-orphan-s": (0, False, None),
    "proxy.port": (0, True, 65535), "proxy.max-context-tokens": (1, True, None),
    "proxy.default-max-tokens": (1, True, None), "proxy.max-body-bytes": (1, True, None),
    "proxy.affinity-slack": (0, True, None), "proxy.max-reroutes": (0, True, None),
    "proxy.engine-wait-s": (0, False, None), "proxy.migration-bandwidth-gbps": (0, True, None),
    "proxy.migration-prefill-tok-s": (0, True, None), "proxy.encode-cache-chars": (0, True, None),
    "proxy.max-calls-per-key": (0, True, None), "proxy.calls-per-second-per-key": (0, True, None),
    "proxy.body-bytes-per-call": (0, True, None), "proxy.render-threads": (1, True, None),
    "proxy.inline-render-chars": (0, True, None), "proxy.close-wait-s": (0, True, None),
    "proxy.engine-progress-timeout-s": (0, True, None), "proxy.roles.system-prompt-prefix-chars": (1, True, None),
    "proxy.roles.helper-max-tokens": (0, True, None), "proxy.engine-hold-s": (0, True, None),
    "proxy.stream-interval-s": (0, True, None), "proxy.gc-every-s": (0, True, None),
    "proxy.gc-every-objects": (0, True, None), "proxy.gc-young-objects": (0, True, None),
    "engine.max-batch": (1, True, None), "engine.max-prefill-tokens": (1, True, None),
    "engine.max-model-len": (1, True, None), "engine.min-decode-step-s": (0, True, None),
    "transfer.keep": (1, True, None), "transfer.timeout-s": (0, False, None),
    "sglang.mem-fraction-static": (0, False, 1),
}


def _numbers(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(flag, value) of every number in a config tree, tuples by element (`actor.betas[0]`)."""
    for f in fields(obj):
        value, flag = getattr(obj, f.name), prefix + f.name.replace("_", "-")
        if is_dataclass(value):
            yield from _numbers(value, flag + ".")
        elif isinstance(value, tuple) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            yield from ((f"{flag}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield flag, value


def check_numbers(cfg: GyreConfig) -> None:
    """Every number of the config tree: finite, and within its bounds (`BOUNDS`), or a ConfigError
    naming the flag; a new float field is checked for NaN and infinity without a line here."""
    for flag, value in _numbers(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"--{flag} must be a finite number, got {value}")
        low, inclusive, high = BOUNDS.get(flag, (None, True, None))
        if low is not None and (value < low or (value == low and not inclusive)):
            raise ConfigError(f"--{flag} must be {'>=' if inclusive else '>'} {low:g}, got {value:g}"
                              + (" (a run of no steps trains nothing)" if flag == "train.steps" else ""))
        if high is not None and value > high:
            raise ConfigError(f"--{flag} must be <= {high:g}, got {value:g}")
    b1, b2 = cfg.actor.betas
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ConfigError(f"--actor.betas must both be in [0, 1), got {b1:g} {b2:g}")


# What the smoke job (the topology check) reads; any other flag belongs to a training job.
# `--run-dir`: launch.sh gives every job one (the smoke job writes nothing there).
SMOKE_FLAGS = ("preset", "job", "parallel.", "log-level", "seed", "help", "h", "run-dir")


def check_job(cfg: GyreConfig, argv: list[str]) -> None:
    """Training flags with `--job smoke` (the default job: the topology check, which trains
    nothing and exits 0) are a forgotten `--job train`: refused, naming it."""
    if cfg.job != "smoke":
        return
    given = [a.split("=", 1)[0] for a in argv if a.startswith("-")]
    training = [a for a in given if not any(a.lstrip("-") == f or (f.endswith(".") and a.lstrip("-").startswith(f))
                                            for f in SMOKE_FLAGS)]
    if training:
        raise ConfigError(f"{', '.join(training)}: training flags, but the job is the topology check (--job smoke, the "
                          f"default of --preset {cfg.preset}), which trains nothing; add --job train")


def check_tasks(executions: ExecutionsConfig, dataset: Any) -> None:
    """What every task will run is there before any execution starts: each harness program
    resolves (on PATH, or an existing file) and each evaluator starts where it will run, in its
    sandbox (`gyre.executions.eval_probe`: a python evaluator imports, a command's program
    resolves and its Python script's imports import)."""
    import shutil

    from gyre.executions.eval_probe import place, probe, probe_argv

    rc = executions.runner
    remote = rc.sandbox_hosts or rc.sandbox == "container"  # programs resolve on those hosts / in the image
    path = (rc.env.get("PATH") or os.environ.get("PATH", os.defpath))
    harnesses: dict[tuple[str, ...], str] = {}
    evaluators: dict[tuple[str, ...], Any] = {}  # one probe per distinct evaluator start: its first task
    for task in dataset:
        argv = task.harness or rc.harness_command
        if not argv:
            raise ConfigError(f"task {task.task_id}: no harness command (set --executions.runner.harness-command "
                              f"or the task's 'harness')")
        harnesses.setdefault(tuple(argv), task.task_id)
        ev = task.evaluator
        if ev.kind == "command" or isinstance(ev.target, str):
            key = probe_argv(ev)
            if key is not None:
                evaluators.setdefault((ev.kind, *key), task)
    where = "--executions.runner.harness-command" if rc.harness_command else "the task's 'harness'"
    for argv, task_id in ([] if remote else harnesses.items()):
        prog = sys.executable if argv[0] == "{python}" else argv[0]
        if os.sep in prog and not Path(prog).is_absolute():
            continue  # relative to the execution's workspace, which the task's files make
        if not (shutil.which(prog, path=path) if os.sep not in prog else os.access(prog, os.X_OK)):
            raise ConfigError(f"task {task_id}: harness program {prog!r} not found ({where}: "
                              f"{' '.join(argv)}); not on PATH, or not an executable file")
        for arg in argv[1:2]:  # `{python} script.py`: the script
            if argv[0] == "{python}" and arg.endswith(".py") and Path(arg).is_absolute() and not Path(arg).is_file():
                raise ConfigError(f"task {task_id}: harness script {arg} not found ({where}: {' '.join(argv)})")
    ec = executions.evaluator
    for task in evaluators.values():
        ev = task.evaluator
        try:
            error = probe(ev, task, ec, rc)
        except ValueError as e:  # the sandbox itself cannot be used
            raise ConfigError(str(e)) from None
        if error is None:
            continue
        if ev.kind == "python":
            raise ConfigError(f"task {task.task_id}: evaluator {ev.target} cannot be imported: {error} ({place(ec, rc)})")
        raise ConfigError(f"task {task.task_id}: evaluator command {' '.join(ev.target)!r} cannot start: {error} "
                          f"({place(ec, rc)})")


def check_prepared(cfg: GyreConfig, *, checkpoint: bool, dataset: bool) -> None:
    """After `--train.prepare` ran (every rank, after the barrier that follows it): the checks
    `check_train_config` left to it, on the files it was to write (`checkpoint`: --model.checkpoint
    was not there before it, `dataset`: the tasks file was not)."""
    wrote = f"(--train.prepare {cfg.train.prepare} wrote into {cfg.train.prepare_dir}, not there)"
    if checkpoint:
        if not Path(cfg.model.checkpoint).is_dir():
            raise ConfigError(f"--model.checkpoint {cfg.model.checkpoint}: no such directory {wrote}")
        _check_model(cfg)
    if dataset:
        if not Path(cfg.executions.dataset.path).exists():
            raise ConfigError(f"--executions.dataset.path {cfg.executions.dataset.path}: no such file {wrote}")
        check_dataset(cfg.executions, cfg.train)


def check_model_dtype(model: ModelConfig, backend: BackendConfig, sglang: SglangOptions) -> None:
    """SGLang serves float16/bfloat16 only: its default attention on Hopper is FA3 (sglang 0.5.23
    arg_groups/model_override_base.py:305-311), whose kernels take fp16/bf16, and its CUDA RMSNorm
    goes through sgl-kernel whatever the dtype (layers/layernorm.py:628, 631). Refused here, before
    any rank starts, instead of a scheduler crash (SIGQUIT to the rank) at engine start."""
    dtype = resolve_model_dtype(model, backend)
    if backend.engine == "sglang" and dtype not in ("bfloat16", "float16"):
        raise ConfigError(f"--model.dtype {dtype} with --backend.engine sglang: SGLang's default GPU kernels (FA3 "
                          f"attention on Hopper, sgl-kernel RMSNorm) take float16/bfloat16 only; use --model.dtype "
                          f"bfloat16 (or auto, which is bfloat16 with a CUDA backend)")
    from gyre.backends.engines.sglang_wire import GYRE_OWNED_SERVER_ARGS

    for key in sglang.extra:
        name = key.replace("-", "_")
        if name in GYRE_OWNED_SERVER_ARGS:
            raise ConfigError(f"--sglang.{key.replace('_', '-')}: Gyre sets ServerArgs.{name} itself "
                              f"({GYRE_OWNED_SERVER_ARGS[name]})")


def check_model_vocab(model: ModelConfig, proxy: ProxyConfig) -> None:
    """The run's tokenizer fits the model (`check_vocab_rows`) and has a chat format the proxy can
    serve (`check_chat_format`)."""
    vocab, _ = check_vocab_rows(model, proxy)
    check_chat_format(proxy, vocab.tokenizer)


def check_vocab_rows(model: ModelConfig, proxy: ProxyConfig) -> tuple[Any, int | None]:
    """(the run's tokenizer, a `gyre.backends.models.vocab.ModelVocab`; the checkpoint's embedding
    rows, None without one): the checkpoint's own tokenizer, else `--proxy.tokenizer-path`, else
    the project's (resolve_tokenizer_dir), with no more ids than the model has embedding rows
    (config.json vocab_size)."""
    from gyre.backends.models import vocab as V

    mc = model.checkpoint
    if mc and not Path(mc).is_dir():
        raise ConfigError(f"--model.checkpoint {mc}: no such directory")
    if proxy.tokenizer_path and not Path(proxy.tokenizer_path).is_dir():
        raise ConfigError(f"--proxy.tokenizer-path {proxy.tokenizer_path}: no such directory")
    rows = V.model_rows(mc) if mc else None
    try:
        vocab = V.load_vocab(mc, proxy.tokenizer_path)
        if rows is not None:
            V.check_project_fallback(mc, rows, vocab)
            V.check_vocab(rows, vocab.size, model=f"--model.checkpoint {mc}",
                          tokenizer=f"the tokenizer at {vocab.path or 'gyre/assets/tokenizer'}")
    except (V.VocabError, OSError) as e:
        raise ConfigError(str(e)) from None
    return vocab, rows


def check_chat_format(proxy: ProxyConfig, tokenizer: Any, model_config: Any = None) -> Any:
    """The run's chat format and tool support (`gyre.proxy.formats.choice.chat_setup`, as the proxy
    builds them): a template no format knows, a format whose end-of-turn token the tokenizer lacks,
    or `--proxy.tool-parser hermes` on a format with other tool calls is a ConfigError naming the
    flag. Returns the `ChatSetup` (what the doctor reports)."""
    from gyre.proxy.formats import UnknownChatFormat
    from gyre.proxy.formats.choice import ChatSetupError, chat_setup

    pc = proxy
    try:
        return chat_setup(tokenizer, model_config, chat_format=pc.chat_format, tool_format=pc.tool_format,
                          tool_parser=pc.tool_parser)
    except (UnknownChatFormat, ChatSetupError) as e:
        raise ConfigError(str(e)) from None


def prepared_later(path: str | None, train: TrainConfig) -> bool:
    """`path` is not there yet, and `--train.prepare` will write it (it lies under
    `--train.prepare-dir`): the checks that read it run in the job, once it is written (a
    newcomer's first `--preset cpu-demo` run has no warm start yet)."""
    return bool(path and not Path(path).exists() and train.prepare and train.prepare_dir
                and Path(train.prepare_dir).resolve() in Path(path).resolve().parents)


def check_megatron_layout(model: ModelConfig, backend: BackendConfig, parallel: ParallelConfig) -> None:
    """--backend.actor megatron: the cell layout (--parallel.tp/pp/cp/ep) against the model's
    architecture (EP on a dense model, PP without Transformer Engine, CP, TP not dividing the
    heads, an unsupported family or RoPE), refused on every rank before any builds anything
    (`gyre.backends.actors.mcore_mapping.check_layout`). Reads only the checkpoint's config.json."""
    if backend.actor != "megatron":
        return
    from gyre.backends.actors.mcore_mapping import check_layout

    if model.checkpoint:
        from transformers import AutoConfig

        try:
            hf = AutoConfig.from_pretrained(model.checkpoint)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--model.checkpoint {model.checkpoint}: no readable config.json ({e})") from None
    else:
        from gyre.backends.models.hf import model_config

        hf = model_config(model.preset, 1)  # the layout does not depend on the vocabulary
    p = parallel
    try:
        check_layout(hf, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep,
                     vocab_size=hf.vocab_size if model.checkpoint else None)
    except ValueError as e:
        raise ConfigError(f"--backend.actor megatron: {e}") from None


def check_dataset(executions: ExecutionsConfig, train: TrainConfig) -> None:
    """The tasks file exists and parses (every task's fields are checked), or `--train.prepare`
    will write it: then it must lie under `--train.prepare-dir`."""
    path = executions.dataset.path
    if not path:
        raise ConfigError("--executions.dataset.path is empty: give a JSONL file of tasks (see examples/cpu_demo)")
    p = Path(path)
    if not p.exists():
        if not prepared_later(path, train):
            raise ConfigError(f"--executions.dataset.path {path}: no such file"
                              + (f" (and --train.prepare writes into {train.prepare_dir}, not there)"
                                 if train.prepare else ""))
        return
    if not p.is_file():
        raise ConfigError(f"--executions.dataset.path {path}: not a file")
    from gyre.executions.tasks import Dataset

    try:
        dataset = Dataset.from_jsonl(p)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--executions.dataset.path {path}: {e}") from None
    check_tasks(executions, dataset)


def run_dir_target(run_dir: str, preset: str) -> tuple[Path, str]:
    """(absolute run directory, how the flag names it), as gyre.run resolves it."""
    target = Path(run_dir) if run_dir else runs_root(preset)
    return target.absolute(), f"--run-dir {run_dir}" if run_dir else f"the default run directory {target}/ (--run-dir)"


def check_run_dir(run_dir: str, preset: str) -> None:
    """Where the run directory goes can be written (the nearest existing directory above it: a
    directory is made and removed there)."""
    import tempfile

    probe, flag = run_dir_target(run_dir, preset)
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{flag}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag}: {probe} is not writable")
    try:  # os.access says yes for root where the filesystem still refuses (/sys, /proc, read-only mounts)
        os.rmdir(tempfile.mkdtemp(prefix=".gyre-probe-", dir=probe))
    except OSError as e:
        raise ConfigError(f"{flag}: cannot create a directory in {probe}: {e.strerror}") from None


def check_tracking(tc: TrackingConfig) -> None:
    """A tracker switched on needs its package: say so before the run starts, not at its end.
    (find_spec, not import: wandb takes a second to import, and every rank runs this check.)"""
    for flag, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if getattr(tc, flag) and importlib.util.find_spec(package) is None:
            raise ConfigError(f"--tracking.{flag} needs the `{package}` package, which is not installed: "
                              f"pip install {package} (or pip install -e '.[tracking]'), or drop --tracking.{flag}")


def preflight(argv: list[str]) -> int:
    """`python -m gyre.config_checks ARGS`: the command line `gyre.run` would get, parsed and
    checked (`check_job`) without starting anything. launch.sh's batch shell runs it once before
    any node starts, so a typo'd flag is said once and no node runs, instead of once per node,
    each followed by torchrun's failure report. Returns the exit status (0: the line parses)."""
    from gyre.config import parse_config

    try:
        check_job(parse_config(argv), argv)
    except ConfigError as e:
        print(f"gyre: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(preflight(sys.argv[1:]))
