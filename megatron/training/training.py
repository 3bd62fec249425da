"""The training loop: set-up, iterations, evaluation and Megatron's log lines.

``pretrain(config, model_provider, datasets_provider, forward_step_func)`` is the entry point
(``pretrain_gpt.py`` supplies the three functions). One iteration:

1. build this rank's micro-batches of the global batch ``[consumed, consumed + global_batch_size)``
   (order documented in :mod:`megatron.training.microbatches`);
2. ``runtime.forward_backward`` runs them (no pipeline: gradient accumulation; a pipeline runtime:
   its schedule) and starts the gradient reducers;
3. wait for the reducers; the optimizer unscales (fp16), checks for overflow on every rank, clips by
   the global norm and steps; the LR schedule advances by the global batch when the step succeeded;
4. the reported lm loss is averaged over all micro-batches of the global batch (all-reduced over data-
   and pipeline-parallel ranks), so it is the same number in every layout.

The loop holds no schedule-specific code (see :mod:`megatron.training.runtime`) and no module
globals; config, process groups and components are passed explicitly. Checkpointing is a hook object
(``load(components)`` -> TrainingState or None, ``save(components, state)``) supplied by the caller.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.core.distributed import GradientReducer, all_reduce_over, all_reduce_world
from megatron.core.optimizer import (MegatronOptimizer, OptimizerParamScheduler, build_lr_scheduler,
                                     build_optimizer)
from megatron.training.flops import gpt_flops_per_iteration, throughput_tflops_per_gpu
from megatron.training.iteration_health import IterationHealth
from megatron.training.initialize import (initialize_megatron, local_rank_from_environment,
                                          training_device)
from megatron.training.logging_utils import (IntervalStats, build_tensorboard_writer,
                                             format_iteration_line, format_validation_lines,
                                             write_training_scalars, write_validation_scalars)
from megatron.training.microbatches import build_microbatches
from megatron.training.runtime import (NoPipelineRuntime, autocast_context, model_parameters)

LOSS_KEYS = ("lm loss",)


@dataclass
class TrainingState:
    """Progress that a checkpoint must restore to resume exactly."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


@dataclass
class TrainingComponents:
    """Everything an iteration needs, built once by :func:`setup_model_and_optimizer`."""

    config: object
    parallel_state: object
    runtime: object
    device: torch.device
    model_chunks: list
    gradient_reducers: list[GradientReducer]
    optimizer: MegatronOptimizer
    lr_scheduler: OptimizerParamScheduler
    autocast: Callable


@dataclass
class IterationRecord:
    """What one iteration did (kept for tests and tools; the log line shows the same numbers)."""

    iteration: int
    losses: dict
    learning_rate: float  # the lr this iteration's update used
    grad_norm: Optional[float]
    loss_scale: float
    skipped: bool
    got_nan: bool


@dataclass
class TrainingResult:
    state: TrainingState
    history: list[IterationRecord] = field(default_factory=list)
    validation: list[tuple[str, dict]] = field(default_factory=list)
    exited_early: bool = False
    components: Optional[TrainingComponents] = None  # the trained model, optimizer, ...


def is_logging_rank(parallel_state) -> bool:
    """Megatron prints from the last rank of the world (a last pipeline stage)."""
    return parallel_state.rank == parallel_state.world_size - 1


def select_runtime_class(config):
    """The runtime for the config: no pipeline, or the pipeline runtime for PP > 1."""
    if config.parallel.pipeline_model_parallel_size == 1:
        return NoPipelineRuntime
    try:
        from megatron.core.pipeline_parallel.execution.runtime import PipelineRuntime
    except ImportError as error:
        raise ValueError("--pipeline-model-parallel-size > 1 needs the pipeline runtime "
                         "(megatron.core.pipeline_parallel.execution.runtime), which is not available in "
                         f"this build ({error}); use --pipeline-model-parallel-size 1") from None
    return PipelineRuntime


def setup_model_and_optimizer(config, parallel_state, runtime, model_provider,
                              device: torch.device) -> TrainingComponents:
    """Build the model chunks, gradient reducers, optimizer and LR schedule."""
    model_chunks = runtime.build_model_chunks(model_provider)
    reducers = runtime.build_gradient_reducers(model_chunks)
    optimizer = build_optimizer(config, model_parameters(model_chunks), parallel_state,
                                owns_grad_norm=runtime.owns_grad_norm)
    scheduler = build_lr_scheduler(optimizer.optimizer, config.optimizer, config.training)
    return TrainingComponents(
        config=config, parallel_state=parallel_state, runtime=runtime, device=device,
        model_chunks=model_chunks, gradient_reducers=reducers, optimizer=optimizer,
        lr_scheduler=scheduler, autocast=autocast_context(config.training, device))


