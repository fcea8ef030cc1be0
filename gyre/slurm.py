"""Slurm helpers for launch.sh: expand a SLURM_JOB_NODELIST without `scontrol`.

    python -m gyre.slurm first-host 'gpu[07-10],login3'   → gpu07
    python -m gyre.slurm hosts 'gpu[07-08,12]'            → gpu07 gpu08 gpu12
"""

from __future__ import annotations

import re
import sys


def _split_top(nodelist: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in nodelist:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        parts.append(cur)
    return parts


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed hostlist syntax (one bracket group per name, zero padding kept)."""
    hosts: list[str] = []
    for part in _split_top(nodelist.strip()):
        m = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\]([^\[\]]*)", part)
        if not m:
            if "[" in part or "]" in part:
                raise ValueError(f"cannot parse Slurm nodelist element {part!r}")
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            if "-" in r:
                lo, hi = r.split("-", 1)
                width = len(lo)
                hosts.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{r}{suffix}")
    return hosts


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("first-host", "hosts"):
        print("usage: python -m gyre.slurm {first-host|hosts} NODELIST", file=sys.stderr)
        return 2
    hosts = expand_nodelist(argv[1])
    print(hosts[0] if argv[0] == "first-host" else " ".join(hosts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
