#!/usr/bin/env bash
# Megatron-style SLURM launch of GPT pretraining with Chimera bidirectional pipelines.
#   sbatch --nodes 4 --ntasks-per-node 8 --gpus-per-node 8 examples/pretrain_gpt_chimera_slurm.sh
# srun starts one task per GPU; pretrain_gpt.py reads its rank from SLURM_PROCID / SLURM_NTASKS /
# SLURM_LOCALID and the master address from the first host of SLURM_JOB_NODELIST (override with
# MASTER_ADDR / MASTER_PORT). Layout here: TP 2 (inside a node) x PP 8 (Chimera, D even) x DP 2.
#SBATCH --job-name=gpt-chimera
#SBATCH --time=04:00:00
set -euo pipefail

DATA=${DATA:-/data/my-gpt2_text_document}
VOCAB=${VOCAB:-/data/gpt2-vocab.json}
MERGES=${MERGES:-/data/gpt2-merges.txt}
CKPT=${CKPT:-$PWD/checkpoints/gpt-chimera}
export MASTER_PORT=${MASTER_PORT:-29500}

srun --kill-on-bad-exit=1 python pretrain_gpt.py \
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
    --distributed-timeout-minutes 10
