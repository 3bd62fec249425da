"""Tier 0: the per-bucket gradient checks see each bucket of a rank's own gradients before the
reduction divides and sends it (megatron/training/gradient_checks.py, the reductions'
``watch_local_gradients`` seam), for the exact, sharded and compressing reductions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.core.distributed.gradient_reducer import GradientReducer
from megatron.core.distributed.sharded_reducer import ShardedGradientReducer
from megatron.core.distributed.topk import TopKReducer
from megatron.training.gradient_checks import LocalGradientNorms, gradient_norms_for


def _params(*sizes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(size, generator=generator)) for size in sizes]


def _backward(params, seed=1):
    generator = torch.Generator().manual_seed(seed)
    loss = sum((p * torch.randn(p.shape, generator=generator)).sum() * 3.0 for p in params)
    loss.backward()


def test_every_bucket_is_seen_before_the_division_in_launch_order():
    params = _params(6, 10, 4)
    reducer = GradientReducer(params, divide_by=4.0, bucket_size=10)
    recorder = LocalGradientNorms().watch([reducer])
    reducer.zero_grad()
    _backward(params)
    local = {id(p): p.grad.clone() for p in params}
    reducer.start()
    reducer.wait()
    expected = [float(torch.cat([local[id(p)].reshape(-1) for p in bucket.params]).norm())
                for bucket in reducer.buckets]
    assert len(reducer.buckets) >= 2
    assert recorder.norms == pytest.approx(expected, rel=1e-6)
    assert params[0].grad.norm() == pytest.approx(local[id(params[0])].norm() / 4.0)  # the division happened
    recorder.clear()
    assert recorder.results(losses=[2.0]).grad_norms == ()


def test_the_sharded_reduction_is_seen_per_segment():
    params = _params(5, 7)
    reducer = ShardedGradientReducer(params, divide_by=2.0)
    recorder = LocalGradientNorms().watch([reducer])
    reducer.zero_grad()
    _backward(params)
    local = torch.cat([p.grad.reshape(-1).clone() for p in params])
    reducer.start()
    reducer.wait()
    assert recorder.norms == pytest.approx([float(local.norm())], rel=1e-6)


def test_a_compressing_reduction_shows_its_uncompressed_local_gradients():
    params = _params(16)
    reducer = TopKReducer(params, direction_group=None, data_group=None, dp_size=1, ratio=0.25)
    recorder = LocalGradientNorms().watch([reducer])
    reducer.zero_grad()
    _backward(params)
    local = params[0].grad.clone()
    reducer.start()
    reducer.wait()
    assert recorder.norms == pytest.approx([float(local.norm())], rel=1e-6)


def test_nothing_is_recorded_unless_a_flag_asks():
    reducer = GradientReducer(_params(3))
    training = SimpleNamespace(check_for_nan_in_loss_and_grad=False, check_for_large_grads=False,
                               rerun_mode="validate_results")
    assert gradient_norms_for(training, [reducer]) is None
    assert reducer.local_gradients_observer is None
    training.check_for_large_grads = True
    recorder = gradient_norms_for(training, [reducer])
    assert recorder is not None and recorder.validator is None  # the engine validates
    training.rerun_mode = "disabled"
    assert gradient_norms_for(training, [reducer]).validator is not None  # validates alone
