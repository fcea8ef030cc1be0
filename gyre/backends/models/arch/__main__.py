"""`python -m gyre.backends.models.arch [DIR ...]`: the supported-architecture table, or each checkpoint
directory's family (refusals print their reason and exit 1)."""

from __future__ import annotations

import sys

from gyre.backends.models.arch import UnsupportedArchitecture, check_checkpoint, supported_table


def main(argv: list[str]) -> int:
    if not argv:
        print(supported_table())
        return 0
    bad = 0
    for path in argv:
        try:
            family = check_checkpoint(path)
            print(f"{path}: {family.name} ({family.hf_class})")
        except (UnsupportedArchitecture, OSError, ValueError) as e:
            print(f"{path}: refused: {e}")
            bad = 1
    return bad


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
