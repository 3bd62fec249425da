"""Cross-cutting validation of a :class:`MegatronConfig`, run before any process group exists.

Owns the rules that relate flags to each other and to the world size (world = TP x PP x DP, heads
divisible by TP, global batch divisible by micro-batch x DP, pipeline schedule options, data and
tokenizer flags, ...) and fills the derived fields (data-parallel size, micro-batches per iteration,
default FFN size and position table, default schedule, padded vocabulary where it is already known).

Every user error names the flags involved and says how to fix it; :func:`validate_config` runs every
independent check and raises one :class:`ConfigurationError` (a ``ValueError``) listing all problems.
Batch-size, training-length and LR-schedule-length rules live in
:mod:`megatron.training.batch_validation`.
The decisions about features that exist as flags but are not implemented are in
:data:`NOT_SUPPORTED_YET` (rejected) and in :mod:`megatron.training.arguments` (accepted and logged as
ignored); ``docs/flags.md`` documents both.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron.core.config import MODEL_FEATURE_GATES, MegatronConfig, ModelConfig
from megatron.core.datasets.fim_dataset import validate_fim_options
from megatron.core.models.gpt.mup import validate_mup_options
from megatron.core.distributed.reducers import BUILTIN_REDUCERS
from megatron.core.pipeline_parallel.planning.schedules import (BUILTIN_SCHEDULES, ScheduleRegistry,
                                                               schedule_layout)
from megatron.core.pipeline_parallel.planning.stage_split import StageSplit, stage_layer_counts
from megatron.training.megatron_leniency import apply_megatron_leniency
from megatron.training.batch_validation import (require_positive, validate_batch,
                                               validate_iterations_schedule,
                                               validate_precision_and_evaluation,
                                               validate_samples_schedule)

logger = logging.getLogger(__name__)

# Vocabulary used by --mock-data (and no tokenizer) when --vocab-size is not given.
DEFAULT_MOCK_VOCAB_SIZE = 1024

# Tokenizers whose vocabulary size is only known once the tokenizer files are read.
FILE_TOKENIZERS = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                   "Llama2Tokenizer", "HuggingFaceTokenizer")

@dataclass(frozen=True)
class UnsupportedFeature:
    """A Megatron flag (or flag value) that exists in the config but is not implemented yet."""

    section: str
    field: str
    shown: str                          # how the user wrote it, e.g. "--normalization RMSNorm"
    is_used: Callable[[Any], bool]      # true when the config asks for the feature
    instead: str                        # what to do instead


# Features that exist as Megatron flags (and config fields) but are not implemented: using them would
# silently train something other than what the user asked for, so validation rejects them.
NOT_SUPPORTED_YET: tuple[UnsupportedFeature, ...] = (
    # The model's gates: one table shared with the model (megatron.core.config).
    *(UnsupportedFeature("model", gate.field, gate.shown, gate.is_used, gate.instead)
      for gate in MODEL_FEATURE_GATES),
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def pad_vocab_size(vocab_size: int, model_config: ModelConfig, tensor_parallel_size: int) -> int:
    """Megatron's padding: round the vocabulary up to a multiple of
    ``make_vocab_size_divisible_by x tensor_parallel_size`` so every TP rank holds an equal slice."""
    if vocab_size < 1:
        raise ValueError(f"vocabulary size {vocab_size} must be >= 1; check the tokenizer or "
                         f"--vocab-size")
    multiple = model_config.make_vocab_size_divisible_by * tensor_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def set_padded_vocab_size(config: MegatronConfig, vocab_size: int) -> int:
    """Fill ``config.model.padded_vocab_size`` once the tokenizer's vocabulary size is known.

    Call this after building a GPT-2 BPE or SentencePiece tokenizer (validation cannot read their
    files). Mutates ``config`` in place and returns the padded size.
    """
    padded = pad_vocab_size(vocab_size, config.model, config.parallel.tensor_model_parallel_size)
    logger.info("padded vocab (size: %d) with %d dummy tokens (new size: %d)",
                vocab_size, padded - vocab_size, padded)
    config.model.padded_vocab_size = padded
    return padded


class ConfigurationError(ValueError):
    """Every problem validation found in one config; ``problems`` holds one message each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        if len(problems) == 1:
            text = problems[0]
        else:
            text = f"{len(problems)} problems in the flags:\n" + "\n".join(
                f"  - {problem}" for problem in problems)
        super().__init__(text)


