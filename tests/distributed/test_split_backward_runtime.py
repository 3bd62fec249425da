"""The runtime executes split backward ops (I: input gradient, W: weight gradients) exactly.

A schedule family defined here, 1F1B with every backward split and all weight halves deferred to the
end of the iteration, runs on PP 2 and TP 2 x PP 2: loss, gradient norm and every gradient equal the
single-process model's (float64, dropout on, 1e-9 relative), and the stored activations stay
counted until the weight half releases them.
"""

from __future__ import annotations

import pytest

from dist_harness import run_distributed
from pipeline_reference import merge_copies, train_one_step
from megatron.core.pipeline_parallel.planning.instructions import Instruction, Kind
from megatron.core.pipeline_parallel.planning.plan import make_plan
from megatron.core.pipeline_parallel.planning.schedules import BUILTIN_SCHEDULES, ScheduleFamily
from megatron.core.pipeline_parallel.planning.schedules.layout import single_pipeline_layout
from megatron.core.pipeline_parallel.planning.schedules.one_f_one_b import build_one_f_one_b
from megatron.core.pipeline_parallel.planning.simulator import simulate_plan
from megatron.core.runtimes import PipelineRuntime

BATCH_N4 = "--micro-batch-size 2 --global-batch-size 8"


def build_split_1f1b(pipeline_size: int, num_microbatches: int):
    """1F1B with each backward's input half in place and every weight half at the end."""
    schedule = []
    for ops in build_one_f_one_b(pipeline_size, num_microbatches):
        split = [Instruction(Kind.BACKWARD_INPUT, op.pipeline, op.stage, op.microbatch, op.chunk)
                 if op.kind is Kind.BACKWARD else op for op in ops]
        split += [Instruction(Kind.BACKWARD_WEIGHT, op.pipeline, op.stage, op.microbatch,
                              op.chunk) for op in ops if op.kind is Kind.BACKWARD]
        schedule.append(split)
    return schedule


SPLIT_1F1B = ScheduleFamily(
    name="split-1f1b", description="1F1B, weight gradients deferred to the end (test only)",
    build=build_split_1f1b,
    layout=lambda pipeline_size: single_pipeline_layout("split-1f1b", pipeline_size))


class SplitRuntime(PipelineRuntime):
    registry = BUILTIN_SCHEDULES.with_family(SPLIT_1F1B)


def _rank(rank: int, world_size: int, argv: list[str]) -> dict:
    return train_one_step(rank, world_size, argv, runtime_class=SplitRuntime,
                          pipeline_schedule="split-1f1b")


def test_deferred_weight_work_keeps_activations_stored_in_the_simulation():
    plan = make_plan("split-1f1b", 2, 4, registry=SplitRuntime.registry)
    assert simulate_plan(plan).peak_activations == [4, 4]  # all released by the final W ops


@pytest.mark.parametrize("layout,world_size", [("", 2), ("--tensor-model-parallel-size 2", 4)],
                         ids=["pp2", "tp2xpp2"])
def test_split_backward_reproduces_the_single_process_gradients(layout, world_size):
    expected = train_one_step(0, 1, BATCH_N4.split())
    argv = f"{BATCH_N4} --pipeline-model-parallel-size 2 {layout}".split()
    results = run_distributed(_rank, world_size, argv, timeout=240)
    for result in results:
        if result["loss"] is not None:
            assert result["loss"] == pytest.approx(expected["loss"], rel=1e-6)
        assert result["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-9)
        assert result["peak_stored"] == 4  # every micro-batch stays stored until its W
    for field in ("grads", "params"):
        reference = {name: value for (_, name), value in expected[field].items()}
        for name, copies in merge_copies(results, field).items():
            scale = reference[name].abs().max().item() + 1e-30
            for value in copies:
                assert (value - reference[name]).abs().max().item() / scale < 1e-9, (field, name)
