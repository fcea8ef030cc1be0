"""Contract tests: every implementation `gyre.backends.factory` can build on this machine passes
the same tests (parametrized over `factory.runnable(...)`, so the GPU backends join when wired in).
Torch runs single-threaded here, as in tests/backends/ (shared cores)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