def not_supported_problems(config: MegatronConfig) -> list[str]:
    """One message per unimplemented feature the config asks for (all of them, not the first)."""
    return [f"{feature.shown} is not supported yet by Megatron-Chimera; {feature.instead}. See "
            f"docs/flags.md for the supported flags."
            for feature in NOT_SUPPORTED_YET
            if _has_field(getattr(config, feature.section), feature.field)  # another model's
            and feature.is_used(getattr(getattr(config, feature.section), feature.field))]


def _has_field(section, name: str) -> bool:
    """Whether the config section declares ``name`` (another model's section may not)."""
    return name in {section_field.name for section_field in dataclasses.fields(section)}


def _translate_legacy_recompute(config: MegatronConfig) -> None:
    """--checkpoint-activations / --recompute-activations become the modern flags (and are reset,
    so the validated config has one spelling and survives a round trip through flags)."""
    recompute = config.recompute
    if recompute.checkpoint_activations and recompute.recompute_activations:
        raise ValueError("--checkpoint-activations and --recompute-activations contradict each "
                         "other (full vs selective recomputation); give only one")
    if recompute.checkpoint_activations:
        if recompute.recompute_granularity not in (None, "full"):
            raise ValueError("--checkpoint-activations means --recompute-granularity full but "
                             f"--recompute-granularity {recompute.recompute_granularity} was "
                             "given; drop one of the two")
        recompute.recompute_granularity = "full"
        recompute.recompute_method = recompute.recompute_method or "uniform"
        if recompute.recompute_num_layers is None:
            recompute.recompute_num_layers = 1
        recompute.checkpoint_activations = False
    if recompute.recompute_activations:
        if recompute.recompute_granularity not in (None, "selective"):
            raise ValueError("--recompute-activations means --recompute-granularity selective but "
                             f"--recompute-granularity {recompute.recompute_granularity} was "
                             "given; drop one of the two")
        recompute.recompute_granularity = "selective"
        recompute.recompute_activations = False
    if recompute.activations_checkpoint_method is not None:
        # Megatron-LM 2021-22: the method alone selected full recomputation.
        if recompute.recompute_granularity not in (None, "full"):
            raise ValueError("--activations-checkpoint-method means --recompute-granularity full "
                             f"but --recompute-granularity {recompute.recompute_granularity} was "
                             "given; drop one of the two")
        if recompute.recompute_method not in (None, recompute.activations_checkpoint_method):
            raise ValueError(f"--activations-checkpoint-method "
                             f"{recompute.activations_checkpoint_method} and --recompute-method "
                             f"{recompute.recompute_method} contradict each other; give only one")
        recompute.recompute_granularity = "full"
        recompute.recompute_method = recompute.activations_checkpoint_method
        recompute.activations_checkpoint_method = None


def _validate_model(config: MegatronConfig) -> None:
    model = config.model
    if model.use_rotary_position_embeddings:  # the legacy spelling becomes today's (round trips)
        if model.position_embedding_type not in ("learned_absolute", "rope"):
            raise ValueError("--use-rotary-position-embeddings means --position-embedding-type "
                             f"rope but --position-embedding-type {model.position_embedding_type} "
                             "was given; drop one of the two")
        model.position_embedding_type = "rope"
        model.use_rotary_position_embeddings = False
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if getattr(model, name) is None:
            raise ValueError(f"{_flag(name)} is required; add it to the command line")
    require_positive(model, ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                              "make_vocab_size_divisible_by"))
    require_positive(model, ("ffn_hidden_size", "max_position_embeddings", "vocab_size"),
                      allow_none=True)
    if model.kv_channels is None and model.hidden_size % model.num_attention_heads:
        raise ValueError(f"--hidden-size {model.hidden_size} is not divisible by "
                         f"--num-attention-heads {model.num_attention_heads}; choose a head count "
                         f"that divides the hidden size (or give --kv-channels)")
    _validate_modern_block(model)
    if model.ffn_hidden_size is None:
        model.ffn_hidden_size = 4 * model.hidden_size
    if model.max_position_embeddings is None:
        model.max_position_embeddings = model.seq_length
    if model.max_position_embeddings < model.seq_length:
        raise ValueError(f"--max-position-embeddings {model.max_position_embeddings} is smaller "
                         f"than --seq-length {model.seq_length}; raise it to at least "
                         f"{model.seq_length} (or omit it: it defaults to --seq-length)")
    for name in ("attention_dropout", "hidden_dropout"):
        if not 0.0 <= getattr(model, name) < 1.0:
            raise ValueError(f"{_flag(name)} {getattr(model, name)} is not a probability in "
                             f"[0, 1); use e.g. 0.1 or 0")
    if model.init_method_std <= 0:
        raise ValueError(f"--init-method-std {model.init_method_std} must be > 0")
    validate_mup_options(model)


