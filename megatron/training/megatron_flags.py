"""Megatron-LM flags that are not fields of our config: the ones accepted and ignored, and the
ones that are known but not implemented.

Megatron launch scripts carry many flags that only tune CUDA kernels, logging side channels or
checkpoint formats. Those are **accepted and logged once as ignored** (:data:`COMPATIBILITY_FLAGS`):
leaving them out cannot change what is trained. Flags for features this project does not have
(mixture of experts, context parallelism, rotary embeddings, retro, vision, ...) would silently
train a different model if ignored, so they are **known but not implemented**
(:data:`UNIMPLEMENTED_FLAGS`): the parser accepts their syntax only so that one run can report every
problem together, each one named as "not implemented" rather than "unknown".

Together with the config fields these cover every option of Megatron-LM's argument list
(``megatron/training/arguments.py``; the list and the commit it was read at are in
tests/unit/test_megatron_flag_catalog.py, which checks that none of them is "unknown").

Flags are grouped by reason; a reason shared by several flags is a constant, so that the log
line, ``--help`` and docs/flags.md say the same thing for all of them. The classification of flags
that *are* config fields lives with the fields (:mod:`megatron.core.config`,
:data:`megatron.training.config_validation.NOT_SUPPORTED_YET`). docs/flags.md is generated from all
of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def _dest(prefix: str, flag: str) -> str:
    return prefix + flag.lstrip("-").replace("-", "_").lower()


@dataclass(frozen=True)
class CompatibilityFlag:
    """A Megatron flag that is not part of our config: accepted so scripts keep working, then
    reported as ignored in the log (never silently).

    Its value syntax is Megatron's: a switch by default, one value from ``choices``, one free value
    (``takes_value``) or one or more values (``takes_list``, Megatron's ``nargs='+'``).
    """

    flag: str
    reason: str
    choices: Optional[tuple[str, ...]] = None  # takes one value from these when set
    takes_value: bool = False                  # takes one free value (e.g. an interval)
    takes_list: bool = False                   # takes one or more free values

    def __post_init__(self):
        assert (self.choices is not None) + self.takes_value + self.takes_list <= 1, \
            f"{self.flag}: choose one value syntax"

    @property
    def dest(self) -> str:
        return _dest("compat__", self.flag)

    @property
    def shown(self) -> str:
        """The flag with its value syntax, as docs/flags.md shows it."""
        if self.choices:
            return f"{self.flag} {{{','.join(self.choices)}}}"
        if self.takes_list:
            return f"{self.flag} VALUE [VALUE ...]"
        return f"{self.flag} VALUE" if self.takes_value else self.flag


@dataclass(frozen=True)
class UnimplementedFlag:
    """A Megatron flag for a feature that does not exist here (rejected with the reason).

    The parser takes any number of values after it (Megatron's switches, single values and lists
    alike), so the rest of the command line still parses and is reported in the same message.
    """

    flag: str
    reason: str

    @property
    def dest(self) -> str:
        return _dest("unimplemented__", self.flag)


def _switches(reason: str, *flags: str) -> tuple[CompatibilityFlag, ...]:
    """Compatibility flags that take no value, all ignored for the same reason."""
    return tuple(CompatibilityFlag(flag, reason) for flag in flags)


def _with_value(reason: str, *flags: str) -> tuple[CompatibilityFlag, ...]:
    """Compatibility flags that take one free value, all ignored for the same reason."""
    return tuple(CompatibilityFlag(flag, reason, takes_value=True) for flag in flags)


def _rejected(reason: str, *flags: str) -> tuple[UnimplementedFlag, ...]:
    """Unimplemented flags (any value syntax), all rejected for the same reason."""
    return tuple(UnimplementedFlag(flag, reason) for flag in flags)


# ---- accepted for compatibility, ignored -----------------------------------------------------
# Ignoring any of these cannot change the trained weights: kernels, communication performance,
# logging side channels, memory housekeeping, checkpoint file formats, profilers, start-up.

_NO_FUSED_KERNEL = "there is no fused CUDA kernel here to switch"
_TENSORBOARD_SCALARS = ("TensorBoard receives this project's fixed set of scalars every "
                        "--log-interval iterations")
_CHECKPOINT_FORMAT = ("choose the format with --ckpt-format torch_dist (global tensors through "
                      "torch.distributed.checkpoint) or torch; loading detects it (see "
                      "docs/checkpointing.md)")
_DIST_CHECKPOINT = ("--ckpt-format torch_dist always saves and loads fully in parallel and fully "
                    "reshardable: each rank writes one replica's share of every tensor and reads "
                    "only the boxes it needs, keyed by parameter name and global shape")
_GARBAGE_COLLECTOR = "Python's garbage collector runs as usual"
_PROFILER = "no built-in profiler; wrap the run in torch.profiler or nsys"
_AUTORESUME = "no ADLR auto-resume service; use --exit-duration-in-mins with --save"
_TIMERS = "timers synchronise the device, not the ranks (no barrier needed)"
_TP_OVERLAP = ("tensor-parallel communication is not overlapped with the matrix multiplications "
               "(a performance switch)")
_DP_COMMUNICATION = ("data-parallel gradients always use this project's contiguous-buffer "
                     "reduction (a performance switch)")
_PIPELINE_P2P = ("pipeline transfers are this project's own point-to-point messages (see "
                 "--p2p-packing); a performance switch")
_STRAGGLER = ("there is no straggler detector; per-rank timings are in the timer block "
              "(--timing-log-option all)")
_ONE_LOGGER = ("NVIDIA's internal one-logger tracking is not available; metrics go to the log, "
               "TensorBoard and Weights & Biases")
_INFERENCE_SERVER = ("read only by Megatron's text-generation server, which training never runs "
                     "(generate text with tools/generate.py)")

COMPATIBILITY_FLAGS: tuple[CompatibilityFlag, ...] = (
    # CUDA kernels and implementation switches.
    CompatibilityFlag("--no-masked-softmax-fusion",
                      "attention uses torch's scaled_dot_product_attention; there is no fused "
                      "softmax kernel to switch off"),
    CompatibilityFlag("--no-bias-gelu-fusion", "bias and GeLU are not fused; nothing to switch off"),
    CompatibilityFlag("--no-bias-dropout-fusion",
                      "bias, dropout and residual add are not fused; nothing to switch off"),
    CompatibilityFlag("--no-bias-swiglu-fusion", f"{_NO_FUSED_KERNEL} (bias and SwiGLU)"),
    CompatibilityFlag("--no-rope-fusion", f"{_NO_FUSED_KERNEL} (rotary embeddings)"),
    CompatibilityFlag("--no-gradient-accumulation-fusion",
                      "gradients accumulate with plain PyTorch ops; there is no fused kernel"),
    CompatibilityFlag("--no-async-tensor-model-parallel-allreduce",
                      "tensor-parallel all-reduces are not overlapped with the weight-gradient "
                      "computation anyway"),
    CompatibilityFlag("--no-persist-layer-norm", f"{_NO_FUSED_KERNEL} (persistent LayerNorm)"),
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
                      choices=("local", "transformer_engine")),
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
                      "external data-parallel manager)", takes_value=True),
    CompatibilityFlag("--use-tp-pp-dp-mapping",
                      "ranks are always ordered tensor, data, pipeline (Megatron's default); the "
                      "order only decides which GPU holds which part"),
    # Communication performance.
    CompatibilityFlag("--DDP-impl", _DP_COMMUNICATION, choices=("local", "torch")),
    *_switches(_DP_COMMUNICATION, "--no-delay-grad-reduce", "--delay-param-gather"),
    CompatibilityFlag("--ddp-bucket-size", _DP_COMMUNICATION, takes_value=True),
    *_switches(_TP_OVERLAP, "--tp-comm-overlap", "--disable-tp-comm-overlap-ag",
               "--disable-tp-comm-overlap-rs", "--tp-comm-overlap-rs-dgrad",
               "--disable-tp-comm-bulk-dgrad", "--disable-tp-comm-bulk-wgrad",
               "--disable-tp-comm-split-ag", "--disable-tp-comm-split-rs"),
    CompatibilityFlag("--tp-comm-overlap-cfg", _TP_OVERLAP, takes_value=True),
    *_switches(_PIPELINE_P2P, "--no-overlap-p2p-communication",
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
    *_switches(_GARBAGE_COLLECTOR, "--manual-gc"),
    CompatibilityFlag("--manual-gc-interval", _GARBAGE_COLLECTOR, takes_value=True),
    *_switches(_GARBAGE_COLLECTOR, "--no-manual-gc-eval"),
    # Logging side channels, diagnostics and profilers.
    *_switches(_TENSORBOARD_SCALARS, "--log-timers-to-tensorboard", "--log-memory-to-tensorboard",
               "--log-validation-ppl-to-tensorboard", "--log-batch-size-to-tensorboard",
               "--log-learning-rate-to-tensorboard", "--log-loss-scale-to-tensorboard",
               "--log-world-size-to-tensorboard",
               "--no-log-learnig-rate-to-tensorboard",  # sic: Megatron's spelling
               "--no-log-loss-scale-to-tensorboard"),
    *_with_value(_TENSORBOARD_SCALARS, "--tensorboard-log-interval", "--tensorboard-queue-size"),
    CompatibilityFlag("--log-progress", "no progress.txt is written; see the log lines"),
    *_switches(_TIMERS, "--barrier-with-L1-time", "--no-barrier-with-level-1-timing"),
    *_switches(_STRAGGLER, "--log-straggler", "--disable-straggler-on-startup"),
    *_with_value(_STRAGGLER, "--straggler-ctrlr-port", "--straggler-minmax-count"),
    *_switches(_ONE_LOGGER, "--enable-one-logger"),
    *_with_value(_ONE_LOGGER, "--one-logger-project", "--one-logger-entity",
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
    *_switches(_PROFILER, "--use-pytorch-profiler", "--profile"),
    *_with_value(_PROFILER, "--profile-step-start", "--profile-step-end"),
    CompatibilityFlag("--profile-ranks", _PROFILER, takes_list=True),
    *_with_value(_INFERENCE_SERVER, "--inference-batch-times-seqlen-threshold",
                 "--max-tokens-to-oom"),
    # Checkpoint file formats.
    CompatibilityFlag("--dist-ckpt-format", _CHECKPOINT_FORMAT, choices=("zarr", "torch_dist")),
    *_switches(_CHECKPOINT_FORMAT, "--use-dist-ckpt", "--auto-detect-ckpt-format"),
    *_switches(_DIST_CHECKPOINT, "--ckpt-fully-parallel-save", "--ckpt-fully-parallel-load",
               "--ckpt-assume-constant-structure", "--dist-ckpt-optim-fully-reshardable"),
    CompatibilityFlag("--dist-ckpt-strictness",
                      "loading checks every key and global shape this run needs and names what is "
                      "missing (as raise_all); saved keys this run does not need are skipped",
                      choices=("assume_ok_unexpected", "log_unexpected", "log_all",
                               "raise_unexpected", "raise_all", "return_unexpected",
                               "return_all", "ignore_all")),
    # Data reading.
    *_switches("dataset .bin files are always memory-mapped", "--no-mmap-bin-files",
               "--mmap-bin-files"),
    CompatibilityFlag("--dataloader-type",
                      "samples are always read in Megatron's 'single' order",
                      choices=("single",)),
    CompatibilityFlag("--num-dataset-builder-threads",
                      "dataset indices are built in the training process", takes_value=True),
    # Cluster services.
    CompatibilityFlag("--adlr-autoresume", _AUTORESUME),
    CompatibilityFlag("--adlr-autoresume-interval", _AUTORESUME, takes_value=True),
)


# ---- known Megatron flags, not implemented (rejected) ----------------------------------------
# Ignoring any of these would train something other than what the flag asks for.

_MOE = "mixture of experts is not implemented"
_FP8 = "FP8 training is not implemented"
_RETRO = "retro (retrieval-augmented GPT) is not implemented"
_VISION = "vision models are not implemented"
_BIENCODER = "biencoder and ICT/REALM retrieval models are not implemented"
_BERT = "BERT models are not implemented (this project trains GPT)"
_ENCODER_DECODER = "encoder-decoder (T5) models are not implemented"
_BERT_T5_DATA = "read only by Megatron's BERT, T5 and ICT datasets, which are not implemented"
_ROTARY = "rotary embeddings are not implemented"
_QUERY_GROUPS = "attention is multi-head (no query groups)"
_EQUAL_STAGES = "stages always hold equal numbers of layers"
_CONSTANT_WEIGHT_DECAY = "weight decay is constant (--weight-decay)"
_ONE_LEARNING_RATE = "all parameters share one learning rate"
_SCHEDULE_FROM_FLAGS = "the schedule always comes from the current flags"
_ONE_DATA_PATH = "use --data-path with --split"


def _removed(replacement: str) -> str:
    return f"Megatron-LM itself no longer accepts it; use {replacement}"


UNIMPLEMENTED_FLAGS: tuple[UnimplementedFlag, ...] = (
    # Model families and features that do not exist here.
    *_rejected(_MOE, "--num-experts", "--expert-model-parallel-size", "--moe-router-topk",
               "--moe-grouped-gemm", "--moe-router-load-balancing-type", "--moe-aux-loss-coeff",
               "--moe-z-loss-coeff", "--moe-input-jitter-eps", "--moe-token-dispatcher-type",
               "--moe-per-layer-logging", "--moe-expert-capacity-factor",
               "--moe-pad-expert-input-to-capacity", "--moe-token-drop-policy",
               "--moe-layer-recompute", "--moe-extended-tp"),
    *_rejected(_RETRO, "--retro-project-dir", "--retro-add-retriever",
               "--retro-cyclic-train-iters", "--retro-encoder-layers",
               "--retro-encoder-hidden-dropout", "--retro-encoder-attention-dropout",
               "--retro-num-neighbors", "--retro-num-retrieved-chunks", "--retro-attention-gate",
               "--retro-no-verify-neighbor-count"),
    *_rejected(_VISION, "--num-classes", "--img-h", "--img-w", "--num-channels", "--patch-dim",
               "--classes-fraction", "--data-per-class-fraction", "--no-data-sharding",
               "--head-lr-mult", "--vision-pretraining", "--vision-pretraining-type",
               "--vision-backbone-type", "--swin-backbone-type", "--mask-type", "--mask-factor",
               "--iter-per-epoch", "--dino-local-img-size", "--dino-local-crops-number",
               "--dino-head-hidden-size", "--dino-bottleneck-size", "--dino-freeze-last-layer",
               "--dino-norm-last-layer", "--dino-warmup-teacher-temp", "--dino-teacher-temp",
               "--dino-warmup-teacher-temp-epochs"),
    *_rejected(_BIENCODER, "--ict-head-size", "--biencoder-projection-dim",
               "--biencoder-shared-query-context-model", "--ict-load", "--bert-load",
               "--titles-data-path", "--query-in-block-prob", "--use-one-sent-docs",
               "--evidence-data-path", "--retriever-report-topk-accuracies",
               "--retriever-score-scaling", "--block-data-path", "--embedding-path",
               "--indexer-batch-size", "--indexer-log-interval", "--retriever-seq-length"),
    *_rejected(_BERT, "--bert-no-binary-head", "--output-bert-embeddings", "--bert-embedder-type"),
    *_rejected(_ENCODER_DECODER, "--decoder-num-layers", "--decoder-seq-length",
               "--pipeline-model-parallel-split-rank"),
    UnimplementedFlag("--encoder-num-layers", f"{_ENCODER_DECODER}; for GPT use --num-layers"),
    UnimplementedFlag("--encoder-seq-length", f"{_ENCODER_DECODER}; for GPT use --seq-length"),
    *_rejected(_BERT_T5_DATA, "--mask-prob", "--short-seq-prob", "--sample-rate"),
    UnimplementedFlag("--vocab-extra-ids",
                      "extra vocabulary ids (T5's sentinel tokens) are not implemented"),
    *_rejected(_FP8, "--fp8-format", "--fp8-margin", "--fp8-interval", "--fp8-amax-history-len",
               "--fp8-amax-compute-algo", "--no-fp8-wgrad"),
    # Parallelism and process layout.
    UnimplementedFlag("--context-parallel-size", "context parallelism is not implemented"),
    UnimplementedFlag("--use-torch-fsdp2", "FSDP is not implemented"),
    UnimplementedFlag("--overlap-param-gather", "needs the distributed optimizer"),
    *_rejected(_EQUAL_STAGES, "--decoder-first-pipeline-num-layers",
               "--decoder-last-pipeline-num-layers", "--account-for-embedding-in-pipeline-split",
               "--standalone-embedding-stage"),
    # Architecture details.
    *_rejected(_QUERY_GROUPS, "--group-query-attention", "--num-query-groups"),
    UnimplementedFlag("--kv-channels", "the head size is always hidden-size / heads"),
    *_rejected(_ROTARY, "--use-rotary-position-embeddings", "--rotary-percent", "--rotary-base",
               "--rotary-interleaved", "--rotary-seq-len-interpolation-factor"),
    UnimplementedFlag("--no-position-embedding", "the model always has learned positions"),
    UnimplementedFlag("--qk-layernorm", "there is no query/key normalisation"),
    UnimplementedFlag("--apply-layernorm-1p", "LayerNorm weights are not zero-centred"),
    UnimplementedFlag("--apply-residual-connection-post-layernorm",
                      "residuals always branch before the LayerNorm"),
    UnimplementedFlag("--fp32-residual-connection", "the residual stream is in the model dtype"),
    UnimplementedFlag("--fp16-lm-cross-entropy", "the cross entropy is always computed in fp32"),
    UnimplementedFlag("--squared-relu", "the MLP uses GeLU"),
    UnimplementedFlag("--add-qkv-bias", "a bias on the query/key/value projection alone is not "
                                        "implemented"),
    UnimplementedFlag("--init-method-xavier-uniform", "initialisation is normal(0, std)"),
    UnimplementedFlag("--data-parallel-random-init",
                      "every data-parallel replica starts from the same weights"),
    UnimplementedFlag("--deterministic-mode", "selecting deterministic kernels is not implemented"),
    # Data.
    UnimplementedFlag("--eod-mask-loss", "the loss mask does not depend on end-of-document tokens"),
    UnimplementedFlag("--reset-position-ids", "positions are not reset at document boundaries"),
    UnimplementedFlag("--reset-attention-mask",
                      "attention is not masked at document boundaries"),
    *_rejected(_ONE_DATA_PATH, "--train-data-path", "--valid-data-path", "--test-data-path"),
    # Optimizer and schedule.
    UnimplementedFlag("--lr-warmup-init", "warm-up always starts at learning rate 0"),
    *_rejected(_CONSTANT_WEIGHT_DECAY, "--start-weight-decay", "--end-weight-decay",
               "--weight-decay-incr-style"),
    *_rejected(_ONE_LEARNING_RATE, "--decoupled-lr", "--decoupled-min-lr"),
    *_rejected(_SCHEDULE_FROM_FLAGS, "--override-opt_param-scheduler",
               "--use-checkpoint-opt_param-scheduler"),
    UnimplementedFlag("--calculate-per-token-loss", "the loss is averaged per micro-batch"),
    # Checkpoints and run control.
    UnimplementedFlag("--use-checkpoint-args", "give the model flags on the command line"),
    UnimplementedFlag("--pretrained-checkpoint", "use --load with --finetune"),
    UnimplementedFlag("--ckpt-step",
                      "--load always resumes from the iteration named in its "
                      "latest_checkpointed_iteration.txt"),
    UnimplementedFlag("--skip-train", "evaluation-only runs are not implemented"),
    UnimplementedFlag("--yaml-cfg", "give the flags on the command line"),
    UnimplementedFlag("--spec", "there is one layer specification"),
    # Spellings Megatron-LM removed (it rejects them too).
    UnimplementedFlag("--batch-size", _removed("--micro-batch-size")),
    UnimplementedFlag("--warmup", _removed("--lr-warmup-iters or --lr-warmup-fraction")),
    UnimplementedFlag("--model-parallel-size", _removed("--tensor-model-parallel-size")),
)


# Values of flags we do implement, for features we do not: reported as "not implemented" with the
# reason (together with every other problem of the command line), not as argparse's "invalid
# choice", which would stop at the first one.
_TOKENIZERS = ("only the GPT2BPETokenizer, SentencePieceTokenizer and NullTokenizer tokenizers are "
               "implemented")
_LR_DECAY = "only constant, linear and cosine learning-rate decay are implemented"
VALUES_NOT_IMPLEMENTED: dict[str, dict[str, str]] = {
    "--lr-decay-style": {"inverse-square-root": _LR_DECAY, "WSD": _LR_DECAY},
    "--dataloader-type": {
        "cyclic": "samples are read in Megatron's 'single' order only; a cyclic loader would "
                  "visit them in another order",
        "external": "an external data loader cannot be plugged in"},
    "--tokenizer-type": {name: _TOKENIZERS for name in (
        "BertWordPieceLowerCase", "BertWordPieceCase", "GPTSentencePieceTokenizer",
        "HuggingFaceTokenizer", "Llama2Tokenizer", "Llama3Tokenizer", "MistralTokenizer",
        "TikTokenizer", "MultimodalTokenizer", "NullMultimodalTokenizer")},
    "--position-embedding-type": {
        "none": "a GPT without position embeddings is not implemented",
        "relative": "relative position embeddings are not implemented"},
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
