#!/usr/bin/env bash
# The one device check of the GPU path (one H200, no network; ≤ 8 minutes). See benchmarks/gpu_check.py.
#
#   bash benchmarks/gpu_check.sh                 # on the GPU box; wheels from benchmarks/wheels/
#   bash benchmarks/gpu_check.sh --dry-run       # on CPU: wheel set, build plan, nvcc compile-only,
#                                                # test selection, the run's config
#   python benchmarks/gpu_check.py --fetch-wheels benchmarks/wheels    # beforehand, where there is network
#
# Writes one JSON: --out, else $OUT/gpu_check.json (without either a dry run prints it); a device
# run adds gpu_check_run_summary.json and gpu_check_run_metrics.jsonl beside it, nothing else (the
# lent machine returns at most 8 files, two folders deep: the run directory stays in a temp dir).
# Rerun a stage on the still-warm machine: --only STAGE --budget-s <device seconds left - 30>.
# One GPU cannot try TP > 1, multi-cell prefix-group gradient reduction or the NCCL weight
# broadcast (NCCL will not put two ranks on one device); the JSON's "one_gpu_cannot_try" names
# the CPU gloo tests that cover their logic.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# the driver keeps its own budget (--budget-s, 470 s) and writes the JSON; this is the backstop
exec timeout --kill-after=10 500 "$PY" benchmarks/gpu_check.py "$@"
