"""Megatron-LM flags that are not fields of our config: the ones accepted and ignored, and the
ones that are known but not implemented.

Megatron launch scripts carry many flags that only tune CUDA kernels, logging side channels or
checkpoint formats. Those are **accepted and logged once as ignored** (:data:`COMPATIBILITY_FLAGS`):
leaving them out cannot change what is trained. Flags for features this project does not have
(mixture of experts, context parallelism, retro, vision, ...) would silently
train a different model if ignored, so they are **known but not implemented**
(:data:`UNIMPLEMENTED_FLAGS`): the parser accepts their syntax only so that one run can report every
problem together, each one named as "not implemented" rather than "unknown".

Together with the config fields these cover every option of Megatron-LM's argument parser at
:data:`MEGATRON_COMMIT` (tests/golden/megatron_flags_d98e8a6.txt) and the spellings its history
accepted and dropped (tests/golden/megatron_flags_removed.txt); tests/unit/test_megatron_flag_catalog.py
checks that none of them is "unknown". This module holds the flags up to May 2024 (307dcf3) and
the earlier spellings; :mod:`megatron.training.megatron_flags_recent` the ones added since.
:data:`RENAMED_FLAGS` maps each earlier spelling to today's flag, and is the only source of "did
you mean" suggestions.

Flags are grouped by reason; a reason shared by several flags is a constant
(:mod:`megatron.training.flag_reasons`), so that the log line, ``--help`` and docs/flags.md say
the same thing for all of them. The classification of flags that *are* config fields lives with
the fields (:mod:`megatron.core.config`,
:data:`megatron.training.config_validation.NOT_SUPPORTED_YET`). docs/flags.md is generated from all
of them.
"""

from __future__ import annotations

from megatron.training import flag_reasons as reasons
from megatron.training.flag_kinds import CompatibilityFlag, UnimplementedFlag
from megatron.training.flag_kinds import rejected as _rejected
from megatron.training.flag_kinds import switches as _switches
from megatron.training.flag_kinds import with_value as _with_value
from megatron.training.megatron_flags_recent import (RECENT_COMPATIBILITY_FLAGS,
                                                      RECENT_UNIMPLEMENTED_FLAGS)

# ---- accepted for compatibility, ignored -----------------------------------------------------
# Ignoring any of these cannot change the trained weights: kernels, communication performance,
# logging side channels, memory housekeeping, checkpoint file formats, profilers, start-up.

