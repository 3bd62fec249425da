"""A2SGD: two-level gradient averaging as the data-parallel reduction (O(1) numbers per worker).

A2SGD (Bhattacharya, Yu, Chowdhury; arXiv 2006.07405) replaces the data-parallel all-reduce of the
whole gradient by an all-reduce of four numbers per *segment* (the whole model portion a reducer
owns by default, as in the paper; or each bucket / each tensor). Per step, on data-parallel rank i:

1. ``p = g + e`` (``g`` this replica's gradient, ``e`` the error kept from the last step, both in
   loss-unscaled units);
2. the sum and count of the non-negative entries of ``p`` and of the negative entries, all-reduced
   over the data-parallel group: global means ``m+`` and ``m-``;
3. the applied gradient is ``m+`` where ``p >= 0`` and ``m-`` elsewhere; ``e <- p - applied``.

The new error is *staged* and committed by ``after_step(ok)`` only when the optimizer stepped (a
loss-scale overflow or a non-finite norm discards it). Replicas apply different updates and drift,
so ``synchronize()`` averages the parameters and the optimizer state exactly over the data-parallel
group before every checkpoint and evaluation, and ``synchronize_periodically()`` every
``sync_interval`` (``--a2sgd-sync-interval``) iterations the parameters and, unless
``--a2sgd-periodic-sync parameters``, the optimizer state. All of this goes through the lifecycle of the
:class:`~.reduction.GradientReduction` seam; the error buffers are the reducer's ``state_dict()``,
which checkpoints keep per data-parallel rank. :data:`A2SGD_REDUCER` is the
``--dp-gradient-reducer a2sgd`` entry of :data:`~.reducers.BUILTIN_REDUCERS`.

The arithmetic is float32 in buffers kept between steps. On CPU float32 buffers it is two fused
passes of the C++ kernel of :mod:`.a2sgd_kernel` (``p`` and the statistics; then the applied
gradient and the new error); elsewhere, or without the extension, a few vectorised torch passes
(see :func:`local_statistics`, :func:`two_level_values`): ``A2SGDReducer(arithmetic=...)``. With
``overlap`` (``--overlap-grad-reduce``) the first pass (``p`` and its statistics) runs per tensor
on a worker thread during the backward, and ``wait()`` only all-reduces the statistics and writes
the result.

Exactness is kept where the issue asks: gradients of one replica's copies of a stage (Chimera's two
pipeline directions) are summed exactly over the *direction group* first (ranks of this data-parallel
replica holding the stage), then A2SGD runs over the data-parallel group (same pipeline rank, other
replicas); with tensor parallelism the tensor-parallel-replicated parameters (layer norms, biases of
row-parallel layers) are all-reduced exactly over the stage's full replica group, since their A2SGD
means would otherwise differ between tensor-parallel ranks. Tied embeddings keep their exact
:class:`~.reducers.TiedEmbeddingReducer`.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.distributed import a2sgd_kernel
from megatron.core.distributed.a2sgd_second_moment import SecondMomentFromExactSteps
from megatron.core.distributed.collectives import group_size
from megatron.core.distributed.error_feedback import ErrorFeedback
from megatron.core.distributed.gradient_reducer import ExactReductionsFirst
from megatron.core.distributed.reduction import ChunkReductionRequest, ReducerKind

GRANULARITIES = ("model", "bucket", "tensor")
FLAG_BUCKET_SIZE = 4096  # entries per segment of --a2sgd-granularity bucket


def segment_bounds(sizes: Sequence[int], granularity: str, bucket_size: int) -> list[tuple]:
    """(start, end) element ranges of the flat buffer, one per averaged segment."""
    total = sum(sizes)
    if granularity == "model":
        return [(0, total)] if total else []
    if granularity == "tensor":
        bounds, offset = [], 0
        for size in sizes:
            bounds.append((offset, offset + size))
            offset += size
        return bounds
    if granularity == "bucket":
        return [(start, min(start + bucket_size, total)) for start in range(0, total, bucket_size)]
    raise ValueError(f"unknown A2SGD granularity {granularity!r}; use one of {GRANULARITIES}")


class SegmentRuns:
    """Segments grouped into *runs* of consecutive segments of equal length, computed once per
    layout: each run is one 2-D view ``[segments, length]`` of the flat buffer, so the statistics
    and the reconstruction cost one kernel per run (the whole model: 1 run; buckets: at most 2;
    tensors: one per change of tensor size) instead of a Python loop over segments.
    """

    def __init__(self, bounds: Sequence[tuple]):
        self.count = len(bounds)
        self.runs: list[tuple[int, int, int, int]] = []  # (start, segments, length, first index)
        for index, (start, end) in enumerate(bounds):
            length = end - start
            if self.runs:
                run_start, segments, run_length, first = self.runs[-1]
                if run_length == length and run_start + segments * run_length == start:
                    self.runs[-1] = (run_start, segments + 1, run_length, first)
                    continue
            self.runs.append((start, 1, length, index))

    @functools.cached_property
    def table(self) -> torch.Tensor:
        """The runs as the kernel's int64 ``[runs, 3]`` table of (start, segments, length)."""
        return a2sgd_kernel.runs_table(self)

    def views(self, flat: torch.Tensor):
        """(first segment index, ``[segments, length]`` view of ``flat``) per run."""
        for start, segments, length, first in self.runs:
            yield first, flat[start:start + segments * length].view(segments, length)