def reduce_losses(loss_dicts: list[dict], parallel_state, device: torch.device,
                  keys=LOSS_KEYS) -> dict:
    """Average each loss over every micro-batch of the global batch, on every rank.

    A rank contributes the micro-batches whose loss it computed (a last pipeline stage; every tensor-
    parallel rank of it holds the same values, so the tensor group is not summed).
    """
    totals = torch.zeros(len(keys) + 1, dtype=torch.float64, device=device)
    for loss_dict in loss_dicts:
        for index, key in enumerate(keys):
            totals[index] += loss_dict[key].detach().to(device=device, dtype=torch.float64)
        totals[-1] += 1
    all_reduce_over(totals, [parallel_state.data_group, parallel_state.pipeline_group])
    count = totals[-1].item()
    if count == 0:
        raise RuntimeError("no rank reported a loss for this iteration; the runtime must return "
                           "the loss dicts of the micro-batches whose loss it computed")
    return {key: totals[index].item() / count for index, key in enumerate(keys)}


def iteration_microbatches(components: TrainingComponents, dataset, first_sample: int
                           ) -> list[dict]:
    """This rank's micro-batches of the global batch starting at ``first_sample``."""
    training, state = components.config.training, components.parallel_state
    return build_microbatches(dataset, first_sample, training.micro_batch_size, state.dp_size,
                              state.dp_rank, training.num_microbatches, components.device)


def train_step(components: TrainingComponents, forward_step_func, microbatches: list[dict]
               ) -> IterationRecord:
    """One iteration on already-built micro-batches; returns its record (iteration unset: 0)."""
    optimizer = components.optimizer
    for chunk in components.model_chunks:
        chunk.train()
    optimizer.zero_grad()
    learning_rate = optimizer.param_groups[0]["lr"]
    loss_dicts = components.runtime.forward_backward(
        forward_step_func=forward_step_func, model_chunks=components.model_chunks,
        microbatches=microbatches, scale_loss=optimizer.scale_loss,
        gradient_reducers=components.gradient_reducers, forward_only=False,
        autocast=components.autocast)
    for reducer in components.gradient_reducers:
        reducer.wait()
    result = optimizer.step()
    if result.update_successful:
        components.lr_scheduler.step(components.config.training.global_batch_size)
    losses = reduce_losses(loss_dicts, components.parallel_state, components.device)
    got_nan = any(not math.isfinite(v) for v in losses.values()) or (
        result.grad_norm is not None and not math.isfinite(result.grad_norm))
    return IterationRecord(iteration=0, losses=losses, learning_rate=learning_rate,
                           grad_norm=result.grad_norm, loss_scale=optimizer.loss_scale,
                           skipped=not result.update_successful, got_nan=got_nan)


