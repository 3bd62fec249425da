"""Performance model of pipeline schedules (Chimera paper §3.4), the paper's baselines, and a
planner over (W, D, B, recomputation, scheme). No torch: used by tools and benchmarks only.

Modules: :mod:`.specs` (model, hardware profile, recomputation modes), :mod:`.costs` (each
term: FLOPs, compute time vs micro-batch size, activations, p2p, all-reduce, link sharing,
network contention, overlap slowdown), :mod:`.profiles` (hardware profiles as JSON),
:mod:`.schemes` (schemes and the one build -> validate -> lower composition), :mod:`.timing`
(closed form and simulated iteration time), :mod:`.memory`, :mod:`.baselines` (GEMS,
PipeDream, PipeDream-2BW, replayed from the authors' implementations), :mod:`.planner` and
:mod:`.paper` (the paper's runs as the authors ran them, published numbers with sources). docs/performance_model.md explains the model.
"""

from megatron.performance_model.baselines import (
    baseline_memory, gems_time, pipedream_2bw_time, pipedream_time)
from megatron.performance_model.costs import (
    StageCosts, activation_bytes, activation_bytes_per_layer, allreduce_time,
    attention_core_forward_flops, compute_times, cross_group_fraction, layer_forward_flops,
    layer_parameters, network_contention, output_layer_forward_flops, overlap_delay, p2p_time,
    recompute_flops, shared_link_finish_times, stage_forward_flops, stage_parameters,
    total_parameters)
from megatron.performance_model.memory import memory_per_worker, peak_stored_microbatches, state_bytes
from megatron.performance_model.profiles import (
    hardware_from_dict, load_profile, profile_dict, save_profile)
from megatron.performance_model.planner import (
    Estimate, compare_schemes, evaluate, launch_flags, search_configurations, valid_shapes)
from megatron.performance_model.schemes import (
    ANALYTIC_SCHEMES, SCHEMES, lowered_schedule, num_replicas)
from megatron.performance_model.specs import (
    GPT2_PAPER, P100_ARIES, RECOMPUTE_MODES, HardwareSpec, ModelSpec, recompute_mode)
from megatron.performance_model.timing import (
    closed_form_iteration_time, critical_path_counts, exposed_allreduce,
    simulated_iteration_time, stage_costs)

__all__ = [
    "ANALYTIC_SCHEMES", "SCHEMES", "GPT2_PAPER", "P100_ARIES", "RECOMPUTE_MODES", "ModelSpec",
    "HardwareSpec", "StageCosts", "Estimate", "recompute_mode", "layer_parameters",
    "stage_parameters", "total_parameters", "layer_forward_flops", "attention_core_forward_flops",
    "output_layer_forward_flops", "stage_forward_flops", "recompute_flops", "compute_times",
    "activation_bytes_per_layer", "activation_bytes", "p2p_time", "allreduce_time",
    "shared_link_finish_times", "cross_group_fraction", "network_contention", "overlap_delay",
    "profile_dict", "save_profile", "load_profile", "hardware_from_dict", "num_replicas", "stage_costs", "critical_path_counts",
    "exposed_allreduce", "closed_form_iteration_time", "lowered_schedule",
    "peak_stored_microbatches", "simulated_iteration_time", "state_bytes", "memory_per_worker",
    "gems_time", "pipedream_time", "pipedream_2bw_time", "baseline_memory", "evaluate",
    "valid_shapes", "search_configurations", "compare_schemes", "launch_flags",
]
