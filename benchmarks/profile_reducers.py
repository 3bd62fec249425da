#!/usr/bin/env python
"""torch.profiler of the data-parallel reducers' reduce step (gloo, CPU).

    python benchmarks/profile_reducers.py [--floats 1e7] [--dp 2] [--reducers "a2sgd model" topk qsgd]

On ``--dp`` forked gloo ranks, each reducer of benchmarks/_reducer_sweep.py reduces the gradient of
an :class:`EmulatedModel` of ``--floats`` entries: four timed steps (``zero_grad``, the emulated
backward without sleep, which is where ``a2sgd overlap`` does its statistics, ``start`` + ``wait`` +
``after_step``; the slowest rank's wall time), then one step under ``torch.profiler`` whose operator
table (self CPU time, rank 0; the backward's gradient accumulation included) is printed. What it showed is in docs/a2sgd.md ("What the reducers' arithmetic costs").
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


def _rank_profile(rank: int, world_size: int, numel: int, names: list, rows: int) -> dict:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from _emulated_compute import ComputeTime, EmulatedModel
    from _reducer_sweep import build_reducer
    group = dist.new_group(list(range(world_size)))
    model = EmulatedModel(numel, tensors=8, seed=1000 + rank)
    params = list(model.parameters())
    out = {}
    for name in names:
        reducer = build_reducer(name, params, group, world_size)

        def step(index):
            reducer.zero_grad()
            reducer.start_when_ready()
            model.forward_backward(ComputeTime(0.0), index)
            reducer.start()
            reducer.wait()
            reducer.after_step(True)
        times = []
        for index in range(STEPS):
            dist.barrier()
            started = time.perf_counter()
            step(index)
            times.append(time.perf_counter() - started)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            step(STEPS)
        out[name] = (times, profiler.key_averages().table(sort_by="self_cpu_time_total",
                                                          row_limit=rows))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floats", type=float, default=1e7)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--reducers", nargs="+",
                        default=["allreduce", "a2sgd model", "a2sgd overlap", "a2sgd bucket",
                                 "topk", "qsgd"])
    parser.add_argument("--rows", type=int, default=12, help="operators per table")
    args = parser.parse_args(argv)
    results = run_distributed(_rank_profile, args.dp, int(args.floats), args.reducers, args.rows,
                              timeout=3600)
    for name in args.reducers:
        slowest = [max(r[name][0][i] for r in results) for i in range(STEPS)]
        print(f"\n{name}: ms per reduce step (slowest rank, {STEPS} steps): "
              + " ".join(f"{t * 1e3:.0f}" for t in slowest))
        print(results[0][name][1])


if __name__ == "__main__":
    main()
