"""Interleaved 1F1B (Megatron's virtual pipeline).

Each rank hosts ``num_model_chunks`` = v chunks; virtual stage c * D + r runs on rank r as its
chunk c, so one pipeline (id 0) has D * v stages placed round-robin. The op order is Megatron's:
micro-batches advance through the chunks in groups of G (``microbatch_group_size``, Megatron's
--microbatch-group-size-per-virtual-pipeline-stage, default D; the last group holds the
N mod G left over when G does not divide N), a rank runs ``min(2 (D - 1 - r) + (v - 1) G, N v)``
warm-up forwards (all N v when N == D), then one forward / one backward pairs, then the remaining
backwards.

Constraints (as in Megatron's forward_backward_pipelining_with_interleaving): v >= 2, D >= 2,
D <= G <= N, and N mod G is 0 or at least D. With the default G = D this means N a multiple of D;
any N >= D is accepted with G = N (one group). On the command line the family is selected by
--num-layers-per-virtual-pipeline-stage (layers per chunk), from which
:func:`derive_interleaved_config` derives v = num_layers / (D x layers per chunk), or by
--num-virtual-stages-per-pipeline-rank (v itself; needed with uneven first/last stages, see
:mod:`..stage_split`).
"""

from __future__ import annotations

from ..instructions import Instruction, backward, forward
from ..stage_split import StageSplit, stage_layer_counts
from .family import ScheduleFamily, ScheduleOption
from .layout import ScheduleLayout


GROUP_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"


def check_interleaved(pipeline_size: int, num_microbatches: int, num_model_chunks,
                      microbatch_group_size=None) -> None:
    """Raise ValueError unless (D, N, v, G) is a valid interleaved 1F1B configuration."""
    if not isinstance(num_model_chunks, int) or num_model_chunks < 2:
        raise ValueError(
            f"interleaved-1f1b needs num_model_chunks >= 2 (got {num_model_chunks!r}); "
            f"use the 1f1b schedule for one chunk per rank")
    if pipeline_size < 2:
        raise ValueError(
            f"interleaved-1f1b needs --pipeline-model-parallel-size >= 2 (got {pipeline_size})")
    if num_microbatches < pipeline_size:
        raise ValueError(
            f"interleaved-1f1b needs at least --pipeline-model-parallel-size ({pipeline_size}) "
            f"micro-batches (got {num_microbatches}); raise --global-batch-size or use 1f1b")
    group = pipeline_size if microbatch_group_size is None else microbatch_group_size
    if not isinstance(group, int) or not pipeline_size <= group <= num_microbatches:
        raise ValueError(
            f"{GROUP_FLAG} {group!r} must lie between --pipeline-model-parallel-size "
            f"({pipeline_size}) and the number of micro-batches ({num_microbatches})")
    remainder = num_microbatches % group
    if 0 < remainder < pipeline_size:
        raise ValueError(
            f"interleaved-1f1b runs micro-batches through the chunks in groups of G = {group} "
            f"({GROUP_FLAG}, default --pipeline-model-parallel-size); {num_microbatches} "
            f"micro-batches leave a last group of {remainder} < {pipeline_size}. Use a number of "
            f"micro-batches that is a multiple of {group}, or set {GROUP_FLAG} to a G in "
            f"[{pipeline_size}, {num_microbatches}] with N mod G = 0 or >= {pipeline_size} "
            f"(e.g. {num_microbatches})")


def derive_interleaved_config(parallel_config, num_layers: int) -> dict:
    """Megatron's config rules of the virtual pipeline; returns the derived
    ``virtual_pipeline_model_parallel_size`` (v, the model chunks per rank).

    v comes from ``--num-virtual-stages-per-pipeline-rank``, or from
    ``--num-layers-per-virtual-pipeline-stage`` as (layers per rank) / (layers per chunk), where
    the layers per rank count the embedding and loss with the account-for flags; uneven first or
    last stages need the former (as in Megatron-LM)."""
    layers_per_chunk = parallel_config.num_layers_per_virtual_pipeline_stage
    chunks = getattr(parallel_config, "num_virtual_stages_per_pipeline_rank", None)
    pp = parallel_config.pipeline_model_parallel_size
    split = StageSplit.from_parallel_config(parallel_config)
    if layers_per_chunk is None and chunks is None:
        raise ValueError("--pipeline-schedule interleaved-1f1b needs "
                         "--num-layers-per-virtual-pipeline-stage (layers per model chunk) or "
                         "--num-virtual-stages-per-pipeline-rank (model chunks per rank)")
    if layers_per_chunk is not None and chunks is not None:
        raise ValueError("--num-layers-per-virtual-pipeline-stage and "
                         "--num-virtual-stages-per-pipeline-rank both give the virtual pipeline's "
                         "size; drop one")
    if pp < 2:
        raise ValueError("the interleaved-1f1b schedule needs --pipeline-model-parallel-size "
                         ">= 2; drop the virtual-stage flag or raise it")
    if chunks is not None:
        if chunks < 2:
            raise ValueError(f"--num-virtual-stages-per-pipeline-rank {chunks} must be >= 2 for "
                             f"interleaved-1f1b (1 is the plain 1f1b schedule: drop the flag)")
        stage_layer_counts(num_layers, pp, pp * chunks, split)
        return {"virtual_pipeline_model_parallel_size": chunks}
    if layers_per_chunk < 1:
        raise ValueError("--num-layers-per-virtual-pipeline-stage must be >= 1")
    if split.first is not None or split.last is not None:
        raise ValueError("uneven first/last pipeline stages need the virtual pipeline's size as "
                         "--num-virtual-stages-per-pipeline-rank (as in Megatron-LM); replace "
                         "--num-layers-per-virtual-pipeline-stage")
    units = num_layers + split.account_for_embedding + split.account_for_loss
    if units % (pp * layers_per_chunk):
        counted = "" if split.is_even else " (counting the embedding / loss as layers)"
        raise ValueError(
            f"--num-layers {num_layers}{counted} is not divisible by "
            f"--pipeline-model-parallel-size {pp} x --num-layers-per-virtual-pipeline-stage "
            f"{layers_per_chunk}; every model chunk needs the same number of layers")
    chunks = units // (pp * layers_per_chunk)
    stage_layer_counts(num_layers, pp, pp * chunks, split)
    return {"virtual_pipeline_model_parallel_size": chunks}


