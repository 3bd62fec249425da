"""Tier 0: every flag of Megatron-LM's argument list is classified here: a config field, accepted
for compatibility (parsed, logged once as ignored) or known but not implemented (rejected with its
reason); none of them is an "unknown flag".

The lists below are the option strings of every ``add_argument`` call in Megatron-LM's
``megatron/training/arguments.py`` at commit 307dcf37f03d44da131ba21999278abe4112d2ad, split by how
Megatron declares the value: a switch (store_true/store_false), one value, or a list (nargs).
"""

import logging

import pytest

from megatron.training.arguments import accepted_flags, parse_args, parse_command_line
from megatron.training.megatron_flags import COMPATIBILITY_FLAGS, UNIMPLEMENTED_FLAGS

MEGATRON_COMMIT = "307dcf37f03d44da131ba21999278abe4112d2ad"

MEGATRON_SWITCHES = (
    "--no-fp8-wgrad", "--output-bert-embeddings", "--retro-add-retriever",
    "--retro-no-verify-neighbor-count", "--group-query-attention",
    "--use-rotary-position-embeddings", "--rotary-interleaved", "--no-position-embedding",
    "--apply-layernorm-1p", "--apply-residual-connection-post-layernorm", "--openai-gelu",
    "--squared-relu", "--swiglu", "--bert-no-binary-head", "--untie-embeddings-and-output-weights",
    "--log-straggler", "--disable-straggler-on-startup", "--log-params-norm",
    "--log-num-zeros-in-grad", "--log-throughput", "--log-progress",
    "--no-barrier-with-level-1-timing", "--log-timers-to-tensorboard",
    "--log-batch-size-to-tensorboard", "--no-log-learnig-rate-to-tensorboard",
    "--no-log-loss-scale-to-tensorboard", "--log-validation-ppl-to-tensorboard",
    "--log-memory-to-tensorboard", "--log-world-size-to-tensorboard", "--enable-one-logger",
    "--recompute-activations", "--no-check-for-nan-in-loss-and-grad",
    "--distribute-saved-activations", "--no-clone-scatter-output-in-embedding", "--profile",
    "--tp-comm-overlap", "--disable-tp-comm-overlap-ag", "--disable-tp-comm-overlap-rs",
    "--tp-comm-overlap-rs-dgrad", "--disable-tp-comm-bulk-dgrad", "--disable-tp-comm-bulk-wgrad",
    "--use-cpu-initialization", "--deterministic-mode", "--checkpoint-activations",
    "--exit-signal-handler", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion", "--use-flash-attn",
    "--disable-bias-linear", "--add-qkv-bias", "--no-async-tensor-model-parallel-allreduce",
    "--no-persist-layer-norm", "--sequence-parallel", "--no-gradient-accumulation-fusion",
    "--use-mcore-models", "--manual-gc", "--no-manual-gc-eval", "--disable-tp-comm-split-ag",
    "--disable-tp-comm-split-rs", "--data-parallel-random-init", "--init-method-xavier-uniform",
    "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler", "--no-save-optim",
    "--no-save-rng", "--no-load-optim", "--no-load-rng", "--finetune", "--no-initialization",
    "--use-checkpoint-args", "--exit-on-missing-checkpoint", "--use-dist-ckpt",
    "--auto-detect-ckpt-format", "--ckpt-fully-parallel-save", "--async-save",
    "--ckpt-fully-parallel-load", "--ckpt-assume-constant-structure", "--fp16", "--bf16",
    "--fp32-residual-connection", "--apply-query-key-layer-scaling", "--attention-softmax-in-fp32",
    "--accumulate-allreduce-grads-in-fp32", "--fp16-lm-cross-entropy",
    "--no-overlap-p2p-communication", "--overlap-grad-reduce", "--no-delay-grad-reduce",
    "--overlap-param-gather", "--delay-param-gather", "--no-scatter-gather-tensors-in-pipeline",
    "--use-ring-exchange-p2p", "--standalone-embedding-stage", "--use-distributed-optimizer",
    "--use-tp-pp-dp-mapping", "--test-mode", "--skip-train", "--no-mmap-bin-files", "--mock-data",
    "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss",
    "--no-create-attention-mask-in-dataloader", "--adlr-autoresume",
    "--biencoder-shared-query-context-model", "--use-one-sent-docs", "--retriever-score-scaling",
    "--no-data-sharding", "--vision-pretraining", "--dino-norm-last-layer", "--qk-layernorm",
    "--moe-grouped-gemm", "--moe-per-layer-logging", "--moe-pad-expert-input-to-capacity",
    "--moe-layer-recompute", "--moe-extended-tp",
)

