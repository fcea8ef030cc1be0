#!/usr/bin/env bash
# Gyre on Slurm: one torchrun per node, every rank runs `-m gyre.run`.
#
#   sbatch --nodes=4 launch.sh --preset cpu-demo
#
# (--backend.engine sglang and --backend.actor megatron run cells with TP inside a cell; see
# docs/gpu-sglang.md. The built-in CPU engine and actor hold a whole model per rank:
# --parallel.cell-size 1.)
#
# The node count is given once (sbatch --nodes or #SBATCH --nodes); everything else is derived
# from $SLURM_*: nnodes, this node's rank, and the rendezvous endpoint (the first host).
# Extra arguments go to gyre.run unchanged.
#
# Knobs (environment): GYRE_NPROC_PER_NODE (default: GPUs on the node, else 1),
# GYRE_MASTER_PORT (default 29500), GYRE_MAX_RESTARTS (default 0: torchrun restarts the job
# this many times after a rank dies; each restart resumes from the newest complete checkpoint),
# GYRE_DRY_RUN=1 prints the torchrun command instead of running it (used by the tests).
#
# Requeue (sbatch --requeue, or a preemption): the run directory must be the same every time, so
# without --run-dir the job writes to runs/slurm/<job id>; on a requeue (SLURM_RESTART_COUNT > 0)
# gyre.run resumes the run there from its newest complete checkpoint (from the start when it had
# none yet), as after a torchrun restart.
#SBATCH --job-name=gyre
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=gyre-%j.out
set -euo pipefail

if [[ -z "${GYRE_LAUNCH_INNER:-}" && -n "${SLURM_JOB_ID:-}" && -z "${GYRE_DRY_RUN:-}" ]]; then
  # Outer: sbatch ran this script on the first node. Start one task per node running the inner part.
  GYRE_LAUNCH_INNER=1 exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash "$0" "$@"
fi

: "${SLURM_NNODES:?launch.sh runs under Slurm (SLURM_NNODES unset)}"
: "${SLURM_NODEID:?launch.sh runs under Slurm (SLURM_NODEID unset)}"
: "${SLURM_JOB_NODELIST:?launch.sh runs under Slurm (SLURM_JOB_NODELIST unset)}"

if command -v scontrol >/dev/null 2>&1; then
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
else
  MASTER_ADDR=$(python -m gyre.slurm first-host "$SLURM_JOB_NODELIST")
fi
MASTER_PORT=${GYRE_MASTER_PORT:-29500}
if [[ -n "${GYRE_NPROC_PER_NODE:-}" ]]; then
  NPROC=$GYRE_NPROC_PER_NODE
elif [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
  NPROC=$SLURM_GPUS_ON_NODE
else
  NPROC=1
fi

args=("$@")
has_run_dir=0
for a in "${args[@]}"; do
  [[ "$a" == --run-dir || "$a" == --run-dir=* ]] && has_run_dir=1
done
if [[ $has_run_dir == 0 ]]; then
  args+=(--run-dir "runs/slurm/${SLURM_JOB_ID:?launch.sh runs under Slurm (SLURM_JOB_ID unset)}")
fi

cmd=(torchrun
  --nnodes "$SLURM_NNODES"
  --node-rank "$SLURM_NODEID"
  --nproc-per-node "$NPROC"
  --master-addr "$MASTER_ADDR"
  --master-port "$MASTER_PORT"
  --max-restarts "${GYRE_MAX_RESTARTS:-0}"
  -m gyre.run "${args[@]}")

if [[ -n "${GYRE_DRY_RUN:-}" ]]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
exec "${cmd[@]}"
