#!/usr/bin/env bash
# Megatron-style SLURM launch of GPT pretraining with Chimera bidirectional pipelines.
#   mkdir -p logs && sbatch examples/pretrain_gpt_chimera_slurm.sh
# (the #SBATCH lines below ask for 4 nodes x 8 GPUs; command-line options of sbatch override them).
# srun starts one task per GPU; pretrain_gpt.py reads its rank from SLURM_PROCID / SLURM_NTASKS /
# SLURM_LOCALID and the master address from the first host of SLURM_JOB_NODELIST (override with
# MASTER_ADDR / MASTER_PORT). Layout here: TP 2 (inside a node) x PP 8 (Chimera, D even) x DP 2.
# Run pretrain_gpt.py through srun (or torchrun): started directly in this script it is a single
# process of a 32-task job, and it stops at once with a message saying so.
# GPUs: each task uses GPU (local rank mod visible GPUs), so --gpus-per-node (all 8 visible, task i
# uses GPU i) and --gpus-per-task=1 / --gpu-bind (each task sees only its own GPU) both work.
#SBATCH --job-name=gpt-chimera
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --time=04:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --error=logs/%x-%j.err
# Preemption and the time limit: SLURM sends SIGTERM to this batch shell (B:) 120 s before the end.
# The trap below forwards it to srun, which passes it to every task; with --exit-signal-handler
# pretrain_gpt.py saves a checkpoint at the end of the current iteration and exits cleanly.
#SBATCH --signal=B:TERM@120
# Requeue: SLURM may put the job back in the queue (preemption, a failed node; or `scontrol requeue
# JOBID`); the new run (SLURM_RESTART_COUNT > 0) resumes from the newest COMPLETE checkpoint in
# $CKPT (--load reads the tracker, which a save writes last), and the logs are appended to.
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail

DATA=${DATA:-/data/my-gpt2_text_document}
VOCAB=${VOCAB:-/data/gpt2-vocab.json}
MERGES=${MERGES:-/data/gpt2-merges.txt}
CKPT=${CKPT:-$PWD/checkpoints/gpt-chimera}
export MASTER_PORT=${MASTER_PORT:-29500}
# Each group of flags may be replaced from the environment (e.g. a small model for a test run).
read -r -a PARALLEL_ARGS <<< "${PARALLEL_ARGS:-\
--tensor-model-parallel-size 2 --pipeline-model-parallel-size 8 --pipeline-schedule chimera \
--chimera-variant direct --chimera-grad-sync eager-opt}"
read -r -a MODEL_ARGS <<< "${MODEL_ARGS:-\
--num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
--seq-length 1024 --max-position-embeddings 1024 --bf16}"
read -r -a TRAINING_ARGS <<< "${TRAINING_ARGS:-\
--micro-batch-size 4 --global-batch-size 128 \
--lr 0.00015 --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-fraction .01 \
--weight-decay 1e-2 --clip-grad 1.0 --train-iters 500000 --lr-decay-iters 320000 \
--log-interval 100 --eval-interval 1000 --eval-iters 10 --save-interval 1000}"
read -r -a DATA_ARGS <<< "${DATA_ARGS:-\
--data-path $DATA --vocab-file $VOCAB --merge-file $MERGES --split 949,50,1}"

if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
    echo "$(date): requeued (SLURM_RESTART_COUNT=$SLURM_RESTART_COUNT); resuming from $CKPT"
fi

# exec: the background job's pid is srun's own, so the trap signals srun itself.
launch() {
    exec srun --kill-on-bad-exit=1 python pretrain_gpt.py \
    "${PARALLEL_ARGS[@]}" "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" \
    --save "$CKPT" --load "$CKPT" \
    --distributed-timeout-minutes 10 --exit-signal-handler
}

# bash runs a trap only between commands, so srun runs in the background while the shell waits.
launch &
SRUN_PID=$!
forward_sigterm() {
    echo "$(date): SIGTERM received, forwarding it to srun (pid $SRUN_PID)"
    kill -TERM "$SRUN_PID"
}
trap forward_sigterm TERM
status=0
wait "$SRUN_PID" || status=$?
if [ "$status" -gt 128 ] && kill -0 "$SRUN_PID" 2>/dev/null; then
    # wait was interrupted by the trap; the tasks are saving their checkpoint: wait for them.
    status=0
    wait "$SRUN_PID" || status=$?
fi
exit "$status"