COMPATIBILITY_FLAGS: tuple[CompatibilityFlag, ...] = (
    # CUDA kernels and implementation switches.
    CompatibilityFlag("--no-masked-softmax-fusion",
                      "attention uses torch's scaled_dot_product_attention; there is no fused "
                      "softmax kernel to switch off"),
    CompatibilityFlag("--no-bias-gelu-fusion",
                      "bias and GeLU are not fused; nothing to switch off"),
    CompatibilityFlag("--no-bias-dropout-fusion",
                      "bias, dropout and residual add are not fused; nothing to switch off"),
    CompatibilityFlag("--no-bias-swiglu-fusion", f"{reasons.NO_FUSED_KERNEL} (bias and SwiGLU)"),
    CompatibilityFlag("--no-rope-fusion", f"{reasons.NO_FUSED_KERNEL} (rotary embeddings)"),
    CompatibilityFlag("--no-gradient-accumulation-fusion",
                      "gradients accumulate with plain PyTorch ops; there is no fused kernel"),
    CompatibilityFlag("--no-async-tensor-model-parallel-allreduce",
                      "tensor-parallel all-reduces are not overlapped with the weight-gradient "
                      "computation anyway"),
    CompatibilityFlag("--no-persist-layer-norm",
                      f"{reasons.NO_FUSED_KERNEL} (persistent LayerNorm)"),
    CompatibilityFlag("--use-flash-attn",
                      "scaled_dot_product_attention already picks a flash kernel when the device "
                      "has one"),
    CompatibilityFlag("--attention-backend",
                      "scaled_dot_product_attention picks its kernel itself",
                      choices=("auto", "flash", "fused", "unfused", "local")),
    CompatibilityFlag("--attention-softmax-in-fp32",
                      "scaled_dot_product_attention computes the softmax with fp32 accumulation"),
    CompatibilityFlag("--apply-query-key-layer-scaling",
                      "Megatron divides and re-multiplies the attention scores by the layer "
                      "number (same result in exact arithmetic, only an fp16 overflow guard); "
                      "scaled_dot_product_attention does not overflow there"),
    CompatibilityFlag("--transformer-impl",
                      "this project has a single transformer implementation of its own",
                      choices=("local", "transformer_engine", "inference_optimized")),
    CompatibilityFlag("--use-mcore-models", "there is one model implementation (no legacy one)"),
    CompatibilityFlag("--use-legacy-models", "there is one model implementation"),
    CompatibilityFlag("--onnx-safe",
                      "there is no ONNX export; its workarounds only write the same functions "
                      "differently", takes_value=True),
    CompatibilityFlag("--no-create-attention-mask-in-dataloader",
                      "the causal mask is applied inside attention; the data loader never builds "
                      "one"),
    # Initialisation and start-up.
    CompatibilityFlag("--use-cpu-initialization",
                      "weights are always initialised layout-independently (the same full weights "
                      "for every TP/PP layout)"),
    CompatibilityFlag("--no-initialization",
                      "weights are always initialised before a checkpoint replaces them (a "
                      "start-up time switch)"),
    CompatibilityFlag("--lazy-mpu-init",
                      "pretrain_gpt.py always sets up its process groups itself (there is no "
                      "external data-parallel manager)"),
    CompatibilityFlag("--use-tp-pp-dp-mapping",
                      "ranks are always ordered tensor, data, pipeline (Megatron's default); the "
                      "order only decides which GPU holds which part"),
    # Communication performance.
    CompatibilityFlag("--DDP-impl", reasons.DP_COMMUNICATION, choices=("local", "torch")),
    *_switches(reasons.DP_COMMUNICATION, "--no-delay-grad-reduce", "--delay-param-gather"),
    CompatibilityFlag("--ddp-bucket-size", reasons.DP_COMMUNICATION, takes_value=True),
    *_switches(reasons.TP_OVERLAP, "--tp-comm-overlap", "--disable-tp-comm-overlap-ag",
               "--disable-tp-comm-overlap-rs", "--tp-comm-overlap-rs-dgrad",
               "--disable-tp-comm-bulk-dgrad", "--disable-tp-comm-bulk-wgrad",
               "--disable-tp-comm-split-ag", "--disable-tp-comm-split-rs"),
    CompatibilityFlag("--tp-comm-overlap-cfg", reasons.TP_OVERLAP, takes_value=True),
    *_switches(reasons.PIPELINE_P2P, "--no-overlap-p2p-communication",
               "--no-scatter-gather-tensors-in-pipeline", "--use-ring-exchange-p2p"),
    CompatibilityFlag("--nccl-communicator-config-path",
                      "NCCL communicators keep their default settings (a performance switch)",
                      takes_value=True),
    # Memory housekeeping.
    CompatibilityFlag("--distribute-saved-activations",
                      "recomputed layers save their full inputs (a memory-only switch)"),
    CompatibilityFlag("--empty-unused-memory-level",
                      "the CUDA caching allocator is left alone (a memory-only switch)",
                      choices=("0", "1", "2")),
    CompatibilityFlag("--no-clone-scatter-output-in-embedding",
                      "whether the embedding output is copied so that its input buffer can be "
                      "freed early (a memory-only switch)"),
    *_switches(reasons.GARBAGE_COLLECTOR, "--manual-gc"),
    CompatibilityFlag("--manual-gc-interval", reasons.GARBAGE_COLLECTOR, takes_value=True),
    *_switches(reasons.GARBAGE_COLLECTOR, "--no-manual-gc-eval"),
    # Logging side channels, diagnostics and profilers.
    *_switches(reasons.TENSORBOARD_SCALARS, "--log-timers-to-tensorboard",
               "--log-memory-to-tensorboard",
               "--log-validation-ppl-to-tensorboard", "--log-batch-size-to-tensorboard",
               "--log-learning-rate-to-tensorboard", "--log-loss-scale-to-tensorboard",
               "--log-world-size-to-tensorboard",
               "--no-log-learnig-rate-to-tensorboard",  # sic: Megatron's spelling
               "--no-log-loss-scale-to-tensorboard"),
    *_with_value(reasons.TENSORBOARD_SCALARS, "--tensorboard-log-interval",
                 "--tensorboard-queue-size"),
    CompatibilityFlag("--log-progress", "no progress.txt is written; see the log lines"),
    *_switches(reasons.TIMERS, "--barrier-with-L1-time", "--no-barrier-with-level-1-timing"),
    *_switches(reasons.STRAGGLER, "--log-straggler", "--disable-straggler-on-startup"),
    *_with_value(reasons.STRAGGLER, "--straggler-ctrlr-port", "--straggler-minmax-count"),
    *_switches(reasons.ONE_LOGGER, "--enable-one-logger", "--enable-onelogger"),
    *_with_value(reasons.ONE_LOGGER, "--one-logger-project", "--one-logger-entity",
                 "--one-logger-run-name"),
    CompatibilityFlag("--no-check-for-nan-in-loss-and-grad",
                      "this project stops on a NaN or infinite loss only when "
                      "--check-for-nan-in-loss-and-grad is given, so there is nothing to switch "
                      "off"),
    CompatibilityFlag("--check-weight-hash-across-dp-replicas-interval",
                      "there is no periodic comparison of the data-parallel replicas' weights (a "
                      "check; it never changes them)", takes_value=True),
    CompatibilityFlag("--test-mode",
                      "there are no built-in tests run alongside training (the tests are under "
                      "tests/)"),
    *_switches(reasons.PROFILER, "--use-pytorch-profiler", "--profile"),
    *_with_value(reasons.PROFILER, "--profile-step-start", "--profile-step-end"),
    CompatibilityFlag("--profile-ranks", reasons.PROFILER, takes_list=True),
    *_with_value(reasons.INFERENCE_SERVER, "--inference-batch-times-seqlen-threshold",
                 "--max-tokens-to-oom"),
    # Checkpoint file formats.
    CompatibilityFlag("--dist-ckpt-format", reasons.CHECKPOINT_FORMAT, choices=("zarr",
                      "torch_dist")),
    *_switches(reasons.CHECKPOINT_FORMAT, "--use-dist-ckpt", "--auto-detect-ckpt-format"),
    *_switches(reasons.DIST_CHECKPOINT,
               "--ckpt-fully-parallel-save", "--ckpt-fully-parallel-load",
               "--ckpt-assume-constant-structure"),
    # Data reading.
    *_switches("dataset .bin files are always memory-mapped", "--no-mmap-bin-files",
               "--mmap-bin-files"),
    CompatibilityFlag("--dataloader-type",
                      "samples are always read in Megatron's 'single' order",
                      choices=("single",)),
    CompatibilityFlag("--num-dataset-builder-threads",
                      "dataset indices are built in the training process", takes_value=True),
    # Cluster services.
    CompatibilityFlag("--adlr-autoresume", reasons.AUTORESUME),
    CompatibilityFlag("--adlr-autoresume-interval", reasons.AUTORESUME, takes_value=True),
    # Spellings of earlier Megatron-LM versions (Megatron's history accepted them).
    CompatibilityFlag("--distribute-checkpointed-activations",
                      "recomputed layers save their full inputs (a memory-only switch; today's "
                      "--distribute-saved-activations)"),
    *_switches(reasons.NO_FUSED_KERNEL, "--no-scaled-masked-softmax-fusion",
               "--scaled-masked-softmax-fusion", "--bias-gelu-fusion", "--bias-dropout-fusion"),
    CompatibilityFlag("--scaled-upper-triang-masked-softmax-fusion", reasons.NO_FUSED_KERNEL,
                      takes_value=True),
    *_switches(reasons.DP_COMMUNICATION, "--no-contiguous-buffers-in-local-ddp",
               "--use-contiguous-buffers-in-ddp", "--align-param-gather"),
    *_switches(reasons.PIPELINE_P2P, "--overlap-p2p-communication"),
    *_switches("recomputation and pipeline buffers are managed by this project (a memory-only "
               "switch)", "--model-parallel-memory-opt", "--deallocate-pipeline-outputs",
               "--checkpoint-attention"),
    CompatibilityFlag("--no-query-key-layer-scaling",
                      "scaled_dot_product_attention does not overflow, so there is no "
                      "layer-number scaling to switch off"),
    *_switches(reasons.HOUSEKEEPING, "--mmap-warmup", "--use-gpu-initialization", "--debug",
               "--legacy-tokenizer"),
    CompatibilityFlag("--use-pipelining",
                      "pipeline-parallel stages always run a pipeline schedule (see "
                      "--pipeline-schedule)"),
    *_switches(reasons.INFERENCE_SERVER, "--inference-flask-server-logging",
               "--disable-chunked-prefill", "--initialize-socket-comms"),
    *_with_value(reasons.INFERENCE_SERVER, "--inference-max-batch-size",
                 "--inference-wandb-logging-step-interval",
                 "--inference-dynamic-batching-active-buffer-size-gb",
                 "--inference-dynamic-batching-buffer-guaranteed-fraction",
                 "--inference-dynamic-batching-buffer-overflow-factor",
                 "--inference-dynamic-batching-chunk-size",
                 "--inference-dynamic-batching-cuda-graph-max-tokens",
                 "--inference-dynamic-batching-max-requests-override",
                 "--inference-dynamic-batching-max-tokens-override"),
    CompatibilityFlag("--s3-cache-path", reasons.HOUSEKEEPING, takes_value=True),
    *RECENT_COMPATIBILITY_FLAGS,
)