def _validate_modern_block(model: ModelConfig) -> None:
    """Rules of the Llama-style options (grouped-query attention, RoPE, MLP activation)."""
    require_positive(model, ("kv_channels", "num_query_groups"), allow_none=True)
    if model.group_query_attention:
        if model.num_query_groups is None:
            raise ValueError("--group-query-attention needs --num-query-groups (the number of "
                             "key/value heads)")
        if model.num_attention_heads % model.num_query_groups:
            raise ValueError(f"--num-attention-heads {model.num_attention_heads} is not divisible "
                             f"by --num-query-groups {model.num_query_groups}; every key/value "
                             f"group needs the same number of query heads")
    if model.swiglu and model.squared_relu:
        raise ValueError("--swiglu and --squared-relu both choose the MLP activation; give one")
    if not 0.0 < model.rotary_percent <= 1.0:
        raise ValueError(f"--rotary-percent {model.rotary_percent} must lie in (0, 1]")


def query_groups(model: ModelConfig) -> int:
    """Key/value heads: --num-query-groups with --group-query-attention, else the head count."""
    return model.num_query_groups if model.group_query_attention else model.num_attention_heads


def _check_gpt_tensor_parallel_split(config: MegatronConfig) -> None:
    """GPT's sizes split over the tensor-parallel ranks (runs after _validate_parallel)."""
    model, tp = config.model, config.parallel.tensor_model_parallel_size
    if model.num_attention_heads % tp:
        raise ValueError(f"--num-attention-heads {model.num_attention_heads} is not divisible by "
                         f"--tensor-model-parallel-size {tp}; each tensor-parallel rank needs whole "
                         f"heads: change the head count or the tensor-parallel size")
    if query_groups(model) % tp:
        raise ValueError(f"--num-query-groups {query_groups(model)} is not divisible by "
                         f"--tensor-model-parallel-size {tp}; each tensor-parallel rank needs whole "
                         f"key/value groups")
    if config.parallel.sequence_parallel and model.seq_length % tp:
        raise ValueError(f"--seq-length {model.seq_length} is not divisible by "
                         f"--tensor-model-parallel-size {tp}; --sequence-parallel splits the "
                         f"sequence evenly over the tensor-parallel ranks")
    if model.ffn_hidden_size % tp:
        raise ValueError(f"--ffn-hidden-size {model.ffn_hidden_size} is not divisible by "
                         f"--tensor-model-parallel-size {tp}; choose an FFN size that splits evenly")


def _validate_parallel(config: MegatronConfig, world_size: int,
                       registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> None:
    parallel = config.parallel
    require_positive(parallel, ("tensor_model_parallel_size", "pipeline_model_parallel_size"))
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if world_size < 1:
        raise ValueError(f"world size {world_size} must be >= 1")
    if world_size % (tp * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} = {tp * pp}; launch a multiple of {tp * pp} "
            f"processes or change the parallel sizes (world size = TP x PP x DP)")
    parallel.world_size = world_size
    parallel.data_parallel_size = world_size // (tp * pp)
    if parallel.distributed_timeout_minutes <= 0:
        raise ValueError(f"--distributed-timeout-minutes {parallel.distributed_timeout_minutes} "
                         f"must be > 0")
    _resolve_pipeline_schedule(config, registry)


