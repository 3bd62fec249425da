#!/usr/bin/env bash
# The first thing to run on a machine with NVIDIA GPUs (docs/benchmarks.md, docs/performance_model.md).
#
#   bash benchmarks/gpu_check.sh                    # results and logs in ${OUT:-./gpu_check_out}
#   GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh   # CPU dry mode: tiny sizes, no GPU needed
#
# Steps, each under its own `timeout`; the whole script stops starting steps at TOTAL_BUDGET seconds
# (default 540) and cuts a step's timeout to what is left, so it ends within 10 minutes (normally 4-6):
#   0. setup   : torch and this project importable (pip install -e . if `import megatron` fails,
#                pip install torch==${TORCH_VERSION:-2.13.0} if torch is missing)
#   a. stage   : one GPT-2 1.3B-like stage (h=2048, 16 heads, 4 layers, s=1024; our GPTModel) forward
#                and backward time for B = 1,2,4 in bf16, and model-FLOPs utilisation
#   b. p2p     : NCCL point-to-point bandwidth between GPU 0 and 1 (skipped with one GPU)
#   c. smoke   : pretrain_gpt.py --mock-data for a few iterations on CUDA (1 GPU, or 2 with DP=2) and on
#                the CPU (gloo, 1 process), same seed, dropout off: the lm loss values must agree
#                within a relative ${LOSS_RTOL:-1e-3} (fp32 both sides; TF32 is off by default in torch)
#   e. determ. : pretrain_gpt.py --deterministic-mode twice on the device (dropout on): identical
#                lm loss values (torch deterministic algorithms must cover every op it runs)
#   d. measure : tools/performance_model.py --measure writes a hardware profile for this device,
#                and the planner reads it back with --profile
#   f. depth   : issue 26 on this machine's CPU cores (no GPU used): benchmarks/emulated_depth.py at
#                D = 4 and 8, N = D, 80 ms units, our Chimera variants against PyTorch's zero-bubble
#                schedules, one rank per core, about 2 minutes (our 2-core machines run 4-16 ranks
#                on 2 cores and post every gloo message slowly, docs/benchmarks.md §9); skipped
#                below 16 cores
# Environment: PYTHON (default python3), OUT, GPU_CHECK_DEVICE (cuda | cpu), GPU_PEAK_TFLOPS (MFU of
# an unlisted GPU), STEP_TIMEOUT_SCALE (multiplies every timeout; default 1), TOTAL_BUDGET.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
OUT="${OUT:-./gpu_check_out}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
SCALE="${STEP_TIMEOUT_SCALE:-1}"
RTOL="${LOSS_RTOL:-1e-3}"
BUDGET="${TOTAL_BUDGET:-540}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
export PYTHONUNBUFFERED=1

note() { echo "$*" | tee -a "$SUMMARY"; }
limit() { echo $(( $1 * SCALE )); }

