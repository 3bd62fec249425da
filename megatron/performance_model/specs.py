"""Inputs of the performance model: the model, the hardware profile, the recomputation mode.

Units: seconds and bytes. No torch here: the model serves the planning tools only.
"""

from __future__ import annotations

from dataclasses import dataclass

RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class ModelSpec:
    """A GPT model: Megatron flag names. ``ffn_hidden_size`` defaults to 4·hidden.

    ``bytes_per_value`` is the width of weights, activations and gradients (4 = fp32, as in the
    paper). The output layer is untied from the embedding (the paper's GPT-2).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: int | None = None
    max_position_embeddings: int | None = None
    bytes_per_value: int = 4

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


# The paper's machine (Piz Daint, §5): one P100 16 GB per node, Cray Aries, gloo, fp32. Stated:
# peak 9.3 TFLOP/s, 16 GB, alpha 20 us. FITTED by `benchmarks/reproduce_paper.py --fit` on the
# four points of the paper's 512-node sweep (nothing else): sustained 40% of peak, no
# micro-batch-size dependence (half-efficiency 0 tokens; only B = 1 points were fitted), 10 ms
# per-op overhead (the edge of the grid), 5 GB/s per link. FITTED on the paper's recomputation
# decisions (Chimera D=32 ran without, Chimera D=16/D=8 and 1F1B D=16 needed it): framework
# overhead 5.5 GB (allowed range 5.1-6.1 GB), i.e. this model's activation count misses about a
# third of what the paper's fp32 implementation held.
P100_ARIES = HardwareSpec(flops_per_second=9.3e12 * 0.40, alpha=20e-6, beta=1 / 5e9,
                          device_memory_bytes=16e9, half_efficiency_tokens=0.0,
                          framework_overhead_bytes=5.5e9, op_overhead_seconds=0.010)

GPT2_PAPER = ModelSpec(num_layers=64, hidden_size=1280, num_attention_heads=20, seq_length=632,
                       vocab_size=50257, ffn_hidden_size=5120, max_position_embeddings=1024)
