"""Tasks, datasets and groups (docs/design.md §2, §5).

A task is a workspace template + an instruction + an evaluator. A dataset is a JSONL file, one
task per line:

    {"task_id": "fill-07",
     "instruction": "Write the value of each key into its file ...",
     "workspace": "templates/fill",              # directory copied into each workspace
     "files": {"NOTES.md": "inline files, written after the template is copied"},
     "evaluator": {"python": "examples.cpu_demo.task:evaluate", "kwargs": {"answers": {...}}},
     "harness": ["{python}", "-m", "examples.cpu_demo.harness"],   # optional override
     "timeout_s": 600,                               # optional override
     "metadata": {...}}

Relative `workspace` paths are resolved against the JSONL file's directory. The evaluator is
either `{"python": "module:function", "kwargs": {...}}` (called as
`function(workspace: pathlib.Path, task: Task, **kwargs)`) or `{"command": [argv...]}` (run in
the workspace; its last stdout line is the reward, a float or `{"reward": x}` JSON).

A group is N executions of one task (one query). `iter_groups` walks the dataset in a seeded
order and hands out groups with unique, filesystem-safe execution ids.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from gyre.ids import TASK_SUFFIX_ROOM, check_id

logger = logging.getLogger(__name__)


@dataclass
class EvaluatorSpec:
    """Which evaluator scores a task.

    kind = "python": `target` is "module:function" (run in a child Python process, so a hang
    can be killed) or a callable (run in a thread of this process; a hang there can only be
    abandoned, not killed — use it for cheap, trusted evaluators and tests).
    kind = "command": `target` is an argv list run inside the workspace.
    """

    kind: str
    target: Any
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind == "python":
            if isinstance(self.target, str):
                module, _, func = self.target.partition(":")
                if not module or not func:
                    raise ValueError(f"evaluator.python must look like 'package.module:function', got {self.target!r}")
            elif not callable(self.target):
                raise ValueError(f"evaluator.python must be 'module:function' or a callable, got {type(self.target).__name__}")
        elif self.kind == "command":
            if isinstance(self.target, str) or not self.target or not all(isinstance(a, str) for a in self.target):
                raise ValueError(f"evaluator.command must be a non-empty list of strings, got {self.target!r}")
        else:
            raise ValueError(f"evaluator kind must be 'python' or 'command', got {self.kind!r}")
        if not isinstance(self.kwargs, dict):
            raise ValueError(f"evaluator.kwargs must be an object, got {type(self.kwargs).__name__}")

    @classmethod
    def from_json(cls, obj: Any, where: str = "evaluator") -> "EvaluatorSpec":
        if not isinstance(obj, dict):
            raise ValueError(f"{where} must be an object with 'python' or 'command', got {obj!r}")
        keys = {"python", "command"} & obj.keys()
        if len(keys) != 1:
            raise ValueError(f"{where} needs exactly one of 'python' or 'command', got keys {sorted(obj)}")
        unknown = set(obj) - {"python", "command", "kwargs"}
        if unknown:
            raise ValueError(f"{where} has unknown keys {sorted(unknown)}")
        kind = keys.pop()
        return cls(kind=kind, target=obj[kind], kwargs=obj.get("kwargs", {}))

    def to_json(self) -> dict[str, Any]:
        if callable(self.target):
            raise ValueError("an in-process callable evaluator cannot be serialized")
        return {self.kind: self.target, "kwargs": self.kwargs}


@dataclass
class Task:
    """One query: where its workspace comes from, what the harness is told, how it is scored."""

    task_id: str
    instruction: str
    evaluator: EvaluatorSpec
    workspace: str | None = None
    files: dict[str, str] = field(default_factory=dict)
    harness: list[str] | None = None
    timeout_s: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_id(self.task_id, "task_id", room=TASK_SUFFIX_ROOM)
        if not isinstance(self.instruction, str):
            raise ValueError(f"task {self.task_id}: instruction must be a string")
        for rel in self.files:
            p = Path(rel)
            if p.is_absolute() or ".." in p.parts:
                raise ValueError(f"task {self.task_id}: files key {rel!r} must be a relative path inside the workspace")
        if self.harness is not None and (not self.harness or not all(isinstance(a, str) for a in self.harness)):
            raise ValueError(f"task {self.task_id}: harness must be a non-empty list of strings")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"task {self.task_id}: timeout_s must be > 0, got {self.timeout_s}")

    @classmethod
    def from_json(cls, obj: dict[str, Any], base_dir: Path | None = None, where: str = "task") -> "Task":
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        known = {"task_id", "instruction", "evaluator", "workspace", "files", "harness", "timeout_s", "metadata"}
        unknown = set(obj) - known
        if unknown:
            raise ValueError(f"{where}: unknown fields {sorted(unknown)} (known: {sorted(known)})")
        for req in ("task_id", "instruction", "evaluator"):
            if req not in obj:
                raise ValueError(f"{where}: missing field {req!r}")
        workspace = obj.get("workspace")
        if workspace is not None and base_dir is not None and not Path(workspace).is_absolute():
            workspace = str((base_dir / workspace).resolve())
        return cls(
            task_id=obj["task_id"],
            instruction=obj["instruction"],
            evaluator=EvaluatorSpec.from_json(obj["evaluator"], where=f"{where}.evaluator"),
            workspace=workspace,
            files=dict(obj.get("files", {})),
            harness=obj.get("harness"),
            timeout_s=obj.get("timeout_s"),
            metadata=dict(obj.get("metadata", {})),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"task_id": self.task_id, "instruction": self.instruction, "evaluator": self.evaluator.to_json()}
        if self.workspace is not None:
            out["workspace"] = self.workspace
        if self.files:
            out["files"] = self.files
        if self.harness is not None:
            out["harness"] = self.harness
        if self.timeout_s is not None:
            out["timeout_s"] = self.timeout_s
        if self.metadata:
            out["metadata"] = self.metadata
        return out


@dataclass
class ExecutionSpec:
    """One execution to run: a task, its group, its index within the group."""

    execution_id: str
    task: Task
    group_id: str
    index: int = 0
    # Latest published policy version when dispatched (v_d in docs/design.md §2); set by the dispatcher.
    dispatch_version: int = 0

    def __post_init__(self) -> None:
        check_id(self.execution_id, "execution_id")


@dataclass
class Group:
    """N executions of one task (one query)."""

    group_id: str
    task: Task
    executions: list[ExecutionSpec]


class Dataset:
    """An ordered list of tasks with unique ids."""

    def __init__(self, tasks: list[Task]) -> None:
        if not tasks:
            raise ValueError("a dataset needs at least one task")
        seen: set[str] = set()
        for t in tasks:
            if t.task_id in seen:
                raise ValueError(f"duplicate task_id {t.task_id!r}")
            seen.add(t.task_id)
        self.tasks = list(tasks)

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, i: int) -> Task:
        return self.tasks[i]

    @classmethod
    def from_jsonl(cls, path: str | Path) -> "Dataset":
        path = Path(path)
        tasks = []
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: invalid JSON: {e}") from None
                try:
                    tasks.append(Task.from_json(obj, base_dir=path.parent, where=where))
                except ValueError as e:
                    msg = str(e)
                    raise ValueError(msg if msg.startswith(where) else f"{where}: {msg}") from None
        logger.info("loaded %d tasks from %s", len(tasks), path)
        return cls(tasks)

    def to_jsonl(self, path: str | Path) -> None:
        with Path(path).open("w") as f:
            for t in self.tasks:
                f.write(json.dumps(t.to_json()) + "\n")

    def iter_groups(self, group_size: int, *, shuffle: bool = True, seed: int = 0, epochs: int | None = None,
                    make_id: Callable[[Task, int], str] | None = None) -> Iterator[Group]:
        """Yield groups of `group_size` executions, walking the tasks epoch after epoch
        (a fresh seeded permutation each epoch when `shuffle`). `epochs=None` never ends.
        Group ids are `<task_id>.g<k>` with k counting groups over the whole iteration, and
        execution ids `<group_id>.<i>`, so ids stay unique across epochs."""
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        rng = random.Random(seed)
        k = 0
        epoch = 0
        while epochs is None or epoch < epochs:
            order = list(range(len(self.tasks)))
            if shuffle:
                rng.shuffle(order)
            for ti in order:
                task = self.tasks[ti]
                gid = make_id(task, k) if make_id else f"{task.task_id}.g{k}"
                k += 1
                execs = [ExecutionSpec(execution_id=f"{gid}.{i}", task=task, group_id=gid, index=i) for i in range(group_size)]
                yield Group(group_id=gid, task=task, executions=execs)
            epoch += 1
