#!/usr/bin/env bash
# Single-node torchrun launch: 8 processes = TP 2 x PP 4 (Chimera) x DP 1.
# On a CPU-only machine the same command runs on gloo (pass --distributed-backend gloo to force it).
set -euo pipefail
NPROC=${NPROC:-8}
torchrun --nproc-per-node "$NPROC" pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 --pipeline-schedule chimera \
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --seq-length 1024 --max-position-embeddings 1024 \
    --micro-batch-size 4 --global-batch-size 64 \
    --lr 0.00015 --lr-decay-style cosine --lr-warmup-fraction .01 --clip-grad 1.0 --bf16 \
    --train-iters 1000 --log-interval 10 --eval-interval 200 --eval-iters 10 \
    --data-path "${DATA:?set DATA to a PREFIX_text_document}" \
    --vocab-file "${VOCAB:?set VOCAB}" --merge-file "${MERGES:?set MERGES}" "$@"
