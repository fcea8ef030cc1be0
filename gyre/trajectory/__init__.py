"""Trajectory processor: TITO records and store, prefix tree, selection, packing, advantages."""