MEGATRON_ONE_VALUE = (
    "--fp8-format", "--fp8-margin", "--fp8-interval", "--fp8-amax-history-len",
    "--fp8-amax-compute-algo", "--transformer-impl", "--inference-batch-times-seqlen-threshold",
    "--max-tokens-to-oom", "--bert-embedder-type", "--retro-project-dir",
    "--retro-cyclic-train-iters", "--retro-encoder-layers", "--retro-encoder-hidden-dropout",
    "--retro-encoder-attention-dropout", "--retro-num-neighbors", "--retro-num-retrieved-chunks",
    "--retro-attention-gate", "--num-layers", "--encoder-num-layers", "--decoder-num-layers",
    "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--kv-channels",
    "--num-query-groups", "--max-position-embeddings", "--position-embedding-type",
    "--rotary-percent", "--rotary-seq-len-interpolation-factor", "--make-vocab-size-divisible-by",
    "--normalization", "--norm-epsilon", "--onnx-safe", "--straggler-ctrlr-port",
    "--straggler-minmax-count", "--timing-log-level", "--timing-log-option",
    "--tensorboard-log-interval", "--tensorboard-queue-size", "--wandb-project",
    "--wandb-exp-name", "--wandb-save-dir", "--one-logger-project", "--one-logger-entity",
    "--one-logger-run-name", "--attention-dropout", "--hidden-dropout", "--weight-decay",
    "--start-weight-decay", "--end-weight-decay", "--weight-decay-incr-style", "--clip-grad",
    "--adam-beta1", "--adam-beta2", "--adam-eps", "--sgd-momentum", "--micro-batch-size",
    "--batch-size", "--global-batch-size", "--recompute-granularity", "--recompute-method",
    "--recompute-num-layers", "--profile-step-start", "--profile-step-end",
    "--tp-comm-overlap-cfg", "--empty-unused-memory-level",
    "--check-weight-hash-across-dp-replicas-interval", "--train-iters", "--train-samples",
    "--log-interval", "--exit-interval", "--exit-duration-in-mins", "--tensorboard-dir",
    "--optimizer", "--dataloader-type", "--manual-gc-interval", "--seed", "--init-method-std",
    "--lr", "--lr-decay-style", "--lr-decay-iters", "--lr-decay-samples", "--lr-warmup-fraction",
    "--lr-warmup-iters", "--lr-warmup-samples", "--lr-warmup-init", "--warmup", "--min-lr",
    "--decoupled-lr", "--decoupled-min-lr", "--save", "--save-interval", "--load",
    "--pretrained-checkpoint", "--ckpt-step", "--dist-ckpt-format", "--loss-scale",
    "--initial-loss-scale", "--min-loss-scale", "--loss-scale-window", "--hysteresis",
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
    "--pipeline-model-parallel-split-rank", "--model-parallel-size",
    "--num-layers-per-virtual-pipeline-stage", "--distributed-backend",
    "--distributed-timeout-minutes", "--ddp-bucket-size", "--local_rank", "--lazy-mpu-init",
    "--context-parallel-size", "--nccl-communicator-config-path", "--eval-iters",
    "--eval-interval", "--split", "--data-cache-path", "--vocab-size", "--vocab-file",
    "--merge-file", "--vocab-extra-ids", "--seq-length", "--encoder-seq-length",
    "--decoder-seq-length", "--retriever-seq-length", "--sample-rate", "--mask-prob",
    "--short-seq-prob", "--num-workers", "--tokenizer-type", "--tokenizer-model",
    "--num-dataset-builder-threads", "--adlr-autoresume-interval", "--ict-head-size",
    "--biencoder-projection-dim", "--ict-load", "--bert-load", "--titles-data-path",
    "--query-in-block-prob", "--evidence-data-path", "--block-data-path", "--embedding-path",
    "--indexer-batch-size", "--indexer-log-interval", "--num-classes", "--img-h", "--img-w",
    "--num-channels", "--patch-dim", "--classes-fraction", "--data-per-class-fraction",
    "--head-lr-mult", "--vision-pretraining-type", "--vision-backbone-type",
    "--swin-backbone-type", "--mask-type", "--mask-factor", "--iter-per-epoch",
    "--dino-local-img-size", "--dino-local-crops-number", "--dino-head-hidden-size",
    "--dino-bottleneck-size", "--dino-freeze-last-layer", "--dino-warmup-teacher-temp",
    "--dino-teacher-temp", "--dino-warmup-teacher-temp-epochs", "--expert-model-parallel-size",
    "--num-experts", "--moe-router-load-balancing-type", "--moe-router-topk",
    "--moe-aux-loss-coeff", "--moe-z-loss-coeff", "--moe-input-jitter-eps",
    "--moe-token-dispatcher-type", "--moe-expert-capacity-factor", "--moe-token-drop-policy",
    "--yaml-cfg",
)

