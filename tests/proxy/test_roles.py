"""Role classification (gyre/proxy/roles.py, docs/design.md §4): which rule wins, case by case,
and the order of the rules as an invariant over random calls."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.proxy.config import RoleRulesConfig
from gyre.proxy.roles import RoleClassifier, parse_role
from gyre.trajectory.record import Role

RULES = RoleRulesConfig(summary_markers=("summarize",), sub_agent_markers=("[sub]",), system_prompt_prefix_chars=8)


class _Execution:
    """One execution's main system prompt, threaded through `classify` call by call as the proxy does."""

    main_system = None

    def role(self, c: RoleClassifier, system, user, header=None, hint=None, *rest, **kw) -> Role:
        role, self.main_system = c.classify(system, user, header, hint, self.main_system, *rest, **kw)
        return role


def _state() -> _Execution:
    return _Execution()


def test_an_execution_told_apart_by_its_system_prompt_and_markers():
    c, s = RoleClassifier(RULES), _state()
    assert s.role(c, "You are the main agent", "fix the bug", None, None) is Role.MAIN
    assert s.main_system == "You are "  # the first 8 characters fix the main system prompt
    assert s.role(c, "You are the main agent (turn 2)", "go on", None, None) is Role.MAIN  # same prefix
    assert s.role(c, "You are the main agent", "Please SUMMARIZE so far", None, None) is Role.MAIN_SUMMARY
    assert s.role(c, "A helper for search", "find x", None, None) is Role.SUB
    assert s.role(c, "A helper for search", "summarize your findings", None, None) is Role.SUB_SUMMARY
    assert s.role(c, "You are the main agent", "[SUB] look this up", None, None) is Role.SUB  # marker


def test_exact_matching_compares_the_whole_system_prompt():
    c, s = RoleClassifier(RoleRulesConfig(system_prompt_match="exact")), _state()
    assert s.role(c, "You are the main agent", "hi", None, None) is Role.MAIN
    assert s.role(c, "You are the main agent, v2", "hi", None, None) is Role.SUB


def test_a_summary_before_any_main_call_does_not_fix_the_main_system_prompt():
    c, s = RoleClassifier(RULES), _state()
    assert s.role(c, "Compactor", "summarize", None, None) is Role.MAIN_SUMMARY
    assert s.main_system is None
    assert s.role(c, "Main prompt", "go", None, None) is Role.MAIN and s.main_system == "Main pro"


def test_header_then_key_hint_then_rules():
    c, s = RoleClassifier(RULES), _state()
    key = Role.SUB  # the role hint the key was issued with
    assert s.role(c, "x", "summarize", "main", key) is Role.MAIN  # the header wins over everything
    assert s.role(c, "x", "hello", None, key) is Role.SUB  # then the key's hint
    no_hint = RoleClassifier(RoleRulesConfig(use_key_hint=False, summary_markers=("summarize",)))
    assert _state().role(no_hint, "x", "hello", None, key) is Role.MAIN  # hint ignored when configured so
    with pytest.raises(ValueError, match="unknown role"):
        s.role(c, "x", "hello", "boss", None)


@pytest.mark.parametrize("name,role", [("main", Role.MAIN), (" Sub_Agent ", Role.SUB), ("summary", Role.MAIN_SUMMARY),
                                       ("sub_summary", Role.SUB_SUMMARY), ("Helper", Role.HELPER)])
def test_parse_role_accepts_the_documented_names(name, role):
    assert parse_role(name) is role


words = st.sampled_from(["go", "summarize", "[sub]", "fix", "SUMMARIZE now", "x"])
systems = st.sampled_from(["System A: main", "System A: other", "System B", ""])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(systems, words), min_size=1, max_size=12))
def test_rule_order_invariant(calls):
    """With no header and no hint, a call is a summary iff its last user turn has a summary marker,
    and a sub-agent call iff it has a sub-agent marker or a main system prompt was fixed and this
    one differs from it in its first 8 characters; only a non-empty system prompt is fixed."""
    c, s = RoleClassifier(RULES), _state()
    for system, user in calls:
        before = s.main_system
        role = s.role(c, system, user, None, None)
        summary = "summarize" in user.lower()
        sub = "[sub]" in user.lower() or (before is not None and system[:8] != before)
        assert role is {(False, False): Role.MAIN, (False, True): Role.MAIN_SUMMARY,
                        (True, False): Role.SUB, (True, True): Role.SUB_SUMMARY}[(sub, summary)]
        fixes = before is None and role is Role.MAIN and system[:8].strip() != ""
        assert s.main_system == (system[:8] if fixes else before)


