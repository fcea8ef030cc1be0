"""`python -m gyre.plan`: the planner, the best scheduler configuration by simulation
(gyre.sim.plan, docs/planning.md); with --memory, whether a model fits a cell's GPUs instead
(gyre.backends.memplan; its --help lists the flags)."""

import sys

from gyre.sim import plan


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--memory" in argv:
        from gyre.backends.memplan.__main__ import main as memory_main

        return memory_main([a for a in argv if a != "--memory"])
    return plan.main(argv)


if __name__ == "__main__":
    sys.exit(main())
