"""Optimizer pieces in one process: LR schedules against hand values, param groups, clipping,
loss scaling and the overflow skip."""

import math

import pytest
import torch

from megatron.core.config import MegatronConfig
from megatron.core.optimizer import (ConstantGradScaler, DynamicGradScaler, OptimizerParamScheduler,
                                     build_lr_scheduler, build_optimizer, build_param_groups,
                                     clip_grads_by_norm, global_grad_norm)
from megatron.core.parallel_state import ParallelState


def _scheduler(style, warmup, decay, max_lr=1.0, min_lr=0.1):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    return OptimizerParamScheduler(optimizer, max_lr=max_lr, min_lr=min_lr, lr_warmup_steps=warmup,
                                   lr_decay_steps=decay, lr_decay_style=style)


@pytest.mark.parametrize("style,expected", [
    # steps 0..12 with warm-up 4 and decay 12, max 1.0, min 0.1 (hand-computed)
    ("constant", [0.0, 0.25, 0.5, 0.75, 1.0] + [1.0] * 8),
    ("linear", [0.0, 0.25, 0.5, 0.75, 1.0, 0.8875, 0.775, 0.6625, 0.55, 0.4375, 0.325, 0.2125,
                0.1]),
    ("cosine", [0.0, 0.25, 0.5, 0.75, 1.0]
     + [0.1 + 0.45 * (math.cos(math.pi * k / 8) + 1) for k in range(1, 9)]),
])
def test_lr_schedule_hand_values(style, expected):
    scheduler = _scheduler(style, warmup=4, decay=12)
    got = [scheduler.get_lr()]
    for _ in range(12):
        got.append(scheduler.step(1))
    assert got == pytest.approx(expected, abs=1e-12)
    assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(expected[-1])
    # past the decay length the schedule stays at its end value
    assert scheduler.step(5) == pytest.approx(1.0 if style == "constant" else 0.1)


def test_cosine_midpoint_and_no_warmup():
    scheduler = _scheduler("cosine", warmup=0, decay=10, max_lr=2.0, min_lr=0.0)
    assert scheduler.get_lr() == 2.0  # no warm-up: the first iteration runs at the peak
    assert scheduler.get_lr(5) == pytest.approx(1.0)


def test_lr_schedule_counts_samples_from_flags():
    config = MegatronConfig()
    config.optimizer.lr, config.optimizer.min_lr = 1e-3, 1e-5
    config.optimizer.lr_decay_style = "linear"
    config.optimizer.lr_warmup_fraction = 0.1
    config.training.global_batch_size, config.training.train_iters = 8, 100
    scheduler = build_lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0),
                                   config.optimizer, config.training)
    assert scheduler.lr_decay_steps == 800 and scheduler.lr_warmup_steps == 80
    config.optimizer.lr_warmup_fraction, config.optimizer.lr_warmup_iters = None, 3
    config.optimizer.lr_decay_iters = 50
    scheduler = build_lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0),
                                   config.optimizer, config.training)
    assert scheduler.lr_decay_steps == 400 and scheduler.lr_warmup_steps == 24
    assert scheduler.step(8) == pytest.approx(1e-3 / 3)


def test_lr_schedule_rejects_warmup_longer_than_decay():
    with pytest.raises(ValueError, match="warm-up"):
        _scheduler("linear", warmup=10, decay=10)


