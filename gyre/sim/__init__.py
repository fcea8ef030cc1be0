"""Discrete-event simulator of Gyre / Colocate / Async (`python -m gyre.sim --help`).

It drives the same `gyre.scheduler.ElasticScheduler` object the runtime drives, with simulated
executions (duration models in `durations`), engine slots, switches and training compute
(`engine`); `variants` holds the paper's Table 1 ablation as configurations, `report` the
outputs. Modelling assumptions: docs/theory.md §5.
"""
