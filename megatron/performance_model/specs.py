"""Inputs of the performance model: the model, the hardware profile, the recomputation mode.

Units: seconds and bytes. No torch here: the model serves the planning tools only.
"""

from __future__ import annotations

from dataclasses import dataclass

RECOMPUTE_MODES = ("none", "selective", "full")
ALLREDUCE_ALGORITHMS = ("rabenseifner", "ring")


@dataclass(frozen=True)
class ModelSpec:
    """A GPT model: Megatron flag names. ``ffn_hidden_size`` defaults to 4·hidden.

    ``bytes_per_value`` is the width of weights, activations and gradients (4 = fp32, as in the
    paper). The output layer is untied from the embedding (the paper's GPT-2).
    ``stage_layer_counts``: the layers of each model stage of an uneven pipeline (as
    ``megatron.core.pipeline_parallel.planning.stage_split.stage_layer_counts`` gives them for
    Megatron's --decoder-first/last-pipeline-num-layers and --account-for-*-in-pipeline-split);
    empty: ``num_layers`` split evenly.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: int | None = None
    max_position_embeddings: int | None = None
    bytes_per_value: int = 4
    stage_layer_counts: tuple = ()

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def positions(self) -> int:
        return self.max_position_embeddings or self.seq_length


@dataclass(frozen=True)
class HardwareSpec:
    """One worker and its network.

    ``flops_per_second``: sustained FLOP/s of one worker on large matrix multiplies (peak ×
    efficiency). ``half_efficiency_tokens``: tokens per micro-batch (B·s) at which a worker
    reaches half that rate; the rate is ``flops_per_second · t / (t + half_efficiency_tokens)``
    (a saturating roofline: small micro-batches are launch- and bandwidth-bound). 0 = rate
    independent of B. ``alpha``: per-message latency (s). ``beta``: seconds per byte of one
    worker's link. ``device_memory_bytes``: device memory. ``framework_overhead_bytes``: memory
    the framework holds besides model state and activations (context, allocator caches,
    communication buffers). ``state_bytes_per_parameter``: weights + gradients + optimizer
    state (16 = fp32 weight, fp32 gradient, two fp32 Adam moments); of these
    ``optimizer_bytes_per_parameter`` are optimizer state, sharded over the data-parallel
    replicas by the distributed optimizer. ``op_overhead_seconds``: fixed time per forward or
    backward op of a stage (framework dispatch, launches, the host side of the p2p calls); it
    does not shrink with the stage, so it penalises deep pipelines of thin stages.

    Network contention (:func:`~megatron.performance_model.costs.network_contention`):
    ``nodes_per_group`` is the size of one dragonfly group (all-to-all electrical links inside;
    384 nodes on a Cray XC/Aries system), 0 = a flat network without contention.
    ``global_bandwidth_fraction`` (γ) is the inter-group bandwidth one node gets when every node
    of the job sends across groups at once, as a fraction of its injection bandwidth (global
    links are tapered). ``overlap_slowdown`` (σ): while a gradient sync is in flight on a rank,
    its compute runs 1 + σ times slower (the host-side all-reduce of gloo competes with the
    compute for the CPU and memory bandwidth); 0 = free overlap.

    ``memory_bandwidth``: device memory bandwidth (bytes/s); the optimizer step, a chain of
    element-wise passes over the hosted parameters, is bound by it (0 = the step is free).

    ``host_staging_bandwidth``: bytes/s of the device-host link when the communication
    library works on host memory (gloo with CUDA tensors copies each message to the host and
    the result back); 0 = no staging.

    ``allreduce_algorithm``: ``rabenseifner`` (the paper's §3.4 formula, 2·log2(r) latency
    steps) or ``ring`` (what gloo runs: 2(r − 1) latency steps, the same bandwidth term).

    Recomputation as the runtime does it: ``recompute_whole_stage`` — full recomputation re-runs
    the stage's whole forward before its backward, the last stage's output layer included
    (the authors' ``run_backward``); False: the layers only (Megatron's full recomputation).
    ``last_stage_kept``: schedule-backed schemes whose runtime never recomputes the last stage
    (it keeps its activations; its forward is followed at once by its backward).
    """

    flops_per_second: float
    alpha: float
    beta: float
    device_memory_bytes: float
    state_bytes_per_parameter: int = 16
    half_efficiency_tokens: float = 0.0
    framework_overhead_bytes: float = 0.0
    optimizer_bytes_per_parameter: int = 8
    op_overhead_seconds: float = 0.0
    nodes_per_group: int = 0
    global_bandwidth_fraction: float = 1.0
    overlap_slowdown: float = 0.0
    allreduce_algorithm: str = "rabenseifner"
    memory_bandwidth: float = 0.0
    host_staging_bandwidth: float = 0.0
    recompute_whole_stage: bool = False
    last_stage_kept: tuple = ()

    def __post_init__(self) -> None:
        # a profile read from JSON gives a list: keep the spec hashable and immutable
        object.__setattr__(self, "last_stage_kept", tuple(self.last_stage_kept))
        if self.allreduce_algorithm not in ALLREDUCE_ALGORITHMS:
            raise ValueError(f"unknown allreduce_algorithm {self.allreduce_algorithm!r}; use one "
                             f"of {', '.join(ALLREDUCE_ALGORITHMS)}")
        if self.nodes_per_group < 0:
            raise ValueError(f"nodes_per_group must be >= 0 (0 = flat network), got "
                             f"{self.nodes_per_group}")
        if not self.global_bandwidth_fraction > 0:
            raise ValueError(f"global_bandwidth_fraction must be > 0, got "
                             f"{self.global_bandwidth_fraction}")
        if self.host_staging_bandwidth < 0:
            raise ValueError(f"host_staging_bandwidth must be >= 0 (0 = no staging), got "
                             f"{self.host_staging_bandwidth}")
        if self.memory_bandwidth < 0:
            raise ValueError(f"memory_bandwidth must be >= 0 (0 = free optimizer step), got "
                             f"{self.memory_bandwidth}")
        if self.overlap_slowdown < 0:
            raise ValueError(f"overlap_slowdown must be >= 0, got {self.overlap_slowdown}")

    def sustained_rate(self, tokens: float) -> float:
        """FLOP/s on a micro-batch of ``tokens`` tokens (B·s)."""
        if tokens <= 0:
            raise ValueError(f"a micro-batch needs at least one token (got {tokens})")
        return self.flops_per_second * tokens / (tokens + self.half_efficiency_tokens)


def recompute_mode(recompute) -> str:
    """Normalise a recomputation setting: bool (False = none, True = full) or a mode name."""
    if recompute is True:
        return "full"
    if recompute is False or recompute is None:
        return "none"
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"unknown recomputation {recompute!r}; use one of "
                         f"{', '.join(RECOMPUTE_MODES)}")
    return recompute


#: NVIDIA Tesla P100 PCIe (Piz Daint's GPU) fp32 peak, from NVIDIA's datasheet.
P100_PEAK_FLOPS = 9.3e12
#: NVIDIA Tesla P100 PCIe 16 GB memory bandwidth (HBM2), from NVIDIA's datasheet.
P100_MEMORY_BANDWIDTH = 732e9
#: The P100 PCIe card's host link, PCIe 3.0 x16 (datasheet): 16 lanes x 8 GT/s x 128/130
#: encoding = 15.75 GB/s per direction.
PCIE3_X16_BANDWIDTH = 16 * 8e9 * 128 / 130 / 8

#: The Cray Aries NIC's peak injection bandwidth per node, per direction (Alverson, Froese,
#: Kaplan, Roweth, "Cray XC Series Network", Cray white paper WP-Aries01-1112, 2012): an upper
#: bound, never reached by gloo over TCP, on the per-node bandwidth the paper fit may choose.
#: It sits below the node's PCIe 3.0 x16 host link (15.75 GB/s), through which the NIC is fed.
ARIES_INJECTION_BANDWIDTH = 10.2e9

# The paper's machine (Piz Daint, §5): one P100 16 GB per node, Cray Aries, gloo, fp32.
# STATED: peak 9.3 TFLOP/s, 16 GB, 732 GB/s memory bandwidth (datasheet), dragonfly groups of
# 384 nodes (two XC cabinets), gloo's ring all-reduce, alpha 20 us per message (assumed for gloo
# over TCP, kept from the previous model; Chimera, 1F1B, GPipe and GEMS move < 1% between 0 and
# 50 us, but PipeDream and PipeDream-2BW pay it once per 25 MiB DDP bucket and ring step: at
# the fitted constants PipeDream-2BW 586 / 440 / 321 seq/s and PipeDream 310 / 256 / 203 at
# 0 / 20 / 50 us), no per-op overhead, no overlap slowdown. Recomputation as the authors'
# runtimes do it (github.com/Shigangli/Chimera@ChimeraBk): `run_backward` re-runs the whole
# stage's forward (the last stage's output layer too), and the PipeDream-2BW main's
# 1F1B-scheduled loop never recomputes the last stage (`recompute_step = args.recompute_step
# and r.stage != (r.num_stages - 1)`; its --gpipe loop recomputes every stage): 1F1B's last
# stage keeps its activations (the published --dapple path of the Chimera main recomputes it:
# see docs/performance_model.md, "The paper's order of the baselines").
# FITTED (three constants, each bounded by the hardware: <= 100% of peak, <= the Aries NIC's
# injection bandwidth above, 0 < gamma <= 1) by `benchmarks/reproduce_paper.py --fit` on the
# paper's eleven GPT-2 throughputs (least squares on log error; leave-one-out fits in
# benchmarks/paper_fit.json):
# sustained 39.2% of peak, 6.83 GB/s effective gloo bandwidth per node, gamma 0.156.
# Memory: 5.5 GB framework overhead carried over from the previous model, where it was chosen
# so that the paper's recomputation decisions hold (not refitted; counted as a fitted choice).
P100_ARIES = HardwareSpec(flops_per_second=P100_PEAK_FLOPS * 0.39225, alpha=20e-6,
                          beta=1 / 6.8329e9, device_memory_bytes=16e9,
                          half_efficiency_tokens=0.0, framework_overhead_bytes=5.5e9,
                          op_overhead_seconds=0.0, nodes_per_group=384,
                          global_bandwidth_fraction=0.15620, overlap_slowdown=0.0,
                          allreduce_algorithm="ring", memory_bandwidth=P100_MEMORY_BANDWIDTH,
                          host_staging_bandwidth=PCIE3_X16_BANDWIDTH,
                          recompute_whole_stage=True, last_stage_kept=("1f1b",))

GPT2_PAPER = ModelSpec(num_layers=64, hidden_size=1280, num_attention_heads=20, seq_length=632,
                       vocab_size=50257, ffn_hidden_size=5120, max_position_embeddings=1024)
