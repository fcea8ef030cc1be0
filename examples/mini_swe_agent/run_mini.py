"""Run the real, unmodified `mini-swe-agent` CLI (`mini`) as a Gyre harness.

The runner starts this script in the execution's workspace with OPENAI_BASE_URL (the proxy),
OPENAI_API_KEY (the execution's key), GYRE_MODEL and GYRE_INSTRUCTION_FILE in the environment;
it turns them into `mini` options and replaces itself with `mini` (exec), so the process the
runner supervises, times out and kills is mini-swe-agent itself:

    mini -y --exit-immediately -m openai/<model> -t <instruction> -o <exec dir>/mini.traj.json
         -c mini.yaml -c model.model_kwargs.api_base=<proxy>/v1
         -c model.cost_tracking=ignore_errors -c agent.step_limit=<N> -c environment.timeout=<s>

mini-swe-agent speaks OpenAI chat completions through litellm with one `bash` tool; the proxy
records every call (TITO) under the execution's key. The key stays in the environment
(OPENAI_API_KEY, which litellm reads): never on a command line, where `ps` shows it to every
user, nor in mini.traj.json, which records the config. Requires `pip install mini-swe-agent`.
Options: `--step-limit`, `--command-timeout`, `--temperature`, `--max-tokens`, or the environment
variables GYRE_MINI_STEP_LIMIT, GYRE_MINI_COMMAND_TIMEOUT, GYRE_MINI_TEMPERATURE, GYRE_MINI_MAX_TOKENS.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def mini_argv(*, step_limit: int, command_timeout: int, temperature: float, max_tokens: int) -> list[str]:
    base = os.environ["OPENAI_BASE_URL"]
    model = os.environ.get("GYRE_MODEL", "gyre-policy")
    instruction = Path(os.environ["GYRE_INSTRUCTION_FILE"]).read_text()
    traj = Path(os.environ["GYRE_INSTRUCTION_FILE"]).with_name("mini.traj.json")
    # The `mini` entry point, run with this interpreter (console-script shims such as pyenv's
    # may not resolve under the runner's filtered environment).
    return [sys.executable, "-m", "minisweagent.run.mini",
        "-y", "--exit-immediately", "-m", f"openai/{model}", "-t", instruction, "-o", str(traj),
        "-c", "mini.yaml",
        "-c", f"model.model_kwargs.api_base={base}",
        "-c", f"model.model_kwargs.temperature={temperature}",
        "-c", f"model.model_kwargs.max_tokens={max_tokens}",
        "-c", "model.cost_tracking=ignore_errors",
        "-c", f"agent.step_limit={step_limit}",
        "-c", "agent.cost_limit=0",
        "-c", f"environment.timeout={command_timeout}",
        "-c", f"environment.cwd={os.getcwd()}",
    ]


def main(argv: list[str] | None = None) -> int:
    # Each option also reads an environment variable, because a `gyre.run` harness command cannot
    # carry `--options` (a word starting with "-" ends tyro's list) while
    # `--executions.runner.env GYRE_MINI_STEP_LIMIT 3` can set them for every execution.
    env_ = os.environ.get
    p = argparse.ArgumentParser(description="run mini-swe-agent against the Gyre proxy")
    p.add_argument("--step-limit", type=int, default=int(env_("GYRE_MINI_STEP_LIMIT", "50")), help="model calls per execution")
    p.add_argument("--command-timeout", type=int, default=int(env_("GYRE_MINI_COMMAND_TIMEOUT", "60")),
                   help="seconds per bash command")
    p.add_argument("--temperature", type=float, default=float(env_("GYRE_MINI_TEMPERATURE", "1.0")))
    p.add_argument("--max-tokens", type=int, default=int(env_("GYRE_MINI_MAX_TOKENS", "1024")), help="per model call")
    a = p.parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("minisweagent") is None:
        print("run_mini: mini-swe-agent is not installed in this interpreter "
              "(pip install -e '.[mini-swe-agent]', or pip install mini-swe-agent)", file=sys.stderr)
        return 127
    env = dict(os.environ)
    # mini asks setup questions on first use unless told it is configured; litellm fetches a
    # cost map from the internet at import unless told to use its local copy.
    env.setdefault("MSWEA_CONFIGURED", "true")
    env.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
    env.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    env.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "3")
    argv_ = mini_argv(step_limit=a.step_limit, command_timeout=a.command_timeout, temperature=a.temperature, max_tokens=a.max_tokens)
    os.execvpe(argv_[0], argv_, env)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
