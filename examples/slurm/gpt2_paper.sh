#!/usr/bin/env bash
# The Chimera paper's GPT-2 runs (Li & Hoefler SC'21, §5): 64 layers, hidden 1280, 20 heads,
# FFN 5120, sequence 632, vocabulary 50257, untied output layer, fp32, one sequence per worker
# (mini-batch = number of workers). Pick the run with the first argument:
#
#   sbatch --nodes 2048 --ntasks-per-node 1 --gpus-per-node 1 examples/slurm/gpt2_paper.sh chimera
#   sbatch --nodes 2048 ... examples/slurm/gpt2_paper.sh 1f1b       # DAPPLE/1F1B, D=16, recompute
#   sbatch --nodes 2048 ... examples/slurm/gpt2_paper.sh gpipe      # GPipe, D=8, recompute
#   sbatch --nodes 512  ... examples/slurm/gpt2_paper.sh sweep-d64  # 512-node sweep: W=8,  D=64
#   sbatch --nodes 512  ... examples/slurm/gpt2_paper.sh sweep-d32  #                 W=16, D=32
#   sbatch --nodes 512  ... examples/slurm/gpt2_paper.sh sweep-d16  #                 W=32, D=16, recompute
#   sbatch --nodes 512  ... examples/slurm/gpt2_paper.sh sweep-d8   #                 W=64, D=8,  recompute
#
# Parameterised by nodes and GPUs per node: world = SLURM_JOB_NUM_NODES x GPUS_PER_NODE (the paper:
# one P100 per node), W = world / D is derived by pretrain_gpt.py. Overrides: GLOBAL_BATCH
# (default = world), MICRO_BATCH (default 1, the paper's Chimera B), DATA / VOCAB / MERGES (default:
# --mock-data with the GPT-2 vocabulary size), TRAIN_ITERS. DRY_RUN=1 prints the command instead of
# launching it (tests/distributed/test_slurm_examples.py parses every run's flags this way).
# Predicted throughput of each run: python benchmarks/reproduce_paper.py
#SBATCH --job-name=gpt2-chimera-paper
#SBATCH --time=01:00:00
set -euo pipefail

RUN=${1:-chimera}
NODES=${SLURM_JOB_NUM_NODES:-${NODES:-1}}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
WORLD=$((NODES * GPUS_PER_NODE))
GLOBAL_BATCH=${GLOBAL_BATCH:-$WORLD}
MICRO_BATCH=${MICRO_BATCH:-1}
TRAIN_ITERS=${TRAIN_ITERS:-100}
export MASTER_PORT=${MASTER_PORT:-29500}

RECOMPUTE=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
CHIMERA=(--pipeline-schedule chimera --chimera-variant direct --chimera-grad-sync eager-opt)
case "$RUN" in
    chimera)   SCHEDULE=("${CHIMERA[@]}" --pipeline-model-parallel-size 32) ;;
    1f1b)      SCHEDULE=(--pipeline-schedule 1f1b --pipeline-model-parallel-size 16 "${RECOMPUTE[@]}") ;;
    gpipe)     SCHEDULE=(--pipeline-schedule gpipe --pipeline-model-parallel-size 8 "${RECOMPUTE[@]}") ;;
    sweep-d64) SCHEDULE=("${CHIMERA[@]}" --pipeline-model-parallel-size 64) ;;
    sweep-d32) SCHEDULE=("${CHIMERA[@]}" --pipeline-model-parallel-size 32) ;;
    sweep-d16) SCHEDULE=("${CHIMERA[@]}" --pipeline-model-parallel-size 16 "${RECOMPUTE[@]}") ;;
    sweep-d8)  SCHEDULE=("${CHIMERA[@]}" --pipeline-model-parallel-size 8 "${RECOMPUTE[@]}") ;;
    *) echo "error: unknown run '$RUN'; use chimera, 1f1b, gpipe, sweep-d64, sweep-d32, sweep-d16 or sweep-d8" >&2
       exit 2 ;;
esac

if [[ -n "${DATA:-}" ]]; then
    DATA_FLAGS=(--data-path "$DATA" --vocab-file "${VOCAB:?set VOCAB}" --merge-file "${MERGES:?set MERGES}"
                --split 949,50,1)
else
    DATA_FLAGS=(--mock-data --vocab-size 50257)
fi

ARGS=(
    "${SCHEDULE[@]}"
    --num-layers 64 --hidden-size 1280 --num-attention-heads 20 --ffn-hidden-size 5120
    --seq-length 632 --max-position-embeddings 1024 --untie-embeddings-and-output-weights
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
    --lr 0.00015 --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-fraction .01
    --weight-decay 1e-2 --clip-grad 1.0 --train-iters "$TRAIN_ITERS"
    "${DATA_FLAGS[@]}" --log-interval 10 --eval-interval 1000 --eval-iters 1
    --distributed-timeout-minutes 10
)

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%s\n' "$WORLD" "${ARGS[@]}"
    exit 0
fi
srun --kill-on-bad-exit=1 python pretrain_gpt.py "${ARGS[@]}"
