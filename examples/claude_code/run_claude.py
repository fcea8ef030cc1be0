"""Run unmodified Claude Code (`claude -p`) as a Gyre harness. It needs the `claude` CLI (npm
@anthropic-ai/claude-code, or GYRE_CLAUDE_BIN); see README.md for what runs today.

The runner starts this script in the execution's workspace with ANTHROPIC_BASE_URL (the proxy),
ANTHROPIC_API_KEY (the execution's key, sent as X-Api-Key), GYRE_MODEL and
GYRE_INSTRUCTION_FILE set; it writes the per-execution settings, maps the model name onto
every alias Claude Code may use, and replaces itself with `claude` (exec) so the runner's
timeout and process-group kill reach Claude Code and every tool process it starts.
See README.md for the why of each setting.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def claude_env(model: str, *, api_timeout_ms: int, bash_timeout_ms: int, max_output_tokens: int,
               context_tokens: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # One policy serves every role: the main agent, sub-agents (Task tool), compaction summaries
    # and the "small/fast" aliases Claude Code uses for helper calls.
    for var in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"):
        env[var] = model
    env.pop("ANTHROPIC_AUTH_TOKEN", None)  # one credential only: the execution key as X-Api-Key
    env.update({
        "API_TIMEOUT_MS": str(api_timeout_ms),  # a long-context call can take minutes on a busy engine
        "BASH_DEFAULT_TIMEOUT_MS": str(bash_timeout_ms),
        "BASH_MAX_TIMEOUT_MS": str(bash_timeout_ms),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_NON_ESSENTIAL_MODEL_CALLS": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_PROMPT_CACHING": "1",
        "IS_SANDBOX": "1",  # root inside a sandbox may skip permission prompts
    })
    if context_tokens:
        # Claude Code takes a model's window from its name (200k, 1M for some): told nothing, it
        # never compacts before the proxy's smaller context is full. This is the window its
        # auto-compaction measures against; the output cap leaves the prompt room below it.
        env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(context_tokens)
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(min(max_output_tokens, max(1, context_tokens // 4)))
    return env


def main(argv: list[str] | None = None) -> int:
    # Each option also reads an environment variable: a `gyre.run` harness command cannot carry
    # `--options`, while `--executions.runner.env GYRE_CLAUDE_MAX_TURNS 100` can set them.
    env_ = os.environ.get
    p = argparse.ArgumentParser(description="run Claude Code against the Gyre proxy")
    p.add_argument("--max-turns", type=int, default=int(env_("GYRE_CLAUDE_MAX_TURNS", "500")))
    p.add_argument("--api-timeout-ms", type=int, default=int(env_("GYRE_CLAUDE_API_TIMEOUT_MS", "3600000")))
    p.add_argument("--bash-timeout-ms", type=int, default=int(env_("GYRE_CLAUDE_BASH_TIMEOUT_MS", "600000")))
    p.add_argument("--max-output-tokens", type=int, default=int(env_("GYRE_CLAUDE_MAX_OUTPUT_TOKENS", "32000")))
    # The proxy's context (the runner sets GYRE_MAX_CONTEXT_TOKENS from --proxy.max-context-tokens).
    p.add_argument("--context-tokens", type=int, default=int(env_("GYRE_MAX_CONTEXT_TOKENS", "0")) or None)
    a = p.parse_args(argv)
    claude = env_("GYRE_CLAUDE_BIN") or shutil.which("claude")  # GYRE_CLAUDE_BIN: a pinned binary
    if claude is None:
        print("run_claude: the `claude` CLI is not installed (npm install -g @anthropic-ai/claude-code, "
              "or set GYRE_CLAUDE_BIN)", file=sys.stderr)
        return 127
    model = os.environ.get("GYRE_MODEL", "gyre-policy")
    instruction = Path(os.environ["GYRE_INSTRUCTION_FILE"]).read_text()
    # Project-level settings in the workspace: permissions without prompts, no web tools.
    settings_dir = Path.cwd() / ".claude"
    settings_dir.mkdir(exist_ok=True)
    (settings_dir / "settings.json").write_text((HERE / "settings.json").read_text())
    argv_ = [claude, "-p", instruction, "--model", model, "--max-turns", str(a.max_turns),
             "--permission-mode", "bypassPermissions", "--output-format", "stream-json", "--verbose"]  # the event stream lands in stdout.log
    env = claude_env(model, api_timeout_ms=a.api_timeout_ms, bash_timeout_ms=a.bash_timeout_ms,
                     max_output_tokens=a.max_output_tokens, context_tokens=a.context_tokens)
    os.execvpe(argv_[0], argv_, env)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