def _resolve_pipeline_schedule(config: MegatronConfig,
                               registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> None:
    """The schedule the flags select, the family's own config rules (its ``derive_config``) and
    the flags of other families."""
    parallel, num_layers = config.parallel, config.model.num_layers
    pp = parallel.pipeline_model_parallel_size
    parallel.pipeline_schedule = registry.select(parallel)
    family = registry.family(parallel.pipeline_schedule)
    for field_name, value in family.derive_config(parallel, num_layers).items():
        setattr(parallel, field_name, value)

    # The family's own check (planning/schedules) rules on depth, pipelines, variant and N (see
    # _check_schedule_options); here only flags that belong to another family are refused.
    _refuse_other_families_flags(config, registry)
    if parallel.split_backward and pp < 2:
        raise ValueError("--split-backward reorders the backward passes of a pipeline schedule; it "
                         "needs --pipeline-model-parallel-size >= 2 (drop it without a pipeline)")
    if parallel.pipeline_op_costs and not parallel.split_backward:
        raise ValueError("--pipeline-op-costs places the weight-gradient halves of a split "
                         "backward; add --split-backward or drop --pipeline-op-costs")
    if parallel.pipeline_op_costs and not os.path.isfile(parallel.pipeline_op_costs):
        raise ValueError(f"--pipeline-op-costs {parallel.pipeline_op_costs!r} is not a file; give "
                         f"a JSON file ('stages' [[F, I, W], ...] or tools/performance_model.py "
                         f"--measure output)")
    if parallel.pipeline_op_costs:
        _refuse_latency_plans_off_gloo(parallel)
    if parallel.split_backward_extra_activations < 0:
        raise ValueError(f"--split-backward-extra-activations "
                         f"{parallel.split_backward_extra_activations} must be >= 0")
    # The chosen gradient reducer's own flag rules (megatron/core/distributed/reducers.py).
    BUILTIN_REDUCERS.get(parallel.dp_gradient_reducer).validate(parallel)
    if parallel.overlap_param_gather and not parallel.use_distributed_optimizer:
        raise ValueError("--overlap-param-gather overlaps the distributed optimizer's parameter "
                         "all-gather; add --use-distributed-optimizer or drop it")
    if pp > 1 and parallel.overlap_grad_reduce:
        _report_overlap_without_effect(parallel)
    _resolve_grad_reduce_in_bf16(config)


def _report_overlap_without_effect(parallel) -> None:
    """--overlap-grad-reduce with a pipeline launches each module's buckets during its last
    backward op (the pipeline runtime's interpreter); the reductions that cannot start before the
    schedule's GradSyncStart are named here (they keep the schedule's placement)."""
    if parallel.use_distributed_optimizer:
        logger.warning("--overlap-grad-reduce does not overlap the distributed optimizer's "
                       "gradient reduce-scatter: with --use-distributed-optimizer each stage's "
                       "reduce-scatter starts at the schedule's gradient sync (see "
                       "--chimera-grad-sync)")
    elif not BUILTIN_REDUCERS.get(parallel.dp_gradient_reducer).overlaps:
        logger.warning(f"--overlap-grad-reduce has no effect with --dp-gradient-reducer "
                       f"{parallel.dp_gradient_reducer}: it compresses the whole gradient, after "
                       f"the module's last backward (at the schedule's gradient sync)")


def _resolve_grad_reduce_in_bf16(config: MegatronConfig) -> None:
    """--grad-reduce-in-bf16 narrows the exact reduction's collectives to bf16; as in Megatron-LM
    it only acts with --bf16 (dropped, with a warning, otherwise)."""
    parallel = config.parallel
    if not parallel.grad_reduce_in_bf16:
        return
    if not config.training.bf16:
        logger.warning("--grad-reduce-in-bf16 is ignored without --bf16 (as in Megatron-LM): "
                       "gradients are reduced in fp32")
        parallel.grad_reduce_in_bf16 = False
    elif parallel.dp_gradient_reducer != "allreduce":
        raise ValueError(f"--grad-reduce-in-bf16 narrows the exact all-reduce/reduce-scatter; "
                         f"--dp-gradient-reducer {parallel.dp_gradient_reducer} communicates "
                         f"its own encoding: drop one of them")


def _refuse_other_families_flags(config: MegatronConfig,
                                 registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> None:
    """A schedule option flag given for a family that does not take it is a mistake, and so is a
    gradient-sync policy for a schedule whose stages have no replicas. Logs the family's note on
    stored activations when recomputation is off."""
    parallel = config.parallel
    defaults = type(parallel)()
    family = registry.family(parallel.pipeline_schedule)
    own_fields = {option.config_field for option in family.options}
    for other in registry.families:
        for field_name in (option.config_field for option in other.options):
            if field_name not in own_fields and \
                    getattr(parallel, field_name) != getattr(defaults, field_name):
                flag = _flag(field_name)
                raise ValueError(f"{flag} only applies to --pipeline-schedule {other.name} (the "
                                 f"schedule is {family.name}); add --pipeline-schedule "
                                 f"{other.name} or drop {flag}")
    options = family.options_from_config(parallel)
    if parallel.chimera_grad_sync != defaults.chimera_grad_sync:
        try:
            replicated = schedule_layout(family.name, parallel.pipeline_model_parallel_size,
                                         registry, **options).has_stage_replicas
        except ValueError:
            replicated = True  # the schedule's own check reports this configuration
        if not replicated:
            raise ValueError(f"--chimera-grad-sync only applies to schedules whose stages have "
                             f"replicas on other pipeline ranks (chimera; the schedule is "
                             f"{family.name}); add --pipeline-schedule chimera or drop it")
    note = family.memory_note({**family.defaults(), **options})
    if note and config.recompute.recompute_granularity is None:
        logger.warning(note)


def _check_schedule_options(config: MegatronConfig,
                            registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> None:
    """Ask the schedule builders whether they accept this depth and micro-batch count."""
    # Imported here: the schedules package owns these rules, and validation must not import it at
    # module level (it is pure, but keeping the flag parser's import light costs nothing).
    from megatron.core.pipeline_parallel.planning.schedules import (check_schedule_options,
                                                           schedule_from_config)
    from megatron.training.microbatches import ramp_batch_sizes
    parallel, training = config.parallel, config.training
    name, options = schedule_from_config(parallel, registry)
    per_step = training.micro_batch_size * parallel.data_parallel_size
    evaluation = [training.eval_global_batch_size] if training.eval_global_batch_size else []
    for batch_size in ramp_batch_sizes(training) + evaluation:
        count = batch_size // per_step
        try:
            check_schedule_options(name, parallel.pipeline_model_parallel_size, count,
                                   micro_batch_size=training.micro_batch_size,
                                   registry=registry, **options)
        except ValueError as error:
            source = ("--eval-global-batch-size" if batch_size in evaluation else
                      "--step-batch-size-schedule" if training.step_batch_size_schedule else
                      "--rampup-batch-size ramp")
            ramp = (f" (global batch size {batch_size} of the {source}; pick sizes that suit "
                    f"the schedule)" if batch_size != training.global_batch_size else "")
            raise ValueError(
                f"--pipeline-schedule {parallel.pipeline_schedule} with "
                f"--pipeline-model-parallel-size {parallel.pipeline_model_parallel_size} and "
                f"{count} micro-batches per iteration (global batch size / (--micro-batch-size x "
                f"data-parallel size)){ramp}: {error}") from error


def _validate_recompute(config: MegatronConfig) -> None:
    recompute = config.recompute
    if recompute.recompute_granularity == "full":
        if recompute.recompute_method is None:
            raise ValueError("--recompute-granularity full needs --recompute-method uniform or "
                             "block")
        if recompute.recompute_num_layers is None:
            recompute.recompute_num_layers = 1
        require_positive(recompute, ("recompute_num_layers",))
        pp, split = config.parallel.pipeline_model_parallel_size, StageSplit.from_parallel_config(
            config.parallel)
        layers_per_stage = (config.model.num_layers // pp if split.is_even else  # uneven: largest
                            max(stage_layer_counts(config.model.num_layers, pp, pp, split)))
        if recompute.recompute_method == "block" and \
                recompute.recompute_num_layers > layers_per_stage:
            raise ValueError(f"--recompute-num-layers {recompute.recompute_num_layers} exceeds the "
                             f"{layers_per_stage} layers of a pipeline stage; lower it")
    elif recompute.recompute_granularity == "selective" and recompute.recompute_method is not None:
        raise ValueError("--recompute-method only applies to --recompute-granularity full "
                         "(selective recomputation has no method, as in Megatron-LM); drop it")
    else:
        # Megatron-LM ignores them without full granularity; so do we, saying so.
        for name in ("recompute_method", "recompute_num_layers"):
            if getattr(recompute, name) is not None:
                logger.warning("%s is ignored: it only applies to --recompute-granularity full",
                               _flag(name))
                setattr(recompute, name, None)


def _validate_optimizer(config: MegatronConfig) -> None:
    optimizer = config.optimizer
    if optimizer.lr is None:
        raise ValueError("--lr (peak learning rate) is required, e.g. --lr 1.5e-4")
    if optimizer.lr <= 0 or optimizer.min_lr < 0 or optimizer.min_lr > optimizer.lr:
        raise ValueError(f"need 0 <= --min-lr ({optimizer.min_lr}) <= --lr ({optimizer.lr}) and "
                         f"--lr > 0")
    if config.training.train_samples is not None:
        validate_samples_schedule(config)
    else:
        validate_iterations_schedule(config)
    if optimizer.decoupled_min_lr is not None and optimizer.decoupled_lr is None:
        raise ValueError("--decoupled-min-lr needs --decoupled-lr (the peak of the embedding and "
                         "output layer's schedule); add it or drop --decoupled-min-lr")
    if optimizer.decoupled_lr is not None:
        floor = optimizer.min_lr if optimizer.decoupled_min_lr is None else \
            optimizer.decoupled_min_lr
        if optimizer.decoupled_lr <= 0 or not 0 <= floor <= optimizer.decoupled_lr:
            raise ValueError(f"need 0 <= --decoupled-min-lr (or --min-lr) ({floor}) <= "
                             f"--decoupled-lr ({optimizer.decoupled_lr}) and --decoupled-lr > 0")
    if optimizer.clip_grad < 0:
        raise ValueError(f"--clip-grad {optimizer.clip_grad} must be >= 0 (0 disables clipping)")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(optimizer, name) < 1.0:
            raise ValueError(f"{_flag(name)} {getattr(optimizer, name)} must lie in [0, 1)")
    if optimizer.adam_eps <= 0:
        raise ValueError(f"--adam-eps {optimizer.adam_eps} must be > 0")
    if optimizer.loss_scale is not None and optimizer.loss_scale <= 0:
        raise ValueError(f"--loss-scale {optimizer.loss_scale} must be > 0 (omit it for dynamic "
                         f"loss scaling)")
    if optimizer.initial_loss_scale <= 0 or optimizer.min_loss_scale <= 0 or \
            optimizer.min_loss_scale > optimizer.initial_loss_scale:
        raise ValueError("need 0 < --min-loss-scale <= --initial-loss-scale")
    require_positive(optimizer, ("loss_scale_window", "hysteresis"))


def _parse_split(split: str) -> list[float]:
    pieces = [piece for piece in re.split(r"[,/]", split) if piece.strip()]
    try:
        weights = [float(piece) for piece in pieces]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {split!r} is not train,valid,test proportions; use e.g. "
                         f"--split 949,50,1")
    return weights


def _check_blend_weights(weights: list) -> None:
    """--data-path W1 P1 W2 P2 ...: every weight a finite number >= 0, and not all zero (checked
    with the other flags, before any process group, model or dataset is built)."""
    values = []
    for weight in weights:
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"--data-path weight {weight!r} is not a finite number >= 0; use "
                             f"W1 P1 W2 P2 ... with weights such as 0.3 0.7 or 30 70")
        values.append(value)
    if sum(values) <= 0:
        raise ValueError(f"--data-path weights {' '.join(map(str, weights))} are all zero: no "
                         f"dataset would ever be sampled; give at least one positive weight")


def _validate_data(config: MegatronConfig) -> None:
    data = config.data
    if data.mock_data and data.data_path is not None:
        raise ValueError("--mock-data and --data-path are both given; give exactly one data source")
    if not data.mock_data and data.data_path is None:
        raise ValueError("no data source given: add --mock-data or --data-path PREFIX (or "
                         "weight-prefix pairs W1 P1 W2 P2 ...)")
    if data.data_path is not None and len(data.data_path) > 1:
        pairs = data.data_path
        if len(pairs) % 2:
            raise ValueError(f"--data-path with several entries needs weight-prefix pairs "
                             f"(W1 P1 W2 P2 ...); got {len(pairs)} entries")
        _check_blend_weights(pairs[0::2])
    _parse_split(data.split)
    if data.num_workers < 0:
        raise ValueError(f"--num-workers {data.num_workers} must be >= 0")

    # Megatron infers the GPT-2 tokenizer from its two files; we also infer SentencePiece from its model.
    if data.tokenizer_type is None:
        if data.vocab_file is not None and data.merge_file is not None:
            data.tokenizer_type = "GPT2BPETokenizer"
        elif data.tokenizer_model is not None:
            data.tokenizer_type = "SentencePieceTokenizer"
        elif data.vocab_file is not None or data.merge_file is not None:
            raise ValueError("the GPT-2 tokenizer needs both --vocab-file and --merge-file")
    tokenizer = data.tokenizer_type
    if tokenizer == "GPT2BPETokenizer" and (data.vocab_file is None or data.merge_file is None):
        raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if tokenizer in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                     "HuggingFaceTokenizer") and data.tokenizer_model is None:
        raise ValueError(f"--tokenizer-type {tokenizer} needs --tokenizer-model")
    if tokenizer is None and not data.mock_data:
        raise ValueError("--data-path needs a tokenizer: give --vocab-file and --merge-file (GPT-2 "
                         "BPE) or --tokenizer-type SentencePieceTokenizer --tokenizer-model FILE")
    validate_fim_options(data)


