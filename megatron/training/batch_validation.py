"""Validation of the training length and batch sizes: --global-batch-size and micro-batches,
--rampup-batch-size, --train-iters / --train-samples, and the iteration- or samples-based
learning-rate schedule lengths. Part of :func:`megatron.training.config_validation.validate_config`
(split out to keep each module small); every error is a ``ValueError`` naming the flags and the fix.
"""

from __future__ import annotations

from megatron.core.config import MegatronConfig


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def require_positive(section, names: tuple[str, ...], allow_none: bool = False) -> None:
    for name in names:
        value = getattr(section, name)
        if value is None and allow_none:
            continue
        if value is None or value < 1:
            raise ValueError(f"{_flag(name)} must be a positive integer, got {value}; "
                             f"set {_flag(name)} to a value >= 1")


def validate_batch(config: MegatronConfig) -> None:
    training, parallel = config.training, config.parallel
    require_positive(training, ("micro_batch_size",))
    require_positive(training, ("global_batch_size", "train_iters", "train_samples"),
                      allow_none=True)
    per_step = training.micro_batch_size * parallel.data_parallel_size
    if training.step_batch_size_schedule is not None:
        _validate_step_schedule(config, per_step)
    if training.global_batch_size is None:
        training.global_batch_size = per_step
    if training.global_batch_size % per_step:
        raise ValueError(
            f"--global-batch-size {training.global_batch_size} is not divisible by "
            f"--micro-batch-size {training.micro_batch_size} x data-parallel size "
            f"{parallel.data_parallel_size} = {per_step}; use a multiple of {per_step}")
    training.num_microbatches = training.global_batch_size // per_step
    if training.eval_global_batch_size is not None:
        require_positive(training, ("eval_global_batch_size",))
        if training.eval_global_batch_size % per_step:
            raise ValueError(
                f"--eval-global-batch-size {training.eval_global_batch_size} is not divisible by "
                f"--micro-batch-size {training.micro_batch_size} x data-parallel size "
                f"{parallel.data_parallel_size} = {per_step}; use a multiple of {per_step}")

    _validate_rampup(config, per_step)
    if training.train_iters is None and training.train_samples is None:
        raise ValueError("give the training length: --train-iters N or --train-samples N")
    if training.train_samples is not None:
        if training.train_samples < training.global_batch_size:
            raise ValueError(f"--train-samples {training.train_samples} is smaller than one "
                             f"global batch ({training.global_batch_size}); raise it")
        from megatron.training.microbatches import iterations_for_samples
        iterations = iterations_for_samples(training, training.train_samples)
        if training.train_iters is not None and training.train_iters != iterations:
            raise ValueError(f"--train-iters {training.train_iters} and --train-samples "
                             f"{training.train_samples} disagree (that is {iterations} iterations "
                             f"of {training.global_batch_size} samples); give only one")
        training.train_iters = iterations


def _validate_step_schedule(config: MegatronConfig, per_step: int) -> None:
    """--step-batch-size-schedule: Megatron's rules, and every batch size splits into whole
    micro-batches of this layout. The global batch size becomes the last step's."""
    from megatron.training.batch_size_schedule import flatten, parse_step_schedule
    training = config.training
    schedule = training.step_batch_size_schedule
    if training.global_batch_size is not None:
        raise ValueError("--step-batch-size-schedule and --global-batch-size both set the global "
                         "batch size; give only one")
    if training.rampup_batch_size is not None:
        raise ValueError("--step-batch-size-schedule and --rampup-batch-size both change the "
                         "global batch size during training; give only one")
    steps = parse_step_schedule(schedule, config.model.seq_length)
    odd = [size for _, size in steps if size % per_step]
    if odd:
        raise ValueError(f"--step-batch-size-schedule {schedule!r}: batch size(s) "
                         f"{', '.join(map(str, odd))} not divisible by --micro-batch-size x "
                         f"data-parallel size = {per_step}")
    training.batch_size_steps = flatten(steps)
    training.global_batch_size = steps[-1][1]


