"""A2SGD's fused C++ kernel (megatron/csrc/a2sgd.cpp) against the torch path of a2sgd.py.

The kernel must give the torch path's ``p = g / scale + e`` bitwise, the same counts and sign
selection, sums equal to a float64 evaluation (the torch path's float32 sums within their
summation error), and bitwise the same applied gradient and error for the same statistics; the
reducer must pick it on CPU float32 and fall back to the torch passes elsewhere.
"""

import pytest
import torch

from megatron.core.distributed import a2sgd_kernel
from megatron.core.distributed.a2sgd import (GRANULARITIES, A2SGDReducer, SegmentRuns,
                                             local_statistics, segment_bounds, segment_means,
                                             two_level_values)

SIZES = [7, 7, 7, 30, 1, 1, 64, 5, 40_001, 3]  # odd lengths, equal-length runs, one long tensor


@pytest.fixture(scope="module")
def ops():
    kernel = a2sgd_kernel.fused_ops()
    assert kernel is not None, a2sgd_kernel._load()[1]  # the extension is part of the build
    return kernel


def _vectors(kind: str, numel: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    gradient = torch.randn(numel, generator=generator)
    error = 0.3 * torch.randn(numel, generator=generator)
    if kind == "zeros":
        gradient.zero_(), error.zero_()
    elif kind == "all negative":
        gradient = -gradient.abs() - 1e-3
        error = -error.abs()
    elif kind == "signed zeros":
        gradient[::3] = 0.0
        error[::3] = -0.0
        gradient[1::5] = -0.0
        error[1::5] = 0.0
    return gradient, error


def _float64_statistics(values: torch.Tensor, bounds) -> torch.Tensor:
    rows = []
    for start, end in bounds:
        segment = values[start:end].double()
        positive = segment >= 0
        rows.append([segment[positive].sum(), positive.sum(), segment[~positive].sum(),
                     (~positive).sum()])
    return torch.tensor(rows, dtype=torch.float64).view(len(rows), 4)


def _torch_corrected(gradient, error, scale):
    """The torch path's ``p`` (A2SGDReducer._form_corrected)."""
    if scale == 1.0:
        return gradient + error
    corrected = gradient.clone()
    corrected.div_(scale)
    return corrected.add_(error)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("kind", ["random", "zeros", "all negative", "signed zeros"])
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_kernel_equals_the_torch_path(ops, granularity, kind, scale):
    numel = sum(SIZES)
    gradient, error = _vectors(kind, numel, seed=len(kind))
    gradient *= scale
    runs = SegmentRuns(segment_bounds(SIZES, granularity, 1000))
    bounds = [(start + s * length, start + (s + 1) * length)
              for start, segments, length, _ in runs.runs for s in range(segments)]
    corrected = torch.empty(numel)
    stats = a2sgd_kernel.corrected_statistics(ops, gradient, error, corrected, scale, runs.table)

    reference = _torch_corrected(gradient, error, scale)
    assert torch.equal(corrected, reference)  # the same float32 operations, bitwise
    assert stats.shape == (runs.count, 4) and stats.dtype == torch.float64
    exact = _float64_statistics(reference, bounds)
    assert torch.equal(stats[:, 1], exact[:, 1]) and torch.equal(stats[:, 3], exact[:, 3])
    torch.testing.assert_close(stats[:, [0, 2]], exact[:, [0, 2]], rtol=1e-12, atol=1e-9)
    torch_stats = local_statistics(reference.clone(), runs)
    assert torch.equal(stats[:, [1, 3]], torch_stats[:, [1, 3]])
    torch.testing.assert_close(stats, torch_stats, rtol=1e-5, atol=1e-3)

    # The same statistics give bitwise the same applied gradient and error.
    for statistics in (stats, torch_stats):
        expected = two_level_values(reference, statistics, runs)
        expected_error = reference - expected
        if scale != 1.0:
            expected = expected * scale
        error_out, applied = reference.clone(), torch.empty(numel)
        positive, negative = segment_means(statistics, torch.float32)
        a2sgd_kernel.two_level_apply(ops, error_out, applied, positive, negative, scale,
                                     runs.table)
        assert torch.equal(applied, expected)
        assert torch.equal(error_out, expected_error)


def test_kernel_sums_are_float64_over_many_entries(ops):
    """A segment of 3 M entries (beyond float32's exact integers for the count, many blocks)."""
    numel = 3_000_001
    gradient, error = _vectors("random", numel, seed=11)
    runs = SegmentRuns(segment_bounds([numel], "model", 0))
    corrected = torch.empty(numel)
    stats = a2sgd_kernel.corrected_statistics(ops, gradient, error, corrected, 1.0, runs.table)
    exact = _float64_statistics(gradient + error, [(0, numel)])
    assert torch.equal(stats[:, [1, 3]], exact[:, [1, 3]])
    torch.testing.assert_close(stats, exact, rtol=1e-12, atol=1e-7)


def test_a_nan_is_treated_like_the_torch_path(ops):
    """NaN: not >= 0 (counted negative, gets the negative mean) and in both sums (like clamp)."""
    gradient = torch.tensor([1.0, float("nan"), -2.0, 3.0])
    runs = SegmentRuns([(0, 4)])
    corrected = torch.empty(4)
    stats = a2sgd_kernel.corrected_statistics(ops, gradient, torch.zeros(4), corrected, 1.0,
                                              runs.table)
    reference = local_statistics(gradient.clone(), runs)
    assert stats[0, 0].isnan() and stats[0, 2].isnan() and reference[0, 0].isnan()
    assert stats[0, [1, 3]].tolist() == reference[0, [1, 3]].tolist() == [2.0, 2.0]


def test_kernel_refuses_bad_inputs(ops):
    runs = SegmentRuns([(0, 4)])
    with pytest.raises(RuntimeError, match="float32"):
        a2sgd_kernel.corrected_statistics(ops, torch.zeros(4, dtype=torch.float64),
                                          torch.zeros(4), torch.zeros(4), 1.0, runs.table)
    with pytest.raises(RuntimeError, match="cover 4 entries of a buffer of 5"):
        a2sgd_kernel.corrected_statistics(ops, torch.zeros(5), torch.zeros(5), torch.zeros(5),
                                          1.0, runs.table)
    with pytest.raises(RuntimeError, match="must tile"):
        a2sgd_kernel.corrected_statistics(ops, torch.zeros(4), torch.zeros(4), torch.zeros(4),
                                          1.0, torch.tensor([[1, 1, 3]]))


def _train_steps(arithmetic: str, granularity: str, loss_scale: float, overlap: bool = False):
    """Three steps of a tiny model: the applied gradients and errors of each step."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4))
    reducer = A2SGDReducer(model.parameters(), granularity=granularity, bucket_size=16,
                           arithmetic=arithmetic, overlap=overlap)
    reducer.loss_scale = lambda: loss_scale
    history = []
    for _step in range(3):
        reducer.zero_grad()
        reducer.start_when_ready()
        loss = torch.nn.functional.mse_loss(model(torch.randn(8, 6)), torch.randn(8, 4))
        (loss * loss_scale).backward()
        reducer.start()
        reducer.wait()
        reducer.finish_step(True)
        history.append(([p.grad.clone() for p in model.parameters()],
                        reducer.errors[torch.float32].clone()))
    return reducer, history


def _assert_same_history(fused_history, plain_history):
    """Every step's applied gradients and error buffer agree between the two paths (the means
    may differ in the last float32 bit: float64 vs float32 sums)."""
    for (fused_grads, fused_error), (plain_grads, plain_error) in zip(fused_history,
                                                                      plain_history):
        for mine, theirs in zip(fused_grads, plain_grads):
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(fused_error, plain_error, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("loss_scale", [1.0, 8.0])
def test_reducer_with_the_kernel_trains_like_the_torch_path(ops, granularity, loss_scale):
    fused, fused_history = _train_steps("auto", granularity, loss_scale)
    plain, plain_history = _train_steps("torch", granularity, loss_scale)
    assert fused.arithmetic_by_dtype == {torch.float32: "fused"}
    assert plain.arithmetic_by_dtype == {torch.float32: "torch"}
    _assert_same_history(fused_history, plain_history)


def test_overlapped_reducer_with_the_kernel_trains_like_the_torch_path(ops):
    fused, fused_history = _train_steps("fused", "model", 8.0, overlap=True)
    plain, plain_history = _train_steps("torch", "model", 8.0, overlap=True)
    assert fused.overlapped_last_step and plain.overlapped_last_step
    _assert_same_history(fused_history, plain_history)


def test_fallback_to_the_torch_path(monkeypatch):
    double = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    assert A2SGDReducer([double]).arithmetic_by_dtype == {torch.float64: "torch"}
    with pytest.raises(ValueError, match="float32 only"):
        A2SGDReducer([double], arithmetic="fused")
    with pytest.raises(ValueError, match="unknown A2SGD arithmetic"):
        A2SGDReducer([torch.nn.Parameter(torch.zeros(4))], arithmetic="cuda")
    # Without the extension (not built, or a stale build): the torch passes, which still train.
    monkeypatch.setattr(a2sgd_kernel, "_load", lambda: (None, "the extension is not built"))
    param = torch.nn.Parameter(torch.zeros(4))
    reducer = A2SGDReducer([param])
    assert reducer.arithmetic_by_dtype == {torch.float32: "torch"}
    with pytest.raises(ValueError, match="not built"):
        A2SGDReducer([param], arithmetic="fused")
    param.grad.copy_(torch.tensor([3.0, -1.0, 1.0, -3.0]))
    reducer.wait()
    reducer.finish_step(True)
    assert param.grad.tolist() == [2.0, -2.0, 2.0, -2.0]
    assert reducer.errors[torch.float32].tolist() == [1.0, 1.0, -1.0, -1.0]


def test_kernel_statistics_do_not_depend_on_the_thread_count(ops):
    """Blocks are summed in order, so replicas with other thread counts agree bitwise."""
    numel = 1_000_003
    gradient, error = _vectors("random", numel, seed=7)
    runs = SegmentRuns(segment_bounds([numel // 2, numel - numel // 2], "tensor", 0))
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            corrected = torch.empty(numel)
            results.append(a2sgd_kernel.corrected_statistics(ops, gradient, error, corrected, 1.0,
                                                             runs.table))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(result, results[0]) for result in results[1:])
