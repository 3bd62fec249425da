"""``benchmarks/a2sgd.py --emulate-compute``: the data-parallel reducers over a sweep of gradient
size and communication / compute, with sleeping compute and real gloo collectives.

Per data-parallel size P and gradient size N (float32 entries) it first measures, on P forked gloo
ranks, the exact all-reduce of the gradient alone (M, median of 5) and the compute that is not
sleep (C0: zeroing and accumulating the gradients, median of 3; no optimizer step). For each target
ratio r of communication / compute, a step then sleeps ``M / r - C0`` (at least 0), so its compute is
C = max(M / r, C0) and M / C = r where the sleep can reach it.

Reducers (each built once per size, all on the same :class:`EmulatedModel`; a reducer's
``zero_grad`` makes the gradients views of its own buffers again):

* ``allreduce``: :class:`GradientReducer`, one bucket, started after the backward;
* ``allreduce overlap``: the same with 8 buckets launched from the backward
  (``--overlap-grad-reduce``);
* ``a2sgd model`` / ``a2sgd bucket``: :class:`A2SGDReducer` over the whole gradient (the paper's, 32
  bytes) / per bucket of 1 M entries; the exact parameter sync every 10 steps is measured separately
  and added amortised (one tenth of its median time per step);
* ``a2sgd overlap``: ``a2sgd model`` with ``overlap=True`` (``--overlap-grad-reduce``): ``p = g + e``,
  its sign indicator and its statistics are formed tensor by tensor in the backward (during the
  sleep, as they would run on an accelerator while the rest of the backward computes); the
  all-reduce of 4 numbers, the reconstruction and the error remain after it;
* ``topk``: :class:`TopKReducer`, ratio 0.01 (8 bytes per kept entry, all-gathered);
* ``qsgd``: :class:`QSGDReducer`, 127 levels, buckets of 512 (1 byte per entry, all-gathered);
* ``a2sgd torch`` (only when named in ``--reducers``): ``a2sgd model`` with the torch passes
  instead of the fused C++ kernel (``A2SGDReducer(arithmetic="torch")``).

Before each (P, N) the benchmark estimates the memory the P ranks need
(:func:`resident_bytes_per_rank`) and skips the point, saying so, when it exceeds 90% of the
available memory.

Measurements are interleaved: round after round, every ratio, every reducer; each does ``steps``
timed steps (after one warm-up step in the first round), each between barriers, the slowest
rank's time. The step time of a
(reducer, ratio) is the median over rounds of each round's median, with the min-max of the round
medians as its spread. Bytes are what one worker sends per step in a ring algorithm
(:func:`~megatron.core.distributed.compressed.ring_bytes_sent`).
"""

from __future__ import annotations

import os
import statistics
import time

from _emulated_compute import ComputeTime, EmulatedModel, median_seconds

REDUCERS = ("allreduce", "allreduce overlap", "a2sgd model", "a2sgd overlap", "a2sgd bucket",
            "topk", "qsgd")
# On request only (--reducers): A2SGD whole model with the torch passes instead of the fused
# kernel, to compare the two arithmetics in the same minutes.
OPTIONAL_REDUCERS = ("a2sgd torch",)
TENSORS = 8
A2SGD_BUCKET = 1_000_000
A2SGD_SYNC_INTERVAL = 10
TOPK_RATIO = 0.01
QSGD_LEVELS, QSGD_BUCKET = 127, 512


