"""QSGD-style stochastic quantisation as the data-parallel reducer (``--dp-gradient-reducer qsgd``),
one of the A2SGD paper's peers (Alistarh et al., arXiv 1610.02132).

Per step, on data-parallel rank i, the loss-unscaled gradient is cut into buckets of ``d`` entries
(``--qsgd-bucket-size``; the last one zero-padded). For a bucket ``v`` with ``s`` levels
(``--qsgd-levels``) each entry is sent as its sign and an integer level:

    r_j = s |v_j| / ||v||_2,   l_j = floor(r_j),
    level_j = l_j + 1 with probability r_j - l_j, else l_j,
    Q(v)_j = ||v||_2 * sign(v_j) * level_j / s

(``Q(v) = 0`` for ``v = 0``), an unbiased estimate of ``v``. The payload is one float32 norm per
bucket and one int8 signed level per entry (``s <= 127``): about a quarter of the float32 gradient.
The payloads are all-gathered over the data-parallel group; every rank dequantises and sums them in
rank order and divides by the data-parallel size, so every replica applies the same gradient. No
error feedback (as in the paper). The random draws come from the reducer's own generator, seeded
from the training seed (``torch.initial_seed()`` when it is built), the data-parallel rank and the
stage, so both Chimera copies of a stage in one replica draw the same numbers and stay equal; its
state is the reducer's ``state_dict()`` (checkpoints resume the same draws).
"""

from __future__ import annotations

from typing import Hashable, Optional

import torch
import torch.distributed as dist

from megatron.core.distributed.collectives import group_size
from megatron.core.distributed.compressed import (CompressingReducer, all_gather_payloads,
                                                  refuse_distributed_optimizer,
                                                  split_exact_params)
from megatron.core.distributed.reduction import ChunkReductionRequest, ReducerKind

MAX_LEVELS = 127  # a signed level fits one int8


def _buckets(values: torch.Tensor, bucket_size: int, out: Optional[torch.Tensor] = None
             ) -> torch.Tensor:
    """``values`` zero-padded to whole buckets, as [buckets, bucket_size] (a view of ``values``
    when no padding is needed; else of ``out``, a work buffer of the padded length, when given)."""
    padding = (-values.numel()) % bucket_size
    if padding:
        if out is None:
            values = torch.cat([values, values.new_zeros(padding)])
        else:
            out[:values.numel()].copy_(values)
            out[values.numel():].zero_()
            values = out
    return values.view(-1, bucket_size)


def quantise(values: torch.Tensor, levels: int, bucket_size: int, uniform: torch.Tensor,
             scratch: Optional[tuple] = None, out_levels: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 norm per bucket, int8 signed level per entry, padded to whole buckets) of float32
    ``values``; ``uniform`` holds one U[0, 1) draw per padded entry (see the module docstring).

    ``values`` and ``uniform`` are only read. ``scratch`` is an optional triple of float32 work
    buffers of the padded length (the ratios, the levels, the zero-padded copy of ``values``);
    ``out_levels`` (int8, padded length) receives the signed levels."""
    padded = uniform.numel()
    ratio_buffer, level_buffer, padding_buffer = (
        scratch if scratch is not None else (torch.empty(padded), torch.empty(padded), None))
    buckets = _buckets(values, bucket_size, out=padding_buffer)
    norms = torch.linalg.vector_norm(buckets, dim=1)
    ratio = torch.abs(buckets, out=ratio_buffer.view_as(buckets))
    ratio.mul_((levels / norms.clamp(min=torch.finfo(torch.float32).tiny))[:, None])
    level = torch.floor(ratio, out=level_buffer.view_as(buckets)).clamp_(max=levels)
    fraction = ratio.sub_(level)
    level.add_(torch.lt(uniform.view_as(buckets), fraction, out=fraction))  # rounds up w.p. frac
    level.copysign_(buckets)  # the sign of the entry (a zero entry has level 0)
    signed = torch.empty(padded, dtype=torch.int8) if out_levels is None else out_levels
    signed.copy_(level.flatten())
    return norms, signed


def dequantise(norms: torch.Tensor, signed_levels: torch.Tensor, levels: int, numel: int,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float32 vector (first ``numel`` entries) a :func:`quantise` payload stands for
    (written into ``out``, a float32 buffer of the padded length, when given)."""
    bucket_size = signed_levels.numel() // max(norms.numel(), 1)
    rows = signed_levels.view(-1, bucket_size)
    target = (torch.empty(rows.shape) if out is None else out.view(rows.shape))
    target.copy_(rows).mul_((norms / levels)[:, None])  # int8 -> float32 is exact
    return target.flatten()[:numel]


