"""Backends (docs/design.md §1, §3): what the runtime plugs in, chosen in one place (`factory.py`).

The top holds what every sub-package shares (the protocols, the factory, the config, devices);
`engines/`, `actors/`, `transfer/` and `models/` hold the rollout engines, the training actors,
the tensor transports and the shared model code; `memplan/` the GPU memory planner. What runs
where: docs/backends.md; the file map: docs/design.md §8. Nothing is imported here: GPU libraries
load lazily inside the adapters.
"""