CC_MAIN = "You are Claude Code, Anthropic's official CLI for Claude.\nYou are an interactive CLI tool that helps users with software engineering tasks."
CC_TOPIC = ("You are Claude Code, Anthropic's official CLI for Claude.\nAnalyze if this message indicates a new conversation topic. "
            "If it does, extract a 2-3 word title that captures the new topic.")
CC_PREFIX_SYS = "Your task is to process Bash commands that an AI coding agent wants to run.\n\nThis policy spec defines how to determine the prefix"
CC_PREFIX_USER = "<policy_spec>\n# Claude Code Code Bash command prefix detection\n\nThis document defines risk levels...\nCommand: git status"


def test_claude_code_helper_calls_are_helpers_and_never_fix_the_main_system_prompt():
    """Defaults: Claude Code's topic/title detection, bash-prefix check and quota probe are HELPER
    calls, whatever comes first; the main agent and its sub-agents are classified as before."""
    c, s = RoleClassifier(RoleRulesConfig()), _state()
    assert s.role(c, CC_TOPIC, "fix the failing test in foo.py", None, None) is Role.HELPER  # often the first call
    assert s.role(c, "", "quota", None, None, max_tokens=1) is Role.HELPER  # the start-up probe
    assert s.main_system is None
    assert s.role(c, CC_MAIN, "fix the failing test in foo.py", None, None) is Role.MAIN
    assert s.role(c, CC_PREFIX_SYS, CC_PREFIX_USER, None, None) is Role.HELPER
    assert s.role(c, "", "Please write a 5-10 word title for the following conversation:\n...", None, None) is Role.HELPER
    assert s.role(c, CC_MAIN, "go on", None, None, max_tokens=4096) is Role.MAIN
    assert s.role(c, "You are a search sub-agent", "find x", None, None) is Role.SUB
    key = Role.SUB  # the role hint the key was issued with
    assert s.role(c, CC_TOPIC, "x", None, key) is Role.HELPER  # a helper rule beats the key's hint
    assert s.role(c, CC_TOPIC, "x", "main", key) is Role.MAIN  # the header beats everything


def test_helper_rules_are_configurable_and_can_be_turned_off():
    rules = RoleRulesConfig(helper_system_markers=("generate a title for",), helper_user_markers=("[bg]",), helper_max_tokens=0)
    c, s = RoleClassifier(rules), _state()
    assert s.role(c, "Main agent", "hi", None, None, max_tokens=1) is Role.MAIN  # max-tokens rule off
    assert s.role(c, "Codex-like: Generate a TITLE for this thread", "hi", None, None) is Role.HELPER
    assert s.role(c, "Main agent", "[BG] check something", None, None) is Role.HELPER
    assert s.role(c, CC_TOPIC, "hi", None, None) is Role.SUB  # the defaults were replaced


def test_an_empty_first_system_prompt_fixes_nothing():
    """Issue 34 item 7: a first call without instructions must not make "" the main system
    prompt (the harness's real calls would all become SUB)."""
    c, s = RoleClassifier(RULES), _state()
    assert s.role(c, "", "hello", None, None) is Role.MAIN
    assert s.main_system is None
    assert s.role(c, "You are the main agent", "fix the bug", None, None) is Role.MAIN
    assert s.role(c, "You are the main agent", "go on", None, None) is Role.MAIN
    assert s.role(c, "A helper for search", "find x", None, None) is Role.SUB


def test_task_text_mentioning_a_helper_marker_leaves_the_main_call_main():
    """Issue 34 item 7: a user-turn helper marker counts only in a call without tools, near the
    start of the turn; the main agent's task that mentions one stays MAIN."""
    c, s = RoleClassifier(RoleRulesConfig()), _state()
    task = "Implement Bash command prefix detection in src/policy.py; <gyre:helper> is a literal tag there."
    assert s.role(c, CC_MAIN, task, None, None, 32000, True) is Role.MAIN  # the agent's call has tools
    late = "Fix the parser. " + "x" * 300 + " Please write a 5-10 word title for the following conversation"
    assert s.role(c, CC_MAIN, late, None, None, 32000, False) is Role.MAIN  # far from the start
    assert s.role(c, "", CC_PREFIX_USER, None, None, 512, False) is Role.HELPER  # the real helper still is


def test_classify_returns_the_role_and_the_main_system_prompt_it_leaves():
    c = RoleClassifier(RULES)
    assert c.classify("You are the main agent", "go", None, None, None) == (Role.MAIN, "You are ")
    assert c.classify("Other prompt", "go", None, None, "You are ") == (Role.SUB, "You are ")  # kept, not replaced
    assert c.classify("Other prompt", "go", None, Role.SUB_SUMMARY, None) == (Role.SUB_SUMMARY, None)  # the hint fixes nothing
    assert c.classify("Other prompt", "go", None, Role.MAIN, None) == (Role.MAIN, "Other pr")
