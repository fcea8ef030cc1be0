"""What setup.py hands setuptools: its `main()` run with `setup` captured (nothing is built), for
the tests that hold other code to setup.py's own requirements (the doctor's pins, the extras'
resolution)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def setup_module():
    """setup.py as a module: its functions defined, `setup()` not run (it is not __main__)."""
    spec = importlib.util.spec_from_file_location("gyre_setup_py", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def setup_kwargs() -> dict:
    mod = setup_module()
    got: dict = {}
    mod.setup = lambda **kw: got.update(kw)
    before = os.environ.get("GYRE_NO_EXT")
    os.environ["GYRE_NO_EXT"] = "1"  # the extension is not probed
    try:
        mod.main()
    finally:
        if before is None:
            os.environ.pop("GYRE_NO_EXT")
        else:
            os.environ["GYRE_NO_EXT"] = before
    return got
