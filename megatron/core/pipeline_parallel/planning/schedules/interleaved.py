"""Interleaved 1F1B (Megatron's virtual pipeline).

Each rank hosts ``num_model_chunks`` = v chunks; virtual stage c * D + r runs on rank r as its
chunk c, so one pipeline (id 0) has D * v stages placed round-robin. The op order is Megatron's:
micro-batches advance through the chunks in groups of D, a rank runs
``min(2 (D - 1 - r) + (v - 1) D, N v)`` warm-up forwards (all N v when N == D), then one
forward / one backward pairs, then the remaining backwards.

Constraints (as in Megatron): v >= 2, D >= 2 and N a multiple of D. On the command line the
family is selected by --num-layers-per-virtual-pipeline-stage (layers per chunk), from which
:func:`derive_interleaved_config` derives v = num_layers / (D x layers per chunk).
"""

from __future__ import annotations

from ..instructions import Instruction, backward, forward
from .family import ScheduleFamily, ScheduleOption
from .layout import ScheduleLayout


def check_interleaved(pipeline_size: int, num_microbatches: int, num_model_chunks) -> None:
    """Raise ValueError unless (D, N, v) is a valid interleaved 1F1B configuration."""
    if not isinstance(num_model_chunks, int) or num_model_chunks < 2:
        raise ValueError(
            f"interleaved-1f1b needs num_model_chunks >= 2 (got {num_model_chunks!r}); "
            f"use the 1f1b schedule for one chunk per rank")
    if pipeline_size < 2:
        raise ValueError(
            f"interleaved-1f1b needs --pipeline-model-parallel-size >= 2 (got {pipeline_size})")
    if num_microbatches % pipeline_size != 0:
        raise ValueError(
            f"interleaved-1f1b needs the number of micro-batches ({num_microbatches}) to be a "
            f"multiple of --pipeline-model-parallel-size ({pipeline_size}); allowed: "
            f"{pipeline_size}, {2 * pipeline_size}, {3 * pipeline_size}, ...")


def derive_interleaved_config(parallel_config, num_layers: int) -> dict:
    """Megatron's config rules of the virtual pipeline; returns the derived
    ``virtual_pipeline_model_parallel_size`` (v, the model chunks per rank)."""
    layers_per_chunk = parallel_config.num_layers_per_virtual_pipeline_stage
    pp = parallel_config.pipeline_model_parallel_size
    if layers_per_chunk is None:
        raise ValueError("--pipeline-schedule interleaved-1f1b needs "
                         "--num-layers-per-virtual-pipeline-stage (layers per model chunk)")
    if layers_per_chunk < 1:
        raise ValueError("--num-layers-per-virtual-pipeline-stage must be >= 1")
    if pp < 2:
        raise ValueError("the interleaved-1f1b schedule needs --pipeline-model-parallel-size "
                         ">= 2; drop --num-layers-per-virtual-pipeline-stage or raise it")
    if num_layers % (pp * layers_per_chunk):
        raise ValueError(
            f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size "
            f"{pp} x --num-layers-per-virtual-pipeline-stage {layers_per_chunk}; "
            f"every model chunk needs the same number of layers")
    return {"virtual_pipeline_model_parallel_size": num_layers // (pp * layers_per_chunk)}


def interleaved_flags(family, options: dict, num_layers: int, pipeline_size: int) -> list[str]:
    """v chunks per rank as Megatron's flag: layers per virtual stage = L / (D v)."""
    return ["--num-layers-per-virtual-pipeline-stage",
            str(num_layers // (pipeline_size * options["num_model_chunks"]))]


def interleaved_critical_path(pipeline_size: int, num_microbatches: int,
                              num_model_chunks: int) -> tuple[int, int]:
    """(Cf, Cb) in ops of one model chunk: N v + D - 1 each (Megatron's bubble (D - 1)/v of a
    whole-stage forward and backward, Narayanan et al. 2021)."""
    count = num_microbatches * num_model_chunks + pipeline_size - 1
    return count, count


def _virtual_op(virtual_index: int, pipeline_size: int, num_model_chunks: int, rank: int,
                is_forward: bool):
    group = pipeline_size * num_model_chunks
    chunk = (virtual_index % group) // pipeline_size
    if not is_forward:
        chunk = num_model_chunks - 1 - chunk
    microbatch = (virtual_index // group) * pipeline_size + virtual_index % pipeline_size
    make = forward if is_forward else backward
    return make(0, chunk * pipeline_size + rank, microbatch, chunk)


def build_interleaved(pipeline_size: int, num_microbatches: int,
                      num_model_chunks: int) -> list[list[Instruction]]:
    """Per-rank instruction lists of interleaved 1F1B."""
    check_interleaved(pipeline_size, num_microbatches, num_model_chunks)
    total = num_microbatches * num_model_chunks
    schedule = []
    for rank in range(pipeline_size):
        if num_microbatches == pipeline_size:
            num_warmup = total  # Megatron runs all forwards first in this case
        else:
            num_warmup = min(2 * (pipeline_size - 1 - rank)
                             + (num_model_chunks - 1) * pipeline_size, total)

        def op(index, is_forward):
            return _virtual_op(index, pipeline_size, num_model_chunks, rank, is_forward)

        ops = [op(k, True) for k in range(num_warmup)]
        for k in range(total - num_warmup):
            ops.append(op(num_warmup + k, True))
            ops.append(op(k, False))
        ops += [op(k, False) for k in range(total - num_warmup, total)]
        schedule.append(ops)
    return schedule


def interleaved_layout(pipeline_size: int, num_model_chunks: int) -> ScheduleLayout:
    """One pipeline of D * v virtual stages; virtual stage c * D + r on rank r (its chunk c)."""
    num_stages = pipeline_size * num_model_chunks
    return ScheduleLayout("interleaved-1f1b", pipeline_size, num_stages,
                          (tuple(stage % pipeline_size for stage in range(num_stages)),))


INTERLEAVED_1F1B = ScheduleFamily(
    name="interleaved-1f1b", description="Megatron's virtual pipeline: v model chunks per rank",
    build=build_interleaved, layout=interleaved_layout,
    check=lambda pipeline_size, num_microbatches, num_model_chunks=None: check_interleaved(
        pipeline_size, num_microbatches, num_model_chunks),
    options=(ScheduleOption(
        "num_model_chunks", None, "virtual_pipeline_model_parallel_size", "--num-model-chunks",
        int, help="Model chunks per rank for interleaved-1f1b (v >= 2).", tool_default=2),),
    op_label=lambda op, options: f"c{op.chunk}",
    selected_by=("num_layers_per_virtual_pipeline_stage",),
    derive_config=derive_interleaved_config,
    critical_path=interleaved_critical_path,
    model_variants=(("", {"num_model_chunks": 2}),),
    config_flags=interleaved_flags)
