"""Tasks and datasets: JSONL round trip, clear errors naming the field, groups of N."""

from __future__ import annotations

import json

import pytest

from gyre.executions.tasks import Dataset, EvaluatorSpec, Task


def _line(**kw):
    base = {"task_id": "t1", "instruction": "do", "evaluator": {"python": "m.n:f", "kwargs": {"a": 1}}}
    base.update(kw)
    return json.dumps(base)


def test_jsonl_roundtrip_and_relative_workspace(tmp_path):
    (tmp_path / "tpl").mkdir()
    path = tmp_path / "data.jsonl"
    path.write_text(_line(workspace="tpl", files={"x/y.txt": "hi"}) + "\n\n"
                    + _line(task_id="t2", evaluator={"command": ["python", "score.py"]}, timeout_s=5) + "\n")
    ds = Dataset.from_jsonl(path)
    assert len(ds) == 2
    assert ds[0].workspace == str((tmp_path / "tpl").resolve())
    assert ds[0].evaluator.kind == "python" and ds[0].evaluator.kwargs == {"a": 1}
    assert ds[1].evaluator.target == ["python", "score.py"] and ds[1].timeout_s == 5
    out = tmp_path / "out.jsonl"
    ds.to_jsonl(out)
    again = Dataset.from_jsonl(out)
    assert [t.to_json() for t in again.tasks] == [t.to_json() for t in ds.tasks]


@pytest.mark.parametrize("line, match", [
    ('{"task_id": "a", "instruction": "x"}', "missing field 'evaluator'"),
    (_line(evaluator={"python": "nocolon"}), "module:function"),
    (_line(evaluator={"python": "a:b", "command": ["x"]}), "exactly one"),
    (_line(evaluator={"command": "a string"}), "list of strings"),
    (_line(task_id="../escape"), "task_id"),
    (_line(files={"../x": "y"}), "relative path"),
    (_line(harness=[]), "harness"),
    (_line(timeout_s=0), "timeout_s"),
    (_line(colour="blue"), "unknown fields"),
    ("{not json", "invalid JSON"),
])
def test_bad_lines_name_the_problem(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=match) as e:
        Dataset.from_jsonl(path)
    assert "bad.jsonl:1" in str(e.value)


def test_duplicate_ids_rejected():
    t = Task(task_id="a", instruction="x", evaluator=EvaluatorSpec("python", "m:f"))
    with pytest.raises(ValueError, match="duplicate task_id"):
        Dataset([t, t])


def test_groups_are_unique_and_cover_tasks_each_epoch():
    tasks = [Task(task_id=f"t{i}", instruction="x", evaluator=EvaluatorSpec("python", "m:f")) for i in range(5)]
    ds = Dataset(tasks)
    groups = list(ds.iter_groups(4, seed=3, epochs=3))
    assert len(groups) == 15
    for e in range(3):
        assert sorted(g.task.task_id for g in groups[5 * e:5 * e + 5]) == [f"t{i}" for i in range(5)]
    ids = [x.execution_id for g in groups for x in g.executions]
    assert len(ids) == len(set(ids)) == 60
    assert all(len(g.executions) == 4 and [x.index for x in g.executions] == [0, 1, 2, 3] for g in groups)
    assert all(x.group_id == g.group_id and x.task is g.task for g in groups for x in g.executions)
    # seeded: same order again; unshuffled: dataset order
    assert [g.task.task_id for g in ds.iter_groups(4, seed=3, epochs=3)] == [g.task.task_id for g in groups]
    assert [g.task.task_id for g in ds.iter_groups(1, shuffle=False, epochs=1)] == [f"t{i}" for i in range(5)]
    with pytest.raises(ValueError, match="group_size"):
        next(ds.iter_groups(0))