# Run one step: NAME SECONDS COMMAND...; its output goes to $OUT/NAME.log and the terminal.
step() {
    local name="$1" seconds left
    seconds="$(limit "$2")"
    shift 2
    left=$(( BUDGET - SECONDS ))
    if [ "$left" -lt 15 ]; then
        note "[SKIPPED] $name: the ${BUDGET}s budget is spent"
        return 125
    fi
    [ "$seconds" -gt "$left" ] && seconds="$left"
    echo "=== $name (timeout ${seconds}s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$seconds" "$@" > "$OUT/$name.log" 2>&1
    local status=$?
    tail -n 25 "$OUT/$name.log"
    local took=$(( SECONDS - start ))
    if [ "$status" -eq 0 ]; then
        note "[ok]     $name (${took}s)"
    elif [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        note "[TIMEOUT] $name after ${seconds}s (log: $OUT/$name.log)"
    else
        note "[FAILED] $name, exit $status (${took}s; log: $OUT/$name.log)"
    fi
    return "$status"
}

if [ "$DEVICE" = "cpu" ]; then
    # CPU dry mode: the same steps at tiny sizes, to check the script itself anywhere.
    export STAGE_HIDDEN=64 STAGE_HEADS=4 STAGE_LAYERS=2 STAGE_SEQ=64 STAGE_MICRO_BATCHES=1,2
    MODEL_FLAGS="--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --vocab-size 256"
    MEASURE_FLAGS="--measure --measure-device cpu --measure-dtype fp32 --measure-layers 2 --measure-micro-batch-sizes 1,2 --measure-threads 1 --measure-repeats 3"
    SMOKE_MODEL="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --vocab-size 256"
    SMOKE_ITERS=3
    DEPTH_FLAGS="--depths 2 --counts 1 --unit-ms 5 --rounds 1 --only split ZBVZeroBubble"
    DEPTH_MIN_CORES=1
    export OMP_NUM_THREADS=1
else
    MODEL_FLAGS="--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024 --vocab-size 50257"
    MEASURE_FLAGS="--measure --measure-device cuda --measure-dtype bf16 --measure-layers 2 --measure-micro-batch-sizes 1,2,4"
    SMOKE_MODEL="--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 --vocab-size 1024"
    SMOKE_ITERS=8
    DEPTH_FLAGS="--depths 4 8 --counts 1 --unit-ms 80 --rounds 2 --only chimera ZeroBubble"
    DEPTH_MIN_CORES=16
fi
note "gpu_check: device mode '$DEVICE', results in $OUT, python $PY"

# ---- 0. setup --------------------------------------------------------------------------------
if ! "$PY" -c "import torch" > /dev/null 2>&1; then
    step setup-torch 120 "$PY" -m pip install "torch==${TORCH_VERSION:-2.13.0}"
fi
if ! (cd "$OUT" && "$PY" -c "import megatron.core.models.gpt") > /dev/null 2>&1; then
    step setup-project 90 "$PY" -m pip install --no-build-isolation -e "$ROOT" || \
        note "         (the steps below still run from the repository root, where megatron imports)"
fi
"$PY" - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import torch
count = torch.cuda.device_count() if torch.cuda.is_available() else 0
names = ", ".join(torch.cuda.get_device_name(i) for i in range(count)) or "none"
print(f"         torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs: {count} ({names})")
EOF
GPUS="$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)"
if [ "$DEVICE" != "cpu" ] && [ "$GPUS" -lt 1 ]; then
    note "no CUDA device visible: rerun with GPU_CHECK_DEVICE=cpu for the dry mode"
    exit 1
fi

# ---- a. one GPT-2 1.3B-like stage, bf16 ------------------------------------------------------
step stage 90 "$PY" benchmarks/gpu_check.py stage "$OUT/stage.json"
grep -h "^stage " "$OUT/stage.log" >> "$SUMMARY" 2>/dev/null

# ---- b. NCCL p2p bandwidth -------------------------------------------------------------------
step p2p 60 "$PY" benchmarks/gpu_check.py p2p "$OUT/p2p.json"
grep -h "^p2p" "$OUT/p2p.log" >> "$SUMMARY" 2>/dev/null

# ---- c. training smoke run: CUDA vs CPU losses -----------------------------------------------
SMOKE_FLAGS="$SMOKE_MODEL --micro-batch-size 2 --global-batch-size 8 --lr 1e-4 --train-iters $SMOKE_ITERS \
    --log-interval 1 --mock-data --seed 1234 --eval-iters 0 --attention-dropout 0 --hidden-dropout 0"
if [ "$DEVICE" = "cpu" ]; then
    NPROC=1; FIRST_BACKEND="--distributed-backend gloo"; FIRST_NAME=smoke-first-cpu
else
    NPROC=$(( GPUS >= 2 ? 2 : 1 )); FIRST_BACKEND=""; FIRST_NAME=smoke-cuda
fi
# shellcheck disable=SC2086  # the flag strings are meant to split
step "$FIRST_NAME" 80 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    pretrain_gpt.py $SMOKE_FLAGS $FIRST_BACKEND
# shellcheck disable=SC2086
step smoke-cpu 80 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
    pretrain_gpt.py $SMOKE_FLAGS --distributed-backend gloo
step smoke-compare 20 "$PY" benchmarks/gpu_check.py compare-losses \
    "$OUT/$FIRST_NAME.log" "$OUT/smoke-cpu.log" "$OUT/smoke.json" --rtol "$RTOL"
grep -h "^loss comparison" "$OUT/smoke-compare.log" >> "$SUMMARY" 2>/dev/null

# ---- e. --deterministic-mode: two runs on the device print identical losses (dropout on) ------
for RUN in 1 2; do
    # shellcheck disable=SC2086
    step "deterministic-$RUN" 80 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
        pretrain_gpt.py $SMOKE_FLAGS $FIRST_BACKEND --attention-dropout 0.1 --hidden-dropout 0.1 \
        --deterministic-mode
done
step deterministic-compare 20 "$PY" benchmarks/gpu_check.py compare-losses \
    "$OUT/deterministic-1.log" "$OUT/deterministic-2.log" "$OUT/deterministic.json" --rtol 0
grep -h "^loss comparison" "$OUT/deterministic-compare.log" >> "$SUMMARY" 2>/dev/null

# ---- d. calibration: --measure writes a profile, --profile reads it --------------------------
# shellcheck disable=SC2086
step measure 100 "$PY" tools/performance_model.py $MODEL_FLAGS $MEASURE_FLAGS \
    --out "$OUT/profile.json"
grep -h "sustained\|note:" "$OUT/measure.log" >> "$SUMMARY" 2>/dev/null
# shellcheck disable=SC2086
step plan-with-profile 30 "$PY" tools/performance_model.py $MODEL_FLAGS --profile "$OUT/profile.json" \
    --world-size 8 --global-batch-size 64 --schemes chimera-direct,1f1b --top 5

# ---- f. emulated stages at depth on the CPU cores, one rank per core (issue 26) ---------------
if [ "$(nproc)" -ge "$DEPTH_MIN_CORES" ]; then
    # shellcheck disable=SC2086
    step depth 240 "$PY" benchmarks/emulated_depth.py $DEPTH_FLAGS
    grep -h "best ours" "$OUT/depth.log" >> "$SUMMARY" 2>/dev/null
else
    note "[skip]   depth: $(nproc) CPU cores, fewer than the $DEPTH_MIN_CORES it needs for a core per rank"
fi

echo
echo "=================== gpu_check summary ($OUT/summary.txt) ==================="
cat "$SUMMARY"
if grep -q "^\[FAILED\]\|^\[TIMEOUT\]\|^\[SKIPPED\]" "$SUMMARY"; then
    exit 1
fi
exit 0
