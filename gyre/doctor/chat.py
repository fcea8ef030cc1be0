"""The doctor's lines for the run's tokenizer and chat template: `vocabulary`, `chat format` and
`tools`, from the functions gyre.run's preflight refuses a run with (gyre.config_checks:
`check_vocab_rows`, `check_chat_format`), so the doctor fails exactly the runs gyre.run refuses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gyre.doctor.table import FAIL, OK, WARN, Line, skipped

if TYPE_CHECKING:
    from gyre.backends.config import ModelConfig
    from gyre.config import TrainConfig
    from gyre.proxy.config import ProxyConfig

NAMES = ("vocabulary", "chat format", "tools")


def chat_lines(model: ModelConfig, proxy: ProxyConfig, train: TrainConfig) -> list[Line]:
    from gyre.config_checks import check_chat_format, check_vocab_rows, prepared_later
    from gyre.errors import ConfigError

    if prepared_later(model.checkpoint, train):
        why = f"{model.checkpoint} is written by --train.prepare {train.prepare} (the job checks it then)"
        return [skipped(n, why) for n in NAMES]
    try:
        vocab, rows = check_vocab_rows(model, proxy)
    except ConfigError as e:
        fix = ("give the checkpoint its own tokenizer (tokenizer.json beside config.json), or --proxy.tokenizer-path "
               "to the one it was trained with")
        return [Line("vocabulary", FAIL, str(e), fix)] + [skipped(n, "no tokenizer to read") for n in NAMES[1:]]
    where = vocab.path or "gyre/assets/tokenizer"
    vocab_line = Line("vocabulary", OK, f"{vocab.size} token ids ({where})"
                      + (f" <= {rows} embedding rows" if rows is not None else ""))
    try:
        setup = check_chat_format(proxy, vocab.tokenizer)
    except ConfigError as e:
        return [vocab_line, Line("chat format", FAIL, str(e), "name the checkpoint's format with --proxy.chat-format "
                                 "(python -m gyre.doctor --help lists the flags; docs/proxy_harnesses.md the formats)"),
                skipped("tools", "no chat format")]
    fmt = setup.format
    how = "--proxy.chat-format" if proxy.chat_format not in ("", "auto") else "the template's"
    fmt_line = Line("chat format", OK, f"{fmt.name} ({how}): {fmt.description}")
    t = setup.tools
    if t.mode == "refuse" and proxy.tool_format == "auto":
        tools_line = Line("tools", WARN, f"requests with tools will get a 400: {t.why}",
                          "--proxy.tool-format hermes, if the harness sends tools")
    elif t.mode == "refuse":
        tools_line = Line("tools", OK, f"requests with tools will get a 400 ({t.why})")
    else:
        tools_line = Line("tools", OK, t.describe() if t.mode == "hermes" else f"{t.describe()}; {fmt.tool_syntax} tool calls parsed")
    return [vocab_line, fmt_line, tools_line]
