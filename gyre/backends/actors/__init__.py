"""Training actors (docs/design.md §3, §6; docs/backends.md): forward/backward on micro-steps, the
gradient reduce over a prefix group, the core's optimizer step, and the memory hand-over at a
switch. Nothing is imported here.
"""
