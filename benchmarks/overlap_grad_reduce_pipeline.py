"""--overlap-grad-reduce with a pipeline: iteration time with and without the flag, side by side.

One command: ``python benchmarks/overlap_grad_reduce_pipeline.py [--schedule 1f1b|interleaved|
chimera-split] [--hidden-size H] [--iters K]``. Both variants run in one process group of
PP 2 x DP 2 (4 forked gloo ranks, the tiny GPT of :mod:`_harness` at ``--hidden-size``), their
iterations alternated (one of each per round, so a load change hits both alike); reported: the
median over rounds of the slowest rank's iteration time, its min and max, the median of the
per-round ratio (with / without), and the exposed reduction: the training step's
``all-grads-sync`` timer (the wait for every reduction after the rank's list, summed over ranks per
round, median over rounds), the part that --overlap-grad-reduce moves into the backward. The
numbers of both variants are identical (the tests check it bit for bit); only where the gradient
all-reduce runs changes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))

import torch  # noqa: E402

from _harness import (MODEL_FLAGS, build_variant, format_table,  # noqa: E402
                      oversubscription_note, parallel_state_for)
from dist_harness import run_distributed  # noqa: E402  (tests/, on the path below)

SCHEDULES = {
    "1f1b": ["--pipeline-schedule", "1f1b"],
    "interleaved": ["--num-layers-per-virtual-pipeline-stage", "2"],
    "chimera-split": ["--pipeline-schedule", "chimera", "--split-backward"],
}


def _rank(rank: int, world_size: int, variants: list, warmup: int, iterations: int,
          bucket_size: int) -> list:
    """Per variant: (iteration seconds, all-grads-sync seconds) of each timed round."""
    import logging
    import time

    import torch.distributed as dist

    import pretrain_gpt
    from megatron.core.runtimes import pipeline
    from megatron.training.timers import Timers
    from megatron.training.training import train_step

    torch.set_num_threads(1)
    # This forked rank only: the runtime's bucket size with --overlap-grad-reduce (Megatron's
    # 40M elements make one bucket per module of this small model; no flag sets it).
    pipeline.OVERLAP_BUCKET_SIZE = bucket_size
    logging.getLogger("megatron.training.config_validation").setLevel(logging.ERROR)
    argvs = [MODEL_FLAGS + list(argv) for argv in variants]
    parallel_state = parallel_state_for(rank, world_size, argvs)
    built = [build_variant(world_size, argv, parallel_state) for argv in argvs]
    timers = Timers(1, "max", torch.device("cpu"))
    results: list = [[] for _ in built]
    for round_index in range(warmup + iterations):
        for (components, microbatches), result in zip(built, results):
            timers.elapsed_s.clear()
            dist.barrier()
            start = time.perf_counter()
            train_step(components, pretrain_gpt.forward_step, microbatches, timers=timers)
            dist.barrier()
            if round_index >= warmup:
                result.append((time.perf_counter() - start,
                               timers.elapsed_s.get("all-grads-sync", 0.0)))
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--bucket-size", type=int, default=40_000_000,
                        help="elements per bucket with --overlap-grad-reduce (default Megatron's "
                             "40M: one bucket per module of this model)")
    args = parser.parse_args(argv)
    base = (["--pipeline-model-parallel-size", "2", "--hidden-size", str(args.hidden_size),
             "--global-batch-size", str(args.global_batch_size)] + SCHEDULES[args.schedule])
    variants = [base, base + ["--overlap-grad-reduce"]]
    torch.set_num_threads(1)  # forked ranks hang if the parent ran multi-threaded ops
    per_rank = run_distributed(_rank, 4, variants, args.warmup, args.iters, args.bucket_size,
                               timeout=1200)
    rounds = [[max(rank[v][i][0] for rank in per_rank) for i in range(args.iters)]
              for v in range(2)]
    waits = [[sum(rank[v][i][1] for rank in per_rank) for i in range(args.iters)]
             for v in range(2)]
    rows = []
    for label, seconds, wait in zip(("without", "--overlap-grad-reduce"), rounds, waits):
        rows.append([label, f"{1e3 * statistics.median(seconds):.1f}",
                     f"{1e3 * min(seconds):.1f}", f"{1e3 * max(seconds):.1f}",
                     f"{1e3 * statistics.median(wait):.1f}",
                     f"{1e3 * min(wait):.1f}-{1e3 * max(wait):.1f}"])
    ratios = [with_ / without for without, with_ in zip(*rounds)]
    print(f"PP 2 x DP 2, {args.schedule}, hidden {args.hidden_size}, global batch "
          f"{args.global_batch_size}, buckets of {args.bucket_size} elements, {args.iters} "
          f"rounds after {args.warmup} warm-up; load before: {os.getloadavg()[0]:.2f}")
    print(format_table(["variant", "median ms", "min ms", "max ms",
                        "all-grads-sync ms (4 ranks)", "its range"], rows))
    print(f"per-round ratio with/without: median {statistics.median(ratios):.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f}")
    print(oversubscription_note(4))


if __name__ == "__main__":
    main()
