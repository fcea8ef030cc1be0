"""Run unmodified Claude Code (`claude -p`) as a Gyre harness. It needs the `claude` CLI (`pip
install claude-agent-sdk` bundles it; or GYRE_CLAUDE_BIN); see README.md for what runs today.

The runner starts this script in the execution's workspace with ANTHROPIC_BASE_URL (the proxy),
ANTHROPIC_API_KEY (the execution's key, sent as X-Api-Key), GYRE_MODEL and
GYRE_INSTRUCTION_FILE set; it writes the per-execution settings, maps the model name onto
every alias Claude Code may use, and replaces itself with `claude` (exec) so the runner's
timeout and process-group kill reach Claude Code and every tool process it starts.
See README.md for the why of each setting.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


# Claude Code (2.1.3xx) compacts once its count of the prompt reaches
#   window - min(CLAUDE_CODE_MAX_OUTPUT_TOKENS, 20000) - COMPACT_RESERVE
# and the compaction request is that prompt plus the last turn plus a ~6.5k-character
# instruction, so the reserve is what one turn (a tool output) and the instruction may use.
COMPACT_RESERVE = 13000
# One tool output must fit in that reserve with the instruction (~3k tokens) beside it, in the
# policy's tokens (as few as ~2 characters each): Bash output is cut to this many characters,
# and a Read of a file longer than this many tokens is refused (Claude Code says to read a part).
TOOL_OUTPUT_CHARS = 20000
FILE_READ_TOKENS = 8000
# The coding tools, the Agent tool (sub-agents) included. Left to its default set, 2.1.337 adds
# scheduling, workflow and skill tools whose schemas double the first prompt (23k tokens of the
# project's tokenizer instead of 12.7k), which leaves a 32k context no room to work in.
DEFAULT_TOOLS = "Bash,Read,Edit,Write,Glob,Grep,Agent,TodoWrite"


def output_cap(max_output_tokens: int, context_tokens: int | None) -> int:
    """The per-call output cap: what was asked, at most a sixteenth of the proxy's context. Every
    token reserved for output moves Claude Code's compaction point down by one (see above): a
    32,768 context compacts at 17,720 with 2,048, and at 11,576 with a quarter (8,192), below the
    first prompt, so every turn would compact."""
    return min(max_output_tokens, max(1, context_tokens // 16)) if context_tokens else max_output_tokens


def claude_env(model: str, *, api_timeout_ms: int, bash_timeout_ms: int, max_output_tokens: int,
               context_tokens: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # One policy serves every role: the main agent, sub-agents (Agent tool), compaction summaries
    # and the "small/fast" aliases Claude Code uses for helper calls.
    for var in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"):
        env[var] = model
    env.pop("ANTHROPIC_AUTH_TOKEN", None)  # one credential only: the execution key as X-Api-Key
    # CLAUDE_CODE_AUTO_COMPACT_WINDOW is read as at least 100,000 tokens, so below that it cannot
    # bring compaction forward; CLAUDE_CODE_MAX_CONTEXT_TOKENS (below) can.
    env.pop("CLAUDE_CODE_AUTO_COMPACT_WINDOW", None)
    env.update({
        "API_TIMEOUT_MS": str(api_timeout_ms),  # a long-context call can take minutes on a busy engine
        "BASH_DEFAULT_TIMEOUT_MS": str(bash_timeout_ms),
        "BASH_MAX_TIMEOUT_MS": str(bash_timeout_ms),
        "BASH_MAX_OUTPUT_LENGTH": str(TOOL_OUTPUT_CHARS),
        "CLAUDE_CODE_FILE_READ_MAX_OUTPUT_TOKENS": str(FILE_READ_TOKENS),
        "MAX_MCP_OUTPUT_TOKENS": str(FILE_READ_TOKENS),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(output_cap(max_output_tokens, context_tokens)),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_NON_ESSENTIAL_MODEL_CALLS": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_PROMPT_CACHING": "1",
        "IS_SANDBOX": "1",  # root inside a sandbox may skip permission prompts
    })
    if context_tokens:
        # The policy's name is unknown to Claude Code, which then assumes a 1M window and never
        # compacts before the proxy refuses; this is the window it takes for such a model.
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(context_tokens)
    return env


def find_claude() -> str | None:
    """GYRE_CLAUDE_BIN (a pinned binary), else `claude` on PATH, else the CLI bundled in the
    `claude-agent-sdk` wheel (pip install claude-agent-sdk: `claude_agent_sdk/_bundled/claude`,
    found without importing the package)."""
    if os.environ.get("GYRE_CLAUDE_BIN"):
        return os.environ["GYRE_CLAUDE_BIN"]
    if found := shutil.which("claude"):
        return found
    spec = importlib.util.find_spec("claude_agent_sdk")
    for d in (spec.submodule_search_locations or []) if spec else []:
        if os.access(bundled := os.path.join(d, "_bundled", "claude"), os.X_OK):
            return bundled
    return None


def main(argv: list[str] | None = None) -> int:
    # Each option also reads an environment variable: a `gyre.run` harness command cannot carry
    # `--options`, while `--executions.runner.env GYRE_CLAUDE_MAX_TURNS 100` can set them.
    env_ = os.environ.get
    p = argparse.ArgumentParser(description="run Claude Code against the Gyre proxy")
    p.add_argument("--max-turns", type=int, default=int(env_("GYRE_CLAUDE_MAX_TURNS", "500")))
    p.add_argument("--api-timeout-ms", type=int, default=int(env_("GYRE_CLAUDE_API_TIMEOUT_MS", "3600000")))
    p.add_argument("--bash-timeout-ms", type=int, default=int(env_("GYRE_CLAUDE_BASH_TIMEOUT_MS", "600000")))
    p.add_argument("--max-output-tokens", type=int, default=int(env_("GYRE_CLAUDE_MAX_OUTPUT_TOKENS", "32000")))
    # Claude Code's built-in tools offered to the policy ("default": the CLI's own set).
    p.add_argument("--tools", default=env_("GYRE_CLAUDE_TOOLS", DEFAULT_TOOLS))
    # The proxy's context (the runner sets GYRE_MAX_CONTEXT_TOKENS from --proxy.max-context-tokens).
    p.add_argument("--context-tokens", type=int, default=int(env_("GYRE_MAX_CONTEXT_TOKENS", "0")) or None)
    a = p.parse_args(argv)
    claude = find_claude()
    if claude is None:
        print("run_claude: the `claude` CLI is not installed (pip install claude-agent-sdk, which bundles it; "
              "or set GYRE_CLAUDE_BIN to a pinned binary)", file=sys.stderr)
        return 127
    model = os.environ.get("GYRE_MODEL", "gyre-policy")
    instruction = Path(os.environ["GYRE_INSTRUCTION_FILE"]).read_text()
    # Project-level settings in the workspace: permissions without prompts, no web tools.
    settings_dir = Path.cwd() / ".claude"
    settings_dir.mkdir(exist_ok=True)
    (settings_dir / "settings.json").write_text((HERE / "settings.json").read_text())
    argv_ = [claude, "-p", instruction, "--model", model, "--max-turns", str(a.max_turns),
             "--permission-mode", "bypassPermissions", "--output-format", "stream-json", "--verbose"]  # the event stream lands in stdout.log
    if a.tools != "default":
        argv_ += ["--tools", a.tools]
    env = claude_env(model, api_timeout_ms=a.api_timeout_ms, bash_timeout_ms=a.bash_timeout_ms,
                     max_output_tokens=a.max_output_tokens, context_tokens=a.context_tokens)
    os.execvpe(argv_[0], argv_, env)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
