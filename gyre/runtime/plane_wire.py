"""What crosses between the execution plane's process and its controller (`gyre.runtime.execution_plane`,
`gyre.runtime.plane_client`): groups and execution events as JSON, and the plane's own file.

    <run_dir>/execution_plane.json     {"pid", "start", "url" (the plane's routes), "proxy_url", "token"}:
                                       written atomically, mode 0600 (the token is the proxy's admin token)
    <run_dir>/execution_plane/         config.json (what rank 0 started it with), events.jsonl (every
                                       event, one a line, with its sequence number), plane.log

An event is one JSON object with `seq` (0, 1, ... over the plane's life) and `type`:
    execution   an `ExecutionEvent` (kind, execution_id, group_id, time, counters, result), and on
                `finished` the execution's close stats (`closed`: calls, sink_errors, counts)
    done        an execution's task ended: `cancelled`, or `error` (what it raised), else its result is
                the last `evaluated` event's
    error       a failed write of the plane's (a TITO record): what, path, errno, message
    reroutes    the router's reroute records since the previous batch (`Router.take_reroutes`)
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from gyre.executions.evaluator import Attempt, Outcome, RewardResult, RewardStatus
from gyre.executions.runner import EventKind, ExecutionEvent, ExecutionResult
from gyre.executions.tasks import ExecutionSpec, Group, Task

PLANE_FILE = "execution_plane.json"
PLANE_DIR = "execution_plane"


class PlaneGone(RuntimeError):
    """The execution plane's process is gone (or never wrote its file): what it ran is lost with it."""


def group_to_json(group: Group) -> dict[str, Any]:
    return {"group_id": group.group_id, "task": group.task.to_json(),
            "executions": [{"execution_id": s.execution_id, "group_id": s.group_id, "index": s.index,
                            "dispatch_version": s.dispatch_version} for s in group.executions]}


def group_from_json(obj: Any) -> Group:
    """The group a dispatch carries; ValueError naming the field when it is malformed."""
    if not isinstance(obj, dict):
        raise ValueError("group: must be an object")
    for name in ("group_id", "task", "executions"):
        if name not in obj:
            raise ValueError(f"group.{name}: is required")
    task = Task.from_json(obj["task"], where="group.task")
    if not isinstance(obj["executions"], list) or not obj["executions"]:
        raise ValueError("group.executions: must be a non-empty list")
    specs = []
    for i, e in enumerate(obj["executions"]):
        where = f"group.executions[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("execution_id"), str):
            raise ValueError(f"{where}.execution_id: must be a string")
        for name in ("index", "dispatch_version"):
            if not isinstance(e.get(name, 0), int) or isinstance(e.get(name), bool):
                raise ValueError(f"{where}.{name}: must be an integer")
        try:
            specs.append(ExecutionSpec(e["execution_id"], task, obj["group_id"], e.get("index", 0), e.get("dispatch_version", 0)))
        except ValueError as err:
            raise ValueError(f"{where}.execution_id: {err}") from None
    return Group(obj["group_id"], task, specs)


def result_to_json(r: ExecutionResult) -> dict[str, Any]:
    return {**r.to_json(), "exec_dir": str(r.exec_dir), "workspace": str(r.workspace)}


def result_from_json(d: dict[str, Any]) -> ExecutionResult:
    rw = d.get("reward")
    reward = None if rw is None else RewardResult(rw["execution_id"], RewardStatus(rw["status"]), rw["reward"],
                                                  [Attempt(**a) for a in rw.get("attempts", [])], rw.get("detail", {}),
                                                  rw.get("evaluator", ""))
    return ExecutionResult(d["execution_id"], d["group_id"], d["task_id"], d["index"], d["dispatch_version"],
                           Outcome(d["outcome"]), d["exit_code"], d["start_time"], d["end_time"], Path(d["exec_dir"]),
                           Path(d["workspace"]), d.get("host", "local"), d.get("error", ""), reward)


def event_to_json(ev: ExecutionEvent) -> dict[str, Any]:
    return {"type": "execution", "kind": ev.kind.value, "execution_id": ev.execution_id, "group_id": ev.group_id,
            "time": ev.time, "counters": list(ev.counters),
            "result": None if ev.result is None else result_to_json(ev.result)}


def event_from_json(d: dict[str, Any]) -> ExecutionEvent:
    return ExecutionEvent(EventKind(d["kind"]), d["execution_id"], d["group_id"], d["time"], tuple(d["counters"]),
                          None if d.get("result") is None else result_from_json(d["result"]))


def error_to_json(exc: BaseException) -> dict[str, Any]:
    return {"exception": type(exc).__name__, "message": str(exc), "errno": getattr(exc, "errno", None),
            "strerror": getattr(exc, "strerror", None), "filename": getattr(exc, "filename", None)}


def error_from_json(d: dict[str, Any]) -> BaseException:
    """The plane's exception as the controller's error paths take it: an OSError keeps its errno
    and path (`gyre.runtime.writes` states them); anything else a RuntimeError naming its type."""
    if d.get("errno") is not None:
        return OSError(d["errno"], d.get("strerror") or d["message"], *([d["filename"]] if d.get("filename") else []))
    return RuntimeError(f"{d['exception']} in the execution plane: {d['message']}")


def write_private(path: Path, obj: Any) -> None:
    """`obj` as JSON at `path`, atomically (temp file + rename), readable by this user only."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_plane_file(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The plane's `execution_plane.json`; PlaneGone when there is none."""
    path = Path(run_dir) / PLANE_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise PlaneGone(f"no execution plane in {run_dir} ({PLANE_FILE} is missing)") from None


def reroute_to_json(rec: Any) -> dict[str, Any]:
    return dataclasses.asdict(rec)