def build_reducer(name: str, params: list, group, size: int):
    """One reducer of ``REDUCERS`` over ``params`` and the data-parallel ``group`` of ``size``."""
    from megatron.core.distributed.a2sgd import A2SGDReducer
    from megatron.core.distributed.gradient_reducer import GradientReducer
    from megatron.core.distributed.qsgd import QSGDReducer
    from megatron.core.distributed.topk import TopKReducer
    import torch.distributed as dist
    if name == "allreduce":
        return GradientReducer(params, group, divide_by=size)
    if name == "allreduce overlap":
        per_tensor = max(p.numel() for p in params)
        return GradientReducer(params, group, divide_by=size, bucket_size=per_tensor,
                               overlap=True)
    if name.startswith("a2sgd"):
        return A2SGDReducer(params, data_group=group, dp_size=size,
                            granularity="bucket" if name == "a2sgd bucket" else "model",
                            bucket_size=A2SGD_BUCKET, sync_interval=A2SGD_SYNC_INTERVAL,
                            overlap=name == "a2sgd overlap",
                            arithmetic="torch" if name == "a2sgd torch" else "auto")
    if name == "topk":
        return TopKReducer(params, ratio=TOPK_RATIO, data_group=group, dp_size=size)
    if name == "qsgd":
        return QSGDReducer(params, levels=QSGD_LEVELS, bucket_size=QSGD_BUCKET,
                           seed=1 + dist.get_rank(), data_group=group, dp_size=size)
    raise ValueError(f"unknown reducer {name!r}; use one of {REDUCERS + OPTIONAL_REDUCERS}")


# Resident memory per rank, in gradient-sized float32 buffers (4 N bytes), measured as the growth
# of one rank's RSS at 5 M floats over two steps and a sync (rounded up): the model (parameters and
# the two gradient patterns), each reducer (A2SGD with the fused kernel: gradient, error and p
# buffers; the torch passes add the sign indicator, and with overlap the hooks' scratch), the exact
# all-reduce that measures M, and one buffer of slack for the collectives.
RESIDENT_BUFFERS = {"model": 3.7, "allreduce": 1.2, "allreduce overlap": 1.2, "a2sgd model": 3.1,
                    "a2sgd overlap": 3.1, "a2sgd bucket": 3.1, "topk": 3.3, "qsgd": 1.2,
                    "a2sgd torch": 4.1}
TORCH_PATH_EXTRA = {"a2sgd model": 1.0, "a2sgd overlap": 2.0, "a2sgd bucket": 1.0}
PROCESS_BYTES = 2 ** 29  # a rank's interpreter, torch and gloo before any buffer
QSGD_GATHERED_PER_RANK = 0.26  # one int8 per entry and a float32 norm per 512, from every rank


def resident_bytes_per_rank(reducers: list, numel: int, ranks: int, fused: bool = True) -> float:
    """Estimated memory one rank of the sweep holds at ``numel`` floats (see RESIDENT_BUFFERS)."""
    buffers = RESIDENT_BUFFERS["model"] + RESIDENT_BUFFERS["allreduce"] + 1.0
    for name in reducers:
        buffers += RESIDENT_BUFFERS[name] + (0.0 if fused else TORCH_PATH_EXTRA.get(name, 0.0))
    if "qsgd" in reducers:
        buffers += QSGD_GATHERED_PER_RANK * ranks
    return buffers * 4 * numel + PROCESS_BYTES