# ---- known Megatron flags, not implemented (rejected) ----------------------------------------
# Ignoring any of these would train something other than what the flag asks for.


UNIMPLEMENTED_FLAGS: tuple[UnimplementedFlag, ...] = (
    # Model families and features that do not exist here.
    *_rejected(reasons.MOE, "--num-experts", "--expert-model-parallel-size", "--moe-router-topk",
               "--moe-grouped-gemm", "--moe-router-load-balancing-type", "--moe-aux-loss-coeff",
               "--moe-z-loss-coeff", "--moe-input-jitter-eps", "--moe-token-dispatcher-type",
               "--moe-per-layer-logging", "--moe-expert-capacity-factor",
               "--moe-pad-expert-input-to-capacity", "--moe-token-drop-policy",
               "--moe-layer-recompute", "--moe-extended-tp"),
    *_rejected(reasons.RETRO, "--retro-project-dir", "--retro-add-retriever",
               "--retro-cyclic-train-iters", "--retro-encoder-layers",
               "--retro-encoder-hidden-dropout", "--retro-encoder-attention-dropout",
               "--retro-num-neighbors", "--retro-num-retrieved-chunks", "--retro-attention-gate",
               "--retro-no-verify-neighbor-count"),
    *_rejected(reasons.VISION, "--num-classes", "--img-h", "--img-w", "--num-channels",
               "--patch-dim",
               "--classes-fraction", "--data-per-class-fraction", "--no-data-sharding",
               "--head-lr-mult", "--vision-pretraining", "--vision-pretraining-type",
               "--vision-backbone-type", "--swin-backbone-type", "--mask-type", "--mask-factor",
               "--iter-per-epoch", "--dino-local-img-size", "--dino-local-crops-number",
               "--dino-head-hidden-size", "--dino-bottleneck-size", "--dino-freeze-last-layer",
               "--dino-norm-last-layer", "--dino-warmup-teacher-temp", "--dino-teacher-temp",
               "--dino-warmup-teacher-temp-epochs"),
    *_rejected(reasons.BIENCODER, "--ict-head-size", "--biencoder-projection-dim",
               "--biencoder-shared-query-context-model", "--ict-load", "--bert-load",
               "--titles-data-path", "--query-in-block-prob", "--use-one-sent-docs",
               "--evidence-data-path", "--retriever-report-topk-accuracies",
               "--retriever-score-scaling", "--block-data-path", "--embedding-path",
               "--indexer-batch-size", "--indexer-log-interval", "--retriever-seq-length"),
    *_rejected(reasons.BERT, "--bert-no-binary-head", "--output-bert-embeddings",
               "--bert-embedder-type"),
    *_rejected(reasons.ENCODER_DECODER, "--decoder-num-layers", "--decoder-seq-length",
               "--pipeline-model-parallel-split-rank"),
    UnimplementedFlag("--encoder-num-layers",
                      f"{reasons.ENCODER_DECODER}; for GPT use --num-layers"),
    UnimplementedFlag("--encoder-seq-length",
                      f"{reasons.ENCODER_DECODER}; for GPT use --seq-length"),
    *_rejected(reasons.BERT_T5_DATA, "--mask-prob", "--short-seq-prob", "--sample-rate"),
    UnimplementedFlag("--vocab-extra-ids",
                      "extra vocabulary ids (T5's sentinel tokens) are not implemented"),
    *_rejected(reasons.FP8, "--fp8-format", "--fp8-margin", "--fp8-interval",
               "--fp8-amax-history-len",
               "--fp8-amax-compute-algo", "--no-fp8-wgrad"),
    # Parallelism and process layout.
    UnimplementedFlag("--context-parallel-size", "context parallelism is not implemented"),
    UnimplementedFlag("--use-torch-fsdp2", "FSDP is not implemented"),
    *_rejected(reasons.EQUAL_STAGES, "--standalone-embedding-stage"),
    # Architecture details.
    UnimplementedFlag("--rotary-seq-len-interpolation-factor",
                      "rotary position interpolation is not implemented"),
    UnimplementedFlag("--apply-residual-connection-post-layernorm",
                      "residuals always branch before the LayerNorm"),
    UnimplementedFlag("--fp32-residual-connection", "the residual stream is in the model dtype"),
    UnimplementedFlag("--fp16-lm-cross-entropy", "the cross entropy is always computed in fp32"),
    UnimplementedFlag("--init-method-xavier-uniform", "initialisation is normal(0, std)"),
    UnimplementedFlag("--data-parallel-random-init",
                      "every data-parallel replica starts from the same weights"),
    # Data.
    UnimplementedFlag("--eod-mask-loss", "the loss mask does not depend on end-of-document tokens"),
    UnimplementedFlag("--reset-position-ids", "positions are not reset at document boundaries"),
    UnimplementedFlag("--reset-attention-mask",
                      "attention is not masked at document boundaries"),
    *_rejected(reasons.ONE_DATA_PATH, "--train-data-path", "--valid-data-path", "--test-data-path"),
    # Optimizer and schedule.
    UnimplementedFlag("--lr-warmup-init", "warm-up always starts at learning rate 0"),
    *_rejected(reasons.CONSTANT_WEIGHT_DECAY, "--start-weight-decay", "--end-weight-decay",
               "--weight-decay-incr-style"),
    # Checkpoints and run control.
    UnimplementedFlag("--use-checkpoint-args", "give the model flags on the command line"),
    UnimplementedFlag("--pretrained-checkpoint", "use --load with --finetune"),
    UnimplementedFlag("--ckpt-step",
                      "--load always resumes from the iteration named in its "
                      "latest_checkpointed_iteration.txt"),
    UnimplementedFlag("--skip-train", "evaluation-only runs are not implemented"),
    UnimplementedFlag("--yaml-cfg", "give the flags on the command line"),
    UnimplementedFlag("--spec", "there is one layer specification"),
    # Flags of Megatron-LM's history whose meaning is not implemented either.
    UnimplementedFlag("--fp32-allreduce",
                      "all-reducing fp16 gradients in fp32 is not implemented; keep fp32 gradient "
                      "buffers with --accumulate-allreduce-grads-in-fp32"),
    UnimplementedFlag("--standalone-embed-stage", reasons.EQUAL_STAGES),
    UnimplementedFlag("--embedding-weights-in-fp32",
                      "the word embedding is kept in the model dtype"),
    UnimplementedFlag("--num-unique-layers", "every layer has its own weights (no sharing)"),
    UnimplementedFlag("--param-sharing-style", "every layer has its own weights (no sharing)"),
    UnimplementedFlag("--model-spec", "there is one layer specification"),
    UnimplementedFlag("--use-custom-fsdp", reasons.FSDP),
    UnimplementedFlag("--expert-parallel", reasons.MOE),
    *_rejected(reasons.ENCODER_DECODER, "--encoder-tensor-model-parallel-size",
               "--encoder-pipeline-model-parallel-size"),
    *_rejected(reasons.BIENCODER, "--allow-trivial-doc", "--async-indexer", "--block-index-path",
               "--block-top-k", "--faiss-use-gpu", "--hash-data-path", "--index-reload-interval",
               "--projection-dim", "--report-topk-accuracies", "--shared-query-context-model"),
    *_rejected(reasons.RETRO, "--retro-workdir"),
    *_rejected(reasons.VISION, "--img-dim"),
    *_rejected(reasons.BERT, "--pool-type", "--ner-data-path"),
    *_rejected(reasons.FP8, "--fp8-e4m3", "--fp8-hybrid",
               "--keep-fp8-transpose-cache-when-using-custom-fsdp"),
    *_rejected(reasons.MOE, "--moe-router-topk-limited-devices", "--moe-token-dropping",
               "--moe-use-legacy-grouped-gemm"),
    *_rejected(reasons.HYBRID, "--hybrid-attention-ratio", "--hybrid-mlp-ratio"),
    *_rejected(reasons.CONTEXT_PARALLEL, "--max-seqlen-per-cp-rank"),
    *_rejected(reasons.OTHER_OPTIMIZERS, "--muon-use-nesterov"),
    *_rejected(reasons.RL, "--grpo-default-temperature", "--grpo-default-top-p",
               "--langrl-external-server", "--langrl-inference-server-conversation-template",
               "--langrl-inference-server-type", "--rl-calculate-intra-group-similarity",
               "--rl-generation-batch-size", "--rl-num-parallel-generation-batches",
               "--rl-num-parallel-generations", "--rl-offload-kv-cache-during-training",
               "--rl-parallel-generation-tasks", "--rl-remove-kv-cache-during-training",
               "--rl-reset-cuda-graphs", "--rl-sequence-packing-bin-size",
               "--max-training-rank"),
    *_rejected(reasons.TOKENIZER_OPTIONS, "--tiktoken-special-tokens",
               "--tokenizer-hf-include-special-tokens", "--tokenizer-hf-use-fast"),
    UnimplementedFlag("--data-loader",
                      "Megatron's 2019 raw/lazy/tfrecords/numpy loaders are gone; datasets are "
                      "Megatron's indexed .bin/.idx files (--data-path)"),
    UnimplementedFlag("--input-data-sizes-file",
                      "Megatron's 2019 numpy loader is gone; use --data-path"),
    UnimplementedFlag("--renormalize-blend-weights",
                      "blend weights are used as given (normalised to sum to 1)"),
    UnimplementedFlag("--load-model-opt-format", "TensorRT model-optimizer checkpoints are not "
                                                 "implemented"),
    UnimplementedFlag("--override-checkpoint-version",
                      "checkpoints carry this project's own format version"),
    UnimplementedFlag("--use-regular-masking", "the attention mask is always causal"),
    # Megatron's own checks refuse these values; so does validation here.
    *RECENT_UNIMPLEMENTED_FLAGS,
)


