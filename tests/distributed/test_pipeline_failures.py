"""Failures explain themselves instead of hanging: a rank that dies mid-run makes its pipeline peers
raise within the collective timeout, and a schedule error names the failing step."""

import os

import pytest
import torch

from dist_harness import run_distributed
from pipeline_reference import train_one_step

CHIMERA = "--pipeline-model-parallel-size 2 --pipeline-schedule chimera --micro-batch-size 2 " \
          "--global-batch-size 8"


def _rank_one_dies_mid_iteration(rank, world_size, argv):
    if rank == 1:
        import pretrain_gpt
        forward_step = pretrain_gpt.forward_step
        calls = []

        def dying_forward_step(microbatch, model):
            calls.append(1)
            if len(calls) == 2:
                os._exit(3)  # a lost rank: no exception, no goodbye
            return forward_step(microbatch, model)

        pretrain_gpt.forward_step = dying_forward_step
    return train_one_step(rank, world_size, argv)


def test_a_dead_rank_makes_its_peer_raise_not_hang():
    with pytest.raises(AssertionError) as failure:
        run_distributed(_rank_one_dies_mid_iteration, 2, CHIMERA.split(), timeout=60)
    message = str(failure.value)
    assert "rank 1 died with exit code 3" in message
    assert "--- rank 0 ---" in message, message  # rank 0 raised on its own ...
    assert "pipeline rank failed at step" in message  # ... inside the schedule, step named ...
    assert "did not finish" not in message, message  # ... and did not have to be killed


def test_interpreter_error_prints_the_grid_with_the_failing_step():
    from megatron.core.pipeline_parallel.execution.interpreter import (ExecutionContext, Interpreter,
                                                             PipelineExecutionError)
    from megatron.core.pipeline_parallel.planning.lowering import lower_schedule
    from megatron.core.pipeline_parallel.planning.schedules import build_schedule, schedule_layout

    layout = schedule_layout("chimera", 2)
    lowered = lower_schedule(build_schedule("chimera", 2, 2), layout)
    context = ExecutionContext(chunks={}, layout=layout, transport=None, forward_step_func=None,
                               microbatches=[], loss_divisor=2, activation_shape=(1, 1, 1),
                               wire_dtype=torch.float32)
    with pytest.raises(PipelineExecutionError) as failure:
        Interpreter(context).run(lowered, rank=1)
    message = str(failure.value)
    assert "pipeline rank failed at step 0" in message
    assert f">{lowered[1][0]}<" in message  # the failing step is marked in the grid
