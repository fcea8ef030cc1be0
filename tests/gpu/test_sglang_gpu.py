"""The SGLang engine on a real GPU (sglang 0.5.23 installed): runs `tests/gpu/sglang_check.py` in a
process of its own, so an SGLang scheduler crash (SIGQUIT to its parent) fails this test instead
of killing pytest. Skipped without CUDA or sglang. On a GPU box:

    pytest -m gpu tests/gpu/test_sglang_gpu.py -v      # or: python -m tests.gpu.sglang_check
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang (pip install 'sglang==0.5.23')")
def test_sglang_lifecycle_on_the_gpu(tmp_path):
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.sglang_check", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    log = (proc.stdout + proc.stderr)[-6000:]
    assert out.exists(), f"the check process died (exit {proc.returncode}; SIGQUIT is -3):\n{log}"
    report = json.loads(out.read_text())
    failed = [c for c in report["checks"] if c["ok"] is False]
    assert report["ok"] and not failed, f"{failed}\n{log}"
