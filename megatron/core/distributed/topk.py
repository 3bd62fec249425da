"""Top-k sparsification with error feedback as the data-parallel reducer (``--dp-gradient-reducer
topk``), one of the A2SGD paper's peers.

Per step, on data-parallel rank i (``g`` its loss-unscaled gradient, ``e`` the error kept from the
last step; Stich et al. 2018, Lin et al. 2018):

1. ``p = g + e``;
2. the ``k = ceil(ratio * n)`` entries of ``p`` largest in magnitude (``--topk-ratio``) are this
   rank's payload: k values and their k indices (int32, sent bit-cast in one float32 message);
3. the payloads are all-gathered over the data-parallel group; every rank scatters them into a zero
   vector in rank order and divides by the data-parallel size: that average is the applied gradient,
   bitwise equal on every replica;
4. ``e <- p - top_k(p)`` is staged, and committed by ``after_step(ok)`` only when the optimizer
   stepped (an overflow step keeps the old error).

A worker sends 8 k bytes per step (an all-gather: each rank receives every other rank's payload).
The exact parts (direction groups, tensor-parallel-replicated parameters, tied embeddings) and the
frame are :mod:`~.compressed`'s.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron.core.distributed.compressed import (CompressingReducer, all_gather_payloads,
                                                  refuse_distributed_optimizer,
                                                  split_exact_params)
from megatron.core.distributed.error_feedback import ErrorFeedback
from megatron.core.distributed.reduction import ChunkReductionRequest, ReducerKind


def kept_entries(numel: int, ratio: float) -> int:
    """k: how many entries top-k keeps of ``numel`` (at least one of a non-empty vector)."""
    return min(numel, max(1, math.ceil(ratio * numel))) if numel else 0


SAMPLE_SIZE = 1 << 16  # entries of the strided sample that estimates the top-k threshold


def top_k(values: torch.Tensor, k: int, magnitudes: Optional[torch.Tensor] = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, int64 indices) of the ``k`` entries of ``values`` largest in magnitude.

    For a small ``k`` of a long vector a threshold ``t`` is taken from a strided sample (the
    magnitude about ``2 k`` entries of the whole exceed), the entries with magnitude ``>= t`` are the
    candidates, and ``torch.topk`` runs on them only. When at least ``k`` entries pass, every one
    of the top k does (the k-th largest magnitude is then ``>= t``), so the result is the top k of
    the whole vector (ties at the k-th magnitude may be broken differently, as ``torch.topk``'s
    own are unspecified); otherwise, or when the magnitudes hold a NaN or an infinity (kept as
    ``torch.topk`` keeps them, so an overflow reaches the applied gradient), the whole vector goes
    to ``torch.topk``. ``magnitudes`` is an optional work buffer like ``values``."""
    magnitudes = torch.abs(values, out=magnitudes) if magnitudes is not None else values.abs()
    numel = values.numel()
    if 0 < k and 16 * k <= numel and numel >= 4 * SAMPLE_SIZE:
        sample = magnitudes[::numel // SAMPLE_SIZE]
        above = min(sample.numel(), math.ceil(2 * k * sample.numel() / numel))
        threshold = torch.kthvalue(sample, sample.numel() - above + 1).values
        if bool(torch.isfinite(magnitudes.sum())):
            candidates = torch.nonzero(magnitudes >= threshold).squeeze(1)
            if candidates.numel() >= k:
                _, chosen = torch.topk(magnitudes[candidates], k, sorted=False)
                indices = candidates[chosen]
                return values[indices], indices
    _, indices = torch.topk(magnitudes, k, sorted=False)
    return values[indices], indices


def sparse_average(payloads: list[tuple[torch.Tensor, torch.Tensor]], numel: int,
                   divide_by: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The sum over ranks (in order) of each rank's sparse (values, indices), divided by
    ``divide_by`` (into ``out`` when given)."""
    total = torch.zeros(numel, dtype=torch.float32) if out is None else out.zero_()
    for values, indices in payloads:
        total.index_add_(0, indices.long(), values)
    return total.div_(divide_by)


class TopKReducer(CompressingReducer):
    """Top-k with error feedback over data parallel (see the module docstring).

    Args (besides :class:`~.compressed.CompressingReducer`'s):
        ratio: the fraction of entries each rank sends (``--topk-ratio``), in (0, 1].
    """

    def __init__(self, params, *, ratio: float = 0.01, **kwargs):
        if not 0 < ratio <= 1:
            raise ValueError(f"top-k ratio {ratio} must be in (0, 1] (--topk-ratio)")
        super().__init__(params, **kwargs)
        self.ratio = float(ratio)
        self.feedback = ErrorFeedback({dtype: torch.zeros(buffer.numel(), dtype=torch.float32)
                                       for dtype, buffer in self.inner.buffers.items()}, "top-k")
        self.errors = self.feedback.errors

    def compressed_average(self, dtype, values):
        numel = values.numel()
        corrected = torch.add(values, self.errors[dtype],
                              out=self.scratch("corrected", dtype, numel))  # p = g + e
        kept, indices = top_k(corrected, kept_entries(numel, self.ratio),
                              magnitudes=self.scratch("magnitudes", dtype, numel))
        if indices.numel() and indices.max() >= 2 ** 31:
            raise ValueError("top-k indices are sent as int32; this chunk has more than 2**31 "
                             "entries of one dtype, split the model into more pipeline stages")
        payload = torch.cat([kept, indices.to(torch.int32).view(torch.float32)])
        self.payload_bytes_last_step += payload.numel() * payload.element_size()
        gathered = all_gather_payloads(payload, self.data_group)
        k = kept.numel()
        applied = sparse_average([(p[:k], p[k:].view(torch.int32)) for p in gathered], numel,
                                 self.dp_size, out=self.scratch("applied", dtype, numel))
        corrected[indices] = 0.0  # the new error: p - top_k(p)
        self.feedback.stage(dtype, corrected)
        return applied

    def commit(self, ok: bool) -> None:
        self.feedback.commit(ok)

    def state_dict(self) -> dict:
        return self.feedback.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.feedback.load_state_dict(state)


def build_topk_reduction(request: ChunkReductionRequest) -> TopKReducer:
    """One chunk's top-k reduction; its ratio from ``--topk-ratio`` (the constructor's default
    without a configuration)."""
    compressed, exact = split_exact_params(request)
    options = {} if request.parallel is None else {"ratio": request.parallel.topk_ratio}
    return TopKReducer(compressed, direction_group=request.direction_group(),
                       data_group=request.data_group, exact_params=exact,
                       exact_group=request.replica_group, dp_size=int(request.divide_by),
                       **options)


def check_topk_flags(parallel) -> None:
    if not 0 < parallel.topk_ratio <= 1:
        raise ValueError(f"--topk-ratio {parallel.topk_ratio} must be in (0, 1] (the fraction of "
                         f"gradient entries each data-parallel rank sends)")
    refuse_distributed_optimizer(parallel, "topk")


TOPK_REDUCER = ReducerKind(
    name="topk", description="top-k sparsification with error feedback (docs/a2sgd.md)",
    build=build_topk_reduction, needs_direction_groups=True, overlaps=False,
    validate=check_topk_flags)
