"""cpu_demo pieces in-process: the agent loop's branching behaviour, the scripted policy, and
the warm start's sequence merging and target masks (hand-computed cases)."""

from __future__ import annotations

import json
import random

import pytest

from gyre.backends.models.tokenizer import load_tokenizer

from examples.cpu_demo.harness import SUMMARY_PROMPT, SYSTEM_SUB, Reply
from examples.cpu_demo.policy import scripted_reply, tool_call
from examples.cpu_demo.task import WORDS, answer, evaluate, make_task
from examples.cpu_demo.warm_start import ScriptedBackend, demo_sequences, parse_output, run_episode, tokenize_with_mask


def test_answers_are_word_lengths():
    assert [answer(w) for w in ("red", "blue", "green", "orange")] == ["3", "4", "5", "6"]
    assert all(3 <= len(w) <= 6 for w in WORDS) and len(set(WORDS)) == len(WORDS)


def test_perfect_policy_episode_branches_and_scores_one(tmp_path):
    tok = load_tokenizer()
    rng = random.Random(1)
    backend = ScriptedBackend(tok, rng, correct_prob=1.0)
    task = make_task("t", rng)
    reward, agent = run_episode(backend, task, tmp_path, compact_at=600)
    assert reward == 1.0
    st = agent.stats
    assert st.sub_agents == 1 and st.compactions >= 1 and st.retries == 0 and st.tool_errors == 0
    # 4 main writes + delegate + finish, 2 helper writes + finish, and one summary per compaction
    assert st.calls == 9 + st.compactions
    prompts = [p for p, _ in backend.pairs]
    assert sum(SUMMARY_PROMPT in p.rsplit("<|im_start|>user\n", 1)[-1] for p in prompts) == st.compactions
    assert sum(SYSTEM_SUB in p for p in prompts) == 3


def test_wrong_numbers_lower_the_reward_by_the_files_they_hit(tmp_path):
    tok = load_tokenizer()
    rng = random.Random(2)
    task = make_task("t", rng)
    backend = ScriptedBackend(tok, random.Random(3), correct_prob=0.0)
    reward, _ = run_episode(backend, task, tmp_path, compact_at=10_000)
    words = task["evaluator"]["kwargs"]["words"]
    written = {w: (tmp_path / f"{w}.txt").read_text() for w in words}
    assert reward == sum(written[w] == str(len(w)) for w in words) / 6
    assert evaluate(tmp_path, None, words)["reward"] == reward


class _FlakyBackend:
    """Returns an invalid call the first time it is asked, then defers to the scripted policy."""

    def __init__(self, tok):
        self.inner = ScriptedBackend(tok, random.Random(0), 1.0)
        self.seen = []

    def complete(self, messages, tools):
        self.seen.append(json.dumps(messages))
        if len(self.seen) == 1:
            return Reply("", [{"id": "x", "name": "write_next", "arguments": '{"content": "lots"}'}], 100)
        return self.inner.complete(messages, tools)


def test_invalid_call_is_retried_with_the_same_request(tmp_path):
    backend = _FlakyBackend(load_tokenizer())
    reward, agent = run_episode(backend, make_task("t", random.Random(4)), tmp_path, compact_at=10_000)
    assert reward == 1.0 and agent.stats.retries == 1 and agent.stats.tool_errors == 0
    assert backend.seen[0] == backend.seen[1]  # the retry resent exactly the same messages


def test_scripted_policy_decisions():
    base = "<|im_start|>system\nYou are the main agent.<|im_end|>\n<|im_start|>user\n"
    asst = "<|im_end|>\n<|im_start|>assistant\n"
    assert scripted_reply(base + "next: green.txt | helper: pink teal" + asst) == tool_call("write_next", {"content": "5"})
    assert scripted_reply(base + "next: none | helper: pink teal" + asst) == tool_call("delegate", {})
    assert scripted_reply(base + "next: none | helper: done" + asst) == tool_call("finish", {})
    sub = f"<|im_start|>system\n{SYSTEM_SUB}<|im_end|>\n<|im_start|>user\n"
    assert scripted_reply(sub + "next: none" + asst) == tool_call("finish", {})
    assert scripted_reply(base + "x\nnext: red.txt | helper: done<|im_end|>\n<|im_start|>user\n" + SUMMARY_PROMPT + asst).startswith("Progress")
    # random values stay in range and hit the right one about 1/6 of the time
    rng = random.Random(0)

    def values(prob: float, wrong: str) -> list[str]:
        prompt = base + "next: green.txt | helper: done" + asst
        return [json.loads(scripted_reply(prompt, rng, prob, wrong).split("\n")[1])["arguments"]["content"] for _ in range(600)]

    vals = values(0.0, "random")
    assert set(vals) <= set("234567") and 60 < vals.count("5") < 140
    # off by one: never right, 4 and 6 about equally; with correct_prob 0.3, right about 30 %
    vals = values(0.0, "off_by_one")
    assert set(vals) == {"4", "6"} and 240 < vals.count("4") < 360
    vals = values(0.3, "off_by_one")
    assert set(vals) == {"4", "5", "6"} and 135 < vals.count("5") < 225
    with pytest.raises(ValueError):
        values(0.0, "sideways")


def test_parse_output_matches_template_rendering():
    text = tool_call("write_next", {"content": "4"}) + "<|im_end|>"
    content, calls = parse_output(text, "c")
    assert content == "" and calls == [{"id": "c-0", "name": "write_next", "arguments": '{"content": "4"}'}]
    # an unparseable call stays text (as the proxy returns it): no tool call, so the harness retries
    content, calls = parse_output("thinking <tool_call>\n{broken\n</tool_call>", "c")
    assert calls == [] and content.startswith("thinking <tool_call>")


def test_demo_sequences_merge_prefix_chains():
    pairs = [("A", "b"), ("AbC", "d"), ("AX", "y")]
    seqs = dict(demo_sequences(pairs))
    assert seqs == {"AbCd": [(1, 2), (3, 4)], "AXy": [(2, 3)]}


def test_tokenize_with_mask_marks_exactly_the_outputs():
    tok = load_tokenizer()
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello there<|im_end|>\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\nbye<|im_end|>"
    a = text.index("hello")
    b = text.index("bye")
    spans = [(a, a + len("hello there<|im_end|>")), (b, len(text))]
    ids, mask = tokenize_with_mask(tok, text, spans)
    assert tok.decode(ids) == text
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "hello there<|im_end|>bye<|im_end|>"
    assert not mask[0]


def test_preparing_the_tasks_again_never_shows_a_reader_a_partial_file(tmp_path):
    """Issue 53 item 6: every rank's preflight parses tasks.jsonl while rank 0's prepare step
    writes it. A reader holding the old file keeps reading the whole old file (the new one is
    renamed in, not written over it), and an unchanged file is not rewritten at all."""
    from examples.cpu_demo.prepare import prepare

    prepare(str(tmp_path), num_tasks=8, seed=0, with_checkpoint=False)
    path = tmp_path / "tasks.jsonl"
    old = path.read_bytes()
    with open(path, "rb") as reader:  # a rank that opened the file just before the rewrite
        reader.read(10)
        prepare(str(tmp_path), num_tasks=9, seed=1, with_checkpoint=False)
        assert old[:10] + reader.read() == old
    assert len(path.read_text().splitlines()) == 9
    before = path.stat()
    prepare(str(tmp_path), num_tasks=9, seed=1, with_checkpoint=False)
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert [p.name for p in tmp_path.iterdir()] == ["tasks.jsonl"]  # no temporary left behind
