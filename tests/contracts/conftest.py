"""Contract tests: every implementation `gyre.backends.factory` can build on this machine passes
the same tests (parametrized over `factory.runnable(...)`, so the GPU backends join when wired in).
Torch runs single-threaded here, as in tests/backends/ (shared cores): the same fixture."""

from tests.backends.conftest import _one_torch_thread  # noqa: F401  (autouse fixture)
