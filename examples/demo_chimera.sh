#!/usr/bin/env bash
# The README demo: build the offline corpus (Python standard-library sources, a SentencePiece
# tokenizer, Megatron .bin/.idx), then train a small GPT with Chimera on 4 CPU processes (gloo).
# PYTHON overrides the interpreter (default: the project's .venv, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

"$PYTHON" tools/build_demo_corpus.py

OMP_NUM_THREADS=1 "$PYTHON" -m torch.distributed.run --nproc-per-node 4 --master-port "${MASTER_PORT:-29517}" \
    pretrain_gpt.py \
    --pipeline-model-parallel-size 4 --pipeline-schedule chimera \
    --num-layers 8 --hidden-size 64 --num-attention-heads 4 \
    --seq-length 64 --max-position-embeddings 64 \
    --micro-batch-size 2 --global-batch-size 16 \
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 5 --clip-grad 1.0 \
    --train-iters "${TRAIN_ITERS:-60}" --log-interval 10 --eval-interval 30 --eval-iters 2 \
    --data-path data/demo/corpus_text_document --split 949,50,1 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model data/demo/tokenizer.model \
    --seed 1234 "$@"
