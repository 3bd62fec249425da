#!/usr/bin/env python
"""torch.profiler of the data-parallel reducers' reduce step (gloo, CPU).

    python benchmarks/profile_reducers.py [--floats 1e7] [--dp 2] [--reducers "a2sgd model" topk qsgd]

On ``--dp`` forked gloo ranks, each reducer of benchmarks/_reducer_sweep.py reduces the gradient of
an :class:`EmulatedModel` of ``--floats`` entries: four timed steps (``zero_grad``, the emulated
backward without sleep, which is where ``a2sgd overlap`` does its statistics, ``start`` + ``wait`` +
``after_step``; the slowest rank's wall time), then one step under ``torch.profiler`` whose operator
table (self CPU time, rank 0; the backward's gradient accumulation included) is printed. What it showed is in docs/a2sgd.md ("What the reducers' arithmetic costs").

    python benchmarks/profile_reducers.py --cpu-time [--floats 1e7] [--steps 8] [--reducers ...]

instead measures, in one process without communication (a gloo group of one rank, one torch
thread), the CPU time (all threads of the process: ``a2sgd overlap`` works on a worker thread) of
a whole emulated step without sleep (``zero_grad``, backward, reduce, ``after_step``), interleaving
the reducers step by step so they share the same minutes, and the same for the backward alone;
it prints the min and median over ``--steps`` steps and the median above the all-reduce's step
(with one rank that is zeroing, the backward's accumulation and the division by P). ``a2sgd torch`` is the whole-model A2SGD with the torch passes (the fused kernel's
predecessor).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _path in (REPO, os.path.join(REPO, "tests"), HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from dist_harness import run_distributed  # noqa: E402  (tests/ helper, shared on purpose)

STEPS = 4


def _reduce_step(reducer, model, index: int) -> None:
    """One emulated step (no sleep) through ``reducer``'s whole lifecycle."""
    from _emulated_compute import ComputeTime
    reducer.zero_grad()
    reducer.start_when_ready()
    model.forward_backward(ComputeTime(0.0), index)
    reducer.start()
    reducer.wait()
    reducer.after_step(True)


def _rank_profile(rank: int, world_size: int, numel: int, names: list, rows: int) -> dict:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from _emulated_compute import EmulatedModel
    from _reducer_sweep import build_reducer
    group = dist.new_group(list(range(world_size)))
    model = EmulatedModel(numel, tensors=8, seed=1000 + rank)
    params = list(model.parameters())
    out = {}
    for name in names:
        reducer = build_reducer(name, params, group, world_size)

        times = []
        for index in range(STEPS):
            dist.barrier()
            started = time.perf_counter()
            _reduce_step(reducer, model, index)
            times.append(time.perf_counter() - started)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            _reduce_step(reducer, model, STEPS)
        out[name] = (times, profiler.key_averages().table(sort_by="self_cpu_time_total",
                                                          row_limit=rows))
    return out


def _rank_cpu_time(rank: int, world_size: int, numel: int, names: list, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from _emulated_compute import ComputeTime, EmulatedModel
    from _reducer_sweep import build_reducer
    torch.set_num_threads(1)
    group = dist.new_group(list(range(world_size)))
    model = EmulatedModel(numel, tensors=8, seed=1000 + rank)
    params = list(model.parameters())
    reducers = {name: build_reducer(name, params, group, world_size) for name in names}

    def backward_only(index):
        reducers[names[0]].zero_grad()
        model.forward_backward(ComputeTime(0.0), index)

    times: dict = {name: [] for name in ["backward only"] + names}
    for index in range(steps + 1):  # the first round warms up
        for name in ["backward only"] + names:
            started = time.process_time()
            if name == "backward only":
                backward_only(index)
            else:
                _reduce_step(reducers[name], model, index)
            if index:
                times[name].append(time.process_time() - started)
    return times


def cpu_time_main(args) -> None:
    import statistics
    times = run_distributed(_rank_cpu_time, 1, int(args.floats), args.reducers, args.steps,
                            timeout=3600)[0]
    base_name = "allreduce" if "allreduce" in times else "backward only"
    base = statistics.median(times[base_name])
    print(f"CPU time per emulated step (process time, 1 torch thread), {int(args.floats):,} "
          f"floats, {args.steps} interleaved steps: min / median ms, and the median above "
          f"{base_name}'s step ({base * 1e3:.1f} ms)")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:>16}: {min(values) * 1e3:7.1f} / {median * 1e3:7.1f}   above "
              f"{(median - base) * 1e3:+7.1f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floats", type=float, default=1e7)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--reducers", nargs="+",
                        default=["allreduce", "a2sgd torch", "a2sgd model", "a2sgd overlap",
                                 "a2sgd bucket", "topk", "qsgd"])
    parser.add_argument("--rows", type=int, default=12, help="operators per table")
    parser.add_argument("--cpu-time", action="store_true",
                        help="measure the CPU time per step of each reducer (no communication)")
    parser.add_argument("--steps", type=int, default=8, help="with --cpu-time: steps per reducer")
    args = parser.parse_args(argv)
    if args.cpu_time:
        cpu_time_main(args)
        return
    results = run_distributed(_rank_profile, args.dp, int(args.floats), args.reducers, args.rows,
                              timeout=3600)
    for name in args.reducers:
        slowest = [max(r[name][0][i] for r in results) for i in range(STEPS)]
        print(f"\n{name}: ms per reduce step (slowest rank, {STEPS} steps): "
              + " ".join(f"{t * 1e3:.0f}" for t in slowest))
        print(results[0][name][1])


if __name__ == "__main__":
    main()
