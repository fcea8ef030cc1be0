"""The tiny harness, except that execution `*.0` of a group first puts a directory where the proxy
will write its TITO file (run_dir/tito/<id>.tito), so every record of its calls fails to write:
a TITO write failure injected from outside Gyre's code (the run must be unsandboxed)."""

import os
import runpy
import sys
from pathlib import Path

eid = os.environ["GYRE_EXECUTION_ID"]
if eid.endswith(".0"):
    run_dir = Path(os.environ["GYRE_WORKSPACE"]).parents[2]  # run_dir/executions/<id>/workspace
    (run_dir / "tito" / f"{eid}.tito").mkdir(parents=True)
sys.argv = [str(Path(__file__).resolve().parents[1] / "runtime" / "tiny_harness.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
