"""Megatron-LM flags that are not fields of our config: the ones accepted and ignored, and the
ones that are known but not implemented.

Megatron launch scripts carry many flags that only tune CUDA kernels, logging side channels or
checkpoint formats. Those are **accepted and logged once as ignored** (:data:`COMPATIBILITY_FLAGS`):
leaving them out cannot change what is trained. Flags for features this project does not have
(mixture of experts, context parallelism, rotary embeddings, ...) would silently train a different
model if ignored, so they are **known but not implemented** (:data:`UNIMPLEMENTED_FLAGS`): the parser
accepts their syntax only so that one run can report every problem together, each one named as "not
implemented" rather than "unknown".

The classification of flags that *are* config fields lives with the fields
(:mod:`megatron.core.config`, :data:`megatron.training.config_validation.NOT_SUPPORTED_YET`).
docs/flags.md is generated from all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class CompatibilityFlag:
    """A Megatron flag that is not part of our config: accepted so scripts keep working, then
    reported as ignored in the log (never silently)."""

    flag: str
    reason: str
    choices: Optional[tuple[str, ...]] = None  # takes one value from these when set
    takes_value: bool = False                  # takes one free value (e.g. an interval)

    @property
    def dest(self) -> str:
        return "compat__" + self.flag.lstrip("-").replace("-", "_").lower()


@dataclass(frozen=True)
class UnimplementedFlag:
    """A Megatron flag for a feature that does not exist here (rejected with the reason)."""

    flag: str
    reason: str

    @property
    def dest(self) -> str:
        return "unimplemented__" + self.flag.lstrip("-").replace("-", "_").lower()


_NO_FUSED_KERNEL = "there is no fused CUDA kernel here to switch"
_TENSORBOARD_SCALARS = ("TensorBoard receives this project's fixed set of scalars every "
                        "--log-interval iterations")
_CHECKPOINT_FORMAT = ("checkpoints are always written in this project's per-rank torch format "
                      "(see docs/checkpointing.md)")

# Ignoring any of these cannot change the trained weights: kernels, logging side channels,
# memory housekeeping, checkpoint file formats.
COMPATIBILITY_FLAGS: tuple[CompatibilityFlag, ...] = (
    CompatibilityFlag("--no-masked-softmax-fusion",
                      "attention uses torch's scaled_dot_product_attention; there is no fused "
                      "softmax kernel to switch off"),
    CompatibilityFlag("--no-bias-gelu-fusion", "bias and GeLU are not fused; nothing to switch off"),
    CompatibilityFlag("--no-bias-dropout-fusion",
                      "bias, dropout and residual add are not fused; nothing to switch off"),
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
    CompatibilityFlag("--use-cpu-initialization",
                      "weights are always initialised layout-independently (the same full weights "
                      "for every TP/PP layout)"),
    CompatibilityFlag("--DDP-impl",
                      "data-parallel gradients always use this project's contiguous-buffer "
                      "all-reduce", choices=("local", "torch")),
    CompatibilityFlag("--tp-comm-overlap",
                      "tensor-parallel communication is not overlapped (a performance switch)"),
    CompatibilityFlag("--distribute-saved-activations",
                      "recomputed layers save their full inputs (a memory-only switch)"),
    CompatibilityFlag("--empty-unused-memory-level",
                      "the CUDA caching allocator is left alone (a memory-only switch)",
                      choices=("0", "1", "2")),
    CompatibilityFlag("--manual-gc", "Python's garbage collector runs as usual"),
    CompatibilityFlag("--manual-gc-interval", "Python's garbage collector runs as usual",
                      takes_value=True),
    CompatibilityFlag("--no-manual-gc-eval", "Python's garbage collector runs as usual"),
    CompatibilityFlag("--log-timers-to-tensorboard", _TENSORBOARD_SCALARS),
    CompatibilityFlag("--log-memory-to-tensorboard", _TENSORBOARD_SCALARS),
    CompatibilityFlag("--log-validation-ppl-to-tensorboard", _TENSORBOARD_SCALARS),
    CompatibilityFlag("--log-batch-size-to-tensorboard", _TENSORBOARD_SCALARS),
    CompatibilityFlag("--log-learning-rate-to-tensorboard", _TENSORBOARD_SCALARS),
    CompatibilityFlag("--log-loss-scale-to-tensorboard", _TENSORBOARD_SCALARS),
    CompatibilityFlag("--log-world-size-to-tensorboard", _TENSORBOARD_SCALARS),
    CompatibilityFlag("--tensorboard-log-interval", _TENSORBOARD_SCALARS, takes_value=True),
    CompatibilityFlag("--tensorboard-queue-size", _TENSORBOARD_SCALARS, takes_value=True),
    CompatibilityFlag("--log-progress", "no progress.txt is written; see the log lines"),
    CompatibilityFlag("--ckpt-format", _CHECKPOINT_FORMAT, choices=("torch", "torch_dist")),
    CompatibilityFlag("--use-dist-ckpt", _CHECKPOINT_FORMAT),
    CompatibilityFlag("--async-save", "checkpoints are saved synchronously (same content)"),
    CompatibilityFlag("--no-mmap-bin-files", "dataset .bin files are always memory-mapped"),
    CompatibilityFlag("--mmap-bin-files", "dataset .bin files are always memory-mapped"),
    CompatibilityFlag("--dataloader-type",
                      "samples are always read in Megatron's 'single' order",
                      choices=("single",)),
    CompatibilityFlag("--num-dataset-builder-threads",
                      "dataset indices are built in the training process", takes_value=True),
    CompatibilityFlag("--use-pytorch-profiler", "no built-in profiler; wrap the run in "
                      "torch.profiler or nsys"),
    CompatibilityFlag("--profile", "no built-in profiler; wrap the run in torch.profiler or nsys"),
    CompatibilityFlag("--profile-step-start", "no built-in profiler", takes_value=True),
    CompatibilityFlag("--profile-step-end", "no built-in profiler", takes_value=True),
    CompatibilityFlag("--adlr-autoresume",
                      "no ADLR auto-resume service; use --exit-duration-in-mins with --save"),
    CompatibilityFlag("--adlr-autoresume-interval", "no ADLR auto-resume service",
                      takes_value=True),
    CompatibilityFlag("--barrier-with-L1-time",
                      "timers synchronise the device, not the ranks (no barrier needed)"),
)

# Known Megatron flags whose feature is missing: ignoring them would train something else.
UNIMPLEMENTED_FLAGS: tuple[UnimplementedFlag, ...] = (
    UnimplementedFlag("--num-experts", "mixture of experts is not implemented"),
    UnimplementedFlag("--expert-model-parallel-size", "mixture of experts is not implemented"),
    UnimplementedFlag("--moe-router-topk", "mixture of experts is not implemented"),
    UnimplementedFlag("--moe-grouped-gemm", "mixture of experts is not implemented"),
    UnimplementedFlag("--context-parallel-size", "context parallelism is not implemented"),
    UnimplementedFlag("--group-query-attention", "attention is multi-head (no query groups)"),
    UnimplementedFlag("--num-query-groups", "attention is multi-head (no query groups)"),
    UnimplementedFlag("--kv-channels", "the head size is always hidden-size / heads"),
    UnimplementedFlag("--use-rotary-position-embeddings", "rotary embeddings are not implemented"),
    UnimplementedFlag("--rotary-percent", "rotary embeddings are not implemented"),
    UnimplementedFlag("--rotary-base", "rotary embeddings are not implemented"),
    UnimplementedFlag("--no-position-embedding", "the model always has learned positions"),
    UnimplementedFlag("--qk-layernorm", "there is no query/key normalisation"),
    UnimplementedFlag("--apply-layernorm-1p", "LayerNorm weights are not zero-centred"),
    UnimplementedFlag("--apply-residual-connection-post-layernorm",
                      "residuals always branch before the LayerNorm"),
    UnimplementedFlag("--fp32-residual-connection", "the residual stream is in the model dtype"),
    UnimplementedFlag("--squared-relu", "the MLP uses GeLU"),
    UnimplementedFlag("--init-method-xavier-uniform", "initialisation is normal(0, std)"),
    UnimplementedFlag("--fp8-format", "FP8 training is not implemented"),
    UnimplementedFlag("--use-torch-fsdp2", "FSDP is not implemented"),
    UnimplementedFlag("--overlap-param-gather", "needs the distributed optimizer"),
    UnimplementedFlag("--decoder-first-pipeline-num-layers",
                      "stages always hold equal numbers of layers"),
    UnimplementedFlag("--decoder-last-pipeline-num-layers",
                      "stages always hold equal numbers of layers"),
    UnimplementedFlag("--account-for-embedding-in-pipeline-split",
                      "stages always hold equal numbers of layers"),
    UnimplementedFlag("--eod-mask-loss", "the loss mask does not depend on end-of-document tokens"),
    UnimplementedFlag("--reset-position-ids", "positions are not reset at document boundaries"),
    UnimplementedFlag("--reset-attention-mask",
                      "attention is not masked at document boundaries"),
    UnimplementedFlag("--train-data-path", "use --data-path with --split"),
    UnimplementedFlag("--valid-data-path", "use --data-path with --split"),
    UnimplementedFlag("--test-data-path", "use --data-path with --split"),
    UnimplementedFlag("--lr-warmup-init", "warm-up always starts at learning rate 0"),
    UnimplementedFlag("--start-weight-decay", "weight decay is constant (--weight-decay)"),
    UnimplementedFlag("--end-weight-decay", "weight decay is constant (--weight-decay)"),
    UnimplementedFlag("--weight-decay-incr-style", "weight decay is constant (--weight-decay)"),
    UnimplementedFlag("--decoupled-lr", "all parameters share one learning rate"),
    UnimplementedFlag("--override-opt_param-scheduler",
                      "the schedule always comes from the current flags"),
    UnimplementedFlag("--use-checkpoint-opt_param-scheduler",
                      "the schedule always comes from the current flags"),
    UnimplementedFlag("--use-checkpoint-args", "give the model flags on the command line"),
    UnimplementedFlag("--calculate-per-token-loss", "the loss is averaged per micro-batch"),
    UnimplementedFlag("--yaml-cfg", "give the flags on the command line"),
    UnimplementedFlag("--spec", "there is one layer specification"),
    UnimplementedFlag("--skip-train", "evaluation-only runs are not implemented"),
)
