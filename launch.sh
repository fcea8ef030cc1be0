#!/usr/bin/env bash
# Gyre on Slurm: one torchrun per node, every rank runs `-m gyre.run`. docs/cluster.md is the
# operator's page (GPUs per node, network interfaces, the shared run directory, preemption).
#
#   sbatch --nodes=4 --gpus-per-node=8 launch.sh --preset ...
#   sbatch --nodes=2 launch.sh --preset cpu-demo            # CPU nodes: one rank per node
#
# (--backend.engine sglang and --backend.actor megatron run cells with TP inside a cell; see
# docs/gpu-sglang.md. The built-in CPU engine and actor hold a whole model per rank:
# --parallel.cell-size 1.)
#
# The node count is given once (sbatch --nodes or #SBATCH --nodes); everything else is derived
# from $SLURM_*: nnodes, this node's rank, and the rendezvous endpoint (the first host, by its
# Slurm node name: it must resolve on every node; see docs/cluster.md for GLOO_SOCKET_IFNAME).
# Extra arguments go to gyre.run unchanged.
#
# Knobs (environment): GYRE_NPROC_PER_NODE (default: the GPUs Slurm gave the node,
# SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE, else 1 with a note), GYRE_MASTER_PORT (default
# 29500), GYRE_MAX_RESTARTS (default 0: torchrun restarts the job this many times after a rank
# dies, every node's ranks, through c10d rendezvous; each restart resumes from the newest complete
# checkpoint; docs/cluster.md section 5), GYRE_NODE_EXIT_WAIT_S (default
# 180: how long the other nodes may finish, e.g. write their checkpoint, after the first node's
# torchrun ended, before srun ends them), GYRE_MAX_REQUEUES (default 8: launch.sh asks for no
# requeue once the job has been requeued this many times, SLURM_RESTART_COUNT), GYRE_DRY_RUN=1 prints this node's torchrun command
# instead of running it (used by the tests).
#
# Signals: the batch shell forwards a SIGTERM/SIGINT meant for it alone to every node's torchrun
# (which forwards it to the ranks: a graceful stop within --train.shutdown-timeout-s), so
# `--signal=B:TERM@120` works. Requeue: the job is requeueable (#SBATCH --requeue; `sbatch
# --no-requeue` turns it off). A graceful stop that is not `scancel` or the time limit (a
# preemption's grace-time SIGTERM, `--signal=B:TERM@N` before the time limit) asks Slurm to
# requeue the job; a crash (a rank that died rather than stopped, even when torchrun then
# SIGTERMed the others) is not requeued. The run directory is the same every time: without --run-dir the job writes to
# runs/slurm/<job id>, and on a requeue (SLURM_RESTART_COUNT > 0) gyre.run resumes there from its
# newest complete checkpoint. docs/cluster.md has the table of Slurm events.
# Every attempt appends to the same log, after a header line naming the attempt.
#SBATCH --job-name=gyre
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=gyre-%j.out
set -euo pipefail

