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
set -euo pipefail

DATA=${DATA:-/data/my-gpt2_text_document}
VOCAB=${VOCAB:-/data/gpt2-vocab.json}
MERGES=${MERGES:-/data/gpt2-merges.txt}
CKPT=${CKPT:-$PWD/checkpoints/gpt-chimera}
export MASTER_PORT=${MASTER_PORT:-29500}

# exec: the background job's pid is srun's own, so the trap signals srun itself.
launch() {
    exec srun --kill-on-bad-exit=1 python pretrain_gpt.py \
    --tensor-model-parallel-size 2 \
    --pipeline-model-parallel-size 8 --pipeline-schedule chimera \
    --chimera-variant direct --chimera-grad-sync eager-opt \
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --seq-length 1024 --max-position-embeddings 1024 \
    --micro-batch-size 4 --global-batch-size 128 \
    --lr 0.00015 --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-fraction .01 \
    --weight-decay 1e-2 --clip-grad 1.0 --bf16 \
    --train-iters 500000 --lr-decay-iters 320000 \
    --data-path "$DATA" --vocab-file "$VOCAB" --merge-file "$MERGES" --split 949,50,1 \
    --save "$CKPT" --load "$CKPT" --save-interval 1000 \
    --log-interval 100 --eval-interval 1000 --eval-iters 10 \
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
