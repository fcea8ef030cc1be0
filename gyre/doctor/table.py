"""The doctor's one table: a `Line` per check, lines of many ranks merged, the exit code.

    Line("torch", OK, "2.13.0+cpu (setup.py: torch>=2.6)")
    Line("run dir", FAIL, "--run-dir /x/y: /x is not a directory", fix="choose a directory ...")
    print(render(lines)); sys.exit(exit_code(lines))

A line's status is one of `ok`, `warn`, `fail`, `skipped`; every line that is not `ok` carries its
fix (a `skipped` line says why it was skipped instead).
"""

from __future__ import annotations

from dataclasses import dataclass

OK, WARN, FAIL, SKIPPED = "ok", "warn", "fail", "skipped"
# Merging ranks keeps the worst: a skipped line (e.g. "the proxy runs on rank 0") never hides an ok one.
SEVERITY = {SKIPPED: 0, OK: 1, WARN: 2, FAIL: 3}
MAX_GROUPS = 4  # distinct per-rank details shown on one merged line, then "and N more"


@dataclass(frozen=True)
class Line:
    """One check's result: `name` (the table's second column), `status`, what was found
    (`detail`) and, when not ok, what to do about it (`fix`)."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status not in SEVERITY:
            raise ValueError(f"Line {self.name!r}: status {self.status!r} is not one of {sorted(SEVERITY)}")


def skipped(name: str, why: str) -> Line:
    return Line(name, SKIPPED, why)


def merge(per_rank: list[tuple[str, list[Line]]]) -> list[Line]:
    """One line per check name from every rank's lines (`(rank label, lines)`, rank 0 first).

    A check whose lines agree on every rank is shown once. Otherwise the merged line has the
    worst status, and its detail names the ranks of each distinct detail at that status (at most
    MAX_GROUPS groups, then "and N more"; no rank labels when the other ranks all skipped it);
    the fix is the first such rank's.

    >>> a, b = Line("gpus", OK, "1 GPU"), Line("gpus", FAIL, "0 GPUs", "x")
    >>> merge([("rank 0", [a]), ("rank 1", [b]), ("rank 2", [b])])[0].detail
    'rank 1, rank 2: 0 GPUs'
    """
    order: list[str] = []
    by_name: dict[str, list[tuple[str, Line]]] = {}
    for label, lines in per_rank:
        for line in lines:
            if line.name not in by_name:
                order.append(line.name)
                by_name[line.name] = []
            by_name[line.name].append((label, line))
    out = []
    for name in order:
        entries = by_name[name]
        if len({(ln.status, ln.detail, ln.fix) for _, ln in entries}) == 1:
            out.append(entries[0][1])
            continue
        worst = max(SEVERITY[ln.status] for _, ln in entries)
        groups: dict[str, list[str]] = {}
        fix = ""
        for label, ln in entries:
            if SEVERITY[ln.status] == worst:
                groups.setdefault(ln.detail, []).append(label)
                fix = fix or ln.fix
        if len(groups) == 1 and all(SEVERITY[ln.status] in (worst, SEVERITY[SKIPPED]) for _, ln in entries):
            shown = list(groups)  # one verdict, the other ranks skipped (e.g. a check only rank 0 makes)
        else:
            shown = [f"{', '.join(labels)}: {detail}" for detail, labels in list(groups.items())[:MAX_GROUPS]]
        if len(groups) > MAX_GROUPS:
            shown.append(f"and {len(groups) - MAX_GROUPS} more")
        status = next(s for s, v in SEVERITY.items() if v == worst)
        out.append(Line(name, status, "; ".join(shown), fix))
    return out


def render(lines: list[Line]) -> str:
    """The table: `STATUS  CHECK  DETAIL`, a `fix:` line under every line that has one, then the
    count of each status."""
    width = max([len(ln.name) for ln in lines] + [5])
    rows = [f"{'status':<8} {'check':<{width}}  detail"]
    for ln in lines:
        rows.append(f"{ln.status:<8} {ln.name:<{width}}  {ln.detail}")
        if ln.fix:
            rows.append(f"{'':<8} {'':<{width}}  fix: {ln.fix}")
    counts = {s: sum(ln.status == s for ln in lines) for s in SEVERITY}
    rows.append(", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no checks")
    return "\n".join(rows)


def exit_code(lines: list[Line]) -> int:
    """1 when any line failed, else 0 (warnings and skipped lines do not fail the preflight)."""
    return 1 if any(ln.status == FAIL for ln in lines) else 0