# This node's part: runs on every node (inside `srun`), built as a function so that srun can be
# handed its text. Under sbatch, $0 is the batch node's spool copy of this script, which the
# other nodes do not have.
gyre_node() {
  set -euo pipefail
  : "${SLURM_NNODES:?launch.sh runs under Slurm (SLURM_NNODES unset)}"
  : "${SLURM_NODEID:?launch.sh runs under Slurm (SLURM_NODEID unset)}"
  : "${SLURM_JOB_NODELIST:?launch.sh runs under Slurm (SLURM_JOB_NODELIST unset)}"
  : "${SLURM_JOB_ID:?launch.sh runs under Slurm (SLURM_JOB_ID unset)}"
  local master nproc
  master=${GYRE_MASTER_ADDR:-$(gyre_first_host)}
  if [[ -n "${GYRE_NPROC_PER_NODE:-}" ]]; then
    nproc=$GYRE_NPROC_PER_NODE
  elif [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
    nproc=$SLURM_GPUS_ON_NODE
  elif [[ -n "${SLURM_GPUS_PER_NODE:-}" ]]; then
    nproc=${SLURM_GPUS_PER_NODE##*:}  # "8" or "h100:8"
  else
    nproc=1
    echo "launch.sh: $(hostname): no GPUs allocated (SLURM_GPUS_ON_NODE and SLURM_GPUS_PER_NODE unset): one rank on this node; ask for GPUs with sbatch --gpus-per-node=N or set GYRE_NPROC_PER_NODE" >&2
  fi
  if ! [[ "$nproc" =~ ^[1-9][0-9]*$ ]]; then
    echo "launch.sh: ranks per node must be a positive integer, got '$nproc' (GYRE_NPROC_PER_NODE / SLURM_GPUS_ON_NODE / SLURM_GPUS_PER_NODE)" >&2
    return 2
  fi
  local args=("$@") has_run_dir=0 a
  for a in "${args[@]}"; do
    [[ "$a" == --run-dir || "$a" == --run-dir=* ]] && has_run_dir=1
  done
  if [[ $has_run_dir == 0 ]]; then
    args+=(--run-dir "runs/slurm/$SLURM_JOB_ID")
  fi
  local restarts=${GYRE_MAX_RESTARTS:-0} port=${GYRE_MASTER_PORT:-29500} rdzv
  if ! [[ "$restarts" =~ ^[0-9]+$ ]]; then
    echo "launch.sh: GYRE_MAX_RESTARTS must be a non-negative integer, got '$restarts'" >&2
    return 2
  fi
  if [[ $restarts == 0 ]]; then
    # No restart: torchrun's static rendezvous, node ranks as Slurm numbers the nodes.
    rdzv=(--node-rank "$SLURM_NODEID" --master-addr "$master" --master-port "$port")
  else
    # Restarts: the c10d rendezvous. With static rendezvous only the failed node's torchrun
    # restarts its ranks; c10d's agents meet again in a new round, so every node's do. The store
    # is hosted by node 0's torchrun (is_host, not guessed from host names). A node's ranks follow
    # the sorted --local-addr (its Slurm name), the same in every round: rank 0 stays on its node,
    # where the execution plane runs. TORCH_DISABLE_SHARE_RDZV_TCP_STORE: each round's ranks get a
    # store of their own (rank 0 hosts it), not the agent's, which keeps the dead round's keys
    # under names the new round would read (its ranks' TORCHELASTIC_RESTART_COUNT differ by node).
    rdzv=(--rdzv-backend c10d --rdzv-endpoint "$master:$port" --rdzv-id "gyre-$SLURM_JOB_ID"
      --rdzv-conf "is_host=$([[ $SLURM_NODEID == 0 ]] && echo 1 || echo 0)"
      --local-addr "${SLURMD_NODENAME:-$(hostname)}")
  fi
  local cmd=(torchrun)
  [[ $restarts == 0 ]] || cmd=(env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun)
  cmd+=(--nnodes "$SLURM_NNODES"
    --nproc-per-node "$nproc"
    "${rdzv[@]}"
    --max-restarts "$restarts"
    -m gyre.run "${args[@]}")
  if [[ -n "${GYRE_DRY_RUN:-}" ]]; then
    printf '%q ' "${cmd[@]}"
    echo
    return 0
  fi
  exec "${cmd[@]}"
}

# The first host of the allocation: scontrol where it works (it needs slurm.conf), else Gyre's
# own expansion of the nodelist.
gyre_first_host() {
  local h=""
  if command -v scontrol >/dev/null 2>&1; then
    h=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null | head -n 1) || h=""
  fi
  [[ -n "$h" ]] || h=$(python -m gyre.slurm first-host "$SLURM_JOB_NODELIST")
  echo "$h"
}

if [[ -z "${SLURM_JOB_ID:-}" || -n "${GYRE_DRY_RUN:-}" ]]; then
  gyre_node "$@"
  exit $?
fi

# Batch shell: sbatch ran this script on the first node.
echo "gyre: job $SLURM_JOB_ID attempt $(( ${SLURM_RESTART_COUNT:-0} + 1 )) (SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST:-?} at $(date -u +%FT%TZ)"
GYRE_MASTER_ADDR=$(gyre_first_host)
export GYRE_MASTER_ADDR

signalled="" requeue=0 srun_pid=""
attempt_t0=$(date +%s)  # this attempt's start (a number, not a temp file a SIGKILL would leave behind)
job_info() { scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null || true; }
requeueable() { [[ "$1" == *" JobState=RUNNING "* && "$1" == *" Requeue=1 "* ]]; }
forward() {
  [[ -n "$signalled" ]] && return  # one stop; torchrun takes a second signal as "force"
  signalled=$1
  # Requeue unless the operator cancelled the job or made it not requeueable. Decided now:
  # `--signal=B:TERM@N` before the time limit finds the job RUNNING; scancel, the time limit
  # itself and a node failure find it already ending (JobState=COMPLETING: Slurm signals every
  # process of the job itself), and --no-requeue shows Requeue=0.
  local info
  info=$(job_info)
  requeueable "$info" && requeue=1
  echo "gyre: $1 at $(date -u +%FT%TZ) ($(grep -o 'JobState=[A-Z_]*' <<<"$info" || echo 'JobState unknown'), requeue $requeue)" >&2
  if [[ "$info" == *" JobState=RUNNING "* || -z "$info" ]]; then
    # The signal was for this shell alone. Not `exec srun`: srun answers SIGTERM by killing every
    # task (exit 137, no summary). Signal the job's steps instead (scancel without --batch), so
    # each node's torchrun gets SIGTERM and the ranks stop gracefully; srun returns when they have.
    echo "gyre: forwarding SIGTERM to every node" >&2
    scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || kill -TERM "$srun_pid" 2>/dev/null || true
  fi
}
trap 'forward SIGTERM' TERM
trap 'forward SIGINT' INT

# The command line, checked here once before any node starts (python -m gyre.config_checks): a
# typo'd flag is said once and the job ends, instead of once per node after torchrun's report.
# (After the traps: a stop signalled meanwhile is handled below like any other, requeue included.)
for a in "$@"; do
  case $a in -h | --help | --help-all) exec python -m gyre.run "$@" ;; esac
