#!/usr/bin/env python
"""What one rank of our runtime spends per iteration, warm: ``cProfile`` of emulated iterations.

    python benchmarks/profile_emulated_rank.py                    # D = 4, N = 8, 0.01 ms units
    python benchmarks/profile_emulated_rank.py --only "ours chimera split" --depth 2 --top 20

Runs one of benchmarks/emulated_depth.py's configurations of ours (the same sleeping stages, real
gloo messages and stage all-reduces) with stage times so short (``--unit-ms``, default 0.01) that
nothing sleeps long and every cost is measured warm. Every rank runs warm-up iterations, then
``--iterations`` timed iterations without the profiler and as many under ``cProfile``; rank
``--rank`` prints both times per iteration, the ``--top`` functions by their own time, and the own
time of all functions under ``megatron/`` (the interpreter, transport, split backward: our Python)
per iteration and per compute op. docs/benchmarks.md §9 ("Per-layer weights, and what a message
costs here") has a run and what it showed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import emulated_depth  # noqa: E402  (puts the repository and tests/ on the path)
from dist_harness import run_distributed  # noqa: E402

OUR_PACKAGE = os.path.join(emulated_depth.REPO_ROOT, "megatron") + os.sep


def our_own_seconds(stats: pstats.Stats) -> float:
    """Own time (not counting callees) of every profiled function in a file under megatron/."""
    entries = stats.stats.items()  # type: ignore[attr-defined]
    return sum(entry[2] for (filename, _, _), entry in entries if filename.startswith(OUR_PACKAGE))


def _rank(rank, world_size, label, unit_ms, count, iterations, warmup, report_rank, top):
    import torch
    from _harness import parallel_state_for
    torch.set_num_threads(1)
    variants = dict(emulated_depth.our_variants(world_size))
    state = parallel_state_for(rank, world_size, [emulated_depth._config_flags(world_size, count)
                                                  + flags for flags in variants.values()])
    times = emulated_depth.equal_unit_times(world_size, unit_ms)
    _, step, _ = emulated_depth._our_configuration(
        label, variants[label], state, world_size, count, times,
        emulated_depth.module_sizes(1 << 20, 1 << 14), emulated_depth.FREE)
    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(iterations):
        step()
    plain = (time.perf_counter() - start) / iterations
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(iterations):
        step()
    profiler.disable()
    profiled = (time.perf_counter() - start) / iterations
    if rank != report_rank:
        return None
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    ops = compute_ops(label, world_size, count, times, rank)
    own = our_own_seconds(stats) / iterations
    return (f"rank {rank}, {label}, D = {world_size}, N = {count}, {unit_ms:g} ms units: "
            f"{plain * 1e3:.1f} ms per iteration without the profiler, {profiled * 1e3:.1f} ms "
            f"with it\nour Python (megatron/ functions' own time, under the profiler): "
            f"{own * 1e3:.1f} ms per iteration, {own * 1e3 / max(ops, 1):.3f} ms per compute op "
            f"({ops} compute ops)\n{text.getvalue()}")


def compute_ops(label, depth, count, times, rank) -> int:
    """How many compute ops ``rank``'s lowered list holds for our configuration ``label``."""
    from megatron.core.pipeline_parallel.planning.instructions import Instruction
    plan, _ = emulated_depth.our_plan(dict(emulated_depth.our_variants(depth))[label], depth,
                                      count, times)
    return sum(isinstance(op, Instruction) for op in plan.lowered[rank])


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="ours chimera interleaved split",
                        help="the configuration of ours (a label of emulated_depth.py)")
    parser.add_argument("--depth", type=int, default=4, help="pipeline ranks D (even)")
    parser.add_argument("--count", type=int, default=2, help="micro-batches N = count x D")
    parser.add_argument("--unit-ms", type=float, default=0.01,
                        help="F = I = W per stage, milliseconds (tiny: every cost warm)")
    parser.add_argument("--iterations", type=int, default=20, help="timed iterations each way")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rank", type=int, default=1, help="the rank that reports")
    parser.add_argument("--top", type=int, default=15, help="functions listed")
    args = parser.parse_args(argv)
    labels = [label for label, _ in emulated_depth.our_variants(args.depth)]
    if args.only not in labels:
        parser.error(f"--only {args.only!r} is not a configuration at D = {args.depth}; one of "
                     f"{labels}")
    if not 0 <= args.rank < args.depth:
        parser.error(f"--rank must be in 0..{args.depth - 1}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    results = run_distributed(_rank, args.depth, args.only, args.unit_ms,
                              args.count * args.depth, args.iterations, args.warmup, args.rank,
                              args.top, timeout=900)
    print(next(result for result in results if result is not None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