def _runs(bounds) -> SegmentRuns:
    return bounds if isinstance(bounds, SegmentRuns) else SegmentRuns(bounds)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The arithmetic dtype of A2SGD on a buffer: float32, float64 for a float64 buffer."""
    return torch.float64 if dtype == torch.float64 else torch.float32


EXACT_FLOAT32_COUNT = 2 ** 24  # a float32 sum of at most this many 0/1 entries is exact


def non_negative_indicator(values: torch.Tensor, out: Optional[torch.Tensor] = None
                           ) -> torch.Tensor:
    """1.0 where ``values >= 0``, else 0.0, in ``values``' dtype (a float indicator: counting and
    selecting with it are plain vectorised arithmetic)."""
    return torch.ge(values, 0, out=torch.empty_like(values) if out is None else out)


def _exact_counts(indicator_rows: torch.Tensor) -> torch.Tensor:
    """Per row, the number of ones of a 0/1 ``[rows, length]`` tensor, exact: summed in chunks
    of at most :data:`EXACT_FLOAT32_COUNT` columns (exact in float32), the chunks in float64."""
    length = indicator_rows.shape[1]
    counts = torch.zeros(indicator_rows.shape[0], dtype=torch.float64)
    for start in range(0, length, EXACT_FLOAT32_COUNT):
        counts += indicator_rows[:, start:start + EXACT_FLOAT32_COUNT].sum(dim=1)
    return counts


def local_statistics(values: torch.Tensor, bounds, scratch: Optional[torch.Tensor] = None,
                     indicator: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float64 [segments, 4]: (sum, count) of the non-negative entries, then of the negative ones.

    The sums are accumulated in ``values``' dtype (torch's cascaded summation; float32 for float32
    gradients) and returned as float64; the counts are exact. ``scratch`` (like ``values``) is an
    optional work buffer; ``indicator`` is :func:`non_negative_indicator` of ``values``, computed
    here when not given."""
    runs = _runs(bounds)
    scratch = torch.empty_like(values) if scratch is None else scratch
    indicator = non_negative_indicator(values) if indicator is None else indicator
    stats = torch.zeros(runs.count, 4, dtype=torch.float64, device=values.device)
    for column, bound in ((0, {"min": 0}), (2, {"max": 0})):
        torch.clamp(values, **bound, out=scratch)  # zeros in place of the other sign's entries
        for first, view in runs.views(scratch):
            stats[first:first + view.shape[0], column] = view.sum(dim=1)
    for first, view in runs.views(indicator):
        positives = _exact_counts(view)
        stats[first:first + view.shape[0], 1] = positives
        stats[first:first + view.shape[0], 3] = view.shape[1] - positives
    return stats


