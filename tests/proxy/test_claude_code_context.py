"""Claude Code past a full context (issue 34, item 1), replayed with the official `anthropic` SDK
against the real proxy server: the overflow 400 is worded as Anthropic words it (Claude Code
compacts on that text and exits on any other), and its changing `x-anthropic-billing-header:`
system line neither moves the compaction and later calls out of their main roles nor breaks the
prefix they share with the calls before."""

import re

import anthropic
import pytest

from gyre.proxy import ProxyConfig
from gyre.proxy.config import RoleRulesConfig
from gyre.proxy.roles import RoleClassifier
from gyre.trajectory.record import Role

from .conftest import TOOLS_ANTHROPIC, scripted_engine

CC_SYSTEM = ("You are Claude Code, Anthropic's official CLI for Claude.\nYou are an interactive CLI tool that helps users "
             "with software engineering tasks. Use the instructions below and the tools available to you.")
SUMMARY_ASK = ("Your task is to create a detailed summary of the conversation so far, paying close attention to the "
               "user's explicit requests and your previous actions.")
# What Anthropic's API answers (the numbers vary), e.g. "prompt is too long: 219898 tokens > 200000 maximum".
ANTHROPIC_OVERFLOW = re.compile(r"^prompt is too long: (\d+) tokens > (\d+) maximum")


def _system(cch: str) -> list[dict]:
    # Claude Code 2.1.x sends its billing line as the first system block; the hash changes at compaction.
    return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.332.a1b; cc_entrypoint=sdk-cli; cch={cch};"},
            {"type": "text", "text": CC_SYSTEM}]


def _assistant(msg) -> dict:
    return {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]}


def test_claude_code_request_sequence_past_a_full_context(make_server):
    limit = 1024
    proxy, h = make_server([(scripted_engine(), "cell", 0)], config=ProxyConfig(max_context_tokens=limit))
    key = proxy.issue_key("ex-cc")
    c = anthropic.Anthropic(base_url=h.url, api_key=key, max_retries=0)
    task = {"role": "user", "content": "List the files, then tell me how many there are."}
    first = c.messages.create(model="claude-sonnet-4-5", max_tokens=200, system=_system("0a1b2"), tools=TOOLS_ANTHROPIC, messages=[task])
    assert first.stop_reason == "tool_use"
    tool_use = next(b for b in first.content if b.type == "tool_use")
    history = [task, _assistant(first)]

    # The tool result fills the context: Anthropic's 400, which Claude Code compacts on.
    big = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "file.txt\n" * 2000}]}
    with pytest.raises(anthropic.BadRequestError) as err:
        c.messages.create(model="claude-sonnet-4-5", max_tokens=200, system=_system("0a1b2"), tools=TOOLS_ANTHROPIC, messages=history + [big])
    assert err.value.status_code == 400
    body = err.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    m = ANTHROPIC_OVERFLOW.match(body["error"]["message"])
    assert m is not None, body["error"]["message"]
    assert int(m.group(1)) > int(m.group(2)) == limit - 1
    assert "--proxy.max-context-tokens" in body["error"]["message"]  # names the setting that raises it

    # Compaction: the history (the oversized result cut short) + the summary request, new billing hash.
    small = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "file.txt (2000 lines)"}]}
    summary = c.messages.create(model="claude-sonnet-4-5", max_tokens=200, system=_system("9f8e7"), tools=TOOLS_ANTHROPIC,
                                messages=history + [small, {"role": "assistant", "content": "Noted."}, {"role": "user", "content": SUMMARY_ASK}])
    # Then the agent goes on from the summary, with yet another hash.
    cont = [{"role": "user", "content": "This session is being continued from a previous conversation. Summary: " + summary.content[0].text[:200]}]
    c.messages.create(model="claude-sonnet-4-5", max_tokens=200, system=_system("77c1d"), tools=TOOLS_ANTHROPIC, messages=cont)

    recs = proxy.sink.for_execution("ex-cc")
    assert [r.role for r in recs] == [Role.MAIN, Role.MAIN_SUMMARY, Role.MAIN]  # the refused call records nothing
    # The compaction call shares the first call's prompt and its sampled turn, token for token.
    shared = list(recs[0].input_ids) + list(recs[0].output_ids)
    assert list(recs[1].input_ids[: len(shared)]) == shared
    assert recs[1].payload_ref["spliced_turns"] == 1
    # ... and the continued call starts with the same system prompt as the first.
    n_sys = recs[0].message_starts[1]
    assert list(recs[2].input_ids[:n_sys]) == list(recs[0].input_ids[:n_sys])


def test_volatile_system_lines_are_ignored_when_roles_are_decided():
    c = RoleClassifier(RoleRulesConfig())

    main = None

    def role(system, user, *rest):
        nonlocal main
        r, main = c.classify(system, user, None, None, main, *rest)
        return r

    hdr = "x-anthropic-billing-header: cc_version=2.1.332; cch={};\n"
    assert role(hdr.format("aaaaa") + CC_SYSTEM, "fix it", 2000, True) is Role.MAIN
    assert role(hdr.format("bbbbb") + CC_SYSTEM, "go on", 2000, True) is Role.MAIN
    assert role(hdr.format("ccccc") + CC_SYSTEM, SUMMARY_ASK, 2000, True) is Role.MAIN_SUMMARY
    assert role(hdr.format("ddddd") + "You are a search sub-agent.", "find x", 2000, True) is Role.SUB
