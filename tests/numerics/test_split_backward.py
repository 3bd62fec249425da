"""Split backward (input gradient now, weight gradients later) equals one full backward.

On GPT chunks (a middle stage, a first stage with the embedding, a last stage with the loss) and
on a linear + GeLU stack, in float64: the input gradient and every weight gradient of the two halves
match a full backward to 1e-13 relative (the same operations on the same operands; only the order in
which several contributions to one parameter are summed may differ). The input half computes no
weight gradient at all.
"""

from __future__ import annotations

import pytest
import torch

from megatron.core.config import ModelConfig, RecomputeConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.execution.split_backward import (TrainableParameters,
                                                                      backward_input,
                                                                      backward_weight,
                                                                      input_half_boundary)

SEQ, BATCH, HIDDEN = 8, 2, 16


def gpt_chunk(pre_process: bool, post_process: bool) -> GPTModel:
    config = ModelConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, seq_length=SEQ,
                         max_position_embeddings=SEQ, padded_vocab_size=32, hidden_dropout=0.1,
                         attention_dropout=0.1)
    return GPTModel(config, RecomputeConfig(), ParallelState.single_process(), 1234,
                    layer_range=range(0, 2), pre_process=pre_process, post_process=post_process,
                    params_dtype=torch.float64)


def run_chunk(chunk, pre_process: bool, post_process: bool):
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 32, (BATCH, SEQ), generator=generator)
    hidden = None
    if not pre_process:
        hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=generator, dtype=torch.float64,
                             requires_grad=True)
    output = chunk(tokens if pre_process else hidden, tokens if post_process else None)
    if post_process:
        output = output.mean()
        grad = None
    else:
        grad = torch.randn(output.shape, generator=generator, dtype=torch.float64)
    return hidden, output, grad


def assert_close(actual, expected, what):
    scale = expected.abs().max().item() + 1e-30
    assert (actual - expected).abs().max().item() <= 1e-13 * scale, what


@pytest.mark.parametrize("pre_process,post_process", [(False, False), (True, False),
                                                       (False, True)],
                         ids=["middle", "first", "last"])
@pytest.mark.parametrize("prepared", [False, True], ids=["plain", "prepared"])
def test_two_halves_equal_one_full_backward_on_gpt_chunks(pre_process, post_process, prepared):
    reference = gpt_chunk(pre_process, post_process)
    hidden, output, grad = run_chunk(reference, pre_process, post_process)
    output.backward(grad)
    split = gpt_chunk(pre_process, post_process)
    split_hidden, split_output, split_grad = run_chunk(split, pre_process, post_process)
    params = list(split.parameters())
    if prepared:  # as the interpreter calls it: parameters and graph walk resolved beforehand
        trainable = TrainableParameters.of(params)
        input_grad, deferred = backward_input(
            split_output, split_grad, split_hidden, trainable,
            input_half_boundary(split_output, split_hidden, trainable))
    else:
        input_grad, deferred = backward_input(split_output, split_grad, split_hidden, params)
    # The input half leaves every weight gradient for later.
    assert all(p.grad is None for p in split.parameters())
    if hidden is not None:
        assert_close(input_grad, hidden.grad, "input gradient")
    backward_weight(deferred)
    for (name, want), got in zip(reference.named_parameters(), split.parameters()):
        assert got.grad is not None, name
        assert_close(got.grad, want.grad, name)


def test_two_halves_accumulate_into_existing_gradients_on_a_linear_gelu_stack():
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8),
                                 torch.nn.GELU()).double()
    reference = torch.nn.Sequential(*[layer for layer in layers]).double()
    inputs = [torch.randn(4, 8, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    grads = [torch.randn(4, 8, dtype=torch.float64) for _ in range(2)]
    expected_input_grads = []
    for x, g in zip(inputs, grads):  # full backward, two micro-batches accumulated
        x_copy = x.detach().clone().requires_grad_(True)
        reference(x_copy).backward(g)
        expected_input_grads.append(x_copy.grad)
    expected = [p.grad.clone() for p in reference.parameters()]
    for p in reference.parameters():
        p.grad = None
    deferred_list = []
    for x, g, want in zip(inputs, grads, expected_input_grads):  # both input halves first
        input_grad, deferred = backward_input(layers(x), g, x, list(layers.parameters()))
        assert_close(input_grad, want, "input gradient")
        deferred_list.append(deferred)
    for deferred in deferred_list:  # then the weight halves, in order
        backward_weight(deferred)
    for got, want in zip(layers.parameters(), expected):
        assert_close(got.grad, want, "weight gradient")
