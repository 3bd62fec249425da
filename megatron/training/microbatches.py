"""Which samples each data-parallel rank trains on, and how samples become micro-batches.

An iteration consumes the global batch ``[first, first + global_batch_size)`` of the dataset, in
Megatron-LM's order: the batch is cut into ``num_microbatches`` consecutive blocks of
``micro_batch_size * data_parallel_size`` samples, and data-parallel rank ``d`` takes slice ``d`` of
each block. So micro-batch ``k`` on rank ``d`` holds samples

    first + k * mbs * DP + d * mbs  ...  first + k * mbs * DP + (d + 1) * mbs - 1.

With ``--rampup-batch-size START INCREMENT RAMP_SAMPLES`` the global batch grows, as in Megatron, from
START by INCREMENT every ``RAMP_SAMPLES / ((global - START) / INCREMENT)`` consumed samples, and is the
full ``--global-batch-size`` once RAMP_SAMPLES samples have been consumed
(:func:`global_batch_size_at`). ``--step-batch-size-schedule`` sets it step-wise instead
(:mod:`megatron.training.batch_size_schedule`).

The union over ranks and micro-batches is exactly the global batch one process would see. Each
micro-batch carries the samples' global indices (``sample_ids``) so dropout masks, which the model
derives from them, do not depend on the layout.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from megatron.training import batch_size_schedule
from megatron.training.batch_size_schedule import step_batch_size_at


def global_batch_size_at(training_config, consumed_samples: int) -> int:
    """The global batch size of the iteration that starts after ``consumed_samples`` samples."""
    if getattr(training_config, "batch_size_steps", None):
        return step_batch_size_at(training_config.batch_size_steps, consumed_samples)
    rampup, full = training_config.rampup_batch_size, training_config.global_batch_size
    if not rampup:
        return full
    start, increment, ramp_samples = rampup
    increments = (full - start) // increment
    if increments == 0 or consumed_samples > ramp_samples:
        return full
    return min(full, start + int(consumed_samples / (ramp_samples / increments)) * increment)


def eval_batch_size(training_config) -> int:
    """Samples per validation iteration: --eval-global-batch-size, else --global-batch-size."""
    return getattr(training_config, "eval_global_batch_size", None) or \
        training_config.global_batch_size


def ramp_batch_sizes(training_config) -> list[int]:
    """Every global batch size a run uses: the --rampup-batch-size steps, then the full size (or
    the --step-batch-size-schedule's sizes)."""
    if getattr(training_config, "batch_size_steps", None):
        return sorted(set(training_config.batch_size_steps[1::2]))
    full = training_config.global_batch_size
    if not training_config.rampup_batch_size:
        return [full]
    start, increment, _ = training_config.rampup_batch_size
    return list(range(start, full, increment)) + [full]


def iterations_for_samples(training_config, train_samples: int) -> int:
    """Iterations that consume ``train_samples`` samples (Megatron's count: the ramp-up phase
    iteration by iteration, then whole full-size batches)."""
    if getattr(training_config, "batch_size_steps", None):
        return batch_size_schedule.iterations_for_samples(training_config.batch_size_steps,
                                                          train_samples)
    full = training_config.global_batch_size
    iterations = consumed = 0
    if training_config.rampup_batch_size:
        ramp_samples = training_config.rampup_batch_size[2]
        while consumed <= ramp_samples and consumed <= train_samples:
            consumed += global_batch_size_at(training_config, consumed)
            iterations += 1
    return iterations + max(0, train_samples - consumed) // full


def microbatch_sample_ids(first_sample: int, micro_batch_size: int, data_parallel_size: int,
                          data_parallel_rank: int, num_microbatches: int) -> list[range]:
    """Global sample indices of each of this rank's micro-batches in one iteration."""
    block = micro_batch_size * data_parallel_size
    return [range(first_sample + k * block + data_parallel_rank * micro_batch_size,
                  first_sample + k * block + (data_parallel_rank + 1) * micro_batch_size)
            for k in range(num_microbatches)]


def batch_from_samples(samples: Sequence[dict], sample_ids: Sequence[int],
                       device: torch.device) -> dict:
    """Stack GPT samples ``{"text": int64[s + 1]}`` into a micro-batch.

    Returns ``tokens`` and ``labels`` ``[b, s]`` (the text shifted by one), ``loss_mask`` ``[b, s]``
    (a sample may carry its own ``loss_mask`` of length s; default all ones) and ``sample_ids`` ``[b]``.
    """
    text = torch.from_numpy(np.stack([np.asarray(s["text"], dtype=np.int64) for s in samples]))
    if "loss_mask" in samples[0]:
        loss_mask = torch.from_numpy(
            np.stack([np.asarray(s["loss_mask"], dtype=np.float32) for s in samples]))
    else:
        loss_mask = torch.ones(text.shape[0], text.shape[1] - 1, dtype=torch.float32)
    return {"tokens": text[:, :-1].contiguous().to(device),
            "labels": text[:, 1:].contiguous().to(device),
            "loss_mask": loss_mask.to(device),
            "sample_ids": torch.tensor(list(sample_ids), dtype=torch.int64, device=device)}


def build_microbatches(dataset, first_sample: int, micro_batch_size: int, data_parallel_size: int,
                       data_parallel_rank: int, num_microbatches: int,
                       device: torch.device, batch_from_samples=batch_from_samples) -> list[dict]:
    """This rank's micro-batches of the iteration starting at sample ``first_sample``, each made
    by ``batch_from_samples(samples, sample_ids, device)`` (a ModelSpec's; default GPT's)."""
    batches = []
    for ids in microbatch_sample_ids(first_sample, micro_batch_size, data_parallel_size,
                                     data_parallel_rank, num_microbatches):
        if ids.stop > len(dataset):
            raise RuntimeError(f"the dataset has {len(dataset)} samples but the iteration needs "
                               f"sample {ids.stop - 1}; build it with enough samples for "
                               f"--train-iters x --global-batch-size")
        batches.append(batch_from_samples([dataset[i] for i in ids], ids, device))
    return batches
