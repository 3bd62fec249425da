"""Memory per worker: model state, stored activations (from the simulator), working set,
logits and a stated framework overhead."""

from __future__ import annotations

from functools import lru_cache

from megatron.core.pipeline_parallel.planning.dependencies import peak_activations
from megatron.core.pipeline_parallel.planning.schedules import BUILTIN_SCHEDULES, ScheduleRegistry
from megatron.performance_model.costs import (
    activation_bytes, activation_bytes_per_layer, stage_parameters)
from megatron.performance_model.schemes import last_stage_kept, lowered_schedule, num_replicas
from megatron.performance_model.specs import HardwareSpec, ModelSpec, recompute_mode


@lru_cache(maxsize=256)
def peak_stored_microbatches(scheme: str, num_stages: int, num_microbatches: int,
                             registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> tuple:
    """Most micro-batch activations of one model stage stored at once on each pipeline rank
    (all hosted stages)."""
    _, lowered = lowered_schedule(scheme, num_stages, num_microbatches, registry=registry)
    return tuple(peak_activations(ops) for ops in lowered)


def state_bytes(model: ModelSpec, hardware: HardwareSpec, num_stages: int, stages,
                replicas: int = 1, distributed_optimizer: bool = False,
                weight_versions: int = 1) -> float:
    """Weights, gradients and optimizer state of the hosted ``stages``.

    ``state_bytes_per_parameter`` per parameter; the distributed optimizer divides the
    ``optimizer_bytes_per_parameter`` share by the stage's ``replicas``;
    ``weight_versions`` > 1 adds stashed weight copies (PipeDream, PipeDream-2BW).
    """
    params = sum(stage_parameters(model, num_stages, stage) for stage in stages)
    optimizer = hardware.optimizer_bytes_per_parameter
    per_parameter = hardware.state_bytes_per_parameter
    if distributed_optimizer:
        per_parameter += optimizer / replicas - optimizer
    per_parameter += (weight_versions - 1) * model.bytes_per_value
    return params * per_parameter


def working_bytes(model: ModelSpec, num_stages: int, micro_batch_size: int, recompute,
                  holds_last_stage: bool) -> float:
    """Transient memory: the layer being recomputed (its full activations) and, on the rank
    running the output layer, the logits and their gradient (2·B·s·V values)."""
    working = 0.0
    if recompute_mode(recompute) != "none":
        working += activation_bytes_per_layer(model, micro_batch_size, "none")
    if holds_last_stage:
        working += 2 * micro_batch_size * model.seq_length * model.vocab_size * model.bytes_per_value
    return working


def memory_per_worker(model: ModelSpec, hardware: HardwareSpec, scheme: str, num_stages: int,
                      num_microbatches: int, micro_batch_size: int, recompute,
                      data_parallel: int = 1, distributed_optimizer: bool = False,
                      registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> list:
    """Bytes each pipeline rank needs: state of its hosted model stages (2 for 2-pipeline
    Chimera, the paper's 2·Mθ; v chunks for interleaved 1F1B) + peak stored micro-batches (from
    the lowered schedule) × one model stage's activations + working set +
    ``framework_overhead_bytes``. The last stage of a scheme in ``hardware.last_stage_kept``
    keeps its full activations (it never recomputes)."""
    layout, _ = lowered_schedule(scheme, num_stages, num_microbatches, registry=registry)
    peaks = peak_stored_microbatches(scheme, num_stages, num_microbatches, registry)
    model_stages = layout.num_stages
    replicas = num_replicas(scheme, data_parallel, num_stages, registry)
    memory = []
    for rank in range(num_stages):
        stages = [stage for _, stage in layout.hosted(rank)]
        # a runtime that never recomputes the last stage keeps its full activations there
        mode = ("none" if last_stage_kept(scheme, hardware) and model_stages > 1
                and model_stages - 1 in stages else recompute)
        # uneven stages: each stored micro-batch counted at the rank's largest hosted stage
        stored = activation_bytes(model, micro_batch_size, model_stages, mode, stages)
        memory.append(
            state_bytes(model, hardware, model_stages, stages, replicas, distributed_optimizer)
            + peaks[rank] * stored + hardware.framework_overhead_bytes
            + working_bytes(model, model_stages, micro_batch_size, mode,
                            model_stages - 1 in stages))
    return memory
