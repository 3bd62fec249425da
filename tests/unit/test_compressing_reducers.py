"""The top-k and QSGD reducers against their definitions on small vectors (one process: the
data-parallel group has one rank; several ranks are emulated by combining payloads by hand)."""

import math

import pytest
import torch

from megatron.core.distributed.compressed import ring_bytes_sent
from megatron.core.distributed.qsgd import QSGDReducer, dequantise, generator_seed, quantise
from megatron.core.distributed.reduction import after_step, load_reducer_states, reducer_states
from megatron.core.distributed.topk import TopKReducer, kept_entries, sparse_average, top_k


def _reducer_with_grad(cls, values, **kwargs):
    param = torch.nn.Parameter(torch.zeros(len(values)))
    reducer = cls([param], **kwargs)
    param.grad.copy_(torch.tensor(values))
    return param, reducer


# ----------------------------------------------------------------------------------------- top-k

def test_kept_entries_rounds_up_and_keeps_at_least_one():
    assert kept_entries(10, 0.25) == 3
    assert kept_entries(10, 0.01) == 1
    assert kept_entries(10, 1.0) == 10
    assert kept_entries(0, 0.5) == 0


def test_top_k_keeps_the_largest_magnitudes():
    values, indices = top_k(torch.tensor([0.1, -5.0, 2.0, -0.3, 4.0]), 2)
    assert sorted(zip(indices.tolist(), values.tolist())) == [(1, -5.0), (4, 4.0)]


def test_top_k_of_a_long_vector_equals_a_full_sort_with_and_without_the_sampled_threshold():
    """Long vectors take the sampled-threshold path: the result is the top k of a full sort; a
    sample that sees only the largest entries (too few candidates) and a NaN fall back to
    ``torch.topk`` over everything, which keeps the NaN (an overflow must reach the gradient)."""
    torch.manual_seed(2)
    values = torch.randn(400_000)
    k = 4_000
    expected = set(torch.sort(values.abs(), descending=True).indices[:k].tolist())
    kept, indices = top_k(values, k)
    assert set(indices.tolist()) == expected and torch.equal(kept, values[indices])
    spiky = torch.zeros(400_000)
    spiky[::6] = torch.arange(1, 66_668, dtype=torch.float32)  # the strided sample sees these
    spiky[1:60_000:6] = 1e6  # ... and misses the 10,000 largest: fewer than k candidates pass
    _, indices = top_k(spiky, 20_000)
    assert set(indices.tolist()) == set(torch.sort(spiky, descending=True).indices[:20_000].tolist())
    values[123] = float("nan")
    _, indices = top_k(values, k)
    assert 123 in indices.tolist()


def test_two_ranks_average_their_sparse_payloads():
    rank0 = (torch.tensor([-5.0, 4.0]), torch.tensor([1, 4]))
    rank1 = (torch.tensor([2.0, 6.0]), torch.tensor([1, 0]))
    assert sparse_average([rank0, rank1], 5, 2.0).tolist() == [3.0, -1.5, 0.0, 0.0, 2.0]


def test_topk_step_and_error_feedback_by_hand():
    param, reducer = _reducer_with_grad(TopKReducer, [0.5, -3.0, 1.0, 2.0], ratio=0.5)
    reducer.start()
    reducer.wait()
    assert param.grad.tolist() == [0.0, -3.0, 0.0, 2.0]
    after_step([reducer], ok=True)
    assert reducer.errors[torch.float32].tolist() == [0.5, 0.0, 1.0, 0.0]
    # next gradient [0.5, 0, 0.5, 0]: p = [1, 0, 1.5, 0]; top-2 is everything non-zero
    reducer.zero_grad()
    param.grad.copy_(torch.tensor([0.5, 0.0, 0.5, 0.0]))
    reducer.wait()
    after_step([reducer], ok=True)
    assert param.grad.tolist() == [1.0, 0.0, 1.5, 0.0]
    assert reducer.errors[torch.float32].tolist() == [0.0] * 4


