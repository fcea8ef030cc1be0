"""Configuration of the executions plane: harness runner, evaluator, dataset (docs/design.md §4–5).

`ExecutionsConfig` is the `--executions.*` section of `gyre.config.GyreConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class RunnerConfig:
    """How harness processes are launched, limited and killed."""

    harness_command: list[str] = field(default_factory=list)
    """Default harness argv, run inside the execution's workspace (a task may override it).
    `{python}` is replaced by the controller's Python interpreter, `{workspace}` by the workspace
    path, `{instruction_file}` by the path of the file holding the task instruction."""

    run_dir: str = "runs/executions"
    """Directory under which each execution gets `<execution_id>/{workspace,stdout.log,
    stderr.log,result.json}`. The runner writes nowhere else."""

    max_concurrency: int = 64
    """Most harness processes alive at once (on this node, or summed over `sandbox_hosts`)."""

    timeout_s: float = 4 * 3600.0
    """Hard wall-clock limit per execution. On expiry the whole process group (and every
    process of the harness's session) gets SIGTERM, then SIGKILL after `kill_grace_s`."""

    kill_grace_s: float = 5.0
    """Seconds between SIGTERM and SIGKILL when an execution is stopped."""

    log_cap_bytes: int = 64 * 1024 * 1024
    """Most bytes kept of each of a harness's stdout.log and stderr.log (per execution). Past it the
    harness keeps running (its output is still read); the log keeps its first bytes, a line naming
    this cap and what was dropped, and its last min(cap/4, 256 KiB) bytes. At least 1024."""

    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for every harness (applied after the passthrough list)."""

    env_passthrough: list[str] = field(
        default_factory=lambda: [
            "PATH", "LANG", "LC_ALL", "LC_CTYPE", "TERM", "TZ", "TMPDIR", "HOME", "USER",
            "PYTHONPATH", "VIRTUAL_ENV", "PYENV_ROOT", "PYENV_VERSION", "SSL_CERT_FILE",
        ]
    )
    """Variables copied from the controller's environment; everything else (credentials of the
    controller, other engines' keys) is withheld from the harness."""

    home: Literal["inherit", "per_execution"] = "inherit"
    """`per_execution` points HOME at `<execution_id>/home` so harnesses that keep state in the
    home directory (Claude Code's ~/.claude) do not share it."""

    model_name: str = "gyre-policy"
    """Model name given to the harness (GYRE_MODEL, OPENAI_MODEL, ANTHROPIC_MODEL)."""

    sandbox_hosts: list[str] = field(default_factory=list)
    """Remote mode: run harnesses on these hosts (round-robin by load) through `remote_shell`
    instead of on the controller's node. Empty = local. See `gyre.executions.runner`."""

    remote_shell: list[str] = field(default_factory=lambda: ["ssh", "-o", "BatchMode=yes", "{host}"])
    """argv prefix that runs a shell command on `{host}` (remote mode only)."""

    remote_push: list[str] = field(default_factory=lambda: ["rsync", "-a", "--delete", "{local}/", "{host}:{remote}/"])
    """argv that copies the prepared workspace `{local}` to `{remote}` on `{host}` before the
    harness starts (remote mode only)."""

    remote_pull: list[str] = field(default_factory=lambda: ["rsync", "-a", "--delete", "{host}:{remote}/", "{local}/"])
    """argv that brings the workspace back after the harness ends, so the evaluator scores the
    preserved workspace on the controller (remote mode only)."""

    remote_root: str = "/tmp/gyre-sandbox"
    """Directory on each sandbox host holding the remote workspaces (remote mode only)."""

    sandbox: Literal["auto", "none", "bwrap", "unshare", "container"] = "auto"
    """How each harness is isolated (gyre.executions.sandbox). `bwrap`: bubblewrap namespaces; the
    harness sees its execution directory read-write, the system and Python read-only, nothing of
    the repository or other executions, and only the proxy on the network; its processes die with
    it. `unshare`: pid/net namespaces only, the filesystem is shared. `container`: `container_cli
    run` of `container_image`. `none`: no isolation ("harness not isolated"), but the harness's
    processes are contained: it runs under a subreaper shim that kills everything it started
    (setsid'd, double-forked daemons included) when it ends, is stopped, or its rank dies
    (`gyre.executions.procs.CONTAIN`). `auto`: bwrap when
    it works here, else none with a warning. Ignored with `sandbox_hosts` (isolate those hosts).
    A harness that reads files beside its script, or a CLI installed outside /usr, names them in
    `sandbox_ro_paths` (examples/claude_code does)."""

    sandbox_network: Literal["proxy", "host"] = "proxy"
    """`proxy`: the sandboxed harness has its own network namespace and reaches only the proxy
    (through a relay on 127.0.0.1:<proxy port>). `host`: it shares the host network (it can reach
    anything the controller can)."""

    sandbox_ro_paths: list[str] = field(default_factory=list)
    """Extra paths visible read-only inside the sandbox (a CLI installed outside /usr, a config file
    next to a harness script). Files named in the harness argv are bound on their own."""

    container_cli: str = "docker"
    """Container engine for `sandbox container` (docker or podman)."""

    container_image: str = ""
    """Image the harness runs in (`sandbox container`); it needs python3 for the proxy relay."""

    container_python: str = "python3"
    """The image's Python: replaces `{python}` in the harness command and runs the relay."""

    container_args: list[str] = field(default_factory=list)
    """Extra `run` options (resource limits: --memory 8g --cpus 2 --pids-limit 512)."""

    proxy_url_for_harness: str = ""
    """Base URL of the proxy as the harness must reach it (e.g. the controller's routable address
    in remote mode). Empty = the proxy's own URL."""


@dataclass(kw_only=True)
class EvaluatorConfig:
    """How an ended execution's preserved workspace is scored (docs/design.md §5)."""

    timeout_s: float = 600.0
    """Wall-clock limit of one evaluator attempt; a hung attempt is killed and counts as failed."""

    max_attempts: int = 3
    """Evaluator attempts per execution (first try + retries). All failed ⇒ execution excluded."""

    retry_backoff_s: float = 1.0
    """Pause before each retry (doubles every retry)."""

    on_crash: Literal["placeholder", "evaluate"] = "placeholder"
    """A harness that failed outright (non-zero exit or killed by a signal other than the
    runner's timeout): `placeholder` gives it a zero-reward placeholder without evaluating
    (docs/design.md §5); `evaluate` scores its workspace like a timed-out execution. A harness that
    could not be launched at all always gets the placeholder."""

    concurrency: int = 8
    """Most evaluator attempts running at once."""

    sandbox: Literal["inherit", "none"] = "inherit"
    """Where command and `module:function` evaluators run (gyre.executions.eval_sandbox).
    `inherit`: in the harnesses' sandbox backend (`--executions.runner.sandbox`, also with
    `sandbox_hosts`); under bwrap an evaluator sees the workspace read-write, its execution
    directory read-only, nothing of other executions, its own package, module file or script
    (with the Python modules beside a single file) and the gyre package read-only, no network (the host's with
    `runner.sandbox_network host`), and the harness's environment passthrough list, not the
    controller's variables. Harnesses in containers: evaluators run under bwrap on this node.
    `none`: unsandboxed, as this user with its environment (an LLM judge that needs the
    network); an evaluator that runs the workspace's tests then runs harness-written code
    outside any sandbox. Either way a workspace the harness replaced by a symbolic link is not
    scored (the execution is excluded, `detail.refused` says why)."""

    sandbox_ro_paths: list[str] = field(default_factory=list)
    """Extra paths visible read-only to sandboxed evaluators (data files beside an evaluator's
    module; `runner.sandbox_ro_paths` are visible too)."""


@dataclass(kw_only=True)
class DatasetConfig:
    """Where tasks come from. (N, the executions per query, is `scheduler.n_per_group`; the task
    order is seeded by the run's `--seed`.)"""

    path: str = ""
    """JSONL file of tasks (see `gyre.executions.tasks.Task` for the fields)."""

    shuffle: bool = True
    """Visit tasks in a seeded random order each epoch."""


@dataclass(kw_only=True)
class HealthConfig:
    """When the run stops because its executions give nothing to train on (crashed, could not
    launch, evaluator failed, or no model call; see `gyre.executions.health`)."""

    window: int = 0
    """How many of the latest evaluated executions are judged together; 0 = one step's worth
    (scheduler.n_per_group × scheduler.batch_groups)."""

    stop_fraction: float = 1.0
    """Stop the run with an error when at least this fraction of the window failed. 1.0 = only when
    every one did; above 1 never stops."""

    evaluator_window: int = 3
    """Stop the run with an error when an evaluator's first this many evaluations all failed (it
    never gave a reward: it cannot start where it runs, or it breaks on every workspace), even
    while other tasks' evaluators score. A workspace refused for a link is the harness's doing and
    does not count. 0 = never stop for this."""


@dataclass(kw_only=True)
class ExecutionsConfig:
    """Everything about executions: runner, evaluator, dataset, health check."""

    runner: RunnerConfig = field(default_factory=RunnerConfig)
    evaluator: EvaluatorConfig = field(default_factory=EvaluatorConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    plane: Literal["process", "rank0"] = "process"
    """Where the proxy, the harness runner and the harnesses live. process: in a process of their
    own beside the ranks (`gyre.runtime.execution_plane`), which a restarted job re-attaches: a
    rank's death under torchrun --max-restarts costs no execution (docs/cluster.md). rank0: in rank
    0's process (they die with it: a restart runs the groups in flight again)."""
    plane_orphan_s: float = 600.0
    """--executions.plane process: seconds the plane waits for a controller to come back before it
    stops its harnesses and exits (also at once when torchrun's agent that started it is gone)."""