MEGATRON_LISTS = (
    "--rampup-batch-size", "--profile-ranks", "--data-path", "--train-data-path",
    "--valid-data-path", "--test-data-path", "--retriever-report-topk-accuracies", "--spec",
)

MEGATRON_FLAGS = MEGATRON_SWITCHES + MEGATRON_ONE_VALUE + MEGATRON_LISTS

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 5 --mock-data").split()

COMPATIBILITY = {flag.flag: flag for flag in COMPATIBILITY_FLAGS}
UNIMPLEMENTED = {flag.flag: flag for flag in UNIMPLEMENTED_FLAGS}


def plausible_values(flag: str) -> list[str]:
    """Values in the syntax Megatron declares for ``flag`` (none for a switch)."""
    if flag in COMPATIBILITY and COMPATIBILITY[flag].choices:
        return [COMPATIBILITY[flag].choices[-1]]
    if flag in MEGATRON_LISTS:
        return ["1", "2"]
    if flag in MEGATRON_ONE_VALUE:
        return ["2"]
    return []


def test_the_megatron_list_has_no_duplicates():
    assert len(set(MEGATRON_FLAGS)) == len(MEGATRON_FLAGS) == 303


def test_every_megatron_flag_is_accepted_or_known_unimplemented():
    accepted = set(accepted_flags())
    unclassified = [flag for flag in MEGATRON_FLAGS
                    if flag not in accepted and flag not in UNIMPLEMENTED]
    assert not unclassified, f"Megatron flags that would be 'unknown flag': {unclassified}"
    assert not accepted & set(UNIMPLEMENTED), "a flag is both accepted and rejected"
    assert len(COMPATIBILITY) == len(COMPATIBILITY_FLAGS), "a compatibility flag is listed twice"
    assert len(UNIMPLEMENTED) == len(UNIMPLEMENTED_FLAGS), "an unimplemented flag is listed twice"


def test_compatibility_flags_take_values_as_megatron_declares_them():
    for flag in MEGATRON_FLAGS:
        if flag not in COMPATIBILITY:
            continue
        spec = COMPATIBILITY[flag]
        takes_one = spec.choices is not None or spec.takes_value
        assert takes_one == (flag in MEGATRON_ONE_VALUE), flag
        assert spec.takes_list == (flag in MEGATRON_LISTS), flag


@pytest.mark.parametrize("flag", [flag for flag in MEGATRON_FLAGS if flag in COMPATIBILITY])
def test_compatibility_flag_parses_with_megatrons_value_syntax(flag):
    parsed = parse_command_line(TINY + [flag] + plausible_values(flag))
    assert parsed.problems == []
    assert len(parsed.ignored) == 1 and parsed.ignored[0].startswith(flag + " is accepted")


def test_every_compatibility_flag_is_logged_once_as_ignored(caplog):
    argv = list(TINY)
    for flag in COMPATIBILITY_FLAGS:
        argv += [flag.flag] + plausible_values(flag.flag)
    with caplog.at_level(logging.WARNING, logger="megatron.training.arguments"):
        parse_args(argv, world_size=1)
    ignored = [record.getMessage() for record in caplog.records
               if "accepted for compatibility and ignored" in record.getMessage()]
    assert [message.split()[0] for message in ignored] == list(COMPATIBILITY)
    for message in ignored:
        assert message.endswith(COMPATIBILITY[message.split()[0]].reason)


@pytest.mark.parametrize("flag", list(UNIMPLEMENTED))
def test_unimplemented_flag_is_rejected_with_its_reason(flag):
    parsed = parse_command_line(TINY + [flag] + plausible_values(flag))
    assert parsed.problems == [f"{flag} is not implemented: {UNIMPLEMENTED[flag].reason}"]


def test_every_unimplemented_flag_is_reported_in_one_message(capsys):
    argv = list(TINY)
    for flag in UNIMPLEMENTED:
        argv += [flag] + plausible_values(flag)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, world_size=1)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert f"{len(UNIMPLEMENTED)} problems:" in message
    assert "unknown flag" not in message
    for flag in UNIMPLEMENTED:
        assert f"  - {flag} is not implemented: " in message, flag
