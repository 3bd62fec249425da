"""The seams hold: a schedule family and a model defined here, in the test, run everywhere.

1. A toy schedule family (GPipe run on each half of the micro-batches in turn; the validator
   requires micro-batch order within a stage, so a reversed GPipe is refused) is registered from inside
   this test with ``BUILTIN_SCHEDULES.with_family`` and, passed as ``registry=``, is chosen with
   ``--pipeline-schedule two-wave-gpipe`` by ``parse_args``, goes through planning (validation and
   lowering), simulation, the viewer, the performance model (closed form from its record equal to
   the simulated plan; launch flags that parse), the distributed runtime on 2 ranks, where one GPT
   training step matches the single-process model (1e-9 relative, float64), and ``pretrain`` with
   checkpointing: a run saved and resumed equals the straight run bitwise, and the checkpoint
   converts to one stage. No project file knows the family.
2. A model that is not a GPT (linear + GeLU blocks with a squared-error loss of its own) implements
   the stage contract and runs under 1F1B and Chimera on 2 ranks; every gradient of every copy
   equals its single-process gradient (1e-12 relative, float64: only summation order differs).
3. The same model trains through ``pretrain`` with a ``ModelSpec`` of its own: its own config
   section (``--num-layers``, ``--stack-width``; GPT's flags are unknown to it), loss key, samples
   and collation; the reported loss and every gradient equal the single-process ones.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from dataclasses import dataclass
from typing import ClassVar, Optional

import pytest
import torch

import pretrain_gpt
from dist_harness import run_distributed
from megatron.core.config import option
from pipeline_reference import merge_copies, train_one_step
from megatron.core.parallel_state import ParallelState, RankLayout, create_parallel_state
from megatron.core.pipeline_parallel.planning.instructions import backward, forward
from megatron.core.pipeline_parallel.planning.plan import make_plan
from megatron.core.pipeline_parallel.planning.schedules import BUILTIN_SCHEDULES, ScheduleFamily
from megatron.core.pipeline_parallel.planning.schedules.layout import single_pipeline_layout
from megatron.core.pipeline_parallel.planning.simulator import simulate_plan
from megatron.core.runtimes import PipelineRuntime
from megatron.performance_model import HardwareSpec, ModelSpec, evaluate, launch_flags
from megatron.training.arguments import parse_args
from megatron.training.checkpoint_conversion import TargetLayout, convert_checkpoint
from megatron.training.checkpointing import METADATA_FILENAME, Checkpointer, read_tracker
from megatron.training.model_spec import ModelSpec as TrainingModelSpec
from megatron.training.training import pretrain

BATCH_N4 = "--micro-batch-size 2 --global-batch-size 8"


def build_two_wave_gpipe(pipeline_size: int, num_microbatches: int):
    """GPipe on micro-batches 0 .. N/2 - 1 (forwards, then backwards), then on the rest."""
    half = (num_microbatches + 1) // 2
    waves = (range(0, half), range(half, num_microbatches))
    return [[op for wave in waves for op in ([forward(0, rank, m) for m in wave]
                                            + [backward(0, rank, m) for m in wave])]
            for rank in range(pipeline_size)]


def check_two_wave_gpipe(pipeline_size: int, num_microbatches: int) -> None:
    if num_microbatches < 2:
        raise ValueError(f"two-wave-gpipe needs at least 2 micro-batches (one per wave), got "
                         f"{num_microbatches}")


TWO_WAVE_GPIPE = ScheduleFamily(
    name="two-wave-gpipe", description="GPipe on each half of the micro-batches (test only)",
    build=build_two_wave_gpipe, check=check_two_wave_gpipe,
    layout=lambda pipeline_size: single_pipeline_layout("two-wave-gpipe", pipeline_size),
    # Two GPipe waves of ceil(N/2) and floor(N/2): each fills and drains D - 1 slots.
    critical_path=lambda pipeline_size, num_microbatches: (
        (num_microbatches + 2 * (pipeline_size - 1),) * 2))
REGISTRY = BUILTIN_SCHEDULES.with_family(TWO_WAVE_GPIPE)

GPT_FLAGS = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
             "--max-position-embeddings 16 --vocab-size 64 --mock-data --lr 1e-3 "
             "--micro-batch-size 1 --global-batch-size 4 --eval-iters 0")


def test_toy_family_is_a_command_line_choice():
    argv = (GPT_FLAGS + " --train-iters 1 --pipeline-model-parallel-size 2 "
            "--pipeline-schedule two-wave-gpipe").split()
    config = parse_args(argv, world_size=2, registry=REGISTRY)
    assert config.parallel.pipeline_schedule == "two-wave-gpipe"
    with pytest.raises(SystemExit):  # the built-in registry does not know it
        parse_args(argv, world_size=2)
    # The family's own check runs in validation (1 micro-batch: one wave would be empty).
    with pytest.raises(ValueError, match="two-wave-gpipe needs at least 2 micro-batches"):
        parse_args(argv + ["--global-batch-size", "1"], world_size=2, registry=REGISTRY)


def test_toy_family_is_modelled():
    model = ModelSpec(8, 64, 4, 32, 512)
    free_links = HardwareSpec(1e12, 0.0, 0.0, 16e9)
    estimate = evaluate(model, free_links, "two-wave-gpipe", 1, 4, 1, 6, "none",
                        registry=REGISTRY)
    work = estimate.costs.forward + estimate.costs.backward
    assert estimate.closed_form_time == pytest.approx((6 + 2 * 3) * work)
    assert estimate.simulated_time == pytest.approx(estimate.closed_form_time)
    with pytest.raises(ValueError, match="unknown scheme 'two-wave-gpipe'"):
        evaluate(model, free_links, "two-wave-gpipe", 1, 4, 1, 6, "none")
    argv = launch_flags(estimate, registry=REGISTRY).split() + [
        "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--mock-data", "--vocab-size", "512", "--train-iters", "1",
        "--lr", "1e-4"]
    config = parse_args(argv, world_size=4, registry=REGISTRY)
    assert config.parallel.pipeline_schedule == "two-wave-gpipe"


def test_toy_family_plans_and_simulates():
    assert "two-wave-gpipe" not in BUILTIN_SCHEDULES.names  # the built-in registry is unchanged
    plan = make_plan("two-wave-gpipe", 4, 6, registry=REGISTRY)
    assert plan.schedule[0][3] == backward(0, 0, 0)
    # Two GPipe waves of 3 micro-batches: 2 x (D - 1 + 3) (F + B) with F = 1, B = 2.
    assert simulate_plan(plan).makespan == 2 * (4 - 1 + 3) * 3
    assert simulate_plan(make_plan("gpipe", 4, 6)).makespan == (4 - 1 + 6) * 3
    with pytest.raises(ValueError, match="unknown pipeline schedule 'two-wave-gpipe'"):
        make_plan("two-wave-gpipe", 4, 6)


def load_viewer():
    """tools/show_schedule.py as a module."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "show_schedule.py")
    spec = importlib.util.spec_from_file_location("show_schedule", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_toy_family_in_the_viewer(capsys):
    show_schedule = load_viewer()
    assert show_schedule.main(["--schedule", "two-wave-gpipe", "--pipeline-model-parallel-size",
                               "2", "--num-microbatches", "3"], registry=REGISTRY) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[1].split()[1:4] == ["F0", "F1", "."]
    assert "makespan" in text


def _toy_family_rank(rank: int, world_size: int, argv: list[str]) -> dict:
    return train_one_step(rank, world_size, argv, registry=REGISTRY)


def test_toy_family_runs_distributed_with_exact_numerics():
    expected = train_one_step(0, 1, BATCH_N4.split())
    argv = (BATCH_N4 + " --pipeline-model-parallel-size 2 "
            "--pipeline-schedule two-wave-gpipe").split()
    results = run_distributed(_toy_family_rank, 2, argv, timeout=240)
    for result in results:
        if result["loss"] is not None:
            assert result["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    reference = {name: value for (_, name), value in expected["grads"].items()}
    for name, copies in merge_copies(results, "grads").items():
        scale = reference[name].abs().max().item() + 1e-30
        for value in copies:
            assert (value - reference[name]).abs().max().item() / scale < 1e-9, name


def _toy_family_pretrain(argv: str, world_size: int):
    config = parse_args(argv.split(), world_size=world_size, registry=REGISTRY)
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, registry=REGISTRY, log=lambda _: None,
                      checkpointing=Checkpointer(config, log=lambda _: None))
    assert result.components.runtime.registry is REGISTRY
    records = [(r.iteration, r.losses["lm loss"], r.grad_norm) for r in result.history]
    params = {name: value.numpy().copy()  # numpy: picklable across the harness pipe
              for name, value in result.components.model_chunks[0].state_dict().items()}
    return records, params


def _toy_family_resume(rank: int, world_size: int, argv: str, save_dir: str):
    straight = _toy_family_pretrain(argv, world_size)
    first = _toy_family_pretrain(f"{argv} --save {save_dir} --exit-interval 2", world_size)
    second = _toy_family_pretrain(f"{argv} --load {save_dir}", world_size)
    return straight, first, second


def test_toy_family_trains_checkpoints_and_resumes_through_pretrain(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    argv = (GPT_FLAGS + " --train-iters 4 --pipeline-model-parallel-size 2 "
            "--pipeline-schedule two-wave-gpipe --distributed-timeout-minutes 1")
    results = run_distributed(_toy_family_resume, 2, argv, save_dir, timeout=300)
    assert read_tracker(save_dir) == 2
    for straight, first, second in results:
        assert first[0] + second[0] == straight[0]  # bitwise: same floats
        assert second[1].keys() == straight[1].keys()
        for name, value in straight[1].items():
            assert (second[1][name] == value).all(), name
    last_stage_losses = [record[1] for record in results[1][0][0]]
    assert all(loss is not None for loss in last_stage_losses)
    with open(os.path.join(save_dir, "iter_0000002", METADATA_FILENAME)) as handle:
        assert json.load(handle)["layout"]["pipeline_schedule"] == "two-wave-gpipe"
    # The checkpoint's layout names the toy family; conversion reads it through the registry.
    written = convert_checkpoint(save_dir, str(tmp_path / "one_stage"), TargetLayout(),
                                 log=lambda _: None, registry=REGISTRY)
    assert os.path.isdir(written)


# ------------------------------------------------------------------------------- a non-GPT model

WIDTH, NUM_LAYERS, MICRO_BATCH, NUM_MICROBATCHES = 8, 4, 2, 4


class LinearGeluStack(torch.nn.Module):
    """``layer_range`` of a stack of Linear + GeLU blocks; the last stage returns the per-sample
    squared error against the target. Weights depend only on the global layer index."""

    def __init__(self, layer_range: range, pre_process: bool, post_process: bool,
                 width: int = WIDTH):
        super().__init__()
        self.layer_indices = list(layer_range)
        self.pre_process, self.post_process = pre_process, post_process
        self.blocks = torch.nn.ModuleList()
        for index in self.layer_indices:
            block = torch.nn.Linear(width, width, dtype=torch.float64)
            generator = torch.Generator().manual_seed(1000 + index)
            with torch.no_grad():
                block.weight.copy_(torch.randn(width, width, generator=generator,
                                               dtype=torch.float64) / math.sqrt(width))
                block.bias.copy_(torch.randn(width, generator=generator, dtype=torch.float64))
            self.blocks.append(block)
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def input_activation_shape(self, microbatch: dict) -> tuple:
        return tuple(microbatch["x"].shape)

    def forward(self, x, target):
        hidden = x if self.pre_process else self.input_tensor
        for block in self.blocks:
            hidden = torch.nn.functional.gelu(block(hidden))
        if self.post_process:
            return ((hidden - target) ** 2).sum(dim=1)
        return hidden


def stack_provider(config, parallel_state, *, pre_process=True, post_process=True,
                   layer_range=None):
    if config is None:  # the single-process reference
        return LinearGeluStack(layer_range or range(NUM_LAYERS), pre_process, post_process)
    return LinearGeluStack(layer_range or range(config.model.num_layers), pre_process,
                           post_process, width=config.model.stack_width)


def stack_forward_step(microbatch: dict, model):
    output = model(microbatch["x"], microbatch["target"])
    return output, lambda out: (out.mean(), {"loss": out.mean().detach()})


def stack_samples(count: int) -> list[dict]:
    """``count`` samples ``{"x", "target"}``, drawn a micro-batch of them at a time."""
    generator = torch.Generator().manual_seed(7)
    samples = []
    while len(samples) < count:
        x = torch.randn(MICRO_BATCH, WIDTH, generator=generator, dtype=torch.float64)
        target = torch.randn(MICRO_BATCH, WIDTH, generator=generator, dtype=torch.float64)
        samples += [{"x": x[row], "target": target[row]} for row in range(MICRO_BATCH)]
    return samples[:count]


def stack_batch(samples, sample_ids, device) -> dict:
    """The stack's micro-batch: its samples' rows stacked."""
    return {key: torch.stack([sample[key] for sample in samples]).to(device)
            for key in ("x", "target")}


def stack_microbatches() -> list[dict]:
    samples = stack_samples(MICRO_BATCH * NUM_MICROBATCHES)
    return [stack_batch(samples[k * MICRO_BATCH:(k + 1) * MICRO_BATCH], None, "cpu")
            for k in range(NUM_MICROBATCHES)]


def stack_config(schedule_flags: str, world_size: int):
    """The stack's config (its own flags, see STACK_SPEC below) with the schedule flags."""
    return parse_args(f"{STACK_FLAGS} {schedule_flags}".split(), world_size=world_size,
                      model_spec=STACK_SPEC)


def stack_gradients_by_layer(model_chunks) -> dict:
    grads = {}
    for chunk in model_chunks:
        for index, block in zip(chunk.layer_indices, chunk.blocks):
            grads.setdefault(index, []).append(torch.cat([block.weight.grad.flatten(),
                                                          block.bias.grad]))
    return grads


def _stack_rank(rank: int, world_size: int, schedule_flags: str) -> dict:
    config = stack_config(schedule_flags, world_size)
    layout = RankLayout.from_world_size(world_size, 1, 2)
    state = create_parallel_state(layout, rank, "gloo",
                                  extra_group_ranks=PipelineRuntime.required_group_ranks(config,
                                                                                         layout))
    runtime = PipelineRuntime(config, state, torch.device("cpu"))
    chunks = runtime.build_model_chunks(stack_provider)
    reducers = runtime.build_gradient_reducers(chunks)
    runtime.forward_backward(forward_step_func=stack_forward_step, model_chunks=chunks,
                             microbatches=stack_microbatches(), scale_loss=lambda loss: loss,
                             gradient_reducers=reducers, forward_only=False)
    for reducer in reducers:
        reducer.wait()
    return stack_gradients_by_layer(chunks)


def single_process_stack_gradients() -> dict:
    model = stack_provider(None, ParallelState.single_process())
    microbatches = stack_microbatches()
    for microbatch in microbatches:
        output, loss_func = stack_forward_step(microbatch, model)
        (loss_func(output)[0] / len(microbatches)).backward()
    return {index: grads[0] for index, grads in stack_gradients_by_layer([model]).items()}


@pytest.mark.parametrize("schedule_flags", ["--pipeline-schedule 1f1b",
                                            "--pipeline-schedule chimera"])
def test_non_gpt_model_matches_single_process_gradients(schedule_flags):
    expected = single_process_stack_gradients()
    results = run_distributed(_stack_rank, 2, schedule_flags, timeout=120)
    seen = {}
    for result in results:
        for index, copies in result.items():
            seen[index] = seen.get(index, 0) + len(copies)
            for value in copies:
                error = (value - expected[index]).abs().max().item()
                assert error <= 1e-12 * expected[index].abs().max().item(), (index, error)
    copies_per_layer = 2 if "chimera" in schedule_flags else 1
    assert seen == {index: copies_per_layer for index in range(NUM_LAYERS)}


# ------------------------------------------------- the non-GPT model through pretrain, its own flags

@dataclass
class StackConfig:
    """The linear+GeLU stack's flags: its config section (``config.model``)."""

    num_layers: Optional[int] = option(None, "Number of Linear + GeLU blocks.")
    stack_width: int = option(WIDTH, "Width of every block.")
    tied_embeddings: ClassVar[bool] = False


def check_stack_flags(config, *_) -> None:
    model = config.model
    if model.num_layers is None or model.num_layers < 1:
        raise ValueError("--num-layers is required and must be >= 1")
    if model.stack_width != WIDTH:
        raise ValueError(f"--stack-width must be {WIDTH}: the test's samples have that width")


def stack_datasets(config, parallel_state, num_samples):
    return tuple(stack_samples(count) for count in num_samples)


STACK_SPEC = TrainingModelSpec(
    name="linear-gelu-stack", model_provider=stack_provider, forward_step=stack_forward_step,
    datasets_provider=stack_datasets, loss_keys=("loss",), config_section=StackConfig,
    validation_steps=(("model", check_stack_flags, ()),), batch_from_samples=stack_batch)

# Only the stack's flags and the generic ones (batch, optimizer, iterations, data source, pipeline).
STACK_FLAGS = (f"--num-layers {NUM_LAYERS} --stack-width {WIDTH} --micro-batch-size {MICRO_BATCH} "
               f"--global-batch-size {MICRO_BATCH * NUM_MICROBATCHES} --lr 1e-2 --clip-grad 0 "
               f"--train-iters 1 --eval-iters 0 --mock-data --pipeline-model-parallel-size 2")


def test_the_stack_spec_has_its_own_flags_only():
    config = parse_args(f"{STACK_FLAGS} --pipeline-schedule 1f1b".split(), world_size=2,
                        model_spec=STACK_SPEC)
    assert isinstance(config.model, StackConfig) and config.model.num_layers == NUM_LAYERS
    with pytest.raises(SystemExit):  # a GPT flag is unknown with the stack's spec
        parse_args(f"{STACK_FLAGS} --num-attention-heads 4".split(), world_size=2,
                   model_spec=STACK_SPEC)
    with pytest.raises(ValueError, match="--num-layers is required"):
        parse_args(STACK_FLAGS.replace(f"--num-layers {NUM_LAYERS} ", "").split(), world_size=2,
                   model_spec=STACK_SPEC)


def _stack_pretrain_rank(rank: int, world_size: int, schedule_flags: str) -> dict:
    config = parse_args(f"{STACK_FLAGS} {schedule_flags}".split(), world_size=world_size,
                        model_spec=STACK_SPEC)
    layout = RankLayout.from_world_size(world_size, 1, 2)
    state = create_parallel_state(layout, rank, "gloo",
                                  extra_group_ranks=PipelineRuntime.required_group_ranks(config,
                                                                                         layout))
    result = pretrain(config, STACK_SPEC, parallel_state=state, log=lambda _: None)
    (record,) = result.history
    # The optimizer does not touch .grad (no clipping): the reduced gradients of the iteration.
    return {"loss": record.losses["loss"],
            "grads": stack_gradients_by_layer(result.components.model_chunks)}


@pytest.mark.parametrize("schedule_flags", ["--pipeline-schedule 1f1b",
                                            "--pipeline-schedule chimera"])
def test_non_gpt_model_trains_through_pretrain(schedule_flags):
    expected = single_process_stack_gradients()
    model = stack_provider(None, ParallelState.single_process())
    expected_loss = sum(stack_forward_step(mb, model)[0].mean().item()
                        for mb in stack_microbatches()) / NUM_MICROBATCHES
    results = run_distributed(_stack_pretrain_rank, 2, schedule_flags, timeout=180)
    copies_per_layer = 2 if "chimera" in schedule_flags else 1
    seen = {}
    for result in results:
        assert result["loss"] == pytest.approx(expected_loss, rel=1e-12)
        for index, copies in result["grads"].items():
            seen[index] = seen.get(index, 0) + len(copies)
            for value in copies:
                error = (value - expected[index]).abs().max().item()
                assert error <= 1e-12 * expected[index].abs().max().item(), (index, error)
    assert seen == {index: copies_per_layer for index in range(NUM_LAYERS)}
