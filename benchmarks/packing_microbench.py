"""Pack + unpack cost per MB of payload, C++ extension vs pure Python, measured side by side.

One command: `python benchmarks/packing_microbench.py [--repeats N]`. The cases mimic pipeline
messages: one large activation, a few medium tensors, many small ones, and tiny control tensors.
"""

import argparse

import torch

from megatron.core.pipeline_parallel.execution.packing import microbenchmark_table, select_packer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed rounds per case (best is kept)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(select_packer("auto").describe())
    cases = ((1, 4 << 20), (8, 512 << 10), (64, 16 << 10), (16, 1 << 10), (4, 64))
    rows = microbenchmark_table(("cpp", "python"), cases, repeats=args.repeats)
    print(f"{'impl':<7}{'tensors':>8}{'bytes each':>12}{'MB/s':>10}{'us/MB':>10}{'us/message':>12}")
    for row in rows:
        if "error" in row:
            print(f"{row['mode']:<7} unavailable: {row['error']}")
            continue
        print(f"{row['mode']:<7}{row['num_tensors']:>8}{row['tensor_nbytes']:>12}"
              f"{row['mb_per_second']:>10.0f}{row['microseconds_per_mb']:>10.0f}"
              f"{row['microseconds_per_message']:>12.1f}")
    by_case = {}
    for row in rows:
        if "error" not in row:
            by_case.setdefault((row["num_tensors"], row["tensor_nbytes"]), {})[row["mode"]] = row
    print("\npython/cpp time ratio per case: " + ", ".join(
        f"{n}x{size}B: {modes['python']['microseconds_per_message'] / modes['cpp']['microseconds_per_message']:.2f}"
        for (n, size), modes in by_case.items() if {"cpp", "python"} <= modes.keys()))


if __name__ == "__main__":
    main()