def evaluate(components: TrainingComponents, forward_step_func, dataset, first_sample: int,
             eval_iters: int) -> dict:
    """Average loss over ``eval_iters`` global batches of ``dataset`` starting at ``first_sample``."""
    for chunk in components.model_chunks:
        chunk.eval()
    totals: dict = {}
    global_batch_size = components.config.training.global_batch_size
    try:
        for step in range(eval_iters):
            microbatches = iteration_microbatches(components, dataset, first_sample + step * global_batch_size)
            loss_dicts = components.runtime.forward_backward(
                forward_step_func=forward_step_func, model_chunks=components.model_chunks,
                microbatches=microbatches, scale_loss=components.optimizer.scale_loss,
                gradient_reducers=(), forward_only=True, autocast=components.autocast)
            for key, value in reduce_losses(loss_dicts, components.parallel_state,
                                            components.device).items():
                totals[key] = totals.get(key, 0.0) + value
    finally:
        for chunk in components.model_chunks:
            chunk.train()
    return {key: value / eval_iters for key, value in totals.items()}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _should_exit_for_duration(config, start_time: float, device: torch.device) -> bool:
    """All ranks agree (MAX over the world) on whether --exit-duration-in-mins has passed."""
    limit = config.training.exit_duration_in_mins
    if limit is None:
        return False
    flag = torch.tensor([1.0 if (time.time() - start_time) / 60.0 > limit else 0.0],
                        device=device)
    all_reduce_world(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def _run_evaluation(components, forward_step_func, dataset, state: TrainingState, prefix: str,
                    result: TrainingResult, log: Callable, advance: bool,
                    tensorboard_writer=None) -> None:
    eval_iters = components.config.training.eval_iters
    first = state.consumed_valid_samples if advance else 0
    losses = evaluate(components, forward_step_func, dataset, first, eval_iters)
    if advance:
        state.consumed_valid_samples += eval_iters * components.config.training.global_batch_size
    result.validation.append((prefix, losses))
    write_validation_scalars(tensorboard_writer, state.iteration, losses)
    if is_logging_rank(components.parallel_state):
        for line in format_validation_lines(prefix, losses):
            log(line)


def train(components: TrainingComponents, forward_step_func, train_dataset, valid_dataset,
          state: TrainingState, *, log: Callable = print, checkpointing=None,
          start_time: Optional[float] = None, tensorboard_writer=None) -> TrainingResult:
    """Iterate from ``state`` to ``--train-iters``, logging, evaluating, saving and exiting as the
    flags say. Returns the final state and per-iteration records."""
    config = components.config
    training, logging_config = config.training, config.logging
    parallel_state, device = components.parallel_state, components.device
    start_time = time.time() if start_time is None else start_time
    flops_per_iteration = gpt_flops_per_iteration(config.model, training.global_batch_size)
    result = TrainingResult(state=state, components=components)
    interval = IntervalStats()
    _synchronize(device)
    interval_start = time.perf_counter()
    last_saved = None
    health = IterationHealth.from_config(config, parallel_state.rank)

    def save():
        nonlocal last_saved
        if checkpointing is not None and config.checkpoint.save is not None:
            checkpointing.save(components, state)
            last_saved = state.iteration

    while state.iteration < training.train_iters:
        microbatches = iteration_microbatches(components, train_dataset, state.consumed_train_samples)
        record = train_step(components, forward_step_func, microbatches)
        state.iteration += 1
        state.consumed_train_samples += training.global_batch_size
        record.iteration = state.iteration
        result.history.append(record)
        interval.add(record.losses, record.skipped, record.got_nan)
        health.check(record)  # raises on NaN (--check-for-nan-in-loss-and-grad) or endless skips

        if state.iteration % logging_config.log_interval == 0:
            _synchronize(device)
            elapsed = (time.perf_counter() - interval_start) / interval.iterations
            learning_rate = components.optimizer.param_groups[0]["lr"]
            losses = interval.average_losses()
            write_training_scalars(tensorboard_writer, state.iteration, losses=losses,
                                   learning_rate=learning_rate,
                                   global_batch_size=training.global_batch_size,
                                   loss_scale=record.loss_scale, grad_norm=record.grad_norm)
            if is_logging_rank(parallel_state):
                log(format_iteration_line(
                    iteration=state.iteration, train_iters=training.train_iters,
                    consumed_samples=state.consumed_train_samples, elapsed_ms=elapsed * 1000.0,
                    throughput_tflops=throughput_tflops_per_gpu(
                        flops_per_iteration, elapsed, parallel_state.world_size),
                    learning_rate=learning_rate,
                    global_batch_size=training.global_batch_size,
                    losses=losses, loss_scale=record.loss_scale,
                    grad_norm=record.grad_norm, skipped_iterations=interval.skipped_iterations,
                    nan_iterations=interval.nan_iterations))
            interval = IntervalStats()
            interval_start = time.perf_counter()

        if (valid_dataset is not None and training.eval_iters > 0 and training.eval_interval
                and state.iteration % training.eval_interval == 0):
            _run_evaluation(components, forward_step_func, valid_dataset, state,
                            f"iteration {state.iteration}", result, log, advance=True,
                            tensorboard_writer=tensorboard_writer)
            interval_start = time.perf_counter()  # evaluation time is not training time

        save_interval = config.checkpoint.save_interval
        if save_interval and state.iteration % save_interval == 0:
            save()
        exit_now = bool(training.exit_interval and state.iteration % training.exit_interval == 0)
        exit_now = _should_exit_for_duration(config, start_time, device) or exit_now
        if exit_now:
            if last_saved != state.iteration:
                save()
            if is_logging_rank(parallel_state):
                log(f"exiting program at iteration {state.iteration}")
            result.exited_early = True
            return result

    if last_saved != state.iteration and state.iteration > 0:
        save()
    return result


def _build_datasets(config, parallel_state, datasets_provider) -> tuple:
    """Megatron's sample counts per split; rank 0 builds first (it may write index caches)."""
    training = config.training
    global_batch_size = training.global_batch_size
    eval_runs = (training.train_iters // training.eval_interval + 1) if training.eval_interval \
        else 1
    num_samples = (training.train_iters * global_batch_size,
                   eval_runs * training.eval_iters * global_batch_size,
                   training.eval_iters * global_batch_size)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    datasets = None
    if not distributed or parallel_state.rank == 0:
        datasets = datasets_provider(config, parallel_state, num_samples)
    if distributed:
        dist.barrier()
        if parallel_state.rank != 0:
            datasets = datasets_provider(config, parallel_state, num_samples)
    return tuple(datasets)


def pretrain(config, model_provider, datasets_provider, forward_step_func, *,
             parallel_state=None, runtime_class=None, checkpointing=None,
             log: Callable = print, tensorboard_writer=None) -> TrainingResult:
    """Train a model as Megatron-LM's ``pretrain`` does.

    Args:
        config: validated :class:`~megatron.core.config.MegatronConfig` (from ``parse_args``).
        model_provider: ``(config, parallel_state, *, pre_process, post_process, layer_range=None)``
            -> module (the runtime decides which chunks this rank builds).
        datasets_provider: ``(config, parallel_state, num_samples=(train, valid, test))`` ->
            (train, valid, test) datasets of ``{"text": int64[seq_length + 1]}`` samples.
        forward_step_func: ``(microbatch, model) -> (output, loss_func)``.
        parallel_state: an existing handle (tests); default: :func:`initialize_megatron`.
        runtime_class: default no-pipeline or pipeline runtime by the config.
        checkpointing: hook object with ``load(components)`` and ``save(components, state)``;
            required when ``--save`` or ``--load`` is given.
        log: where the last rank's log lines go.
        tensorboard_writer: anything with ``add_scalar(tag, value, step)``; default: a
            ``SummaryWriter`` on the last rank when ``--tensorboard-dir`` is given.
    """
    start_time = time.time()
    if checkpointing is None and (config.checkpoint.save or config.checkpoint.load):
        raise ValueError("--save/--load need a checkpointing hook, and this entry point has none; "
                         "drop --save/--load or use a pretrain_gpt.py with checkpoint support")
    runtime_class = runtime_class or select_runtime_class(config)
    if parallel_state is None:
        from megatron.core.parallel_state import RankLayout
        world_size = config.parallel.world_size or 1
        layout = RankLayout.from_world_size(world_size, config.parallel.tensor_model_parallel_size,
                                            config.parallel.pipeline_model_parallel_size)
        parallel_state = initialize_megatron(
            config, extra_group_ranks=runtime_class.required_group_ranks(config, layout))
    device = training_device(parallel_state.backend, local_rank_from_environment(config))
    if tensorboard_writer is None:
        tensorboard_writer = build_tensorboard_writer(config.logging,
                                                      is_logging_rank(parallel_state))
    runtime = runtime_class(config, parallel_state, device)
    components = setup_model_and_optimizer(config, parallel_state, runtime, model_provider, device)
    if is_logging_rank(parallel_state):
        log(f"> optimizer: {components.optimizer.implementation}; device: {device}; "
            f"backend: {parallel_state.backend}; world size: {parallel_state.world_size} "
            f"(TP {parallel_state.tp_size}, DP {parallel_state.dp_size}, "
            f"PP {parallel_state.pp_size})")
        log(runtime.describe())

    state = TrainingState()
    if checkpointing is not None and config.checkpoint.load:
        state = checkpointing.load(components) or state
    train_dataset, valid_dataset, test_dataset = _build_datasets(config, parallel_state,
                                                                 datasets_provider)
    result = train(components, forward_step_func, train_dataset, valid_dataset, state, log=log,
                   checkpointing=checkpointing, start_time=start_time,
                   tensorboard_writer=tensorboard_writer)
    runtime.report(log if is_logging_rank(parallel_state) else None)  # collective
    if result.exited_early:
        if tensorboard_writer is not None and hasattr(tensorboard_writer, "flush"):
            tensorboard_writer.flush()
        return result
    eval_iters = config.training.eval_iters
    if valid_dataset is not None and eval_iters > 0:
        _run_evaluation(components, forward_step_func, valid_dataset, state,
                        f"iteration {state.iteration} on validation set", result, log,
                        advance=True, tensorboard_writer=tensorboard_writer)
    if test_dataset is not None and eval_iters > 0:
        _run_evaluation(components, forward_step_func, test_dataset, state,
                        f"iteration {state.iteration} on test set", result, log, advance=False)
    if tensorboard_writer is not None and hasattr(tensorboard_writer, "flush"):
        tensorboard_writer.flush()
    return result
