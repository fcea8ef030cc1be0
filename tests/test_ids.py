"""One id rule (gyre/ids.py) at every entry point: the task file loader, the proxy's key registry,
the TITO store and the execution spec accept exactly the same ids, judged here against a
character-by-character reading of the rule (not the module's regex)."""

from __future__ import annotations

import json
import string

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gyre.executions.tasks import Dataset, EvaluatorSpec, ExecutionSpec, Task
from gyre.proxy.keys import KeyRegistry
from gyre.trajectory.store import TitoStore, TitoWriter

ALNUM = string.ascii_letters + string.digits
EXEC_MAX, TASK_MAX = 200, 128


def follows_rule(s: str, limit: int) -> bool:
    return 1 <= len(s) <= limit and s[0] in ALNUM and all(c in ALNUM + "._-" for c in s)


def accepts(fn, s) -> bool:
    try:
        fn(s)
    except ValueError:
        return False
    return True


ids = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=ALNUM + "._-/ \n\t~é٣", max_size=24),
    st.text(alphabet=ALNUM + "._-", min_size=120, max_size=210),
    st.builds(lambda a, b: a + b, st.text(alphabet=ALNUM, min_size=1, max_size=3), st.sampled_from(["\n", "/x", "", " "])),
)
settings_ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@settings_
@example("ex-1")
@example("x\n")
@example("-x")
@example(".")
@example("..")
@example("a" * 200)
@example("a" * 201)
@example("٣")
@example("a/b")
@given(ids)
def test_proxy_store_and_spec_accept_the_same_execution_ids(tmp_path, s):
    store = TitoStore(tmp_path)
    task = Task(task_id="t", instruction="x", evaluator=EvaluatorSpec("python", "m:f"))
    want = follows_rule(s, EXEC_MAX)
    assert accepts(KeyRegistry().issue, s) == want
    assert accepts(store.path_for, s) == want
    assert accepts(lambda e: TitoWriter(tmp_path / "w.tito", e), s) == want
    assert accepts(lambda e: ExecutionSpec(e, task, "g"), s) == want


@settings_
@example("t1")
@example("t\n")
@example("a" * 128)
@example("a" * 129)
@example("../escape")
@given(ids)
def test_task_loader_keeps_room_for_the_execution_id_suffix(tmp_path, s):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"task_id": s, "instruction": "x", "evaluator": {"python": "m:f"}}) + "\n")
    try:
        (task,) = Dataset.from_jsonl(path).tasks
    except ValueError as e:
        assert "task_id" in str(e)
        assert not follows_rule(s, TASK_MAX)
        return
    assert follows_rule(s, TASK_MAX)
    # The longest execution id a run makes from it (attempt, group counter, member: controller and
    # iter_groups) is one the proxy and the store take.
    longest = f"{task.task_id}.a9999.g{10**15}.{99999}"
    assert len(longest) <= EXEC_MAX
    KeyRegistry().issue(longest)
    TitoStore(tmp_path).path_for(longest)
    (g,) = Dataset([task]).iter_groups(2, epochs=1)
    for spec in g.executions:
        KeyRegistry().issue(spec.execution_id)
