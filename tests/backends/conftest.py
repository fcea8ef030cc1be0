"""Backend tests run torch single-threaded: the dev machine's 2 cores are shared with other
test processes, and OpenMP oversubscription slows small ops ~10× (restored after each test)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