def test_topk_overflow_step_keeps_the_old_error_and_loss_scale_is_removed():
    param, reducer = _reducer_with_grad(TopKReducer, [0.5, -3.0, 1.0, 2.0], ratio=0.25)
    reducer.loss_scale = lambda: 4.0
    param.grad.mul_(4.0)
    reducer.wait()
    assert param.grad.tolist() == [0.0, -12.0, 0.0, 0.0]  # applied, scaled back
    after_step([reducer], ok=False)
    assert reducer.errors[torch.float32].tolist() == [0.0] * 4
    reducer.zero_grad()
    param.grad.copy_(torch.tensor([2.0, -12.0, 4.0, 8.0]))
    reducer.wait()
    after_step([reducer], ok=True)
    assert reducer.errors[torch.float32].tolist() == [0.5, 0.0, 1.0, 2.0]  # unscaled units


def test_topk_with_ratio_one_is_plain_sgd():
    torch.manual_seed(0)
    data, target = torch.randn(16, 5), torch.randn(16, 3)
    model, reference = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    reference.load_state_dict(model.state_dict())
    reducer = TopKReducer(model.parameters(), ratio=1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        reducer.zero_grad()
        torch.nn.functional.mse_loss(model(data), target).backward()
        reducer.wait()
        optimizer.step()
        reducer.after_step(True)
        reference_optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(data), target).backward()
        reference_optimizer.step()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_topk_errors_round_trip_and_bad_ratio_is_refused():
    param, reducer = _reducer_with_grad(TopKReducer, [0.5, -3.0, 1.0, 2.0], ratio=0.5)
    reducer.wait()
    reducer.after_step(True)
    _, fresh = _reducer_with_grad(TopKReducer, [0.0] * 4, ratio=0.5)
    load_reducer_states([fresh], [reducer_states([reducer])], dp_rank=0)
    assert fresh.errors[torch.float32].tolist() == [0.5, 0.0, 1.0, 0.0]
    _, wrong = _reducer_with_grad(TopKReducer, [0.0] * 3)
    with pytest.raises(ValueError, match="does not fit"):
        load_reducer_states([wrong], [reducer_states([reducer])], dp_rank=0)
    with pytest.raises(ValueError, match="--topk-ratio"):
        TopKReducer([torch.nn.Parameter(torch.zeros(2))], ratio=0.0)


# ------------------------------------------------------------------------------------------ QSGD

def _qsgd_by_definition(v, levels, uniform):
    """One bucket, straight from the formula: ||v|| sign(v_j) level_j / s."""
    norm = math.sqrt(sum(x * x for x in v))
    out = []
    for x, u in zip(v, uniform):
        if norm == 0:
            out.append(0.0)
            continue
        r = abs(x) / norm * levels
        lower = math.floor(r)
        level = lower + (1 if u < r - lower else 0)
        out.append(norm * math.copysign(1.0, x) * level / levels if x != 0 else 0.0)
    return out


def test_quantise_then_dequantise_equals_the_definition():
    v = [3.0, -4.0, 0.0, 1.0, -2.0, 2.0, 0.5]
    levels, bucket = 4, 4
    uniform = torch.tensor([0.1, 0.9, 0.5, 0.3, 0.7, 0.2, 0.6, 0.4])  # 2 buckets, padded
    norms, signed = quantise(torch.tensor(v), levels, bucket, uniform)
    assert signed.dtype == torch.int8 and signed.numel() == 8
    expected = (_qsgd_by_definition(v[:4], levels, uniform[:4].tolist())
                + _qsgd_by_definition(v[4:], levels, uniform[4:7].tolist()))
    torch.testing.assert_close(dequantise(norms, signed, levels, len(v)),
                               torch.tensor(expected), rtol=1e-6, atol=1e-6)
    # by hand, bucket 1: norm 5.1, r = [2.353, 3.137, 0, 0.784]; u decides the rounding
    assert signed[:4].tolist() == [3, -3, 0, 1]