def _resolve_gpt_vocabulary(config: MegatronConfig) -> None:
    """GPT's vocabulary flags against the tokenizer, and the padded size (after _validate_data)."""
    data, model = config.data, config.model
    tokenizer = data.tokenizer_type
    if tokenizer == "NullTokenizer" and model.vocab_size is None:
        raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
    if tokenizer in FILE_TOKENIZERS:
        if model.vocab_size is not None:
            # Megatron-LM pads the tokenizer's own vocabulary size and never reads --vocab-size
            # for these tokenizers; so here.
            logger.warning("--vocab-size %d is ignored (as in Megatron-LM): the %s reads its "
                           "vocabulary size from its files", model.vocab_size, tokenizer)
            model.vocab_size = None
        # Known only after the tokenizer is built: see set_padded_vocab_size.
        model.padded_vocab_size = None
    elif tokenizer == "NullTokenizer":
        # Megatron's NullTokenizer appends its end-of-document id after the --vocab-size ids.
        model.padded_vocab_size = pad_vocab_size(
            model.vocab_size + 1, model, config.parallel.tensor_model_parallel_size)
    else:
        # --mock-data without a tokenizer: token ids 0 .. vocab_size - 1.
        if model.vocab_size is None:
            model.vocab_size = DEFAULT_MOCK_VOCAB_SIZE
        model.padded_vocab_size = pad_vocab_size(
            model.vocab_size, model, config.parallel.tensor_model_parallel_size)


