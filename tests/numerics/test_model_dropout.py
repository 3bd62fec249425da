"""Counter-based dropout masks: pure functions of (seed, layer, site, sample, full coordinates)."""

import pytest
import torch

from megatron.core.tensor_parallel.random import CounterBasedDropout, mix32


def python_mix32(value):
    """The published hash with plain python modular arithmetic (no 2**63 concerns)."""
    value ^= value >> 16
    value = (value * 0x21F0AAAD) % 2 ** 32
    value ^= value >> 15
    value = (value * 0x735A2D97) % 2 ** 32
    return value ^ (value >> 15)


def python_bits(seed, layer, site, sample_id, flat_index, full_numel):
    """The documented recipe, element by element, with python integers (independent of torch)."""
    mix = python_mix32
    state = mix(mix(mix(0x9E3779B9) ^ (seed % 2 ** 32)) ^ (seed >> 32))
    state = mix(mix(state ^ layer) ^ site)
    first = mix(mix(state ^ (sample_id % 2 ** 32)) ^ (sample_id >> 32))
    second = mix(first ^ 0x68E31DA4)
    bits = mix((flat_index % 2 ** 32) ^ first)
    if full_numel > 2 ** 32:
        bits = mix(bits ^ (flat_index >> 32))
    return mix(bits ^ second)


def test_mix32_matches_plain_modular_arithmetic():
    values = [0, 1, 2, 0xFFFFFFFF, 0x80000000, 123456789, 2 ** 31 - 1, 987654321]
    tensor = mix32(torch.tensor(values, dtype=torch.int64))
    assert tensor.tolist() == [python_mix32(v) for v in values]
    assert [mix32(v) for v in values] == [python_mix32(v) for v in values]
    assert int(tensor.max()) < 2 ** 32 and int(tensor.min()) >= 0


def test_bits_follow_the_documented_formula():
    dropout = CounterBasedDropout(seed=2 ** 40 + 17)
    sample_ids = torch.tensor([0, 5, 2 ** 33 + 1])
    bits = dropout.random_bits(3, 1, sample_ids, full_shape=(4, 5, 6), offsets=(2, 1, 0),
                               shape=(2, 3, 6))
    assert bits.shape == (3, 2, 3, 6)
    for b, sample in enumerate(sample_ids.tolist()):
        for i in range(2):
            for j in range(3):
                for k in range(6):
                    flat = ((2 + i) * 5 + (1 + j)) * 6 + k
                    assert bits[b, i, j, k].item() == python_bits(
                        2 ** 40 + 17, 3, 1, sample, flat, 4 * 5 * 6)


def test_masks_are_deterministic_and_have_the_right_rate():
    dropout = CounterBasedDropout(seed=99)
    sample_ids = torch.arange(16)
    for probability in (0.1, 0.5):
        mask = dropout.keep_mask(probability, 1, 2, sample_ids, (64, 1024))
        assert torch.equal(mask, dropout.keep_mask(probability, 1, 2, sample_ids, (64, 1024)))
        drop_rate = 1 - mask.double().mean().item()
        # 2^20 Bernoulli draws: standard deviation <= 0.0005, allow 5 of them
        assert abs(drop_rate - probability) < 0.0025, (probability, drop_rate)
    assert bool(dropout.keep_mask(0.0, 1, 2, sample_ids, (8,)).all())
    assert not bool(dropout.keep_mask(1.0, 1, 2, sample_ids, (8,)).any())


@pytest.mark.parametrize("change", ["seed", "layer", "site", "sample"])
def test_masks_differ_between_keys(change):
    probability = 0.5
    base = dict(seed=7, layer=1, site=1, sample=3)
    other = dict(base, **{change: base[change] + 1})

    def mask(key):
        return CounterBasedDropout(key["seed"]).keep_mask(
            probability, key["layer"], key["site"], torch.tensor([key["sample"]]), (256, 256))

    agreement = (mask(base) == mask(other)).double().mean().item()
    assert abs(agreement - 0.5) < 0.01  # independent masks agree half the time


def test_tensor_parallel_slice_equals_full_mask_slice():
    dropout = CounterBasedDropout(seed=5)
    sample_ids = torch.tensor([11, 12])
    heads, seq = 8, 16
    full = dropout.keep_mask(0.1, 4, 1, sample_ids, (heads, seq, seq))
    for tp_size in (2, 4):
        per_rank = heads // tp_size
        for rank in range(tp_size):
            shard = dropout.keep_mask(0.1, 4, 1, sample_ids, (heads, seq, seq),
                                      offsets=(rank * per_rank, 0, 0), shape=(per_rank, seq, seq))
            assert torch.equal(shard, full[:, rank * per_rank:(rank + 1) * per_rank])
    # a sample's mask does not depend on which other samples share the micro-batch
    alone = dropout.keep_mask(0.1, 4, 1, sample_ids[1:], (heads, seq, seq))
    assert torch.equal(alone[0], full[1])


def test_apply_scales_kept_values_and_has_gradient():
    dropout = CounterBasedDropout(seed=1)
    x = torch.ones(4, 10, 20, dtype=torch.float64, requires_grad=True)
    y = dropout.apply(x, 0.2, 1, 0, torch.arange(4))
    kept = y != 0
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1.25))
    y.sum().backward()
    torch.testing.assert_close(x.grad, kept.double() * 1.25)
    hidden = torch.ones(10, 4, 20)  # [s, b, h]: the mask is laid out per sample
    torch.testing.assert_close(dropout.apply_to_hidden(hidden, 0.2, 1, 0, torch.arange(4)),
                               y.detach().float().transpose(0, 1))


def test_bad_inputs_are_rejected():
    dropout = CounterBasedDropout(seed=1)
    with pytest.raises(ValueError, match="probability"):
        dropout.keep_mask(1.5, 1, 0, torch.arange(2), (4,))
    with pytest.raises(ValueError, match="outside"):
        dropout.keep_mask(0.1, 1, 0, torch.arange(2), (4,), offsets=(2,), shape=(4,))
    with pytest.raises(ValueError, match="non-negative"):
        dropout.keep_mask(0.1, 1, 0, torch.tensor([-1]), (4,))


def test_full_tensors_beyond_two_to_the_32_elements_use_the_high_index_word():
    dropout = CounterBasedDropout(seed=3)
    full_shape = (2 ** 17, 2 ** 16)  # 2**33 elements per sample: only a block is materialised
    offsets, shape = (2 ** 16 + 5, 100), (2, 3)
    bits = dropout.random_bits(2, 1, torch.tensor([9]), full_shape, offsets, shape)
    for i in range(2):
        for j in range(3):
            flat = (offsets[0] + i) * full_shape[1] + offsets[1] + j
            assert flat >= 2 ** 32
            assert bits[0, i, j].item() == python_bits(3, 2, 1, 9, flat, 2 ** 33)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="hardware-gated: CPU/CUDA bit identity needs a CUDA device")
def test_cuda_bits_equal_cpu_bits():
    dropout = CounterBasedDropout(seed=2 ** 35 + 3)
    sample_ids = torch.tensor([0, 17, 2 ** 34])
    cpu = dropout.random_bits(5, 1, sample_ids, (8, 64, 64), (2, 0, 0), (4, 64, 64))
    cuda = dropout.random_bits(5, 1, sample_ids.cuda(), (8, 64, 64), (2, 0, 0), (4, 64, 64))
    assert torch.equal(cuda.cpu(), cpu)
