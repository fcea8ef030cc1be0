"""A proxy that first sees an execution whose records already exist (it was restarted under a
running harness) resumes it (gyre/proxy/resume.py): call ids go on after the largest recorded
one, the re-sent history splices to its sampled ids, and the stats count every recorded call."""

import numpy as np
import openai

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.proxy import Proxy, ProxyConfig, serve_proxy
from gyre.proxy.sink import FanoutSink, MemorySink, StoreSink
from gyre.trajectory.store import TitoStore, read_execution
from gyre.trajectory.tree import build_tree


def chat(url, key, history, n):
    """`n` more calls of one conversation, each re-sending the whole history (assistant turns as
    the client got them)."""
    c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    for _ in range(n):
        history.append({"role": "user", "content": f"step {len(history) // 2}"})
        r = c.chat.completions.create(model="m", messages=history, max_tokens=12)
        history.append({"role": "assistant", "content": r.choices[0].message.content})


def test_restarted_proxy_goes_on_with_call_ids_and_splices_the_history(tmp_path):
    engine = DeterministicEngine("A", salt=1, eos_prob=0.05)
    history = [{"role": "system", "content": "You are terse."}]
    lives = []
    for life, calls in enumerate((3, 2, 2)):
        sink = StoreSink(TitoStore(tmp_path))
        proxy = Proxy(ProxyConfig(), sink=sink)
        proxy.router.add_engine(engine, kind="cell", index=0)
        h = serve_proxy(proxy)
        lives.append(proxy)
        try:
            chat(h.url, proxy.issue_key("ex-r"), history, calls)
        finally:
            h.stop()
        sink.close()  # not sealed: the execution goes on
        if life == 0:  # a writer killed mid-frame leaves a torn tail
            with open(tmp_path / "ex-r.tito", "ab") as f:
                f.write(b"TIT0\x99\x00")
    stats = lives[-1].close_execution("ex-r")
    res = read_execution(tmp_path / "ex-r.tito")
    recs = res.records
    assert not res.torn  # the next writer truncated it
    assert [r.call_id for r in recs] == list(range(7))
    for k, r in enumerate(recs):
        assert (r.payload_ref["spliced_turns"], r.payload_ref["unmatched_turns"]) == (k, 0), k
        if k:  # each call's input is the one before it, input + sampled output, exactly
            prev = recs[k - 1]
            assert r.input_ids[: prev.num_tokens].tolist() == np.concatenate([prev.input_ids, prev.output_ids]).tolist()
    # the last life's close counts every recorded call, not only its own
    assert (stats.calls, stats.spliced_turns, stats.unmatched_turns, dict(stats.roles)) == (7, 21, 0, {"MAIN": 7})
    tree = build_tree(recs)
    assert tree.stats.leaves == 1 and tree.stats.unique_target_tokens == sum(len(r.output_ids) for r in recs)


def test_resume_of_an_unknown_or_memory_execution():
    from gyre.proxy.resume import resumed_state
    from gyre.trajectory.record import CallRecord, Role

    assert next(resumed_state("new", MemorySink()).call_ids) == 0
    assert next(resumed_state("new", object()).call_ids) == 0  # a sink without heads: nothing to resume
    mem = MemorySink()
    for cid in (0, 4, 2):
        mem.on_record(CallRecord("m", cid, Role.SUB, [1, 2], [3], [-0.5], 0, finish_reason="abort" if cid == 4 else "stop"))
    st = resumed_state("m", FanoutSink(MemorySink(), mem))
    assert next(st.call_ids) == 5
    assert (st.stats.calls, st.stats.aborted_calls, dict(st.stats.roles)) == (3, 1, {"SUB": 3})
    assert not st.turns  # records without a turn entry (an older proxy's) splice nothing


def test_tool_turns_splice_after_a_restart(tmp_path):
    """Anthropic tool use across a restart: the turns' tool calls (stored as the client got them,
    objects) and the tool-use ids naming their call come back, so the re-sent turns splice."""
    import anthropic

    from .conftest import TOOLS_ANTHROPIC, scripted_engine

    kw = dict(model="m", max_tokens=300, system="You are an agent.", tools=TOOLS_ANTHROPIC)
    msgs = [{"role": "user", "content": "How many files?"}]
    for life in range(3):  # one call per proxy life
        sink = StoreSink(TitoStore(tmp_path))
        proxy = Proxy(ProxyConfig(), sink=sink)
        proxy.router.add_engine(scripted_engine(), kind="cell", index=0)
        h = serve_proxy(proxy)
        try:
            a = anthropic.Anthropic(base_url=h.url, api_key=proxy.issue_key("ex-t"), max_retries=0)
            got = a.messages.create(messages=msgs, **kw)
        finally:
            h.stop()
            sink.close()
        msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in got.content]})
        uses = [b for b in got.content if b.type == "tool_use"]
        if uses:
            msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": f"out {life}"}]})
    assert got.stop_reason == "end_turn" and got.content[0].text == "All done: found 2 files."
    recs = read_execution(tmp_path / "ex-t.tito").records
    assert [r.call_id for r in recs] == [0, 1, 2]
    assert [(r.payload_ref["spliced_turns"], r.payload_ref["unmatched_turns"]) for r in recs] == [(0, 0), (1, 0), (2, 0)]
    assert [r.payload_ref["spliced_calls"] for r in recs] == [[], [0], [0, 1]]
