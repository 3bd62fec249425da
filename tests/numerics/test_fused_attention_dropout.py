"""Fused attention dropout (the default): Megatron's semantics, reproducible, RNG-neutral.

The layout-invariant masks (``--layout-invariant-attention-dropout``) are covered by test_model.py
and the layout-equivalence tests; here the default path: ``scaled_dot_product_attention`` with
``dropout_p``, its stream seeded per (layer, TP rank, micro-batch's first sample).
"""

import pytest
import torch

from megatron.core.config import RecomputeConfig
from megatron.core.tensor_parallel.random import attention_dropout_seed

from test_model import build, loss_and_grads, make_batch, make_config


def fused_config(**overrides):
    return make_config(hidden_dropout=0.0, layout_invariant_attention_dropout=False, **overrides)


def test_fused_dropout_drops_and_is_reproducible():
    tokens, labels = make_batch()
    model = build(fused_config())
    first, grads = loss_and_grads(model, tokens, labels)
    again, grads_again = loss_and_grads(model, tokens, labels)
    assert torch.equal(first, again)  # same micro-batch, same masks
    assert all(torch.equal(grads[name], grads_again[name]) for name in grads)
    model.eval()
    without = model(tokens, labels)
    assert not torch.allclose(first, without)  # dropout did something in training mode
    model.train()
    other_samples, _ = loss_and_grads(model, tokens, labels, sample_ids=torch.arange(3) + 3)
    assert not torch.allclose(first, other_samples)  # another micro-batch draws other masks


def test_fused_dropout_differs_from_layout_invariant_masks():
    tokens, labels = make_batch()
    fused = build(fused_config())(tokens, labels)
    invariant = build(make_config(hidden_dropout=0.0,
                                  layout_invariant_attention_dropout=True))(tokens, labels)
    assert not torch.allclose(fused, invariant)


@pytest.mark.parametrize("recompute", [
    RecomputeConfig(recompute_granularity="selective"),
    RecomputeConfig(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=1)], ids=["selective", "full"])
def test_recomputation_redraws_the_same_fused_masks(recompute):
    tokens, labels = make_batch()
    loss, grads = loss_and_grads(build(fused_config()), tokens, labels)
    recomputed_loss, recomputed_grads = loss_and_grads(build(fused_config(), recompute), tokens,
                                                       labels)
    assert torch.equal(recomputed_loss, loss)
    for name, grad in grads.items():
        assert torch.equal(recomputed_grads[name], grad), name


def test_global_rng_state_is_untouched():
    tokens, labels = make_batch()
    model = build(fused_config())
    torch.manual_seed(7)
    state = torch.get_rng_state()
    model(tokens, labels).sum().backward()
    assert torch.equal(torch.get_rng_state(), state)


def test_streams_differ_per_tensor_parallel_rank_layer_and_microbatch():
    base = attention_dropout_seed(1234, 1, 0, 0)
    assert len({base, attention_dropout_seed(1234, 1, 1, 0), attention_dropout_seed(1234, 2, 0, 0),
                attention_dropout_seed(1234, 1, 0, 4)}) == 4
    assert attention_dropout_seed(1234, 1, 0, 0) == base  # a pure function: no state to save