def interleaved_flags(family, options: dict, num_layers: int, pipeline_size: int) -> list[str]:
    """v chunks per rank as Megatron's flag: layers per virtual stage = L / (D v); G as its flag."""
    flags = ["--num-layers-per-virtual-pipeline-stage",
             str(num_layers // (pipeline_size * options["num_model_chunks"]))]
    if options.get("microbatch_group_size") is not None:
        flags += [GROUP_FLAG, str(options["microbatch_group_size"])]
    return flags


def interleaved_critical_path(pipeline_size: int, num_microbatches: int,
                              num_model_chunks: int, microbatch_group_size=None) -> tuple[int, int]:
    """(Cf, Cb) in ops of one model chunk: N v + D - 1 each (Megatron's bubble (D - 1)/v of a
    whole-stage forward and backward, Narayanan et al. 2021)."""
    count = num_microbatches * num_model_chunks + pipeline_size - 1
    return count, count


def interleaved_order(num_microbatches: int, num_model_chunks: int,
                      group_size: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of each forward in a rank's order: groups of ``group_size``
    consecutive micro-batches, each group through chunk 0, then chunk 1, ...; the last group
    holds what is left (as Megatron's schedule table). The k-th backward runs the k-th entry's
    micro-batch on chunk v - 1 - chunk."""
    order = []
    for first in range(0, num_microbatches, group_size):
        members = range(first, min(first + group_size, num_microbatches))
        order += [(microbatch, chunk) for chunk in range(num_model_chunks)
                  for microbatch in members]
    return order


def build_interleaved(pipeline_size: int, num_microbatches: int, num_model_chunks: int,
                      microbatch_group_size=None) -> list[list[Instruction]]:
    """Per-rank instruction lists of interleaved 1F1B."""
    check_interleaved(pipeline_size, num_microbatches, num_model_chunks, microbatch_group_size)
    group = pipeline_size if microbatch_group_size is None else microbatch_group_size
    order = interleaved_order(num_microbatches, num_model_chunks, group)
    total = len(order)
    schedule = []
    for rank in range(pipeline_size):
        if num_microbatches == pipeline_size:
            num_warmup = total  # Megatron runs all forwards first in this case
        else:
            num_warmup = min(2 * (pipeline_size - 1 - rank) + (num_model_chunks - 1) * group,
                             total)

        def op(index, is_forward):
            microbatch, chunk = order[index]
            if not is_forward:
                chunk = num_model_chunks - 1 - chunk
            make = forward if is_forward else backward
            return make(0, chunk * pipeline_size + rank, microbatch, chunk)

        ops = [op(k, True) for k in range(num_warmup)]
        for k in range(total - num_warmup):
            ops.append(op(num_warmup + k, True))
            ops.append(op(k, False))
        ops += [op(k, False) for k in range(total - num_warmup, total)]
        schedule.append(ops)
    return schedule


def interleaved_layout(pipeline_size: int, num_model_chunks: int,
                       microbatch_group_size=None) -> ScheduleLayout:
    """One pipeline of D * v virtual stages; virtual stage c * D + r on rank r (its chunk c).
    The micro-batch group size orders ops only; it does not change the layout."""
    num_stages = pipeline_size * num_model_chunks
    return ScheduleLayout("interleaved-1f1b", pipeline_size, num_stages,
                          (tuple(stage % pipeline_size for stage in range(num_stages)),))


INTERLEAVED_1F1B = ScheduleFamily(
    name="interleaved-1f1b", description="Megatron's virtual pipeline: v model chunks per rank",
    build=build_interleaved, layout=interleaved_layout,
    check=lambda pipeline_size, num_microbatches, num_model_chunks=None,
    microbatch_group_size=None: check_interleaved(
        pipeline_size, num_microbatches, num_model_chunks, microbatch_group_size),
    options=(ScheduleOption(
        "num_model_chunks", None, "virtual_pipeline_model_parallel_size", "--num-model-chunks",
        int, help="Model chunks per rank for interleaved-1f1b (v >= 2).", tool_default=2),
        ScheduleOption(
            "microbatch_group_size", None, "microbatch_group_size_per_virtual_pipeline_stage",
            "--microbatch-group-size", int,
            help="Micro-batches per group through the chunks for interleaved-1f1b (default D; "
                 "D <= G <= N, N mod G = 0 or >= D).", bounded_by_microbatches=True)),
    op_label=lambda op, options: f"c{op.chunk}",
    selected_by=("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank"),
    derive_config=derive_interleaved_config,
    critical_path=interleaved_critical_path,
    model_variants=(("", {"num_model_chunks": 2}),),
    config_flags=interleaved_flags)