def segment_means(stats: torch.Tensor, dtype: torch.dtype) -> tuple:
    """(positive means, negative means) ``[segments]`` of float64 statistics, rounded to
    ``dtype`` (a mean over no entries is 0)."""
    return ((stats[:, 0] / stats[:, 1].clamp(min=1)).to(dtype),
            (stats[:, 2] / stats[:, 3].clamp(min=1)).to(dtype))


def two_level_values(values: torch.Tensor, stats: torch.Tensor, bounds,
                     out: Optional[torch.Tensor] = None,
                     indicator: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The applied gradient: each segment's global positive mean where ``values >= 0``, its global
    negative mean elsewhere (a mean over no entries is 0), computed in float64 and rounded to
    ``values``' dtype. ``indicator`` may hold :func:`non_negative_indicator` of ``values``;
    ``out`` receives the result (it may be ``indicator`` itself).

    The selection is ``lerp(negative mean, positive mean, indicator)``, exact at the weights 0 and
    1 (torch computes ``start + w (end - start)`` below 0.5 and ``end - (end - start)(1 - w)`` from
    0.5), and one vectorised pass, where ``torch.where`` on a mask is several times slower on CPU."""
    runs = _runs(bounds)
    positive_mean, negative_mean = segment_means(stats, values.dtype)
    indicator = non_negative_indicator(values) if indicator is None else indicator
    applied = torch.empty_like(values) if out is None else out
    indicators = dict(runs.views(indicator))
    for first, view in runs.views(applied):
        rows = slice(first, first + view.shape[0])
        torch.lerp(negative_mean[rows, None], positive_mean[rows, None], indicators[first],
                   out=view)
    return applied


class A2SGDReducer(ExactReductionsFirst):
    """A :class:`~.reducers.GradientReduction` of one model chunk with A2SGD over data parallel.

    Args:
        params: the chunk's parameters averaged with A2SGD.
        direction_group: group of this replica's copies of the stage (Chimera's pipeline
            directions; None for one-directional schedules): gradients are summed exactly over it.
        data_group: the data-parallel group the two means are all-reduced over.
        exact_params, exact_group, dp_size: parameters all-reduced exactly over ``exact_group``
            (divided by ``dp_size``): tensor-parallel-replicated ones.
        granularity: ``model`` (paper, default), ``bucket`` or ``tensor``.
        bucket_size: elements per segment for ``bucket``.
        sync_interval: ``synchronize()`` every this many iterations (``--a2sgd-sync-interval``).
        flush_errors_at_sync: every ``synchronize()`` also makes the next step an exact one: it
            all-reduces ``p = g + e`` (the mean over the data-parallel group is applied) and
            clears the error, so every rank's unapplied error reaches the optimizer
            (``--a2sgd-sync-flushes-errors``).
        flush_interval: every this many steps (counted by :meth:`after_step`, 0: never) the next
            step is an exact one, as after a flushing sync, independently of the sync
            (``--a2sgd-flush-interval``).
        periodic_sync_averages_optimizer: the sync every ``sync_interval`` iterations also averages
            the optimizer state (default); False: the parameters only
            (``--a2sgd-periodic-sync parameters``). :meth:`synchronize` (before a checkpoint or
            an evaluation) always averages both.
        second_moment_from_exact_steps: with ``flush_errors_at_sync`` and Adam, only the exact
            steps (the first one too) shape Adam's second moment, each weighted over the
            optimizer steps since the previous one; an exact step the optimizer skipped is
            retried at the next step (:mod:`.a2sgd_second_moment`,
            ``--a2sgd-second-moment-from-exact-steps``).
        overlap: once armed by ``start_when_ready()``, form ``p``, its sign indicator and its
            statistics tensor by tensor during the backward, as each gradient is complete, on a
            worker thread (whole-model granularity without a direction group; otherwise
            everything happens in ``wait()``).
        arithmetic: ``auto`` (default): the fused C++ kernel (:mod:`.a2sgd_kernel`) for CPU
            float32 buffers when the extension provides it, else the torch passes; ``fused``:
            the kernel, a ValueError where it cannot serve a buffer; ``torch``: the torch passes.
            :attr:`arithmetic_by_dtype` says which one each buffer uses.
    """

    has_state = True  # the error buffers

    def __init__(self, params: Iterable[torch.nn.Parameter], *, direction_group: Any = None,
                 data_group: Any = None, exact_params: Iterable[torch.nn.Parameter] = (),
                 exact_group: Any = None, dp_size: int = 1, granularity: str = "model",
                 bucket_size: int = 1_000_000, sync_interval: int = 0, overlap: bool = False,
                 arithmetic: str = "auto", flush_errors_at_sync: bool = False,
                 periodic_sync_averages_optimizer: bool = True,
                 second_moment_from_exact_steps: bool = False, flush_interval: int = 0):
        if granularity not in GRANULARITIES:
            raise ValueError(f"unknown A2SGD granularity {granularity!r}; use one of "
                             f"{GRANULARITIES}")
        if arithmetic not in a2sgd_kernel.ARITHMETICS:
            raise ValueError(f"unknown A2SGD arithmetic {arithmetic!r}; use one of "
                             f"{a2sgd_kernel.ARITHMETICS}")
        self._reduce_exactly_first(params, direction_group, exact_params, exact_group, dp_size)
        self.data_group = data_group
        self.granularity = granularity
        self.bucket_size = int(bucket_size)
        self.sync_interval = int(sync_interval)
        self.flush_errors_at_sync = bool(flush_errors_at_sync)
        self.periodic_sync_averages_optimizer = bool(periodic_sync_averages_optimizer)
        if flush_interval < 0:
            raise ValueError(f"the A2SGD flush interval must be >= 0 (got {flush_interval})")
        self.flush_interval = int(flush_interval)
        self.steps_done = 0  # steps seen by after_step(), for flush_interval
        self.exact_next_step = False  # set by synchronize() with flush_errors_at_sync
        self.second_moment: Optional[SecondMomentFromExactSteps] = None
        if second_moment_from_exact_steps:
            if not self.flush_errors_at_sync:
                raise ValueError("--a2sgd-second-moment-from-exact-steps needs "
                                 "--a2sgd-sync-flushes-errors (the exact steps it learns from)")
            self.second_moment = SecondMomentFromExactSteps(self.params)
            self.exact_next_step = True  # the second moment starts from an exact gradient
        self.loss_scale: Callable[[], float] = lambda: 1.0
        self._torch_optimizer: Optional[torch.optim.Optimizer] = None  # once attached
        self.feedback = ErrorFeedback(
            {dtype: torch.zeros_like(buf) for dtype, buf in self.inner.buffers.items()}, "A2SGD")
        self.errors = self.feedback.errors
        self._sizes = {dtype: [p.numel() for p in self.inner.params[::-1] if p.dtype == dtype]
                       for dtype in self.inner.buffers}
        self.bytes_last_step = 0  # data-parallel bytes all-reduced by the last wait()
        self._runs: dict = {}  # (dtype, granularity, bucket size) -> SegmentRuns
        self._work: dict = {}  # dtype -> (p, scratch) work buffers
        self._indicators: dict = {}  # dtype -> the torch path's sign indicator buffer
        self._kernel = {dtype: self._choose_kernel(arithmetic, buffer, self.errors[dtype])
                        for dtype, buffer in self.inner.buffers.items()}
        self.arithmetic_by_dtype = {dtype: "torch" if ops is None else "fused"
                                    for dtype, ops in self._kernel.items()}
        self.direction_group = direction_group
        self.overlap = bool(overlap)
        self._armed = False
        self.overlapped_last_step = False  # whether the last wait() used the backward's statistics
        self._pending: dict = {}  # dtype -> gradients still to arrive in the armed backward
        self._partial: dict = {}  # dtype -> float64 [4] statistics of the arrived gradients
        self._hook_scratch: dict = {}  # dtype -> work buffer of the backward hooks
        self._worker: Optional[ThreadPoolExecutor] = None  # runs the hooks' arithmetic
        self._jobs: list = []  # its jobs of the armed backward
        if self.overlap:
            for param in self.params:
                param.register_post_accumulate_grad_hook(self._on_grad_ready)

    @staticmethod
    def _choose_kernel(arithmetic: str, buffer: torch.Tensor, error: torch.Tensor):
        """The kernel's operators for this buffer, or None for the torch passes."""
        if arithmetic == "torch":
            return None
        reason = a2sgd_kernel.unavailable_reason(buffer, error)
        if reason is None:
            return a2sgd_kernel.fused_ops()
        if arithmetic == "fused":
            raise ValueError(f"A2SGDReducer(arithmetic='fused') cannot use the fused kernel: "
                             f"{reason}; use arithmetic='auto' to fall back to the torch passes")
        return None

    def start_when_ready(self) -> None:
        """With ``overlap``: arm the backward hooks for the next backward (call before the last
        micro-batch's); the statistics of each gradient are formed as soon as it is complete."""
        for job in self._jobs:  # a backward armed before but never reduced
            job.result()
        self._jobs = []
        self._armed = False
        if (not self.overlap or self.granularity != "model"
                or group_size(self.direction_group) > 1):
            return  # the whole-gradient path in wait()
        self.inner.rebind_all()  # the hooks read the buffers autograd writes
        for dtype, buffer in self.inner.buffers.items():
            self._work_buffers(dtype, buffer)
            self._pending[dtype] = sum(1 for p in self.params if p.dtype == dtype)
            self._partial[dtype] = torch.zeros(4, dtype=torch.float64)
        self._armed = True

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Backward hook (when armed): hand ``param``'s slice to the worker thread, so its
        arithmetic runs while the backward goes on (torch releases the GIL in its kernels)."""
        if not self._armed or self._pending.get(param.dtype, 0) <= 0:
            return
        self._pending[param.dtype] -= 1
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="a2sgd")
        start = self.inner.offset_of(param)
        self._jobs.append(self._worker.submit(
            self._slice_statistics, param.dtype, start, start + param.numel(),
            float(self.loss_scale())))

    def _slice_statistics(self, dtype: torch.dtype, start: int, end: int, scale: float) -> None:
        """``p``, indicator and statistics of ``[start, end)``, added to the step's partial sums
        (run by the one worker thread, so the additions are in submission order)."""
        ops = self._kernel[dtype]
        if ops is not None:  # one fused pass: p and its statistics
            corrected = self._work_buffers(dtype, self.inner.buffers[dtype])[0]
            whole = torch.tensor([[0, 1, end - start]], dtype=torch.int64)
            self._partial[dtype] += a2sgd_kernel.corrected_statistics(
                ops, self.inner.buffers[dtype][start:end], self.errors[dtype][start:end],
                corrected[start:end], scale, whole)[0]
            return
        corrected, indicator = self._form_corrected(dtype, start, end, scale)
        if dtype not in self._hook_scratch:
            self._hook_scratch[dtype] = torch.empty_like(self._work[dtype][0])
        scratch = self._hook_scratch[dtype][start:end]
        partial = self._partial[dtype]
        partial[0] += torch.clamp(corrected, min=0, out=scratch).sum()
        partial[2] += torch.clamp(corrected, max=0, out=scratch).sum()
        positives = _exact_counts(indicator.view(1, -1))[0]
        partial[1] += positives
        partial[3] += (end - start) - positives

    def _form_corrected(self, dtype: torch.dtype, start: int, end: int, scale: float) -> tuple:
        """``p = g / scale + e`` and its non-negative indicator on ``[start, end)`` of
        ``dtype``'s work buffers (views returned)."""
        buffer = self.inner.buffers[dtype]
        corrected = self._work_buffers(dtype, buffer)[0]
        indicator = self._indicator(dtype)
        gradient, error = buffer[start:end], self.errors[dtype][start:end]
        corrected, indicator = corrected[start:end], indicator[start:end]
        if scale == 1.0 and gradient.dtype == corrected.dtype == error.dtype:
            torch.add(gradient, error, out=corrected)
        else:
            corrected.copy_(gradient)
            if scale != 1.0:
                corrected.div_(scale)
            corrected.add_(error)
        non_negative_indicator(corrected, out=indicator)
        return corrected, indicator

    def wait(self) -> None:
        self.wait_exact()
        scale = float(self.loss_scale())
        self.bytes_last_step = 0
        jobs, self._jobs = self._jobs, []
        for job in jobs:
            job.result()  # the backward's statistics are complete (re-raises a worker's error)
        overlapped = self._armed and all(n == 0 for n in self._pending.values())
        self._armed = False
        self.overlapped_last_step = overlapped
        exact, self.exact_next_step = self.exact_next_step, False
        if self.second_moment is not None:
            self.second_moment.before_step(exact)
        for dtype, buffer in self.inner.buffers.items():
            if exact:
                self._reduce_exactly(dtype, buffer, scale, formed=overlapped)
                continue
            corrected, scratch = self._work_buffers(dtype, buffer)
            error = self.errors[dtype]
            runs = self._segment_runs(dtype)
            ops = self._kernel[dtype]
            if overlapped:  # p (and the indicator) and statistics were formed in the backward
                stats = self._partial[dtype].view(1, 4).clone()
            elif ops is not None:  # one fused pass: p = g / scale + e and the statistics
                stats = a2sgd_kernel.corrected_statistics(ops, buffer, error, corrected, scale,
                                                          runs.table)
            else:
                self._form_corrected(dtype, 0, buffer.numel(), scale)  # p = g / scale + e
                stats = local_statistics(corrected, runs, scratch,
                                         self._indicator(dtype))  # g consumed
            if group_size(self.data_group) > 1:
                dist.all_reduce(stats, group=self.data_group)
            self.bytes_last_step += stats.numel() * stats.element_size()
            if ops is not None:  # one fused pass: applied (into the gradient buffer), p - applied
                positive, negative = segment_means(stats, corrected.dtype)
                a2sgd_kernel.two_level_apply(ops, corrected, buffer, positive, negative, scale,
                                             runs.table)
                self.feedback.stage(dtype, corrected)
                continue
            indicator = self._indicator(dtype)
            applied = two_level_values(corrected, stats, runs, out=scratch, indicator=indicator)
            corrected.sub_(applied)  # the new error, p - applied
            self._stage_error(dtype, corrected)
            if scale != 1.0:
                applied.mul_(scale)
            if applied is not buffer:
                buffer.copy_(applied)

    def _reduce_exactly(self, dtype: torch.dtype, buffer: torch.Tensor, scale: float,
                        formed: bool) -> None:
        """The step after a flushing sync: the data-parallel mean of ``p = g / scale + e``
        becomes the applied gradient and the staged error is zero (``formed``: the backward's
        hooks already wrote ``p``)."""
        if not formed:
            self._form_corrected(dtype, 0, buffer.numel(), scale)
        corrected = self._work_buffers(dtype, buffer)[0]
        size = group_size(self.data_group)
        if size > 1:
            dist.all_reduce(corrected, group=self.data_group)
            corrected.div_(size)
        self.bytes_last_step += corrected.numel() * corrected.element_size()
        if scale != 1.0:
            corrected.mul_(scale)
        buffer.copy_(corrected)
        corrected.zero_()  # the new error
        self._stage_error(dtype, corrected)

    def _stage_error(self, dtype: torch.dtype, new_error: torch.Tensor) -> None:
        """Stage ``new_error`` (the work buffer ``p``, in the arithmetic dtype) as ``dtype``'s
        error: the buffer itself when the dtypes agree (adopted by a swap), else a cast copy."""
        error = self.errors[dtype]
        self.feedback.stage(dtype, new_error if new_error.dtype == error.dtype
                            else new_error.to(error.dtype))

    def _segment_runs(self, dtype: torch.dtype) -> SegmentRuns:
        """The segment layout of ``dtype``'s buffer, computed once per granularity."""
        key = (dtype, self.granularity, self.bucket_size)
        if key not in self._runs:
            self._runs[key] = SegmentRuns(segment_bounds(self._sizes[dtype], self.granularity,
                                                         self.bucket_size))
        return self._runs[key]

    def _work_buffers(self, dtype: torch.dtype, buffer: torch.Tensor) -> tuple:
        """(p, scratch) for ``dtype``'s buffer, allocated once, in the arithmetic dtype:
        ``p = g + e`` and then the new error; the scratch (the gradient buffer itself when it has
        the arithmetic dtype: the gradient is consumed once ``p`` is formed) holds the clamped
        values, then the applied gradient."""
        if dtype not in self._work:
            work = work_dtype(dtype)
            corrected = torch.empty(buffer.shape, dtype=work, device=buffer.device)
            scratch = buffer if buffer.dtype == work else torch.empty_like(corrected)
            self._work[dtype] = (corrected, scratch)
        return self._work[dtype]

    def _indicator(self, dtype: torch.dtype) -> torch.Tensor:
        """The torch path's work buffer for the indicator (1.0 where ``p >= 0``, else 0.0),
        allocated on first use (the fused kernel needs none)."""
        if dtype not in self._indicators:
            self._indicators[dtype] = torch.empty_like(self._work[dtype][0])
        return self._indicators[dtype]

    def attach(self, optimizer) -> None:
        """Read the loss scale (the errors are kept unscaled) and keep, for ``synchronize()``, the
        torch optimizer of the run's :class:`~megatron.core.optimizer.MegatronOptimizer`."""
        self.loss_scale = lambda: optimizer.loss_scale
        self._torch_optimizer = optimizer.optimizer
        if self.second_moment is not None:
            self.second_moment.attach(optimizer.optimizer)

    def after_step(self, ok: bool) -> None:
        self.finish_step(ok)
        self.steps_done += 1
        if self.flush_interval and self.steps_done % self.flush_interval == 0:
            self.exact_next_step = True
        if self.second_moment is not None:
            if not ok and self.second_moment.step_is_exact:
                self.exact_next_step = True  # v learns only from applied exact steps: retry
            self.second_moment.after_step(ok)

    def synchronize(self) -> None:
        """The exact replica average of the parameters and the optimizer state (collective);
        with ``flush_errors_at_sync`` the next step then reduces exactly (see :meth:`wait`)."""
        self._average_and_flush(self._optimizer_state())

    def synchronize_periodically(self) -> None:
        """The sync every ``sync_interval`` iterations: like :meth:`synchronize`, but the
        optimizer state only with ``periodic_sync_averages_optimizer``."""
        self._average_and_flush(
            self._optimizer_state() if self.periodic_sync_averages_optimizer else None)

    def _optimizer_state(self) -> Optional[dict]:
        """The torch optimizer's per-parameter state, read at each sync (not kept from
        :meth:`attach`: ``load_state_dict`` of a resume replaces the optimizer's ``state``)."""
        return None if self._torch_optimizer is None else self._torch_optimizer.state

    def _average_and_flush(self, optimizer_state: Optional[dict]) -> None:
        self.average_parameters(optimizer_state)
        if self.flush_errors_at_sync:
            self.exact_next_step = True

    def finish_step(self, update_successful: bool) -> None:
        """Commit the staged error when the optimizer stepped; drop it on an overflow step. The
        staged error is the work buffer ``p``; it becomes the kept error by a swap (no copy), and
        the old error buffer becomes the next step's ``p``."""
        for dtype, old_error in self.feedback.adopt_staged(update_successful).items():
            if dtype in self._work and self.errors[dtype] is self._work[dtype][0]:
                self._work[dtype] = (old_error,) + self._work[dtype][1:]

    def state_dict(self) -> dict:
        """The error buffers (per dtype, in this reducer's flat layout), whether the next step
        reduces exactly (a checkpoint is saved right after a sync), the step count of
        ``flush_interval`` and, with ``second_moment_from_exact_steps``, the optimizer steps since
        the last exact step."""
        state = {**self.feedback.state_dict(), "exact_next_step": self.exact_next_step,
                 "steps_done": self.steps_done}
        if self.second_moment is not None:
            state["second_moment_steps_since_exact"] = self.second_moment.steps_since_exact
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; keys absent from older checkpoints take their defaults."""
        self.feedback.load_state_dict(state)
        self.exact_next_step = bool(state.get("exact_next_step", False))  # absent: older files
        self.steps_done = int(state.get("steps_done", 0))
        if self.second_moment is not None:
            # absent (written before the count was kept): the old rule's assumption, the last
            # exact step one sync interval before the next one, at most the steps taken
            legacy = min(max(self.sync_interval - 1, 0), self.steps_done)
            self.second_moment.steps_since_exact = int(
                state.get("second_moment_steps_since_exact", legacy))

    def average_parameters(self, optimizer_state: Optional[dict] = None) -> None:
        """Make the replicas identical: the exact mean over the data-parallel group of every
        parameter and (given the torch optimizer's ``state``) of its optimizer state tensors."""
        size = group_size(self.data_group)
        if size == 1:
            return
        with torch.no_grad():
            for param in self.params:
                tensors = [param.data]
                if optimizer_state is not None:
                    tensors += [value for value in optimizer_state.get(param, {}).values()
                                if torch.is_tensor(value) and value.is_floating_point()]
                for tensor in tensors:
                    dist.all_reduce(tensor, group=self.data_group)
                    tensor.div_(size)


def build_a2sgd_reduction(request: ChunkReductionRequest) -> A2SGDReducer:
    """One chunk's A2SGD reduction: exact over the direction group (this replica's copies of the
    stage), two-level means over the data-parallel group; with tensor parallelism the
    tensor-parallel-replicated parameters are all-reduced exactly over the stage's replica group."""
    def exact(param):
        return request.tensor_parallel and not getattr(param, "tensor_model_parallel", False)
    return A2SGDReducer([p for p in request.params if not exact(p)],
                        direction_group=request.direction_group(),
                        data_group=request.data_group,
                        exact_params=[p for p in request.params if exact(p)],
                        exact_group=request.replica_group, dp_size=int(request.divide_by),
                        bucket_size=FLAG_BUCKET_SIZE, overlap=request.overlap,
                        **_flag_options(request.parallel))


def _flag_options(parallel) -> dict:
    """The reducer's options from the A2SGD flags; none without a configuration (the
    constructor's defaults: no periodic sync, the whole-model segment, no flush)."""
    if parallel is None:
        return {}
    return {"sync_interval": parallel.a2sgd_sync_interval,
            "granularity": parallel.a2sgd_granularity,
            "flush_errors_at_sync": parallel.a2sgd_sync_flushes_errors,
            "periodic_sync_averages_optimizer": parallel.a2sgd_periodic_sync != "parameters",
            "second_moment_from_exact_steps": parallel.a2sgd_second_moment_from_exact_steps,
            "flush_interval": parallel.a2sgd_flush_interval}


def check_a2sgd_flags(parallel) -> None:
    """The flag rules of ``--dp-gradient-reducer a2sgd``."""
    if parallel.a2sgd_sync_interval < 1:
        raise ValueError(f"--a2sgd-sync-interval must be >= 1 (got {parallel.a2sgd_sync_interval})")
    if parallel.a2sgd_flush_interval < 0:
        raise ValueError(f"--a2sgd-flush-interval must be >= 0 (got {parallel.a2sgd_flush_interval})")
    if parallel.a2sgd_second_moment_from_exact_steps and not parallel.a2sgd_sync_flushes_errors:
        raise ValueError("--a2sgd-second-moment-from-exact-steps learns Adam's second moment from "
                         "the exact steps of --a2sgd-sync-flushes-errors; add that flag")
    if parallel.use_distributed_optimizer:
        raise ValueError("--dp-gradient-reducer a2sgd and --use-distributed-optimizer both replace "
                         "the data-parallel gradient all-reduce; choose one")


A2SGD_REDUCER = ReducerKind(
    name="a2sgd", description="A2SGD: two means per worker with error feedback (docs/a2sgd.md)",
    build=build_a2sgd_reduction, needs_direction_groups=True,
    overlaps=True,  # --overlap-grad-reduce: the statistics are formed in the backward
    validate=check_a2sgd_flags)


def a2sgd_reducers(reducers: Iterable) -> list[A2SGDReducer]:
    """The A2SGD reducers among a rank's reducers (for measurements such as benchmarks/a2sgd.py)."""
    return [r for r in reducers if isinstance(r, A2SGDReducer)]
