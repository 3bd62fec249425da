"""A2SGD reducer against hand-computed examples (one process: the data-parallel group has one rank)."""

import pytest
import torch

from megatron.core.distributed.a2sgd import (A2SGDReducer, local_statistics, segment_bounds,
                                             two_level_values)
from megatron.core.distributed.reduction import after_step, load_reducer_states, reducer_states


def _reducer_with_grad(values, **kwargs):
    param = torch.nn.Parameter(torch.zeros(len(values)))
    reducer = A2SGDReducer([param], **kwargs)
    param.grad.copy_(torch.tensor(values))
    return param, reducer


def test_hand_computed_single_rank_step_and_error_feedback():
    param, reducer = _reducer_with_grad([3.0, -1.0, 1.0, -3.0])
    reducer.start()
    reducer.wait()
    # non-negative mean (3 + 1) / 2 = 2, negative mean (-1 - 3) / 2 = -2
    assert param.grad.tolist() == [2.0, -2.0, 2.0, -2.0]
    reducer.finish_step(True)
    assert reducer.errors[torch.float32].tolist() == [1.0, 1.0, -1.0, -1.0]
    # next step with a zero gradient: p = e = [1, 1, -1, -1] is applied exactly, error back to 0
    reducer.zero_grad()
    reducer.wait()
    reducer.finish_step(True)
    assert param.grad.tolist() == [1.0, 1.0, -1.0, -1.0]
    assert reducer.errors[torch.float32].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_two_ranks_hand_computed_from_statistics():
    """What two data-parallel ranks compute: the summed statistics give the global means."""
    rank0, rank1 = torch.tensor([3.0, -1.0, 1.0, -3.0]), torch.tensor([1.0, 1.0, -2.0, -4.0])
    bounds = segment_bounds([4], "model", 0)
    stats = local_statistics(rank0, bounds) + local_statistics(rank1, bounds)
    assert stats.tolist() == [[6.0, 4.0, -10.0, 4.0]]
    assert two_level_values(rank0, stats, bounds).tolist() == [1.5, -2.5, 1.5, -2.5]
    assert two_level_values(rank1, stats, bounds).tolist() == [1.5, 1.5, -2.5, -2.5]


def test_granularities_segment_the_buffer():
    assert segment_bounds([2, 3], "model", 4) == [(0, 5)]
    assert segment_bounds([2, 3], "tensor", 4) == [(0, 2), (2, 5)]
    assert segment_bounds([2, 3], "bucket", 4) == [(0, 4), (4, 5)]
    with pytest.raises(ValueError, match="granularity"):
        segment_bounds([2], "layer", 4)
    values = torch.tensor([4.0, 2.0, -1.0, 1.0, -3.0])
    stats = local_statistics(values, segment_bounds([2, 3], "tensor", 0))
    assert two_level_values(values, stats, segment_bounds([2, 3], "tensor", 0)).tolist() == \
        [3.0, 3.0, -2.0, 1.0, -2.0]


def test_overflow_step_keeps_the_old_error_and_loss_scale_is_removed():
    param, reducer = _reducer_with_grad([3.0, -1.0, 1.0, -3.0])
    reducer.loss_scale = lambda: 4.0
    param.grad.mul_(4.0)  # the backward of a scaled loss
    reducer.wait()
    assert param.grad.tolist() == [8.0, -8.0, 8.0, -8.0]  # applied, scaled back
    after_step([reducer], ok=False)
    assert reducer.errors[torch.float32].tolist() == [0.0] * 4  # overflow: error unchanged
    reducer.zero_grad()
    param.grad.copy_(torch.tensor([12.0, -4.0, 4.0, -12.0]))
    reducer.wait()
    after_step([reducer], ok=True)
    assert reducer.errors[torch.float32].tolist() == [1.0, 1.0, -1.0, -1.0]  # unscaled units


def test_one_rank_equals_sgd_with_error_feedback():
    """With one data-parallel rank, training with the reducer is SGD on the error-fed two-mean
    quantisation of the gradient, computed here by hand."""
    torch.manual_seed(0)
    data, target = torch.randn(16, 5), torch.randn(16, 3)
    model = torch.nn.Linear(5, 3)
    reference = torch.nn.Linear(5, 3)
    reference.load_state_dict(model.state_dict())
    reducer = A2SGDReducer(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(reference.parameters())
    error = [torch.zeros_like(p) for p in params]
    for _ in range(5):
        reducer.zero_grad()
        torch.nn.functional.mse_loss(model(data), target).backward()
        reducer.wait()
        optimizer.step()
        reducer.finish_step(True)

        grads = torch.autograd.grad(torch.nn.functional.mse_loss(reference(data), target), params)
        p = torch.cat([(g + e).flatten() for g, e in zip(grads, error)]).double()
        positive, negative = p[p >= 0].mean(), p[p < 0].mean()
        applied = torch.where(p >= 0, positive, negative)
        offset = 0
        with torch.no_grad():
            for param, e in zip(params, error):
                n = param.numel()
                e.copy_((p[offset:offset + n] - applied[offset:offset + n]).view_as(e))
                param -= 0.1 * applied[offset:offset + n].view_as(param).float()
                offset += n
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)


