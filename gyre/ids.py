"""The one rule for the ids that name things on disk: tasks, groups, executions (docs/design.md §4).

An id is 1 to `MAX_LEN` characters of [A-Za-z0-9._-], starting with a letter or digit: it is
used verbatim as a file name (`<execution_id>.tito` in the TITO store), a directory
(`<run_dir>/<execution_id>/`) and a container name (`gyre-<execution_id>`), so it can hold no
path separator, cannot be `.` or `..`, and cannot start with `-` (it would read as an option).

`MAX_LEN` = 200 keeps the longest name made from an id (the id plus a short prefix or suffix)
well under the 255-byte file-name limit of Linux file systems. A task id is the prefix of its
execution ids (`<task_id>.a<attempt>.g<k>.<i>`, docs/train-your-own-agent.md), so a task id
keeps `TASK_SUFFIX_ROOM` characters free for that suffix: every execution id made from a task
the loader accepted is one the proxy and the store accept.
"""

from __future__ import annotations

import re

__all__ = ["MAX_LEN", "TASK_SUFFIX_ROOM", "check_id", "is_valid_id"]

MAX_LEN = 200
TASK_SUFFIX_ROOM = 72  # ".a<attempt>.g<k>.<i>" with room to spare: task ids are at most 128 chars
_ID = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_LEN - 1}}}")


def is_valid_id(value: object, *, room: int = 0) -> bool:
    """Does `value` follow the id rule, with `room` characters to spare for a suffix?"""
    return isinstance(value, str) and len(value) + room <= MAX_LEN and _ID.fullmatch(value) is not None


def check_id(value: object, field: str, *, room: int = 0) -> str:
    """`value` if it follows the id rule (see `is_valid_id`); otherwise a ValueError naming `field`."""
    if not is_valid_id(value, room=room):
        raise ValueError(f"{field} {value!r}: use 1-{MAX_LEN - room} characters of [A-Za-z0-9._-], "
                         "starting with a letter or digit (it names files and directories)")
    return value  # type: ignore[return-value]