def _validate_rampup(config: MegatronConfig, per_step: int) -> None:
    """--rampup-batch-size START INCREMENT RAMP_SAMPLES (Megatron's rules)."""
    training = config.training
    if training.rampup_batch_size is None:
        return
    if len(training.rampup_batch_size) != 3:
        raise ValueError("--rampup-batch-size takes three numbers: START INCREMENT RAMP_SAMPLES, "
                         "e.g. --rampup-batch-size 16 16 5859375")
    start, increment, ramp_samples = training.rampup_batch_size
    if start < 1 or increment < 1 or ramp_samples < 0 or start > training.global_batch_size:
        raise ValueError(f"--rampup-batch-size {start} {increment} {ramp_samples} needs "
                         f"1 <= START <= --global-batch-size {training.global_batch_size}, "
                         f"INCREMENT >= 1 and RAMP_SAMPLES >= 0")
    if (training.global_batch_size - start) % increment:
        raise ValueError(f"--global-batch-size {training.global_batch_size} minus the ramp-up start "
                         f"{start} is not a multiple of the increment {increment}; fix "
                         f"--rampup-batch-size")
    if start % per_step or increment % per_step:
        raise ValueError(f"--rampup-batch-size START {start} and INCREMENT {increment} must be "
                         f"multiples of --micro-batch-size x data-parallel size = {per_step}, so "
                         f"every batch of the ramp splits into whole micro-batches")


def validate_precision_and_evaluation(config: MegatronConfig) -> None:
    training = config.training
    if training.fp16 and training.bf16:
        raise ValueError("--fp16 and --bf16 are mutually exclusive; choose one")
    if training.eval_interval < 1 or training.eval_iters < 0:
        raise ValueError("--eval-interval must be >= 1 and --eval-iters >= 0")


def _validate_warmup_fraction(optimizer, warmup_flag: str) -> None:
    if optimizer.lr_warmup_fraction is None:
        return
    if getattr(optimizer, warmup_flag.lstrip("-").replace("-", "_")):
        raise ValueError(f"give only one of --lr-warmup-fraction and {warmup_flag}")
    if not 0.0 <= optimizer.lr_warmup_fraction <= 1.0:
        raise ValueError(f"--lr-warmup-fraction {optimizer.lr_warmup_fraction} must lie in [0, 1]")


def validate_iterations_schedule(config: MegatronConfig) -> None:
    """--train-iters: the schedule is in iterations (--lr-decay-iters, --lr-warmup-iters)."""
    optimizer = config.optimizer
    if optimizer.lr_decay_samples is not None or optimizer.lr_warmup_samples:
        raise ValueError("--lr-decay-samples / --lr-warmup-samples belong to samples-based "
                         "training; use --train-samples, or --lr-decay-iters / --lr-warmup-iters")
    if optimizer.lr_decay_iters is None:
        optimizer.lr_decay_iters = config.training.train_iters
    if optimizer.lr_decay_iters < 1:
        raise ValueError(f"--lr-decay-iters {optimizer.lr_decay_iters} must be >= 1")
    _validate_warmup_fraction(optimizer, "--lr-warmup-iters")
    if optimizer.lr_warmup_fraction is None and not \
            0 <= optimizer.lr_warmup_iters <= optimizer.lr_decay_iters:
        raise ValueError(f"--lr-warmup-iters {optimizer.lr_warmup_iters} must lie in [0, "
                         f"--lr-decay-iters {optimizer.lr_decay_iters}]; shorten the warm-up")


def validate_samples_schedule(config: MegatronConfig) -> None:
    """--train-samples: the schedule is in samples (Megatron: --lr-decay-samples defaults to
    --train-samples; the iteration-based schedule flags are refused)."""
    optimizer = config.optimizer
    if optimizer.lr_decay_iters is not None or optimizer.lr_warmup_iters:
        raise ValueError("--lr-decay-iters / --lr-warmup-iters belong to iteration-based training; "
                         "with --train-samples use --lr-decay-samples / --lr-warmup-samples")
    if optimizer.lr_decay_samples is None:
        optimizer.lr_decay_samples = config.training.train_samples
    if optimizer.lr_decay_samples < 1:
        raise ValueError(f"--lr-decay-samples {optimizer.lr_decay_samples} must be >= 1")
    _validate_warmup_fraction(optimizer, "--lr-warmup-samples")
    if optimizer.lr_warmup_fraction is None and not \
            0 <= optimizer.lr_warmup_samples < optimizer.lr_decay_samples:
        raise ValueError(f"--lr-warmup-samples {optimizer.lr_warmup_samples} must lie in [0, "
                         f"--lr-decay-samples {optimizer.lr_decay_samples}); shorten the warm-up")