def _validate_logging_and_checkpoints(config: MegatronConfig) -> None:
    require_positive(config.logging, ("log_interval",))
    if config.checkpoint.use_checkpoint_opt_param_scheduler and \
            config.checkpoint.override_opt_param_scheduler:
        raise ValueError("--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler "
                         "contradict each other (the checkpoint's schedule vs the flags'); give "
                         "only one")
    require_positive(config.checkpoint, ("save_interval", "save_retain_interval"), allow_none=True)
    require_positive(config.training, ("exit_interval",), allow_none=True)
    negative = [n for n in config.training.iterations_to_skip or () if n < 0]
    if negative:
        raise ValueError(f"--iterations-to-skip {negative} must be >= 0 (N skips the step after N "
                         f"completed iterations)")
    if config.checkpoint.save_interval is not None and config.checkpoint.save is None:
        logger.warning("--save-interval %d is given without --save: no checkpoints will be written",
                       config.checkpoint.save_interval)


def validate_config(config: MegatronConfig, world_size: int,
                    registry: ScheduleRegistry = BUILTIN_SCHEDULES,
                    model_steps: Optional[tuple] = None) -> MegatronConfig:
    """Check every cross-flag rule and return a copy with the derived fields filled in.

    Raises ``ValueError`` naming the offending flags and the fix. ``world_size`` is the number of
    processes of the run (``TP x PP x DP``). ``registry`` holds the schedule families
    ``--pipeline-schedule`` may name; each family rules on its own flags (its ``derive_config``
    and ``check``). ``model_steps``: the model's own checks (a ``ModelSpec``'s
    ``validation_steps``, each ``(name, step(config, world_size, registry), needs)``; default
    GPT's, :data:`GPT_VALIDATION_STEPS`): those without ``needs`` run before the generic steps,
    the others after them. The input config is not modified.
    """
    config = copy.deepcopy(config)
    apply_megatron_leniency(config)
    model_steps = GPT_VALIDATION_STEPS if model_steps is None else tuple(model_steps)
    steps = (_VALIDATION_STEPS[:1] + tuple(step for step in model_steps if not step[2])
             + _VALIDATION_STEPS[1:] + tuple(step for step in model_steps if step[2]))
    problems = not_supported_problems(config)
    failed: set[str] = set()
    for name, step, needs in steps:
        if failed.intersection(needs):
            failed.add(name)  # its inputs are invalid: its own verdict would mislead
            continue
        try:
            step(config, world_size, registry)
        except ConfigurationError as error:
            problems.extend(error.problems)
            failed.add(name)
        except ValueError as error:
            problems.append(str(error))
            failed.add(name)
    if problems:
        raise ConfigurationError(problems)
    return config


