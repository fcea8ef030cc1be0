"""What the proxy tells a client whose prompt does not fit in the context (docs/proxy_harnesses.md).

The wording is Anthropic's own (`prompt is too long: N tokens > M maximum`, an HTTP 400
`invalid_request_error`; the OpenAI adapter sends the same text with code
`context_length_exceeded`): harnesses match that text to compact their context instead of
giving up (Claude Code 2.1.x exits on any other wording). M is the longest prompt that still
leaves room for one output token (`max_context_tokens` - 1). What follows the standard sentence
names the setting that raises the limit.
"""

from __future__ import annotations


def context_overflow_message(n: int, max_context_tokens: int, at_least: bool = False) -> str:
    """`prompt is too long: N tokens > M maximum`, then the proxy setting that raises it. With
    `at_least`, N is a lower bound (text refused before it was tokenized)."""
    bound = " (at least; counted from its characters before tokenizing)" if at_least else ""
    return (f"prompt is too long: {n} tokens > {max_context_tokens - 1} maximum{bound}. The proxy's context is "
            f"{max_context_tokens} tokens (--proxy.max-context-tokens raises it, up to what the model and engines support).")
