"""--log-params-norm and --log-num-zeros-in-grad: Megatron's 'num zeros' and 'params norm' fields
in the iteration line, checked against the model's own tensors."""

import math
import pytest
import torch

import pretrain_gpt
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.parallel_state import ParallelState
from megatron.training.arguments import parse_args
from megatron.training.logging_utils import format_iteration_line
from megatron.training.model_statistics import num_zeros_in_grads, params_norm
from megatron.training.training import pretrain

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 64 --mock-data --seed 1234 --lr 1e-3 "
        "--micro-batch-size 2 --global-batch-size 4 --log-interval 1 --eval-iters 0 --train-iters 2")


def _field(line: str, name: str) -> float:
    return float(line.split(f" {name}: ")[1].split(" |")[0])


def test_params_norm_and_zero_gradients_in_the_log_line():
    config = parse_args((TINY + " --log-params-norm --log-num-zeros-in-grad").split(),
                        world_size=1)
    lines = []
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=ParallelState.single_process(),
                      log=lines.append)
    last = [line for line in lines if "iteration        2/" in line][0]
    params = [p for chunk in result.components.model_chunks for p in chunk.parameters()]
    expected_norm = math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in params))
    expected_zeros = sum(int((p.grad == 0).sum()) for p in params if p.grad is not None)
    assert _field(last, "params norm") == pytest.approx(expected_norm, abs=1e-3)
    assert _field(last, "num zeros") == expected_zeros
    assert last.index(" grad norm:") < last.index(" num zeros:") < last.index(" params norm:")


def test_fields_are_absent_without_the_flags():
    line = format_iteration_line(iteration=1, train_iters=2, consumed_samples=4, elapsed_ms=1.0,
                                 throughput_tflops=None, learning_rate=1e-3, global_batch_size=4,
                                 losses={"lm loss": 1.0}, loss_scale=1.0, grad_norm=1.0,
                                 skipped_iterations=0, nan_iterations=0)
    assert "params norm" not in line and "num zeros" not in line


def test_statistics_count_only_the_parameters_this_rank_owns():
    """Zeros and norm follow the optimizer's ownership predicate (a replicated parameter counts on
    one tensor-parallel rank only)."""
    owned = torch.nn.Parameter(torch.tensor([3.0, 0.0, 4.0]))
    owned.grad = torch.tensor([0.0, 1.0, 0.0])
    duplicate = torch.nn.Parameter(torch.tensor([100.0]))
    duplicate.grad = torch.tensor([0.0])
    state = ParallelState.single_process()
    optimizer = MegatronOptimizer(torch.optim.SGD([owned, duplicate], lr=0.1), [owned, duplicate],
                                  state, owns_grad_norm=lambda param: param is owned)
    assert params_norm(optimizer, state) == pytest.approx(5.0)
    assert num_zeros_in_grads(optimizer, state) == 2