def test_quantise_is_unbiased_and_a_zero_bucket_stays_zero():
    torch.manual_seed(0)
    v = torch.tensor([0.3, -1.2, 0.05, 0.7])
    draws = 20000
    uniform = torch.rand(draws, 4)
    mean = torch.stack([dequantise(*quantise(v, 2, 4, u), 2, 4) for u in uniform]).mean(0)
    torch.testing.assert_close(mean, v, rtol=0, atol=0.02)
    norms, signed = quantise(torch.zeros(4), 2, 4, torch.rand(4))
    assert dequantise(norms, signed, 2, 4).tolist() == [0.0] * 4


def test_qsgd_reducer_applies_the_quantised_gradient_and_resumes_its_draws():
    values = [3.0, -4.0, 0.0, 1.0, -2.0, 2.0]
    param, reducer = _reducer_with_grad(QSGDReducer, values, levels=4, bucket_size=4, seed=11)
    uniform = torch.rand(8, generator=torch.Generator().manual_seed(11))
    reducer.loss_scale = lambda: 2.0
    param.grad.mul_(2.0)
    saved = [reducer_states([reducer])]  # one data-parallel rank
    reducer.wait()
    expected = (_qsgd_by_definition(values[:4], 4, uniform[:4].tolist())
                + _qsgd_by_definition(values[4:], 4, uniform[4:6].tolist()))
    torch.testing.assert_close(param.grad, 2.0 * torch.tensor(expected), rtol=1e-6, atol=1e-6)
    assert reducer.payload_bytes_last_step == 2 * 4 + 8  # two float32 norms, eight int8 levels
    first = param.grad.clone()
    load_reducer_states([reducer], saved, dp_rank=0)  # the same draws again
    reducer.zero_grad()
    param.grad.copy_(2.0 * torch.tensor(values))
    reducer.wait()
    assert torch.equal(param.grad, first)


def test_qsgd_bad_levels_are_refused_and_seeds_match_across_chimera_directions():
    with pytest.raises(ValueError, match="--qsgd-levels"):
        QSGDReducer([torch.nn.Parameter(torch.zeros(2))], levels=128)
    from megatron.core.pipeline_parallel.execution.model_chunks import ModuleKey
    assert generator_seed(7, 1, ModuleKey(0, 1)) == generator_seed(7, 1, ModuleKey(1, 1))
    assert generator_seed(7, 0, ModuleKey(0, 1)) != generator_seed(7, 1, ModuleKey(0, 1))


def test_ring_bytes():
    assert ring_bytes_sent(400, 4, "all_reduce") == 600.0
    assert ring_bytes_sent(100, 4, "all_gather") == 300.0
    assert ring_bytes_sent(100, 1, "all_gather") == 0.0


def test_flags_parse_and_bad_values_are_refused():
    from megatron.training.arguments import parse_args
    tiny = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 5 "
            "--mock-data").split()
    config = parse_args(tiny + ["--dp-gradient-reducer", "topk", "--topk-ratio", "0.1"],
                        world_size=1)
    assert (config.parallel.dp_gradient_reducer, config.parallel.topk_ratio) == ("topk", 0.1)
    config = parse_args(tiny + ["--dp-gradient-reducer", "qsgd"], world_size=1)
    assert (config.parallel.qsgd_levels, config.parallel.qsgd_bucket_size) == (127, 512)
    with pytest.raises(ValueError, match="--topk-ratio 2.0 must be in"):
        parse_args(tiny + ["--dp-gradient-reducer", "topk", "--topk-ratio", "2"], world_size=1)
    with pytest.raises(ValueError, match="--qsgd-levels 0 must be in"):
        parse_args(tiny + ["--dp-gradient-reducer", "qsgd", "--qsgd-levels", "0"], world_size=1)
    with pytest.raises(ValueError, match="choose one"):
        parse_args(tiny + ["--dp-gradient-reducer", "qsgd", "--use-distributed-optimizer"],
                   world_size=1)