def test_error_buffers_round_trip_through_checkpoint_state():
    param, reducer = _reducer_with_grad([3.0, -1.0, 1.0, -3.0])
    reducer.wait()
    reducer.finish_step(True)
    states = [reducer_states([reducer])]  # one data-parallel rank
    _, fresh = _reducer_with_grad([0.0] * 4)
    load_reducer_states([fresh], states, dp_rank=0)
    assert fresh.errors[torch.float32].tolist() == [1.0, 1.0, -1.0, -1.0]
    with pytest.raises(ValueError, match="data-parallel rank 1"):
        load_reducer_states([fresh], states, dp_rank=1)
    _, wrong = _reducer_with_grad([0.0] * 3)
    with pytest.raises(ValueError, match="does not fit"):
        load_reducer_states([wrong], states, dp_rank=0)


def test_flags_parse_and_a_bad_sync_interval_is_refused():
    from megatron.training.arguments import parse_args
    tiny = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 5 "
            "--mock-data").split()
    config = parse_args(tiny + ["--dp-gradient-reducer", "a2sgd"], world_size=1)
    assert (config.parallel.dp_gradient_reducer, config.parallel.a2sgd_sync_interval) == ("a2sgd", 10)
    with pytest.raises(ValueError, match="--a2sgd-sync-interval must be >= 1"):
        parse_args(tiny + ["--dp-gradient-reducer", "a2sgd", "--a2sgd-sync-interval", "0"],
                   world_size=1)


@pytest.mark.parametrize("loss_scale", [1.0, 8.0])
def test_overlapped_statistics_equal_the_whole_gradient_path(loss_scale):
    """With ``overlap`` the backward hooks form p, the indicator and the statistics tensor by
    tensor (after gradient accumulation over two micro-batches); the applied gradients and errors
    equal those of the path that computes everything in wait(), up to the float32 summation order."""
    torch.manual_seed(3)
    models = [torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4))
              for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    reducers = [A2SGDReducer(models[0].parameters()),
                A2SGDReducer(models[1].parameters(), overlap=True)]
    for reducer in reducers:
        reducer.loss_scale = lambda: loss_scale
    for _step in range(3):
        batches = [(torch.randn(8, 6), torch.randn(8, 4)) for _ in range(2)]
        for model, reducer in zip(models, reducers):
            reducer.zero_grad()
            for index, (data, target) in enumerate(batches):
                if index == len(batches) - 1:
                    reducer.start_when_ready()
                loss = torch.nn.functional.mse_loss(model(data), target) * loss_scale
                loss.backward()
            reducer.start()
            reducer.wait()
            reducer.finish_step(True)
        assert reducers[1].overlapped_last_step and not reducers[0].overlapped_last_step
        for plain, overlapped in zip(models[0].parameters(), models[1].parameters()):
            torch.testing.assert_close(overlapped.grad, plain.grad, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(reducers[1].errors[torch.float32],
                                   reducers[0].errors[torch.float32], rtol=1e-6, atol=1e-7)


def test_vectorised_statistics_equal_the_per_segment_definition():
    """The run-wise statistics and reconstruction equal a per-segment float64 evaluation of the
    definition (sums within float32 summation error, counts and selections exactly)."""
    torch.manual_seed(5)
    sizes = [7, 7, 7, 30, 1, 1, 64, 5]
    values = torch.randn(sum(sizes))
    values[3] = 0.0
    for granularity in GRANULARITY_CASES:
        bounds = segment_bounds(sizes, granularity, 16)
        stats = local_statistics(values, bounds)
        for index, (start, end) in enumerate(bounds):
            segment = values[start:end].double()
            positive = segment >= 0
            expected = [segment[positive].sum(), positive.sum(), segment[~positive].sum(),
                        (~positive).sum()]
            torch.testing.assert_close(stats[index], torch.stack(expected).double(),
                                       rtol=1e-6, atol=1e-6)
            assert stats[index, 1] == positive.sum() and stats[index, 3] == (~positive).sum()
        applied = two_level_values(values, stats, bounds)
        for index, (start, end) in enumerate(bounds):
            means = (stats[index, 0] / stats[index, 1].clamp(min=1),
                     stats[index, 2] / stats[index, 3].clamp(min=1))
            expected = torch.where(values[start:end] >= 0, means[0].float(), means[1].float())
            assert torch.equal(applied[start:end], expected)


GRANULARITY_CASES = ("model", "bucket", "tensor")