def generator_seed(base_seed: int, dp_rank: int, key: Hashable) -> int:
    """The quantiser's seed: the training seed, the data-parallel rank and the chunk's stage (the
    same on both Chimera copies of a stage in one replica)."""
    stage = getattr(key, "stage", key if isinstance(key, int) else 0)
    return (int(base_seed) + 1_000_003 * int(dp_rank) + 7919 * int(stage)) % (2 ** 63)


class QSGDReducer(CompressingReducer):
    """QSGD over data parallel (see the module docstring).

    Args (besides :class:`~.compressed.CompressingReducer`'s):
        levels: ``s``, 1..127 (``--qsgd-levels``).
        bucket_size: entries per norm (``--qsgd-bucket-size``).
        seed: the seed of the reducer's generator.
    """

    def __init__(self, params, *, levels: int = 127, bucket_size: int = 512, seed: int = 0,
                 **kwargs):
        if not 1 <= levels <= MAX_LEVELS:
            raise ValueError(f"QSGD levels {levels} must be in 1..{MAX_LEVELS} (--qsgd-levels)")
        if bucket_size < 1:
            raise ValueError(f"QSGD bucket size {bucket_size} must be >= 1 (--qsgd-bucket-size)")
        super().__init__(params, **kwargs)
        self.levels, self.bucket_size = int(levels), int(bucket_size)
        self.generator = torch.Generator().manual_seed(seed)

    def compressed_average(self, dtype, values):
        numel = values.numel()
        padded = numel + (-numel) % self.bucket_size
        buckets = padded // self.bucket_size
        uniform = torch.rand(padded, generator=self.generator,
                             out=self.scratch("uniform", dtype, padded))
        norm_bytes = buckets * 4
        payload = self.scratch("payload", dtype, norm_bytes + padded, torch.uint8)
        norms, _ = quantise(values, self.levels, self.bucket_size, uniform,
                            scratch=(self.scratch("ratio", dtype, padded),
                                     self.scratch("level", dtype, padded),
                                     self.scratch("padded", dtype, padded)),
                            out_levels=payload[norm_bytes:].view(torch.int8))
        payload[:norm_bytes].view(torch.float32).copy_(norms)
        self.payload_bytes_last_step += payload.numel()
        total = self.scratch("applied", dtype, padded)
        term = self.scratch("ratio", dtype, padded)  # free again once the levels are in
        for rank, gathered in enumerate(all_gather_payloads(payload, self.data_group)):
            dequantise(gathered[:norm_bytes].view(torch.float32),
                       gathered[norm_bytes:].view(torch.int8), self.levels, padded,
                       out=total if rank == 0 else term)
            if rank > 0:
                total.add_(term)
        return total[:numel].div_(self.dp_size)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def build_qsgd_reduction(request: ChunkReductionRequest) -> QSGDReducer:
    """One chunk's QSGD reduction; levels and bucket size from ``--qsgd-levels`` and
    ``--qsgd-bucket-size`` (the constructor's defaults without a configuration)."""
    compressed, exact = split_exact_params(request)
    parallel = request.parallel
    options = {} if parallel is None else {"levels": parallel.qsgd_levels,
                                           "bucket_size": parallel.qsgd_bucket_size}
    dp_rank = dist.get_rank(request.data_group) if group_size(request.data_group) > 1 else 0
    return QSGDReducer(compressed, **options,
                       seed=generator_seed(torch.initial_seed(), dp_rank, request.key),
                       direction_group=request.direction_group(), data_group=request.data_group,
                       exact_params=exact, exact_group=request.replica_group,
                       dp_size=int(request.divide_by))


def check_qsgd_flags(parallel) -> None:
    if not 1 <= parallel.qsgd_levels <= MAX_LEVELS:
        raise ValueError(f"--qsgd-levels {parallel.qsgd_levels} must be in 1..{MAX_LEVELS} (a "
                         f"signed level is sent as one int8)")
    if parallel.qsgd_bucket_size < 1:
        raise ValueError(f"--qsgd-bucket-size {parallel.qsgd_bucket_size} must be >= 1")
    refuse_distributed_optimizer(parallel, "qsgd")


QSGD_REDUCER = ReducerKind(
    name="qsgd", description="QSGD stochastic quantisation, int8 levels (docs/a2sgd.md)",
    build=build_qsgd_reduction, needs_direction_groups=True, overlaps=False,
    validate=check_qsgd_flags)