done
check_rc=0
python -m gyre.config_checks "$@" || check_rc=$?
if [[ $check_rc != 0 && -z "$signalled" ]]; then
  echo "gyre: the command line was refused (exit $check_rc); no node started" >&2
  exit "$check_rc"
fi

# --kill-on-bad-exit=0 with --wait: in a graceful stop a node whose torchrun is done first must
# not get the others SIGKILLed while rank 0 still writes the checkpoint and summary; a node that
# died still ends the job after GYRE_NODE_EXIT_WAIT_S.
rc=143  # stopped before srun started (a signal during the check above)
if [[ -z "$signalled" ]]; then
  srun --ntasks-per-node=1 --kill-on-bad-exit=0 --wait="${GYRE_NODE_EXIT_WAIT_S:-180}" \
    bash -c "$(declare -f gyre_node gyre_first_host); gyre_node \"\$@\"" gyre-node "$@" &
  srun_pid=$!
  while :; do
    rc=0
    wait "$srun_pid" || rc=$?
    kill -0 "$srun_pid" 2>/dev/null || break  # else: a trap ended the wait; srun still runs
  done
fi

# The run directory, as gyre_node gives it to gyre.run.
run_dir="runs/slurm/$SLURM_JOB_ID"
prev=""
for a in "$@"; do
  [[ "$prev" == --run-dir ]] && run_dir=$a
  [[ "$a" == --run-dir=* ]] && run_dir=${a#--run-dir=}
  prev=$a
done
if [[ -z "$signalled" && $rc != 0 ]]; then
  # A preemption (PreemptMode=REQUEUE with a GraceTime) signals the steps, not this shell: the
  # run stopped gracefully on a SIGTERM (this attempt's summary says so) while the job is still
  # RUNNING. Requeue it, or the non-zero exit leaves it FAILED before Slurm's own requeue.
  info=$(job_info)
  # A crash looks the same from here when torchrun SIGTERMed the surviving ranks: the summary
  # says interrupted, but names the ranks that never reported stopping (the dead ones).
  if requeueable "$info"; then
    how=$(python -c 'import json, os, sys
if os.path.getmtime(sys.argv[1]) < int(sys.argv[2]): sys.exit()  # from an earlier attempt
s = json.load(open(sys.argv[1]))
crashed = sorted(set(s.get("ranks_not_stopped") or []) | set(s.get("dead_ranks") or []))
print("crash %s" % crashed if crashed else "preemption" if s.get("interrupted") else "")' \
      "$run_dir/summary.json" "$attempt_t0" 2>/dev/null || true)
    if [[ "$how" == preemption ]]; then
      signalled="a SIGTERM to the steps (a preemption)"
      requeue=1
    elif [[ "$how" == crash* ]]; then
      echo "gyre: ranks ${how#crash } died (exit $rc): a crash, not a preemption; not requeued" \
        "(GYRE_MAX_RESTARTS lets torchrun restart the job after a rank dies)" >&2
    fi
  fi
fi
if [[ $requeue == 1 && ${SLURM_RESTART_COUNT:-0} -ge ${GYRE_MAX_REQUEUES:-8} ]]; then
  echo "gyre: stopped on $signalled (exit $rc); not requeued: the job was requeued ${SLURM_RESTART_COUNT:-0}" \
    "times already (GYRE_MAX_REQUEUES=${GYRE_MAX_REQUEUES:-8})" >&2
  requeue=0
  signalled=""
fi
if [[ $requeue == 1 ]]; then
  # The next allocation resumes the run (SLURM_RESTART_COUNT > 0). Without this a graceful stop
  # exits non-zero and Slurm marks the job FAILED, never requeued.
  echo "gyre: stopped on $signalled (exit $rc); requeueing job $SLURM_JOB_ID to resume" >&2
  scontrol requeue "$SLURM_JOB_ID" || echo "gyre: scontrol requeue failed; resubmit to resume" >&2
elif [[ -n "$signalled" ]]; then
  echo "gyre: stopped on $signalled (exit $rc); not requeued by launch.sh (scancel, the time limit, --no-requeue," \
    "or a node failure, which Slurm itself requeues when the job is requeueable)" >&2
fi
exit "$rc"
