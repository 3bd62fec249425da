"""The training loop: set-up, iterations, evaluation and Megatron's log lines.

``pretrain(config, model_spec, datasets_provider)`` is the entry point: the
:class:`~megatron.training.model_spec.ModelSpec` holds the model provider, forward step, loss keys,
micro-batch collation and FLOPs function (``pretrain_gpt.py`` builds GPT's). One iteration:

1. build this rank's micro-batches of the global batch ``[consumed, consumed + global_batch_size)``
   (order documented in :mod:`megatron.training.microbatches`);
2. ``runtime.forward_backward`` runs them (no pipeline: gradient accumulation; a pipeline runtime:
   its schedule) and starts the gradient reducers (with ``--rerun-mode validate_results`` the
   re-run engine, :mod:`megatron.training.rerun`, validates the losses and may run this step twice
   or stop the run before the update);
3. wait for the reducers; the optimizer unscales (fp16), checks for overflow on every rank, clips by
   the global norm and steps; the LR schedule advances by the global batch when the step succeeded;
4. each of the spec's losses is averaged over all micro-batches of the global batch (all-reduced over
   data- and pipeline-parallel ranks), so it is the same number in every layout.

The gradient reducers are driven only through the lifecycle of the
:class:`~megatron.core.distributed.reduction.GradientReduction` seam: ``attach`` after the optimizer
is built, ``after_step`` after every optimizer step, ``synchronize`` every ``sync_interval``
iterations and before every evaluation and checkpoint.

The loop holds no schedule-specific code (see :mod:`megatron.core.runtimes`) and no module
globals; config, process groups and components are passed explicitly. Checkpointing is a hook object
(``load(components)`` -> TrainingState or None, ``save(components, state)``) supplied by the caller.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.distributed import GradientReducer, all_reduce_over, all_reduce_world, group_size
from megatron.core.distributed.reduction import (after_step, attach_reducers,
                                                 synchronize_if_due, synchronize_reducers)
from megatron.core.distributed.timeouts import awaiting, describe_group
from megatron.core.optimizer.decoupled_lr import mark_embedding_or_output_parameters
from megatron.core.optimizer.mup import mark_mup_parameters
from megatron.core.optimizer.qk_layernorm_decay import decay_qk_layernorm_parameters
from megatron.core.optimizer import (MegatronOptimizer, OptimizerParamScheduler, build_lr_scheduler,
                                     build_optimizer)
from megatron.training.determinism import apply_deterministic_mode
from megatron.training.flops import throughput_tflops_per_gpu
from megatron.training.iteration_health import IterationHealth
from megatron.training.initialize import (initialize_megatron, local_rank_from_environment,
                                          training_device)
from megatron.training.logging_utils import (IntervalStats, build_tensorboard_writer,
                                             check_logging_packages, close_writer,
                                             format_iteration_line, format_validation_lines,
                                             memory_report,
                                             write_training_scalars, write_validation_scalars)
from megatron.training.microbatches import (build_microbatches, eval_batch_size,
                                            global_batch_size_at)
from megatron.training.gpt_spec import as_model_spec
from megatron.training.model_spec import ModelSpec
from megatron.training.per_token_loss import (TOKENS_KEY, per_token_correction,
                                              per_token_forward_step)
from megatron.training.gradient_checks import LocalGradientNorms, gradient_norms_for
from megatron.training.rerun import LocalResults, RerunEngine, RerunStop
from megatron.training.model_statistics import num_zeros_in_grads, params_norm
from megatron.training.signal_handler import ExitSignalHandler
from megatron.training.timers import Timers
from megatron.training.training_state import TrainingState  # noqa: F401 (also imported from here)
from megatron.core.runtimes import autocast_context, model_parameters, select_runtime_class


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
    # Called between the forward/backward passes and the wait for the gradient reductions
    # (crossover scheduling hands the ranks to another job there).
    after_compute: Callable[[], None] = lambda: None
    model_spec: Optional[ModelSpec] = None  # loss keys, micro-batch collation, FLOPs


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
    rerun_stop: Optional[RerunStop] = None  # --rerun-mode validate_results stopped the run here


@dataclass
class TrainingResult:
    state: TrainingState
    history: list[IterationRecord] = field(default_factory=list)
    validation: list[tuple[str, dict]] = field(default_factory=list)
    exited_early: bool = False
    components: Optional[TrainingComponents] = None  # the trained model, optimizer, ...
    exit_code: int = 0  # the re-run engine's exit status when it stopped the run (else 0)


def is_logging_rank(parallel_state) -> bool:
    """Megatron prints from the last rank of the world (a last pipeline stage)."""
    return parallel_state.rank == parallel_state.world_size - 1


def setup_model_and_optimizer(config, parallel_state, runtime, model,
                              device: torch.device) -> TrainingComponents:
    """Build the model chunks, gradient reducers, optimizer and LR schedule. ``model``: a
    :class:`~megatron.training.model_spec.ModelSpec` (or a bare GPT model provider)."""
    spec = as_model_spec(model)
    model_chunks = runtime.build_model_chunks(spec.model_provider)
    if config.optimizer.decoupled_lr is not None:  # their own shards under the distributed optimizer
        mark_embedding_or_output_parameters(model_chunks)
    if getattr(config.model, "use_mup", False):  # MuP's lr classes: their own shards too
        mark_mup_parameters(model_chunks)
    if getattr(config.optimizer, "apply_wd_to_qk_layernorm", False):
        decay_qk_layernorm_parameters(model_chunks)
    reducers = runtime.build_gradient_reducers(model_chunks)
    optimizer = build_optimizer(config, model_parameters(model_chunks), parallel_state,
                                owns_grad_norm=runtime.owns_grad_norm,
                                gradient_reducers=reducers, model_chunks=model_chunks)
    scheduler = build_lr_scheduler(optimizer.optimizer, config.optimizer, config.training)
    attach_reducers(reducers, optimizer)
    return TrainingComponents(
        config=config, parallel_state=parallel_state, runtime=runtime, device=device,
        model_chunks=model_chunks, gradient_reducers=reducers, optimizer=optimizer,
        lr_scheduler=scheduler, autocast=autocast_context(config.training, device),
        model_spec=spec)


def reduce_losses(loss_dicts: list[dict], parallel_state, device: torch.device,
                  keys: Sequence[str]) -> dict:
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


def iteration_microbatches(components: TrainingComponents, dataset, first_sample: int,
                           global_batch_size: Optional[int] = None) -> list[dict]:
    """This rank's micro-batches of the global batch starting at ``first_sample`` (of
    ``global_batch_size`` samples; default ``--global-batch-size``)."""
    training, state = components.config.training, components.parallel_state
    num_microbatches = training.num_microbatches if global_batch_size is None else \
        global_batch_size // (training.micro_batch_size * state.dp_size)
    return build_microbatches(dataset, first_sample, training.micro_batch_size, state.dp_size,
                              state.dp_rank, num_microbatches, components.device,
                              batch_from_samples=components.model_spec.batch_from_samples)


def _timed(timers: Optional[Timers], name: str):
    return contextlib.nullcontext() if timers is None else timers.time(name)


def train_step(components: TrainingComponents, forward_step_func, microbatches: list[dict],
               global_batch_size: Optional[int] = None,
               timers: Optional[Timers] = None, rerun: Optional[RerunEngine] = None,
               iteration: int = 0, gradient_norms: Optional[LocalGradientNorms] = None
               ) -> IterationRecord:
    """One iteration on already-built micro-batches of ``global_batch_size`` samples (default
    ``--global-batch-size``); returns its record (iteration unset: 0). ``timers`` (optional)
    records forward-backward, all-grads-sync and optimizer. ``rerun`` (--rerun-mode
    validate_results) validates the passes of iteration ``iteration`` (1-based) before the update
    and may re-run them or stop before the update (the record's ``rerun_stop``).
    ``gradient_norms`` (--check-for-large-grads, --check-for-nan-in-loss-and-grad) records each
    gradient bucket's local norm for the engine, or checks them itself without one."""
    optimizer = components.optimizer
    for chunk in components.model_chunks:
        chunk.train()
    learning_rate = optimizer.param_groups[0]["lr"]
    per_token = _per_token_reference(components)
    if per_token:
        forward_step_func = per_token_forward_step(forward_step_func, per_token)

    def forward_backward_and_reduce() -> list[dict]:
        if gradient_norms is not None:
            gradient_norms.clear()
        clock = timers.instruction_clock() if timers is not None else None
        with _timed(timers, "forward-backward"):
            # the runtime zeroes the gradients where it has time (a pipeline: in its fill)
            loss_dicts = components.runtime.forward_backward(
                forward_step_func=forward_step_func, model_chunks=components.model_chunks,
                microbatches=microbatches, scale_loss=optimizer.scale_loss,
                gradient_reducers=components.gradient_reducers, forward_only=False,
                autocast=components.autocast, instruction_seconds=clock,
                zero_grad=optimizer.zero_grad)
        if clock is not None:
            timers.add(clock.seconds)
        components.after_compute()
        with _timed(timers, "all-grads-sync"):
            for reducer in components.gradient_reducers:
                reducer.wait()
        return loss_dicts

    if rerun is None:
        loss_dicts = forward_backward_and_reduce()
        if gradient_norms is not None:
            gradient_norms.validate_alone(components.parallel_state.rank, iteration)
    else:
        def local_results(dicts: list[dict]) -> LocalResults:
            losses = _local_losses(dicts, components.model_spec.loss_keys)
            return (gradient_norms.results(losses) if gradient_norms is not None
                    else LocalResults(losses=losses))
        loss_dicts, stop = rerun.run_iteration(iteration, forward_backward_and_reduce,
                                               local_results)
        if stop is not None:  # no update: the run stops before it
            return IterationRecord(iteration=0, losses={}, learning_rate=learning_rate,
                                   grad_norm=None, loss_scale=optimizer.loss_scale,
                                   skipped=True, got_nan=False, rerun_stop=stop)
    correction = _per_token_correction(components, loss_dicts, per_token)
    if correction != 1.0:
        optimizer.scale_gradients(correction)  # --calculate-per-token-loss
    with _timed(timers, "optimizer"):
        result = optimizer.step()
    after_step(components.gradient_reducers, result.update_successful)
    if result.update_successful:
        components.lr_scheduler.step(global_batch_size or
                                     components.config.training.global_batch_size)
    losses = {key: value * correction for key, value in
              reduce_losses(loss_dicts, components.parallel_state, components.device,
                            components.model_spec.loss_keys).items()}
    got_nan = any(not math.isfinite(v) for v in losses.values()) or (
        result.grad_norm is not None and not math.isfinite(result.grad_norm))
    return IterationRecord(iteration=0, losses=losses, learning_rate=learning_rate,
                           grad_norm=result.grad_norm, loss_scale=optimizer.loss_scale,
                           skipped=not result.update_successful, got_nan=got_nan)


def _local_losses(loss_dicts: list[dict], keys: Sequence[str]) -> list[float]:
    """This rank's losses of the iteration, micro-batch by micro-batch (what the re-run engine
    validates; empty on a rank that computed no loss)."""
    return [float(loss_dict[key].detach().float().item()) for loss_dict in loss_dicts
            for key in keys]


def _rerun_engine(components: TrainingComponents, log: Callable) -> Optional[RerunEngine]:
    """--rerun-mode's engine; a re-run starts from the generator and gradient-reducer states the
    iteration started from."""
    from megatron.core.distributed.reduction import load_reducer_states, reducer_states
    from megatron.training.checkpointing.state import capture_rng_state, restore_rng_state
    reducers = components.gradient_reducers

    def save_state():
        return capture_rng_state(), copy.deepcopy(reducer_states(reducers))  # no aliases

    def restore_state(state) -> None:
        rng_state, reducers_state = state
        restore_rng_state(rng_state)
        load_reducer_states(reducers, [reducers_state], dp_rank=0)
    return RerunEngine.from_config(components.config, components.parallel_state.rank,
                                   components.device, save_state, restore_state, log=log)


def _per_token_reference(components: TrainingComponents) -> int:
    """--calculate-per-token-loss: the reference token count of a micro-batch (0 when off)."""
    config = components.config
    if not config.training.calculate_per_token_loss:
        return 0
    return config.training.micro_batch_size * config.model.seq_length


def _per_token_correction(components: TrainingComponents, loss_dicts, reference: int) -> float:
    """The factor from the micro-batches' averaged loss to the per-token loss (1.0 when off)."""
    if not reference:
        return 1.0
    tokens = reduce_losses(loss_dicts, components.parallel_state, components.device,
                           keys=(TOKENS_KEY,))[TOKENS_KEY]
    return per_token_correction(tokens, reference)


def evaluate(components: TrainingComponents, forward_step_func, dataset, first_sample: int,
             eval_iters: int) -> dict:
    """Average loss over ``eval_iters`` global batches of ``dataset`` starting at ``first_sample``."""
    for chunk in components.model_chunks:
        chunk.eval()
    totals: dict = {}
    global_batch_size = eval_batch_size(components.config.training)
    per_token = _per_token_reference(components)
    if per_token:
        forward_step_func = per_token_forward_step(forward_step_func, per_token)
    try:
        for step in range(eval_iters):
            microbatches = iteration_microbatches(components, dataset,
                                                  first_sample + step * global_batch_size,
                                                  global_batch_size)
            loss_dicts = components.runtime.forward_backward(
                forward_step_func=forward_step_func, model_chunks=components.model_chunks,
                microbatches=microbatches, scale_loss=components.optimizer.scale_loss,
                gradient_reducers=(), forward_only=True, autocast=components.autocast)
            correction = _per_token_correction(components, loss_dicts, per_token)
            for key, value in reduce_losses(loss_dicts, components.parallel_state,
                                            components.device,
                                            components.model_spec.loss_keys).items():
                totals[key] = totals.get(key, 0.0) + value * correction
    finally:
        for chunk in components.model_chunks:
            chunk.train()
    return {key: value / eval_iters for key, value in totals.items()}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _should_exit_now(config, start_time: float, device: torch.device,
                     exit_signal: Optional[ExitSignalHandler]) -> bool:
    """All ranks agree (MAX over the world, one all-reduce) on whether --exit-duration-in-mins has
    passed or any rank received the exit signal (--exit-signal-handler)."""
    limit = config.training.exit_duration_in_mins
    if limit is None and exit_signal is None:
        return False
    over_time = limit is not None and (time.time() - start_time) / 60.0 > limit
    signalled = exit_signal is not None and exit_signal.received
    flag = torch.tensor([1.0 if over_time or signalled else 0.0], device=device)
    all_reduce_world(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def _run_evaluation(components, forward_step_func, dataset, state: TrainingState, prefix: str,
                    result: TrainingResult, log: Callable, advance: bool,
                    tensorboard_writer=None) -> None:
    eval_iters = components.config.training.eval_iters
    synchronize_reducers(components.gradient_reducers)  # evaluate identical replicas
    first = state.consumed_valid_samples if advance else 0
    losses = evaluate(components, forward_step_func, dataset, first, eval_iters)
    if advance:
        state.consumed_valid_samples += eval_iters * eval_batch_size(components.config.training)
    result.validation.append((prefix, losses))
    write_validation_scalars(tensorboard_writer, state.iteration, losses)
    if is_logging_rank(components.parallel_state):
        for line in format_validation_lines(prefix, losses):
            log(line)


@dataclass
class _LoopContext:
    """What the training loop's helpers share: the run's objects and the interval being logged."""

    components: TrainingComponents
    forward_step_func: Callable
    state: TrainingState
    result: TrainingResult
    log: Callable
    checkpointing: object
    start_time: float
    tensorboard_writer: object
    timers: Timers
    exit_signal: Optional[ExitSignalHandler] = None
    health: Optional[IterationHealth] = None
    rerun: Optional[RerunEngine] = None  # --rerun-mode validate_results or report_stats
    gradient_norms: Optional[LocalGradientNorms] = None  # per-bucket gradient checks
    interval: IntervalStats = field(default_factory=IntervalStats)
    interval_start: float = 0.0
    last_saved: Optional[int] = None

    @property
    def config(self):
        return self.components.config

    def restart_interval_clock(self) -> None:
        _synchronize(self.components.device)
        self.interval_start = time.perf_counter()

    def save(self) -> None:
        """Save (when --save is given) unless this iteration is already saved."""
        if self.last_saved == self.state.iteration:
            return
        if self.checkpointing is not None and self.config.checkpoint.save is not None:
            synchronize_reducers(self.components.gradient_reducers)  # save identical replicas
            self.checkpointing.save(self.components, self.state)
            self.last_saved = self.state.iteration


def _describe_rank_groups(parallel_state) -> str:
    """This rank's tensor-, data- and pipeline-parallel groups (for a timeout's message)."""
    groups = {"tensor-parallel": parallel_state.tensor_group,
              "data-parallel": parallel_state.data_group,
              "pipeline": parallel_state.pipeline_group}
    return "; ".join(describe_group(name, group) for name, group in groups.items()
                     if group_size(group) > 1) or "none"


def _train_iteration(loop: _LoopContext, train_dataset) -> tuple[IterationRecord, int]:
    """One training iteration at the current (possibly ramping) global batch size."""
    state = loop.state
    batch_size = global_batch_size_at(loop.config.training, state.consumed_train_samples)
    with loop.timers.time("batch-generator"):
        microbatches = iteration_microbatches(loop.components, train_dataset,
                                              state.consumed_train_samples, batch_size)
    with awaiting(lambda: f"a collective of iteration {state.iteration + 1} on one of this "
                          f"rank's groups: {_describe_rank_groups(loop.components.parallel_state)}"):
        record = train_step(loop.components, loop.forward_step_func, microbatches, batch_size,
                            loop.timers, rerun=loop.rerun, iteration=state.iteration + 1,
                            gradient_norms=loop.gradient_norms)
    if record.rerun_stop is not None:
        return record, batch_size  # the iteration did not happen
    state.iteration += 1
    state.consumed_train_samples += batch_size
    record.iteration = state.iteration
    loop.result.history.append(record)
    synchronize_if_due(loop.components.gradient_reducers, state.iteration)
    loop.interval.add(record.losses, record.skipped, record.got_nan)
    if loop.health is not None:  # raises on NaN (--check-for-nan-in-loss-and-grad), endless skips
        loop.health.check(record)
    return record, batch_size


def _report_memory(loop: _LoopContext) -> None:
    """Megatron's memory line after the run's first iteration, printed by every rank of data-
    parallel rank 0 (CUDA only; whatever the pipeline depth)."""
    parallel_state = loop.components.parallel_state
    line = memory_report(parallel_state.rank, loop.state.iteration, loop.components.device)
    if line is not None and parallel_state.dp_rank == 0:
        print(line, flush=True)


def _log_interval(loop: _LoopContext, record: IterationRecord, batch_size: int) -> None:
    """Megatron's iteration line and the TensorBoard scalars for the interval that just ended."""
    components, state, interval = loop.components, loop.state, loop.interval
    parallel_state = components.parallel_state
    _synchronize(components.device)
    elapsed = (time.perf_counter() - loop.interval_start) / interval.iterations
    learning_rate = components.optimizer.param_groups[0]["lr"]
    losses = interval.average_losses()
    logging_config = loop.config.logging
    zeros = num_zeros_in_grads(components.optimizer, parallel_state) \
        if logging_config.log_num_zeros_in_grad else None  # collective: every rank
    norm = params_norm(components.optimizer, parallel_state) \
        if logging_config.log_params_norm else None
    flops = components.model_spec.flops_per_iteration
    throughput = None if flops is None else throughput_tflops_per_gpu(
        flops(loop.config.model, batch_size), elapsed, parallel_state.world_size)
    write_training_scalars(loop.tensorboard_writer, state.iteration, losses=losses,
                           learning_rate=learning_rate, global_batch_size=batch_size,
                           loss_scale=record.loss_scale, grad_norm=record.grad_norm)
    if is_logging_rank(parallel_state):
        loop.log(format_iteration_line(
            iteration=state.iteration, train_iters=loop.config.training.train_iters,
            consumed_samples=state.consumed_train_samples, elapsed_ms=elapsed * 1000.0,
            throughput_tflops=throughput,
            learning_rate=learning_rate, global_batch_size=batch_size, losses=losses,
            loss_scale=record.loss_scale, grad_norm=record.grad_norm,
            skipped_iterations=interval.skipped_iterations,
            nan_iterations=interval.nan_iterations, num_zeros_in_grad=zeros,
            params_norm=norm))
    timer_lines = loop.timers.report(interval.iterations, parallel_state.world_size)
    if is_logging_rank(parallel_state):
        for line in timer_lines:
            loop.log(line)
    loop.interval = IntervalStats()
    loop.interval_start = time.perf_counter()


def _evaluate_if_due(loop: _LoopContext, valid_dataset) -> None:
    training, iteration = loop.config.training, loop.state.iteration
    if (valid_dataset is not None and training.eval_iters > 0 and training.eval_interval
            and iteration % training.eval_interval == 0):
        _run_evaluation(loop.components, loop.forward_step_func, valid_dataset, loop.state,
                        f"iteration {iteration}", loop.result, loop.log, advance=True,
                        tensorboard_writer=loop.tensorboard_writer)
        loop.interval_start = time.perf_counter()  # evaluation time is not training time


def _save_and_exit_if_due(loop: _LoopContext) -> bool:
    """Save every --save-interval; on --exit-interval / --exit-duration-in-mins save and say so.
    Returns True when the run must stop now."""
    config, iteration = loop.config, loop.state.iteration
    save_interval = config.checkpoint.save_interval
    if save_interval and iteration % save_interval == 0:
        loop.save()
    exit_interval = config.training.exit_interval
    exit_now = bool(exit_interval and iteration % exit_interval == 0)
    exit_now = _should_exit_now(config, loop.start_time, loop.components.device,
                                loop.exit_signal) or exit_now
    if exit_now:
        loop.save()
        if is_logging_rank(loop.components.parallel_state):
            loop.log(f"exiting program at iteration {iteration}")
    return exit_now


def train(components: TrainingComponents, forward_step_func, train_dataset, valid_dataset,
          state: TrainingState, *, log: Callable = print, checkpointing=None,
          start_time: Optional[float] = None, tensorboard_writer=None) -> TrainingResult:
    """Iterate from ``state`` to ``--train-iters``, logging, evaluating, saving and exiting as the
    flags say. Returns the final state and per-iteration records."""
    loop = _LoopContext(
        components=components, forward_step_func=forward_step_func, state=state,
        result=TrainingResult(state=state, components=components), log=log,
        checkpointing=checkpointing, tensorboard_writer=tensorboard_writer,
        start_time=time.time() if start_time is None else start_time,
        timers=Timers(components.config.logging.timing_log_level,
                      components.config.logging.timing_log_option, components.device),
        health=IterationHealth.from_config(components.config, components.parallel_state.rank),
        rerun=_rerun_engine(components, log),
        gradient_norms=gradient_norms_for(components.config.training,
                                          components.gradient_reducers))
    _resume_pending_rerun(loop)
    if components.config.training.exit_signal_handler:
        with ExitSignalHandler() as loop.exit_signal:
            return _run_loop(loop, train_dataset, valid_dataset)
    return _run_loop(loop, train_dataset, valid_dataset)


def _run_loop(loop: _LoopContext, train_dataset, valid_dataset) -> TrainingResult:
    state, config = loop.state, loop.config
    loop.restart_interval_clock()
    skip = set(config.training.iterations_to_skip or ())
    while state.iteration < config.training.train_iters:
        if state.iteration in skip:
            _skip_iteration(loop)
            continue
        record, batch_size = _train_iteration(loop, train_dataset)
        if record.rerun_stop is not None:
            return _stop_for_rerun(loop, record.rerun_stop)
        if len(loop.result.history) == 1:
            _report_memory(loop)
        if state.iteration % config.logging.log_interval == 0:
            _log_interval(loop, record, batch_size)
        _evaluate_if_due(loop, valid_dataset)
        if _save_and_exit_if_due(loop):
            loop.result.exited_early = True
            return loop.result
    if state.iteration > 0:
        loop.save()
    return loop.result


def _skip_iteration(loop: _LoopContext) -> None:
    """--iterations-to-skip (Megatron's): the step after this many completed iterations consumes
    its global batch of samples and does nothing else (no compute, update, learning-rate step,
    logging, evaluation or save)."""
    state = loop.state
    batch_size = global_batch_size_at(loop.config.training, state.consumed_train_samples)
    state.iteration += 1
    state.consumed_train_samples += batch_size
    if is_logging_rank(loop.components.parallel_state):
        loop.log(f"skipping iteration {state.iteration} (--iterations-to-skip): its {batch_size} "
                 f"samples are consumed, not trained on")


def _resume_pending_rerun(loop: _LoopContext) -> None:
    """A checkpoint saved by the re-run engine at exit 16 asks to re-run its next iteration for a
    diagnosis: hand that to the engine (or say why it cannot be done)."""
    pending, loop.state.rerun_state = loop.state.rerun_state, None
    if pending is None:
        return
    if loop.rerun is not None:
        loop.rerun.resume_from_checkpoint(pending)
        if is_logging_rank(loop.components.parallel_state):
            loop.log(f"re-run engine: the checkpoint asks to re-run iteration "
                     f"{pending['iteration']} on other hardware to establish a diagnosis")
    elif is_logging_rank(loop.components.parallel_state):
        loop.log(f"re-run engine: the checkpoint asks to re-run iteration {pending['iteration']} "
                 f"for a diagnosis, but --rerun-mode is disabled: training continues without it")


def _stop_for_rerun(loop: _LoopContext, stop: RerunStop) -> TrainingResult:
    """The re-run engine's verdict ends the run: save first when it asks, say why, keep the exit
    status (Megatron's 16 or 17) for the entry point."""
    if stop.save_checkpoint:  # with the engine's state: the resumed job re-runs the iteration
        loop.state.rerun_state = stop.checkpoint_state
        loop.last_saved = None  # re-save an iteration saved before the fault: now with the state
        try:
            loop.save()
        finally:
            loop.state.rerun_state = None
    if is_logging_rank(loop.components.parallel_state):
        loop.log(f"re-run engine: {stop.message}")
    loop.result.exited_early = True
    loop.result.exit_code = stop.exit_code
    return loop.result


def _build_datasets(config, parallel_state, datasets_provider) -> tuple:
    """Megatron's sample counts per split; rank 0 builds first (it may write index caches)."""
    training = config.training
    global_batch_size = training.global_batch_size
    eval_runs = (training.train_iters // training.eval_interval + 1) if training.eval_interval \
        else 1
    num_samples = (training.train_iters * global_batch_size,
                   eval_runs * training.eval_iters * eval_batch_size(training),
                   training.eval_iters * eval_batch_size(training))
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    datasets = None
    if not distributed or parallel_state.rank == 0:
        datasets = datasets_provider(config, parallel_state, num_samples)
    if distributed:
        with awaiting(lambda: "the barrier where every rank waits for rank 0 to build the "
                              "datasets, on " + describe_group("world", dist.group.WORLD)):
            dist.barrier()
        if parallel_state.rank != 0:
            datasets = datasets_provider(config, parallel_state, num_samples)
    return tuple(datasets)


def pretrain(config, model_spec, datasets_provider=None, forward_step_func=None, *,
             parallel_state=None, runtime_class=None, registry=None, checkpointing=None,
             log: Callable = print, tensorboard_writer=None,
             after_compute: Optional[Callable[[], None]] = None) -> TrainingResult:
    """Train a model as Megatron-LM's ``pretrain`` does.

    Args:
        config: validated :class:`~megatron.core.config.MegatronConfig` (from ``parse_args``, with
            the spec's ``model_spec=`` for another model than GPT).
        model_spec: the :class:`~megatron.training.model_spec.ModelSpec` (its ``model_provider``
            builds the chunks the runtime decides this rank holds). The older form, a bare GPT
            ``model_provider`` followed by ``datasets_provider`` and ``forward_step_func``, still
            works and means the GPT spec with these functions.
        datasets_provider: ``(config, parallel_state, num_samples=(train, valid, test))`` ->
            (train, valid, test) datasets whose samples the spec's ``batch_from_samples`` stacks
            (GPT: ``{"text": int64[seq_length + 1]}``); default: the spec's.
        forward_step_func: ``(microbatch, model) -> (output, loss_func)``; default: the spec's.
        parallel_state: an existing handle (tests); default: :func:`initialize_megatron`.
        runtime_class: default no-pipeline or pipeline runtime by the config.
        registry: the schedule families the pipeline runtime plans with (the one given to
            ``parse_args``; default the built-in ones); ignored when ``runtime_class`` is given.
        checkpointing: hook object with ``load(components)`` and ``save(components, state)``;
            required when ``--save`` or ``--load`` is given.
        log: where the last rank's log lines go.
        tensorboard_writer: anything with ``add_scalar(tag, value, step)``; default: a
            ``SummaryWriter`` on the last rank when ``--tensorboard-dir`` is given.
        after_compute: called in every iteration after the forward/backward passes, before the
            gradient reductions are waited for (see :mod:`megatron.training.crossover`).
    """
    start_time = time.time()
    spec = as_model_spec(model_spec, forward_step_func)
    datasets_provider = datasets_provider or spec.datasets_provider
    if datasets_provider is None or spec.forward_step is None:
        raise ValueError(f"the {spec.name} model spec has no "
                         f"{'datasets provider' if datasets_provider is None else 'forward step'}"
                         f"; give it one (ModelSpec) or pass it to pretrain")
    forward_step_func = spec.forward_step
    if checkpointing is None and (config.checkpoint.save or config.checkpoint.load):
        raise ValueError("--save/--load need a checkpointing hook, and this entry point has none; "
                         "drop --save/--load or use a pretrain_gpt.py with checkpoint support")
    runtime_class = runtime_class or select_runtime_class(config, registry)
    if config.training.deterministic_mode:
        apply_deterministic_mode()  # before any communicator or cuBLAS handle exists
    if tensorboard_writer is None:
        check_logging_packages(config.logging)  # before any process group exists
    if parallel_state is None:
        from megatron.core.parallel_state import RankLayout
        world_size = config.parallel.world_size or 1
        layout = RankLayout.from_world_size(world_size, config.parallel.tensor_model_parallel_size,
                                            config.parallel.pipeline_model_parallel_size)
        parallel_state = initialize_megatron(
            config, extra_group_ranks=runtime_class.required_group_ranks(config, layout))
    device = training_device(parallel_state.backend, local_rank_from_environment(config))
    if tensorboard_writer is None:
        tensorboard_writer = build_tensorboard_writer(
            config.logging, is_logging_rank(parallel_state), save_dir=config.checkpoint.save,
            run_config=dataclasses.asdict(config))
    runtime = runtime_class(config, parallel_state, device)
    components = setup_model_and_optimizer(config, parallel_state, runtime, spec, device)
    if after_compute is not None:
        components.after_compute = after_compute
    if is_logging_rank(parallel_state):
        _announce_setup(components, log)

    state = TrainingState()
    if checkpointing is not None and config.checkpoint.load:
        state = checkpointing.load(components) or state
    train_dataset, valid_dataset, test_dataset = _build_datasets(config, parallel_state,
                                                                 datasets_provider)
    result = train(components, forward_step_func, train_dataset, valid_dataset, state, log=log,
                   checkpointing=checkpointing, start_time=start_time,
                   tensorboard_writer=tensorboard_writer)
    components.optimizer.finish_parameter_gather()  # the trained weights, settled on every rank
    if hasattr(checkpointing, "finish"):  # --async-save: publish the save still being written
        checkpointing.finish(components, last=True)
    runtime.report(log if is_logging_rank(parallel_state) else None)  # collective
    if not result.exited_early:
        _final_evaluations(components, forward_step_func, valid_dataset, test_dataset, result,
                           log, tensorboard_writer)
    close_writer(tensorboard_writer)
    return result


def _announce_setup(components: TrainingComponents, log: Callable) -> None:
    """The setup lines: optimizer, device, backend, layout and the runtime's description."""
    parallel_state = components.parallel_state
    log(f"> optimizer: {components.optimizer.implementation}; device: {components.device}; "
        f"backend: {parallel_state.backend}; world size: {parallel_state.world_size} "
        f"(TP {parallel_state.tp_size}, DP {parallel_state.dp_size}, "
        f"PP {parallel_state.pp_size})")
    log(components.runtime.describe())


def _final_evaluations(components: TrainingComponents, forward_step_func, valid_dataset,
                       test_dataset, result: TrainingResult, log: Callable,
                       tensorboard_writer) -> None:
    """Megatron's evaluation on the validation and the test set after training."""
    state = result.state
    if components.config.training.eval_iters <= 0:
        return
    if valid_dataset is not None:
        _run_evaluation(components, forward_step_func, valid_dataset, state,
                        f"iteration {state.iteration} on validation set", result, log,
                        advance=True, tensorboard_writer=tensorboard_writer)
    if test_dataset is not None:
        _run_evaluation(components, forward_step_func, test_dataset, state,
                        f"iteration {state.iteration} on test set", result, log, advance=False)