def test_param_groups_skip_weight_decay_on_flagged_and_1d_params():
    weight = torch.nn.Parameter(torch.ones(3, 3))
    flagged = torch.nn.Parameter(torch.ones(3, 3))
    flagged.no_weight_decay = True
    bias = torch.nn.Parameter(torch.ones(3))
    groups = build_param_groups([weight, flagged, bias], weight_decay=0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert groups[0]["params"] == [weight]
    assert groups[1]["params"] == [flagged, bias]


def _model_with_grads(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    model(torch.randn(4, 5)).pow(2).sum().mul(10).backward()
    return model


@pytest.mark.parametrize("max_norm", [0.01, 1e6])
def test_clipping_equals_torch_clip_grad_norm(max_norm):
    ours, reference = _model_with_grads(), _model_with_grads()
    state = ParallelState.single_process()
    norm = global_grad_norm(ours.parameters(), lambda p: True, state)
    clip_grads_by_norm(list(ours.parameters()), max_norm, norm)
    reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    assert norm == pytest.approx(reference_norm.item(), rel=1e-6)
    for a, b in zip(ours.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)


def test_norm_counts_only_owned_params():
    model = _model_with_grads()
    first = list(model[0].parameters())
    state = ParallelState.single_process()
    norm = global_grad_norm(model.parameters(), lambda p: any(p is q for q in first), state)
    expected = torch.cat([p.grad.flatten() for p in first]).norm().item()
    assert norm == pytest.approx(expected, rel=1e-6)


def test_dynamic_scaler_hysteresis_backoff_and_growth():
    scaler = DynamicGradScaler(initial_scale=16.0, min_scale=2.0, growth_interval=3, hysteresis=2)
    scaler.update(True)
    assert scaler.scale == 16.0  # the first overflow is absorbed by the hysteresis
    scaler.update(True)
    assert scaler.scale == 8.0
    scaler.update(True)
    assert scaler.scale == 4.0  # hysteresis budget stays spent until the next growth
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 2.0  # clamped at the minimum
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 4.0 and scaler.hysteresis_tracker == 2
    scaler.update(True)
    assert scaler.scale == 4.0


def _config(**optimizer_fields):
    config = MegatronConfig()
    config.optimizer.lr = 0.1
    config.training.global_batch_size, config.training.train_iters = 1, 10
    for key, value in optimizer_fields.items():
        if hasattr(config.training, key):
            setattr(config.training, key, value)
        else:
            setattr(config.optimizer, key, value)
    return config


def test_fp16_overflow_skips_the_step_and_shrinks_the_scale():
    model = torch.nn.Linear(4, 2)
    config = _config(fp16=True, initial_loss_scale=1024.0, hysteresis=1)
    optimizer = build_optimizer(config, model.parameters(), ParallelState.single_process())
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 4)).sum().backward()
    model.weight.grad[0, 0] = float("inf")
    result = optimizer.step()
    assert not result.update_successful and result.found_inf and result.grad_norm is None
    assert optimizer.loss_scale == 512.0
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    # a clean step afterwards updates the parameters, with gradients unscaled first
    optimizer.zero_grad()
    optimizer.scale_loss(model(torch.ones(1, 4)).sum()).backward()
    result = optimizer.step()
    assert result.update_successful and result.grad_norm == pytest.approx(math.sqrt(8 + 2), rel=1e-6)
    assert not torch.equal(model.weight, before[0])


def test_static_loss_scale_and_fp32_nan_skip():
    model = torch.nn.Linear(4, 2)
    optimizer = build_optimizer(_config(fp16=True, loss_scale=8.0), model.parameters(),
                                ParallelState.single_process())
    assert isinstance(optimizer.grad_scaler, ConstantGradScaler) and optimizer.loss_scale == 8.0
    fp32 = build_optimizer(_config(), model.parameters(), ParallelState.single_process())
    assert fp32.grad_scaler is None and fp32.loss_scale == 1.0
    model(torch.ones(1, 4)).sum().backward()
    model.bias.grad[0] = float("nan")
    before = model.weight.detach().clone()
    result = fp32.step()
    assert not result.update_successful and math.isnan(result.grad_norm)
    assert torch.equal(model.weight, before)


def test_adamw_matches_torch_with_decay_groups_and_clipping():
    reference, ours = _model_with_grads(), _model_with_grads()
    config = _config(weight_decay=0.05, clip_grad=0.5, adam_beta2=0.95)
    optimizer = build_optimizer(config, ours.parameters(), ParallelState.single_process())
    assert "AdamW" in optimizer.implementation
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    reference_optimizer = torch.optim.AdamW(
        [{"params": [reference[0].weight, reference[2].weight], "weight_decay": 0.05},
         {"params": [reference[0].bias, reference[2].bias], "weight_decay": 0.0}],
        lr=0.1, betas=(0.9, 0.95), eps=1e-8)
    assert optimizer.step().update_successful
    reference_optimizer.step()
    for a, b in zip(ours.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_sgd_option():
    model = torch.nn.Linear(2, 1)
    optimizer = build_optimizer(_config(optimizer="sgd", clip_grad=0.0), model.parameters(),
                                ParallelState.single_process())
    assert isinstance(optimizer.optimizer, torch.optim.SGD)
