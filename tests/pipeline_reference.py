"""One training step in any layout, reduced to comparable numbers (shared by the pipeline tests).

``train_one_step(rank, world_size, argv)`` runs inside a gloo rank (or in the test process for the
single-process reference, with ``world_size == 1``): it parses the flags, builds the process groups the
runtime needs, the model chunks (float64, or float32 under --bf16/--fp16; dropout on), the optimizer, and runs one iteration of the
real training step on mock data. It returns the reported loss, the gradient norm, and every parameter
and gradient of every chunk this rank holds, gathered to full size over tensor parallelism and keyed
by (pipeline, parameter name), so the test can check that every copy of every parameter equals the
single-process model's.
"""

from __future__ import annotations

import pytest
import torch

import pretrain_gpt
from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import ParallelState, RankLayout, create_parallel_state
from megatron.core.tensor_parallel.utils import gather_full_state
from megatron.training.arguments import parse_args
from megatron.training.gradient_checks import LocalGradientNorms
from megatron.training.training import (iteration_microbatches, select_runtime_class,
                                        setup_model_and_optimizer, train_step)

MODEL_FLAGS = ("--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
               "--max-position-embeddings 16 --vocab-size 96 --make-vocab-size-divisible-by 64 "
               "--lr 1e-2 --train-iters 2 --mock-data --seed 1234 --eval-iters 0 "
               "--layout-invariant-attention-dropout").split()  # exact in every layout


def test_model_provider(config, parallel_state, *, pre_process=True, post_process=True,
                        layer_range=None):
    """float64 parameters, or float32 master parameters under --bf16 / --fp16 (as real runs)."""
    half = config.training.bf16 or config.training.fp16
    return GPTModel(config.model, config.recompute, parallel_state, config.training.seed,
                    layer_range=layer_range, pre_process=pre_process, post_process=post_process,
                    params_dtype=torch.float32 if half else torch.float64,
                    sequence_parallel=config.parallel.sequence_parallel)


def train_one_step(rank: int, world_size: int, argv: list[str], runtime_class=None,
                   pipeline_schedule: str | None = None, registry=None,
                   watch_gradients: bool = False) -> dict:
    """``registry`` (a schedule registry with families of the test's own) goes to the flag parser
    and the runtime, so ``--pipeline-schedule NAME`` can name such a family. ``runtime_class`` and
    ``pipeline_schedule`` (set after parsing) let a test run a runtime subclass of its own.
    ``watch_gradients``: record the per-bucket local gradient norms (the gradient checks' seam)
    in ``local_grad_norms``. ``backward_launches``: buckets the reducers launched from the
    backward's hooks (``--overlap-grad-reduce``), summed over this rank's reducers."""
    config = parse_args(MODEL_FLAGS + list(argv), world_size=world_size,
                        **({} if registry is None else {"registry": registry}))
    if pipeline_schedule is not None:
        config.parallel.pipeline_schedule = pipeline_schedule
    runtime_class = runtime_class or select_runtime_class(config, registry)
    if world_size == 1:
        parallel_state = ParallelState.single_process()
    else:
        layout = RankLayout.from_world_size(world_size, config.parallel.tensor_model_parallel_size,
                                            config.parallel.pipeline_model_parallel_size)
        parallel_state = create_parallel_state(
            layout, rank, "gloo",
            extra_group_ranks=runtime_class.required_group_ranks(config, layout))
    device = torch.device("cpu")
    runtime = runtime_class(config, parallel_state, device)
    components = setup_model_and_optimizer(config, parallel_state, runtime,
                                           test_model_provider, device)
    train, _, _ = pretrain_gpt.datasets_provider(config, parallel_state,
                                                 (config.training.global_batch_size, 0, 0))
    microbatches = iteration_microbatches(components, train, 0)
    norms = (LocalGradientNorms().watch(components.gradient_reducers) if watch_gradients
             else None)
    record = train_step(components, pretrain_gpt.forward_step, microbatches,
                        gradient_norms=norms)
    keys = getattr(runtime, "keys", None) or [None] * len(components.model_chunks)
    grads, params = {}, {}
    for key, chunk in zip(keys, components.model_chunks):
        pipeline = 0 if key is None else key.pipeline
        for name, value in gather_full_state(chunk, parallel_state, gradients=True).items():
            grads[(pipeline, name)] = value
        for name, value in gather_full_state(chunk, parallel_state).items():
            params[(pipeline, name)] = value
    return {"loss": record.losses["lm loss"], "grad_norm": record.grad_norm,
            "skipped": record.skipped,
            "grads": grads, "params": params,
            "peak_stored": getattr(getattr(runtime, "last_interpreter", None), "peak_stored", None),
            "eager_sends": getattr(runtime, "eager_sends", None),
            "backward_launches": sum(getattr(reducer, "backward_launches", 0)
                                     for reducer in components.gradient_reducers),
            "local_grad_norms": None if norms is None else list(norms.norms)}


# Layout comparisons: 1e-9 relative for gradients and parameters (float64 model; layouts differ only
# in summation order), 1e-6 for the reported loss (averaged in float32 as Megatron does).
TOLERANCE = 1e-9
LOSS_TOLERANCE = 1e-6


def merge_copies(results: list[dict], field: str) -> dict:
    """``{name: [every copy over ranks and pipelines]}`` of ``field`` ("grads" or "params")."""
    merged: dict = {}
    for result in results:
        for (_, name), value in result[field].items():
            merged.setdefault(name, []).append(value)
    return merged


def assert_matches_reference(results: list[dict], expected: dict,
                             fields: tuple[str, ...] = ("grads", "params")) -> None:
    for result in results:
        if result["loss"] is not None:
            assert result["loss"] == pytest.approx(expected["loss"], rel=LOSS_TOLERANCE)
        assert result["grad_norm"] == pytest.approx(expected["grad_norm"], rel=TOLERANCE)
    for field in fields:
        copies = merge_copies(results, field)
        reference_values = {name: value for (_, name), value in expected[field].items()}
        assert set(copies) == set(reference_values), f"{field}: parameter sets differ"
        for name, values in copies.items():
            want = reference_values[name]
            scale = want.abs().max().item() + 1e-30
            for value in values:
                error = (value - want).abs().max().item() / scale
                assert error < TOLERANCE, f"{field} of {name}: relative error {error:.2e}"