def available_memory_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux), else the physical memory."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def bytes_per_step(name: str, numel: int, ranks: int) -> float:
    """What one worker sends per step (ring model), A2SGD's sync amortised."""
    from megatron.core.distributed.compressed import ring_bytes_sent
    from megatron.core.distributed.topk import kept_entries
    gradient = 4 * numel
    if name.startswith("allreduce"):
        return ring_bytes_sent(gradient, ranks, "all_reduce")
    if name.startswith("a2sgd"):
        segments = -(-numel // A2SGD_BUCKET) if name == "a2sgd bucket" else 1
        return (ring_bytes_sent(32 * segments, ranks, "all_reduce")
                + ring_bytes_sent(gradient, ranks, "all_reduce") / A2SGD_SYNC_INTERVAL)
    if name == "topk":
        return ring_bytes_sent(8 * kept_entries(numel, TOPK_RATIO), ranks, "all_gather")
    if name == "qsgd":
        padded = numel + (-numel) % QSGD_BUCKET
        return ring_bytes_sent(padded + 4 * padded // QSGD_BUCKET, ranks, "all_gather")
    raise ValueError(name)


def _one_step(model, reducer, compute: ComputeTime, step: int) -> None:
    reducer.zero_grad()
    reducer.start_when_ready()  # only the overlapping all-reduce does something
    model.forward_backward(compute, step)
    reducer.start()
    reducer.wait()
    reducer.after_step(True)  # no optimizer: see benchmarks/_emulated_compute.py


def rank_sweep(rank: int, world_size: int, sizes: list, ratios: list, reducers: list,
               rounds: int, steps: int) -> dict:
    """On one gloo rank: the whole sweep for this data-parallel size (see the module docstring)."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    group = dist.new_group(list(range(world_size)))
    barrier = dist.barrier
    out = {}
    for numel in sizes:
        model = EmulatedModel(numel, tensors=TENSORS, seed=1000 + rank)
        params = list(model.parameters())
        exact = build_reducer("allreduce", params, group, world_size)
        model.forward_backward(ComputeTime(0.0), 0)
        communication = median_seconds(lambda: (exact.start(), exact.wait()), 5, barrier)

        def compute_only():
            exact.zero_grad()
            model.forward_backward(ComputeTime(0.0), 1)
        fixed_compute = median_seconds(compute_only, 3, barrier)
        sleeps = {ratio: max(communication / ratio - fixed_compute, 0.0) for ratio in ratios}
        times = {(name, ratio): [] for name in reducers for ratio in ratios}
        sync_times = {name: [] for name in reducers if name.startswith("a2sgd")}
        # built once per size: an overlapping reducer's hooks stay on the parameters for good
        built = {name: build_reducer(name, params, group, world_size) for name in reducers}
        for round_index in range(rounds):
            for ratio in ratios:
                for name in reducers:
                    reducer = built[name]
                    compute = ComputeTime(sleeps[ratio])
                    if round_index == 0:
                        _one_step(model, reducer, compute, 0)  # warm-up
                    per_step = []
                    for step in range(1, steps + 1):
                        barrier()
                        started = time.perf_counter()
                        _one_step(model, reducer, compute, step)
                        per_step.append(time.perf_counter() - started)
                    if name in sync_times:
                        barrier()
                        started = time.perf_counter()
                        reducer.synchronize()
                        sync_times[name].append(time.perf_counter() - started)
                    times[(name, ratio)].append(per_step)
        out[numel] = {"communication": communication, "fixed_compute": fixed_compute,
                      "sleeps": sleeps, "times": times, "sync_times": sync_times}
    return out


def combine_ranks(per_rank: list, reducers: list, ratios: list) -> dict:
    """The slowest rank's step times -> per (size): M, C per ratio, and per (reducer, ratio) the
    median over rounds of the round medians, with their min-max (A2SGD's sync amortised)."""
    combined = {}
    for numel, first in per_rank[0].items():
        communication = max(r[numel]["communication"] for r in per_rank)
        fixed = max(r[numel]["fixed_compute"] for r in per_rank)
        sync = {name: statistics.median(max(r[numel]["sync_times"][name][i] for r in per_rank)
                                        for i in range(len(first["sync_times"][name])))
                for name in first["sync_times"]}
        rows = {}
        for ratio in ratios:
            compute = first["sleeps"][ratio] + fixed
            row = {"compute": compute, "ratio": communication / compute}
            for name in reducers:
                rounds = first["times"][(name, ratio)]
                round_medians = []
                for index in range(len(rounds)):
                    slowest = [max(r[numel]["times"][(name, ratio)][index][step]
                                   for r in per_rank)
                               for step in range(len(rounds[index]))]
                    round_medians.append(statistics.median(slowest)
                                         + sync.get(name, 0.0) / A2SGD_SYNC_INTERVAL)
                row[name] = (statistics.median(round_medians), min(round_medians),
                             max(round_medians))
            rows[ratio] = row
        combined[numel] = {"communication": communication, "fixed_compute": fixed,
                           "sync": sync, "rows": rows}
    return combined


def crossings(rows: dict, name: str) -> str:
    """Where ``name`` starts to beat ``allreduce`` along the sweep (by target ratio)."""
    wins = [ratio for ratio in sorted(rows) if rows[ratio][name][0] < rows[ratio]["allreduce"][0]]
    if not wins:
        return "never"
    if len(wins) == len(rows):
        return "everywhere"
    monotone = wins == sorted(rows)[-len(wins):]
    return f"from M/C {min(wins):g}" + ("" if monotone else " (not monotone)")
