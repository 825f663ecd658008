#!/usr/bin/env bash
# d20 on several GPU hosts under SLURM: one JAX process per node, each driving all of its node's GPUs;
# jax.distributed starts from SLURM's variables (jaxchat.distributed.mesh.maybe_initialize_distributed), and the
# mesh spans every GPU of every node.
#
#   sbatch runs/multihost_slurm.sh                   # 2 nodes x 8 GPUs, as set below
#   sbatch --nodes=4 runs/multihost_slurm.sh
#   sbatch runs/multihost_slurm.sh --depth=26        # arguments: more flags for scripts.train (they win)
#
#   JAXCHAT_PYTHON   a Python with jaxchat installed, instead of this checkout's .venv (the tests)
#   JAXCHAT_MAX_REQUEUES   how often a job that keeps losing processes (status 69, 134) queues itself again (3)
#
# Before the first job, once, from a login or compute node: the virtual environment, the data and the
# tokenizer, as runs/speedrun.sh makes them (its first three sections). This checkout with its .venv must be on a
# filesystem that every node sees, and $JAXCHAT_BASE_DIR (shards, tokenizer, checkpoints: Orbax writes one
# checkpoint from all processes together) there too, or in a bucket: JAXCHAT_BASE_DIR=gs://BUCKET/PREFIX with the
# gcs extra (README: A bucket as the base directory).
#
# Without SLURM: start the same command on every host with
#   JAX_COORDINATOR_ADDRESS=<host 0>:<free port> JAX_NUM_PROCESSES=<hosts> JAX_PROCESS_ID=<0..hosts-1>
#
#SBATCH --job-name=jaxchat-d20
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=16
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.log
#SBATCH --requeue
#SBATCH --signal=TERM@180
# --requeue and --signal: SLURM sends SIGTERM 3 minutes before the time limit (or on preemption); the
# processes agree on a step to stop at (even if only some got the signal), save it, and the requeued job's
# --resume-from-step=latest continues from it. A task that dies makes the others exit with 69 within
# seconds (jaxchat/train/loop.py's EXIT_PEER_LOST), or 134 once the heartbeat timeout passes where no
# collective reports it: the job requeues itself (below), and the requeued job resumes exactly.
# The run directory's lock (jaxchat/checkpoint/lock.py) does not stop a requeued job: NFS keeps the flock of a node
# that died until the server's lease ends, so process 0 takes over a lock whose holder was an earlier start of
# this job (same SLURM_JOB_ID, smaller SLURM_RESTART_COUNT), or whose heartbeat (renewed every 30 s) is over
# 300 s old, and says so in one line. A run whose lock was taken over so stops at its next heartbeat, without
# saving, with status 2 (as a start refused because another run holds the directory).
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"

export JAXCHAT_BASE_DIR="${JAXCHAT_BASE_DIR:-$HOME/.cache/jaxchat}"
export PYTHONUNBUFFERED=1
WANDB_RUN="${WANDB_RUN:-dummy}"
PYTHON="${JAXCHAT_PYTHON:-$PWD/.venv/bin/python}"

# nanochat's batch of 524,288 tokens = device_batch_size x 2048 x GPUs over all nodes (16 rows per GPU on 16 GPUs)
GPUS=$((SLURM_JOB_NUM_NODES * ${SLURM_GPUS_ON_NODE:-8}))
DEVICE_BATCH=$((524288 / 2048 / GPUS))
if [ "$DEVICE_BATCH" -lt 1 ] || [ $((DEVICE_BATCH * 2048 * GPUS)) -ne 524288 ]; then
    echo "524,288 tokens do not split into whole rows of 2048 over $GPUS GPUs: choose --total-batch-size to suit" >&2
    exit 2
fi
echo "$SLURM_JOB_NUM_NODES nodes x ${SLURM_GPUS_ON_NODE:-8} GPUs: $DEVICE_BATCH rows of 2048 per GPU"

"$PYTHON" -m jaxchat.report reset --keep  # a requeued job keeps its report (the base dir may be a bucket: gs://)

# one task per node. Training exits 75 when a signal stopped it with its checkpoint saved (scripts/train.py's
# EXIT_STOPPED), so a non-zero exit is not always a failure: rather than --kill-on-bad-exit (its SIGKILL of
# the other tasks would make srun report 137, not 75), --wait ends the others a minute after the first task
# exits, so a process that dies does not leave the rest hanging.
status=0
srun --ntasks-per-node=1 --wait=60 "$PYTHON" -m scripts.train --depth=20 \
    --device-batch-size="$DEVICE_BATCH" --save-every=500 --keep-checkpoints=2 --resume-from-step=latest \
    --run="$WANDB_RUN" "$@" || status=$?
# What the exit status says (scripts/train.py, jaxchat/train/loop.py), and what carries the run on:
#   75   stopped by SIGTERM (time limit, preemption) after saving its checkpoint
#   69   a process lost a peer (a node died, an OOM kill); the newest complete checkpoint is intact
#   134  JAX's own abort: the coordination service lost a process (process 0, or one whose loss no collective
#        reported) within --heartbeat-timeout
# Each is carried on by this same job: queue it again (--resume-from-step=latest continues exactly) rather than
# evaluate a half run. A job that keeps losing processes is queued again at most JAXCHAT_MAX_REQUEUES times
# (default 3; SLURM counts its restarts in SLURM_RESTART_COUNT); a time limit requeues it always. Not queued
# again: 70, another process failed with its own error (an out-of-memory, a bug: its output has it, and it exits
# 1, or 74 for a failed save), which the same run would meet again; and any other failure.
requeue=0
case "$status" in
    75) requeue=1 ;;
    69|134) [ "${SLURM_RESTART_COUNT:-0}" -lt "${JAXCHAT_MAX_REQUEUES:-3}" ] && requeue=1 ;;
esac
if [ "$requeue" = 1 ]; then
    echo "training exited with status $status: queueing job $SLURM_JOB_ID again to resume from its newest checkpoint"
    scontrol requeue "$SLURM_JOB_ID" || true  # (on preemption SLURM requeues it already)
    exit 0
fi
[ "$status" -eq 0 ] || exit "$status"

# evaluation runs on every node too (the batches span all devices); the report on this one
srun --ntasks-per-node=1 --kill-on-bad-exit=1 "$PYTHON" -m scripts.base_loss --device-batch-size="$DEVICE_BATCH"
srun --ntasks-per-node=1 --kill-on-bad-exit=1 "$PYTHON" -m scripts.base_eval
"$PYTHON" -m jaxchat.report generate