# Values of flags we do implement, for features we do not: reported as "not implemented" with the
# reason (together with every other problem of the command line), not as argparse's "invalid
# choice", which would stop at the first one.
VALUES_NOT_IMPLEMENTED: dict[str, dict[str, str]] = {
    "--ckpt-format": {
        "torch_dcp": "use --ckpt-format torch_dist (torch.distributed.checkpoint with global keys)",
        "fsdp_dtensor": "FSDP is not implemented; use --ckpt-format torch_dist"},
    "--lr-decay-style": {"inverse-square-root": reasons.LR_DECAY, "WSD": reasons.LR_DECAY},
    "--dataloader-type": {
        "cyclic": "samples are read in Megatron's 'single' order only; a cyclic loader would "
                  "visit them in another order",
        "external": "an external data loader cannot be plugged in"},
    "--tokenizer-type": {name: reasons.TOKENIZERS for name in (
        "BertWordPieceLowerCase", "BertWordPieceCase",
        "Llama3Tokenizer", "MistralTokenizer",
        "TikTokenizer", "MultimodalTokenizer", "NullMultimodalTokenizer", "SFTTokenizer")},
    "--position-embedding-type": {
        "relative": "relative position embeddings are not implemented",
        "yarn": reasons.MLA, "mrope": "multimodal rotary embeddings are not implemented"},
    "--optimizer": {name: reasons.OTHER_OPTIMIZERS
                    for name in ("muon", "dist_muon", "lion", "soap", "adaptive_muon")},
    "--distributed-backend": {"ccl": "only the nccl and gloo backends are supported"},
}