# (name, step(config, world_size, registry), names of the steps whose derived fields it reads).
# Independent steps all run, so one run reports every problem; a step whose inputs failed is
# skipped.
_VALIDATION_STEPS: tuple = (
    ("legacy", lambda config, *_: _translate_legacy_recompute(config), ()),
    ("parallel", _validate_parallel, ("model",)),
    ("batch", lambda config, *_: validate_batch(config), ("parallel",)),
    ("precision", lambda config, *_: validate_precision_and_evaluation(config), ()),
    ("schedule", lambda config, _, registry: _check_schedule_options(config, registry), ("batch",)),
    ("recompute", lambda config, *_: _validate_recompute(config), ("parallel", "legacy")),
    ("optimizer", lambda config, *_: _validate_optimizer(config), ("batch",)),
    ("data", lambda config, *_: _validate_data(config), ("parallel",)),
    ("logging", lambda config, *_: _validate_logging_and_checkpoints(config), ()),
)

# GPT's own checks (the GPT ModelSpec's validation_steps; the default of validate_config).
GPT_VALIDATION_STEPS: tuple = (
    ("model", lambda config, *_: _validate_model(config), ()),
    ("tensor-parallel split", lambda config, *_: _check_gpt_tensor_parallel_split(config),
     ("model", "parallel")),
    ("vocabulary", lambda config, *_: _resolve_gpt_vocabulary(config),
     ("model", "parallel", "data")),
)


def _refuse_latency_plans_off_gloo(parallel) -> None:
    """A ``message_latency`` in --pipeline-op-costs makes a latency-tolerant plan whose eager sends
    are deadlock-free only when sends complete in the background (gloo); under a blocking exchange
    they deadlock (the simulator's ``rendezvous`` semantics), and NCCL's ordering of p2p work was
    not checked on a GPU. Refuse the combination instead of risking a hang."""
    import torch

    from megatron.core.pipeline_parallel.planning.op_cost_profile import message_latency
    backend = parallel.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "gloo":
        return
    latency = message_latency(parallel.pipeline_op_costs)
    if latency:
        raise ValueError(f"--pipeline-op-costs {parallel.pipeline_op_costs!r} gives "
                         f"message_latency {latency}: latency-tolerant plans send eagerly, which "
                         f"is verified deadlock-free only on gloo; drop message_latency from the "
                         f"file or use --distributed-backend gloo")
