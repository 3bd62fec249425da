"""Typed configuration tree: one validated object that every part of the project reads.

Field names equal Megatron-LM's argument names (``--num-layers`` is ``model.num_layers``); the
command-line parser in :mod:`megatron.training.arguments` is generated from these dataclasses, and each
field's ``help`` metadata is its ``--help`` text. Derived values (padded vocabulary, data-parallel size,
micro-batches per iteration) are filled in by validation, never by hand.

Library code receives this object (or one of its sections) explicitly; nothing reads ``sys.argv``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from megatron.core.pipeline_parallel.planning.lowering import GRAD_SYNC_POLICIES
from megatron.core.pipeline_parallel.planning.schedules import BUILTIN_SCHEDULES, CHIMERA_VARIANTS


def option(default: Any = None, help: str = "", *, choices: tuple | None = None,
           aliases: tuple[str, ...] = (), derived: bool = False, factory=None) -> Any:
    """A config field with its ``--help`` text.

    ``aliases`` are extra (legacy) flag spellings; ``derived`` fields are computed by validation and
    never become flags.
    """
    metadata = {"help": help, "choices": choices, "aliases": aliases, "derived": derived}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelConfig:
    """GPT architecture (Megatron's model flags)."""

    num_layers: Optional[int] = option(None, "Number of transformer layers.")
    hidden_size: Optional[int] = option(None, "Transformer hidden size.")
    ffn_hidden_size: Optional[int] = option(
        None, "Hidden size of the MLP; defaults to 4 * hidden-size.")
    num_attention_heads: Optional[int] = option(None, "Number of attention heads.")
    seq_length: Optional[int] = option(None, "Sequence length of a training sample.")
    max_position_embeddings: Optional[int] = option(
        None, "Size of the learned position-embedding table; defaults to seq-length.")
    attention_dropout: float = option(0.1, "Dropout probability on attention weights.")
    hidden_dropout: float = option(0.1, "Dropout probability on the hidden state.")
    layout_invariant_attention_dropout: bool = option(
        False, "Draw attention-dropout masks from the counter-based hash (explicit s x s softmax, "
               "slower) so they are identical in every TP/PP/DP/Chimera layout; default: fused "
               "scaled_dot_product_attention with dropout from a per-TP-rank stream (Megatron's "
               "semantics). Hidden dropout is layout-invariant either way.")
    init_method_std: float = option(
        0.02, "Standard deviation of the normal weight initialisation.")
    layernorm_epsilon: float = option(1e-5, "Epsilon of the normalisation layers.",
                                      aliases=("--norm-epsilon",))
    make_vocab_size_divisible_by: int = option(
        128, "Pad the vocabulary to a multiple of this value times the tensor-parallel size.")
    untie_embeddings_and_output_weights: bool = option(
        False, "Use a separate output layer instead of the transposed word embedding.")
    normalization: str = option("LayerNorm", "Normalisation layer.",
                                choices=("LayerNorm", "RMSNorm"))
    position_embedding_type: str = option(
        "learned_absolute", "Position embedding (none: no positions at all, as "
                            "--no-position-embedding).",
        choices=("learned_absolute", "rope", "none"))
    use_rotary_position_embeddings: bool = option(
        False, "Legacy (2023) spelling of --position-embedding-type rope.")
    swiglu: bool = option(False, "Use a SwiGLU MLP instead of GeLU.")
    squared_relu: bool = option(False, "Use a squared-ReLU MLP instead of GeLU.")
    rotary_percent: float = option(
        1.0, "With --position-embedding-type rope: fraction of each head's channels rotated.")
    rotary_base: int = option(10000, "With --position-embedding-type rope: the rotary base.")
    rotary_interleaved: bool = option(
        False, "With --position-embedding-type rope: rotate interleaved channel pairs (0,1), "
               "(2,3), ... instead of the two halves of the rotated channels.")
    no_position_embedding: bool = option(
        False, "No position embedding at all (with learned_absolute: no position table).")
    apply_layernorm_1p: bool = option(
        False, "Zero-centred norm weights: the stored weight w scales by (1 + w), initialised 0.")
    qk_layernorm: bool = option(
        False, "Normalise queries and keys per head (same kind as --normalization).")
    add_qkv_bias: bool = option(
        False, "Bias on the query/key/value projection even with --disable-bias-linear.")
    group_query_attention: bool = option(
        False, "Grouped-query attention with --num-query-groups key/value heads.")
    num_query_groups: Optional[int] = option(
        None, "With --group-query-attention: number of key/value head groups.")
    kv_channels: Optional[int] = option(
        None, "Channels per attention head; defaults to hidden-size / num-attention-heads.")
    openai_gelu: bool = option(
        False, "GeLU with the tanh approximation (GPT-2's and Hugging Face's gelu_new).")
    disable_bias_linear: bool = option(False, "Linear layers without bias.")
    use_mup: bool = option(
        False, "Maximal-update parameterisation (Megatron's MuP rules for initialisation, "
               "attention scale, logits and per-group learning rates; see docs/model.md).")
    mup_base_hidden_size: Optional[int] = option(
        None, "With --use-mup: hidden size of the base model; width multiplier m = hidden-size / "
              "this (default: the hidden size, m = 1).")
    mup_width_mult: Optional[float] = option(
        None, "With --use-mup: derived as hidden-size / mup-base-hidden-size; a different value "
              "is an error.")
    mup_embedding_mult: float = option(
        1.0, "With --use-mup: multiplier of the embedding output.")
    mup_output_mult: float = option(
        1.0, "With --use-mup: multiplier of the logits; left at 1 it becomes 1/m.")
    mup_base_head_dim: Optional[float] = option(
        None, "With --use-mup: attention softmax scale sqrt(this) / head-dim ** power "
              "(default 1 / head-dim ** power).")
    mup_attn_scale_power: float = option(
        1.0, "With --use-mup: power p of the head dimension in the softmax scale (1: MuP's 1/d, "
             "0.5: the standard 1/sqrt(d)).")
    vocab_size: Optional[int] = option(
        None, "Vocabulary size for the NullTokenizer and --mock-data (before padding).")
    padded_vocab_size: Optional[int] = option(
        None, "Vocabulary size after padding (derived).", derived=True)

    @property
    def tied_embeddings(self) -> bool:
        """The output layer reuses the word embedding (a model section's contract, see
        megatron/training/model_spec.py)."""
        return not self.untie_embeddings_and_output_weights


@dataclass(frozen=True)
class ModelFeatureGate:
    """A model flag (or flag value) whose feature is refused: the one place that decides it, read
    by argument validation (before any process starts) and by the model itself (for library use)."""

    field: str                          # ModelConfig field
    shown: str                          # how the user writes it, e.g. "--normalization RMSNorm"
    is_used: Callable[[Any], bool]      # true when the field's value asks for the feature
    instead: str                        # what to do instead


# Model features that are refused (the table is read by argument validation and by the model).
# Empty: every model flag of ModelConfig is implemented and held to the single-process reference
# under TP, PP and Chimera (tests/numerics/test_modern_block.py, tests/distributed/
# test_tensor_parallel.py and test_pipeline_numerics.py).
MODEL_FEATURE_GATES: tuple[ModelFeatureGate, ...] = ()


def refused_model_features(model_config: "ModelConfig") -> list[str]:
    """One message per refused feature that ``model_config`` asks for (empty when none)."""
    return [f"{gate.shown} is not supported yet by Megatron-Chimera; {gate.instead}"
            for gate in MODEL_FEATURE_GATES if gate.is_used(getattr(model_config, gate.field))]


@dataclass
class RecomputeConfig:
    """Activation recomputation (Megatron's recompute flags)."""

    recompute_granularity: Optional[str] = option(
        None, "Recompute activations in the backward pass: 'full' layers or 'selective' "
              "(attention core only).", choices=("full", "selective"))
    recompute_method: Optional[str] = option(
        None, "With full granularity: 'uniform' recomputes every chunk of recompute-num-layers "
              "layers, 'block' only the first recompute-num-layers layers of each stage.",
        choices=("uniform", "block"))
    recompute_num_layers: Optional[int] = option(
        None, "Layers per recomputed chunk (uniform) or recomputed layers per stage (block).",
        aliases=("--activations-checkpoint-num-layers", "--checkpoint-num-layers"))
    checkpoint_activations: bool = option(
        False, "Legacy spelling of --recompute-granularity full --recompute-method uniform.")
    recompute_activations: bool = option(
        False, "Legacy spelling of --recompute-granularity selective.")
    activations_checkpoint_method: Optional[str] = option(
        None, "Legacy (2021-22) spelling of --recompute-granularity full --recompute-method.",
        choices=("uniform", "block"))


@dataclass
class ParallelConfig:
    """Process layout: tensor, data and pipeline parallelism and the pipeline schedule."""

    tensor_model_parallel_size: int = option(1, "Tensor-parallel size.",
                                             aliases=("--model-parallel-size",))
    pipeline_model_parallel_size: int = option(1, "Pipeline-parallel size (pipeline depth D).")
    num_layers_per_virtual_pipeline_stage: Optional[int] = option(
        None, "Layers per virtual pipeline stage; selects the interleaved 1F1B schedule.")
    num_virtual_stages_per_pipeline_rank: Optional[int] = option(
        None, "Virtual pipeline stages (model chunks) per pipeline rank; selects the interleaved "
              "1F1B schedule (the other way to give its size; needed with uneven stages).")
    decoder_first_pipeline_num_layers: Optional[int] = option(
        None, "Transformer layers of the first pipeline stage; the remaining layers split evenly "
              "over the middle stages (default: all stages equal).")
    decoder_last_pipeline_num_layers: Optional[int] = option(
        None, "Transformer layers of the last pipeline stage; the remaining layers split evenly "
              "over the middle stages (default: all stages equal).")
    account_for_embedding_in_pipeline_split: bool = option(
        False, "Count the embedding as one layer when splitting the layers over the pipeline "
               "stages (the first stage builds one transformer layer fewer).")
    account_for_loss_in_pipeline_split: bool = option(
        False, "Count the output layer and loss as one layer when splitting the layers over the "
               "pipeline stages (the last stage builds one transformer layer fewer).")
    pipeline_schedule: Optional[str] = option(
        None, "Pipeline schedule (default 1f1b, or interleaved-1f1b when "
              "--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank "
              "is given). chimera: Li & Hoefler's bidirectional pipelines (SC'21), the same "
              "losses as 1f1b up to rounding; it needs an even --pipeline-model-parallel-size "
              "and keeps two stages, "
              "so two weight copies, per rank; see --chimera-*.",
        choices=BUILTIN_SCHEDULES.choices)  # parse_args(registry=...) lists that registry's
    chimera_pipelines: int = option(
        2, "Number of Chimera pipelines 2f (f down, f up); f must divide D/2.")
    chimera_variant: str = option(
        "direct", "How Chimera schedules more micro-batches than stages: direct (basic units "
                  "back to back), forward-doubling (two forwards per step; micro-batches a "
                  "multiple of D; doubles stored activations, pair it with "
                  "--recompute-granularity full), backward-halving (forward doubling on half "
                  "micro-batches; even --micro-batch-size) or interleaved (each direction cut "
                  "into 2D half-size stages; --num-layers a multiple of 2D).",
        choices=CHIMERA_VARIANTS)
    chimera_grad_sync: str = option(
        "eager-opt", "When the all-reduce between the replicas of a Chimera stage starts: "
                     "eager-opt (after the stage's last backward, except on the two middle "
                     "ranks, which sync at the end: the paper's choice), eager (always right "
                     "after the last backward) or end (after the whole schedule).",
        choices=GRAD_SYNC_POLICIES)
    split_backward: bool = option(
        False, "Split every backward into its input-gradient and weight-gradient halves and move "
               "the weight halves into the schedule's idle slots (zero-bubble; any schedule: "
               "Chimera's remaining bubbles, a ZB-H1-style 1F1B).")
    split_backward_extra_activations: int = option(
        0, "With --split-backward: micro-batches of activations a rank may keep stored beyond "
           "the schedule's busiest rank's peak in order to defer weight-gradient work (0: the "
           "schedule's peak activation memory is unchanged).")
    pipeline_op_costs: Optional[str] = option(
        None, "With --split-backward: JSON file of per-stage compute costs the planner places the "
              "weight-gradient work and groups messages with: {\"stages\": [[F, I, W], ...]} "
              "seconds, or tools/performance_model.py --measure output (default: F = 1, "
              "I = W = 1 on every stage).")
    p2p_packing: str = option(
        "auto", "Pack all tensors bound for one peer into one message: auto (C++ if it builds, "
                "else Python), cpp, python or off.", choices=("auto", "cpp", "python", "off"))
    sequence_parallel: bool = option(
        False, "Megatron sequence parallelism: norms, dropout and the residual stream are split "
               "along the sequence over the tensor-parallel ranks (turned off, with a warning, "
               "when tensor-model-parallel-size is 1).")
    distributed_backend: Optional[str] = option(
        None, "torch.distributed backend; default nccl when CUDA is available, else gloo.",
        choices=("nccl", "gloo"))
    distributed_timeout_minutes: float = option(
        10, "Timeout of collective operations; a lost rank raises instead of hanging.")
    use_distributed_optimizer: bool = option(
        False, "Shard the fp32 weights' optimizer step and Adam state over all replicas of each "
               "stage (data parallel; under Chimera both pipeline directions too): gradients are "
               "reduce-scattered, each rank steps its shard, parameters are all-gathered.")
    overlap_param_gather: bool = option(
        False, "With --use-distributed-optimizer: start the all-gather of the updated parameters "
               "after the step and wait for each model chunk's part just before its next forward "
               "pass (as Megatron), instead of waiting at the end of the step.")
    overlap_grad_reduce: bool = option(
        False, "Overlap the data-parallel gradient reduction with the backward pass: each "
               "bucket's all-reduce starts as soon as its gradients are final, during the last "
               "micro-batch's backward (with a pipeline: during each model chunk's last backward "
               "op, its last weight half under --split-backward; the schedule's gradient sync "
               "launches the rest). No effect on --use-distributed-optimizer's reduce-scatter "
               "or the compressing --dp-gradient-reducer choices.")
    grad_reduce_in_bf16: bool = option(
        False, "With --bf16: run the data-parallel gradient all-reduce (reduce-scatter with "
               "--use-distributed-optimizer) in bfloat16; gradients are still accumulated in "
               "fp32 and cast back after the collective.")
    dp_gradient_reducer: str = option(
        "allreduce", "Data-parallel gradient reduction: exact all-reduce, or A2SGD (two means per "
                     "worker, error feedback; see docs/a2sgd.md), top-k sparsification with error "
                     "feedback, or QSGD quantisation.",
        choices=("allreduce", "a2sgd", "topk", "qsgd"))
    a2sgd_sync_interval: int = option(
        10, "With --dp-gradient-reducer a2sgd: average the parameters exactly over data-parallel "
            "replicas every this many iterations (also before every checkpoint and evaluation).")
    a2sgd_granularity: str = option(
        "model", "With --dp-gradient-reducer a2sgd: the segments that get their own two means: "
                 "the whole model chunk (the paper's; 32 bytes per step), buckets of 4096 "
                 "entries, or each tensor (see docs/a2sgd.md).",
        choices=("model", "bucket", "tensor"))
    a2sgd_sync_flushes_errors: bool = option(
        False, "With --dp-gradient-reducer a2sgd: every sync also hands each rank's unapplied "
               "error to the optimizer: the step after a sync all-reduces the error-corrected "
               "gradient exactly (one gradient-sized all-reduce) and clears the error (see "
               "docs/a2sgd.md).")
    a2sgd_flush_interval: int = option(
        0, "With --dp-gradient-reducer a2sgd: every this many iterations the next step is exact "
           "(all-reduces the error-corrected gradient and clears the error, as after a sync with "
           "--a2sgd-sync-flushes-errors), independently of --a2sgd-sync-interval; 0: never "
           "(see docs/a2sgd.md).")
    a2sgd_periodic_sync: str = option(
        "parameters-and-optimizer",
        "With --dp-gradient-reducer a2sgd: what the sync every --a2sgd-sync-interval iterations "
        "averages: the parameters and the optimizer state (three gradient-sized all-reduces with "
        "Adam), or the parameters only (one); the sync before every checkpoint and evaluation "
        "always averages both (see docs/a2sgd.md).",
        choices=("parameters-and-optimizer", "parameters"))
    a2sgd_second_moment_from_exact_steps: bool = option(
        False, "With --dp-gradient-reducer a2sgd, --a2sgd-sync-flushes-errors and Adam: only the "
               "exact steps (the first step and each step after a sync or a flush interval) "
               "update Adam's second moment, each weighted over the optimizer steps since the "
               "previous one (1 for the first step); the two-level steps between them leave it "
               "unchanged, so Adam stays linear in the gradient there, as error feedback needs "
               "(see docs/a2sgd.md).")
    topk_ratio: float = option(
        0.01, "With --dp-gradient-reducer topk: the fraction of gradient entries (largest in "
              "magnitude, after error feedback) each data-parallel rank sends.")
    qsgd_levels: int = option(
        127, "With --dp-gradient-reducer qsgd: quantisation levels s (1..127; one int8 per entry).")
    qsgd_bucket_size: int = option(
        512, "With --dp-gradient-reducer qsgd: gradient entries per bucket (one norm each).")
    local_rank: Optional[int] = option(
        None, "Local rank passed by torch.distributed.launch.", aliases=("--local_rank",))
    world_size: Optional[int] = option(None, "Number of processes (derived).", derived=True)
    data_parallel_size: Optional[int] = option(
        None, "Data-parallel size (derived).", derived=True)
    virtual_pipeline_model_parallel_size: Optional[int] = option(
        None, "Model chunks per pipeline rank for interleaved 1F1B (derived from "
              "--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank).",
        derived=True)
    microbatch_group_size_per_virtual_pipeline_stage: Optional[int] = option(
        None, "With interleaved 1F1B: micro-batches run through the model chunks in groups of "
              "this many (default --pipeline-model-parallel-size); between the pipeline size and "
              "the number of micro-batches, dividing it or leaving at least the pipeline size.")


@dataclass
class TrainingConfig:
    """Batch sizes, iteration counts, precision and seeds."""

    micro_batch_size: int = option(1, "Samples per micro-batch on one data-parallel rank.",
                                   aliases=("--batch-size",))
    global_batch_size: Optional[int] = option(
        None, "Samples per iteration over all data-parallel ranks; default micro-batch-size * "
              "data-parallel size.")
    rampup_batch_size: Optional[list[int]] = option(
        None, "Batch-size ramp-up START INCREMENT RAMP_SAMPLES: the global batch grows from START "
              "by INCREMENT in equal steps over the first RAMP_SAMPLES samples (every schedule: the "
              "pipeline is planned per micro-batch count).")
    step_batch_size_schedule: Optional[str] = option(
        None, "Step-wise global batch size \"THRESHOLD:BS THRESHOLD:BS ...\" (instead of "
              "--global-batch-size): from THRESHOLD tokens on (suffixes K, M, B, T; the first "
              "threshold 0) the global batch size is BS.")
    batch_size_steps: Optional[list[int]] = option(
        None, "The step schedule in samples, flattened threshold, batch size, ... (derived).",
        derived=True)
    train_iters: Optional[int] = option(None, "Number of training iterations.")
    train_samples: Optional[int] = option(
        None, "Number of training samples (alternative to --train-iters).")
    eval_interval: int = option(1000, "Run validation every this many iterations.")
    eval_iters: int = option(100, "Validation iterations per evaluation.")
    eval_global_batch_size: Optional[int] = option(
        None, "Samples per validation iteration over all data-parallel ranks; default "
              "--global-batch-size.")
    exit_interval: Optional[int] = option(
        None, "Save (if --save) and exit when the iteration is a multiple of this.")
    exit_duration_in_mins: Optional[float] = option(
        None, "Save (if --save) and exit after this many minutes.")
    exit_signal_handler: bool = option(
        False, "On SIGTERM, save (if --save) at the end of the current iteration on every rank "
               "and exit normally.")
    iterations_to_skip: Optional[list[int]] = option(
        None, "Skip these iterations (Megatron's numbering: N skips the step taken after N "
              "completed iterations, logged as iteration N+1): their samples are consumed, "
              "nothing is computed, the learning rate does not advance.")
    seed: int = option(1234, "Random seed.")
    deterministic_mode: bool = option(
        False, "Bitwise-reproducible runs: PyTorch deterministic algorithms (an op without one "
               "raises), deterministic cuDNN, and NCCL_ALGO=Ring, CUBLAS_WORKSPACE_CONFIG=:4096:8 "
               "where unset (set values must be deterministic ones).")
    fp16: bool = option(False, "Train in float16 with dynamic loss scaling.")
    bf16: bool = option(False, "Train in bfloat16.")
    calculate_per_token_loss: bool = option(
        False, "The loss (and its gradient) is the sum of the token losses over the number of "
               "loss-mask tokens in the global batch, instead of the mean of the micro-batches' "
               "mean losses (they differ when loss masks differ between samples).")
    check_for_nan_in_loss_and_grad: bool = option(
        False, "Stop (error naming the iteration and rank) when the loss or gradient norm is NaN "
               "or infinite, instead of skipping the update; each gradient bucket is checked on "
               "its own rank before the data-parallel reduction (with --rerun-mode "
               "validate_results: re-run first).")
    max_consecutive_skipped_iterations: int = option(
        100, "Stop when this many iterations in a row skipped their update (overflow/NaN the "
             "loss scaler cannot recover from); 0 disables.")
    rerun_mode: str = option(
        "disabled", "validate_results: check every iteration's local losses (NaN and Inf; spikes "
                    "with --check-for-spiky-loss) before the update and re-run a rejected "
                    "iteration on the same ranks to tell a transient fault (exit 17) from a "
                    "reproducible one (save, exit 16; see docs/reliability.md). report_stats: "
                    "run every iteration twice from the same state and log, every 2 iterations, "
                    "how much the two runs' results differ (twice the compute).",
        choices=("disabled", "validate_results", "report_stats"))
    check_for_spiky_loss: bool = option(
        False, "With --rerun-mode validate_results: also reject a loss at least 10 times the "
               "largest of the first 100 (re-run, then continue).")
    check_for_large_grads: bool = option(
        False, "Check the norm of each gradient bucket on its own rank before the data-parallel "
               "reduction: at least 10 times the largest of the first 100 is rejected (with "
               "--rerun-mode validate_results re-run, then continue; without, logged).")
    error_injection_rate: int = option(
        0, "With --rerun-mode validate_results: reject each validated result with probability "
           "1/N on purpose (0: never), to test the re-run engine.")
    error_injection_type: str = option(
        "transient_error", "What the re-run of an injected error finds.",
        choices=("correct_result", "transient_error", "persistent_error"))
    result_rejected_tracker_filename: Optional[str] = option(
        None, "With --rerun-mode validate_results: append a line for every rejected result and "
              "its re-run to this file (Megatron's format).")
    num_microbatches: Optional[int] = option(
        None, "Micro-batches per iteration per data-parallel rank (derived).", derived=True)


@dataclass
class OptimizerConfig:
    """Optimizer, learning-rate schedule, clipping and loss scaling."""

    optimizer: str = option("adam", "Optimizer (adam means AdamW).", choices=("adam", "sgd"))
    lr: Optional[float] = option(None, "Peak learning rate.")
    min_lr: float = option(0.0, "Minimum learning rate after decay.")
    decoupled_lr: Optional[float] = option(
        None, "Peak learning rate of the input embedding and output layer (their own schedule "
              "of the same shape); default: --lr.")
    decoupled_min_lr: Optional[float] = option(
        None, "Minimum learning rate of the input embedding and output layer with "
              "--decoupled-lr; default: --min-lr.")
    lr_decay_style: str = option("linear", "Learning-rate decay.",
                                 choices=("constant", "linear", "cosine"))
    lr_decay_iters: Optional[int] = option(
        None, "Iterations to decay over; default --train-iters.")
    lr_warmup_iters: int = option(0, "Linear warm-up iterations.")
    lr_decay_samples: Optional[int] = option(
        None, "Samples to decay over (samples-based training, with --train-samples); default "
              "--train-samples.")
    lr_warmup_samples: int = option(
        0, "Linear warm-up samples (samples-based training, with --train-samples).")
    lr_warmup_fraction: Optional[float] = option(
        None, "Warm-up as a fraction of the decay iterations (overrides --lr-warmup-iters).",
        aliases=("--warmup",))
    weight_decay: float = option(0.01, "Weight decay (not applied to biases and norms).")
    clip_grad: float = option(1.0, "Clip gradients to this global norm (0 disables).")
    adam_beta1: float = option(0.9, "Adam beta1.")
    adam_beta2: float = option(0.999, "Adam beta2.")
    adam_eps: float = option(1e-8, "Adam epsilon.")
    sgd_momentum: float = option(0.9, "SGD momentum.")
    loss_scale: Optional[float] = option(
        None, "Static loss scale for fp16; dynamic scaling when unset.")
    initial_loss_scale: float = option(2.0 ** 32, "Initial dynamic loss scale.")
    min_loss_scale: float = option(1.0, "Minimum dynamic loss scale.", aliases=("--min-scale",))
    loss_scale_window: int = option(1000, "Iterations without overflow before the scale grows.")
    hysteresis: int = option(2, "Overflows tolerated before the scale shrinks.")
    apply_wd_to_qk_layernorm: bool = option(
        False, "Apply weight decay to the --qk-layernorm weights (and biases) too.")
    accumulate_allreduce_grads_in_fp32: bool = option(
        False, "Keep gradient buffers in fp32 under bf16/fp16.")


@dataclass
class DataConfig:
    """Datasets and tokenizers."""

    data_path: Optional[list[str]] = option(
        None, "One dataset prefix, or weight-prefix pairs to blend: W1 P1 W2 P2 ...")
    split: str = option("969, 30, 1", "Train/valid/test proportions, e.g. 949,50,1.")
    mock_data: bool = option(False, "Train on deterministic synthetic data (no files needed).")
    tokenizer_type: Optional[str] = option(
        None, "Tokenizer.", choices=("GPT2BPETokenizer", "SentencePieceTokenizer",
                                     "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                                     "HuggingFaceTokenizer", "NullTokenizer"))
    vocab_file: Optional[str] = option(None, "GPT-2 vocab.json.")
    merge_file: Optional[str] = option(None, "GPT-2 merges.txt.")
    tokenizer_model: Optional[str] = option(
        None, "SentencePiece model file; with HuggingFaceTokenizer a tokenizer directory or a "
              "Hugging Face model name.")
    data_impl: str = option("mmap", "Legacy; only mmap exists.", choices=("mmap",))
    num_workers: int = option(2, "Data-loader worker processes.")
    data_cache_path: Optional[str] = option(
        None, "Where dataset index caches go; default next to the data.")
    fim_data: bool = option(
        False, "Fill-in-the-middle: rewrite samples into prefix/suffix/middle order with the "
               "tokenizer's FIM tokens (Megatron's FIM dataset; see docs/data.md).")
    fim_rate: float = option(0.5, "With --fim-data: probability that a segment is rewritten.")
    fim_spm_rate: float = option(
        0.5, "With --fim-data: probability that a rewritten segment uses SPM order (else PSM).")
    fim_split_sample: Optional[str] = option(
        None, "With --fim-data: token at which a segment is cut into fragments rewritten one by "
              "one (needs --fim-fragment-rate).")
    fim_fragment_rate: Optional[float] = option(
        None, "With --fim-split-sample: probability that each fragment is rewritten.")
    fim_no_prefix: Optional[str] = option(
        None, "With --fim-data: leave segments whose text starts with this string unchanged.")
    fim_prefix_token: str = option("<fim_prefix>", "FIM prefix token.")
    fim_middle_token: str = option("<fim_middle>", "FIM middle token.")
    fim_suffix_token: str = option("<fim_suffix>", "FIM suffix token.")
    fim_pad_token: str = option("<fim_pad>", "FIM padding token.")
    fim_eod_token: str = option("<|endoftext|>", "FIM end-of-document token (segments are cut "
                                                 "at it).")


@dataclass
class CheckpointConfig:
    """Saving and loading."""

    save: Optional[str] = option(None, "Directory to save checkpoints to.")
    load: Optional[str] = option(None, "Directory to load checkpoints from.")
    save_interval: Optional[int] = option(None, "Save every this many iterations.",
                                          aliases=("--persistent-save-interval",))
    save_retain_interval: Optional[int] = option(
        None, "Keep only the checkpoints of iterations that are multiples of this, plus the "
              "latest; the others under --save are deleted after each save.")
    no_load_optim: bool = option(False, "Do not load optimizer state.")
    no_load_rng: bool = option(False, "Do not load RNG state.")
    exit_on_missing_checkpoint: bool = option(
        False, "With --load: stop with an error when the directory holds no checkpoint, instead "
               "of starting from scratch.")
    no_save_optim: bool = option(
        False, "Save checkpoints without the optimizer state and learning-rate schedule (as "
               "Megatron); resuming from one then needs --no-load-optim (or --finetune).")
    no_save_rng: bool = option(
        False, "Save checkpoints without the RNG states; resuming from one then needs "
               "--no-load-rng (or --finetune).")
    finetune: bool = option(
        False, "Load weights only and start at iteration 0.")
    use_checkpoint_opt_param_scheduler: bool = option(
        False, "On --load, take the learning-rate schedule (--lr, --min-lr, warm-up, decay length "
               "and style) from the checkpoint instead of the flags.",
        aliases=("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-lr-scheduler"))
    override_opt_param_scheduler: bool = option(
        False, "On --load, keep the learning-rate schedule of the flags even where the "
               "checkpoint's differs (without either flag the flags are used and each difference "
               "is logged).",
        aliases=("--override-opt_param-scheduler", "--override-lr-scheduler"))
    allow_overwrite_checkpoints: bool = option(
        False, "Start even though --save holds checkpoints this run does not resume from "
               "(they may be overwritten); without it such a run stops before training.")
    ckpt_format: str = option(
        "torch_dist", "Checkpoint format to save: torch_dist (the default, as in Megatron-LM: "
                      "global tensors through torch.distributed.checkpoint, resumable in any "
                      "layout) or torch (Megatron's legacy file per tensor/pipeline position). "
                      "Loading detects the format.",
        choices=("torch", "torch_dist"))
    async_save: bool = option(
        False, "With --ckpt-format torch_dist: write checkpoint files in the background while "
               "training goes on; the tracker is written, in the background, once every rank's "
               "write finished; the next save and the end of training wait for it.")
    use_persistent_ckpt_worker: bool = option(
        False, "With --async-save: write in a persistent background process (DCP's process "
               "executor) instead of a thread of the training process, so that writing does not "
               "compete with training for the Python interpreter; started at the first save.")


@dataclass
class LoggingConfig:
    """Log lines, TensorBoard and pipeline timelines."""

    log_interval: int = option(100, "Print a log line every this many iterations.")
    log_throughput: bool = option(
        False, "Accepted as in Megatron; the log line here always includes the throughput per GPU "
               "(model TFLOP/s/GPU, the README's convention), with or without this flag.")
    timing_log_level: int = option(
        0, "Timers in the block after each log line, at Megatron's levels: 0 none (no block); "
           "1 forward-backward, all-grads-sync and optimizer; 2 also batch-generator and one per "
           "instruction kind (forward-compute, backward-compute or its split halves, p2p-post, "
           "p2p-wait, grad-sync-start).",
        choices=(0, 1, 2))
    timing_log_option: str = option(
        "minmax", "How the timer block summarises ranks.", choices=("max", "minmax", "all"))
    log_params_norm: bool = option(
        False, "Include the L2 norm of all parameters in the log line ('params norm').")
    log_num_zeros_in_grad: bool = option(
        False, "Include the number of zero gradient elements in the log line ('num zeros').")
    tensorboard_dir: Optional[str] = option(None, "Write TensorBoard scalars here.")
    wandb_project: Optional[str] = option(
        None, "Log the TensorBoard scalars to this Weights & Biases project too (needs the wandb "
              "package; WANDB_MODE=offline works without network).")
    wandb_exp_name: Optional[str] = option(None, "Weights & Biases run name.")
    wandb_save_dir: Optional[str] = option(
        None, "Directory for Weights & Biases files; default <--save>/wandb, else ./wandb.")
    pipeline_timeline: Optional[str] = option(
        None, "Write a Chrome-trace timeline of one iteration's pipeline instructions here.")


@dataclass
class MegatronConfig:
    """The whole run: one section per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def sections(config: MegatronConfig):
    """Yield (section name, section object) pairs in declaration order."""
    for section_field in dataclasses.fields(config):
        yield section_field.name, getattr(config, section_field.name)