def invalid_choice_problem(flag: str, value, choices) -> str:
    """The problem line of a value outside ``choices``: "not implemented" with the reason for a
    Megatron value of a feature we lack, else "not a valid choice" with the choices."""
    reason = VALUES_NOT_IMPLEMENTED.get(flag, {}).get(str(value))
    if reason is not None:
        return f"{flag} {value} is not implemented: {reason}"
    return (f"{flag} {value}: not a valid choice; choose from "
            f"{', '.join(str(choice) for choice in choices)}")


# The Megatron-LM commit whose whole argument list is classified (tests/golden/megatron_flags_*.txt).
MEGATRON_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"

# True renames in Megatron-LM's history: an earlier spelling and today's flag of the same meaning.
# Each earlier spelling is classified like today's flag (a config-field alias, an ignored or a
# rejected flag; tests/unit/test_megatron_flag_catalog.py checks it). "Did you mean" comes from
# here, or from writing dashes for underscores, and from nowhere else: a look-alike flag can mean
# something else entirely (--no-ckpt-fully-parallel-save is not --ckpt-fully-parallel-save).
RENAMED_FLAGS: dict[str, str] = {
    "--activations-checkpoint-method": "--recompute-method",
    "--activations-checkpoint-num-layers": "--recompute-num-layers",
    "--checkpoint-num-layers": "--recompute-num-layers",
    "--distribute-checkpointed-activations": "--distribute-saved-activations",
    "--batch-size": "--micro-batch-size",
    "--model-parallel-size": "--tensor-model-parallel-size",
    "--warmup": "--lr-warmup-fraction",
    "--min-scale": "--min-loss-scale",
    "--layernorm-epsilon": "--norm-epsilon",
    "--local_rank": "--local-rank",
    "--no-scaled-masked-softmax-fusion": "--no-masked-softmax-fusion",
    "--use-checkpoint-lr-scheduler": "--use-checkpoint-opt_param-scheduler",
    "--use-checkpoint-opt-param-scheduler": "--use-checkpoint-opt_param-scheduler",
    "--override-lr-scheduler": "--override-opt_param-scheduler",
    "--override-opt-param-scheduler": "--override-opt_param-scheduler",
    "--standalone-embed-stage": "--standalone-embedding-stage",
    "--enable-onelogger": "--enable-one-logger",
    "--persistent-save-interval": "--save-interval",
}


def renamed_flag(flag: str, known: set[str]) -> str | None:
    """The accepted flag that ``flag`` is another spelling of, or None: from
    :data:`RENAMED_FLAGS`, or ``flag`` with dashes for underscores (``--num_layers``)."""
    if flag in RENAMED_FLAGS and RENAMED_FLAGS[flag] in known:
        return RENAMED_FLAGS[flag]
    dashed = "--" + flag.lstrip("-").replace("_", "-")
    if dashed != flag and dashed in known:
        return dashed
    return None
