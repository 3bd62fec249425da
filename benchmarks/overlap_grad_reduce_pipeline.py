"""--overlap-grad-reduce with a pipeline: iteration time with and without the flag, side by side.

One command: ``python benchmarks/overlap_grad_reduce_pipeline.py [--schedule 1f1b|interleaved|
chimera-split] [--hidden-size H] [--iters K]``. Both variants run in one process group of
PP 2 x DP 2 (4 forked gloo ranks, the tiny GPT of :mod:`_harness` at ``--hidden-size``), their
iterations alternated (one of each per round, so a load change hits both alike); reported: the
median over rounds of the slowest rank's iteration time, its min and max, and the median of the
per-round ratio (with / without). The numbers of both variants are identical (the tests check it
bit for bit); only where the gradient all-reduce runs changes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import format_table, oversubscription_note, run_side_by_side  # noqa: E402

SCHEDULES = {
    "1f1b": ["--pipeline-schedule", "1f1b"],
    "interleaved": ["--num-layers-per-virtual-pipeline-stage", "2"],
    "chimera-split": ["--pipeline-schedule", "chimera", "--split-backward"],
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    base = (["--pipeline-model-parallel-size", "2", "--hidden-size", str(args.hidden_size),
             "--global-batch-size", str(args.global_batch_size)] + SCHEDULES[args.schedule])
    variants = [base, base + ["--overlap-grad-reduce"]]
    per_rank = run_side_by_side(4, variants, warmup=args.warmup, iterations=args.iters,
                                timeout=1200)
    rounds = [[max(rank[v].iteration_seconds[i] for rank in per_rank)
               for i in range(args.iters)] for v in range(2)]
    rows = []
    for label, seconds in zip(("without", "--overlap-grad-reduce"), rounds):
        rows.append([label, f"{1e3 * statistics.median(seconds):.1f}",
                     f"{1e3 * min(seconds):.1f}", f"{1e3 * max(seconds):.1f}"])
    ratios = [with_ / without for without, with_ in zip(*rounds)]
    print(f"PP 2 x DP 2, {args.schedule}, hidden {args.hidden_size}, global batch "
          f"{args.global_batch_size}, {args.iters} rounds after {args.warmup} warm-up")
    print(format_table(["variant", "median ms", "min ms", "max ms"], rows))
    print(f"per-round ratio with/without: median {statistics.median(ratios):.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f}")
    print(oversubscription_note(4))


if __name__ == "__main__":
    main()
