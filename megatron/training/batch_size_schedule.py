"""``--step-batch-size-schedule "THRESHOLD:BS THRESHOLD:BS ..."`` (Megatron-LM's step-wise global
batch size).

Each entry says: from this point of training on, the global batch size is BS. THRESHOLD and BS take
Megatron's suffixes K (1e3), M (1e6), B (1e9) and T (1e12); thresholds count *tokens* (Megatron
passes the sequence length, so ``250B`` means 250 billion tokens) and become sample counts by
integer division by ``--seq-length``. The first threshold must be 0 and thresholds must increase;
entries may be separated by spaces or commas. An iteration that starts after ``consumed`` samples
uses the BS of the last threshold ``<= consumed``.
"""

from __future__ import annotations

_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def _number(text: str, schedule: str) -> int:
    text = text.strip().upper()
    multiplier = _SUFFIXES.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in _SUFFIXES else text
    try:
        return int(float(digits) * multiplier)
    except ValueError:
        raise ValueError(f"--step-batch-size-schedule {schedule!r}: {text!r} is not a number "
                         f"(suffixes K, M, B, T allowed)") from None


def parse_step_schedule(schedule: str, seq_length: int) -> list[tuple[int, int]]:
    """``[(threshold in samples, global batch size), ...]`` sorted by threshold, checked."""
    steps = []
    for entry in schedule.strip().strip("'\"").replace(",", " ").split():
        if ":" not in entry:
            raise ValueError(f"--step-batch-size-schedule {schedule!r}: entry {entry!r} is not "
                             f"THRESHOLD:BATCH_SIZE, e.g. \"0:768 250B:1536\"")
        threshold, batch_size = entry.split(":", 1)
        steps.append((_number(threshold, schedule) // seq_length, _number(batch_size, schedule)))
    steps.sort()
    if not steps or steps[0][0] != 0:
        raise ValueError(f"--step-batch-size-schedule {schedule!r}: the first threshold must be "
                         f"0 (the batch size training starts with)")
    for (previous, _), (threshold, _) in zip(steps, steps[1:]):
        if threshold <= previous:
            raise ValueError(f"--step-batch-size-schedule {schedule!r}: thresholds must increase "
                             f"(in samples of --seq-length {seq_length} tokens: {previous} then "
                             f"{threshold})")
    if any(batch_size < 1 for _, batch_size in steps):
        raise ValueError(f"--step-batch-size-schedule {schedule!r}: batch sizes must be >= 1")
    return steps


def flatten(steps: list[tuple[int, int]]) -> list[int]:
    """The schedule as the config stores it: ``[threshold0, bs0, threshold1, bs1, ...]``."""
    return [number for step in steps for number in step]


def unflatten(numbers: list[int]) -> list[tuple[int, int]]:
    return list(zip(numbers[0::2], numbers[1::2]))


def step_batch_size_at(numbers: list[int], consumed_samples: int) -> int:
    """The global batch size of the iteration that starts after ``consumed_samples`` samples."""
    size = numbers[1]
    for threshold, batch_size in unflatten(numbers):
        if consumed_samples < threshold:
            break
        size = batch_size
    return size


def iterations_for_samples(numbers: list[int], train_samples: int) -> int:
    """Iterations that consume ``train_samples`` samples: every step's batches up to the next
    threshold (the last batch of a step may cross it), then whole batches of the last step."""
    steps = unflatten(numbers)
    iterations = consumed = 0
    for (_, batch_size), (next_threshold, _) in zip(steps, steps[1:]):
        limit = min(next_threshold, train_samples)
        if consumed < limit:
            count = -(-(limit - consumed) // batch_size)
            iterations += count
            consumed += count * batch_size
    last = steps[-1][1]
    return iterations + max(0, train_samples - consumed) // last
