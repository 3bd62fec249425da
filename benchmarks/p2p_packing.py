"""Point-to-point packing, measured: messages and p2p time per iteration, packing off vs C++ vs Python.

One command: ``python benchmarks/p2p_packing.py [--quick]``. For each pipeline configuration
(Chimera D=2 and D=4, direct and forward doubling, and 1F1B D=4) it forks D gloo ranks once and
trains the tiny GPT of :mod:`_harness` with ``--p2p-packing off``, ``cpp`` and ``python`` side by
side (one process group, iterations interleaved), reading the transport counters of the timed
iterations only. Then it times pack + unpack per MB, C++ vs Python, on messages shaped like this
model's activations.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import format_table, oversubscription_note, run_side_by_side, summarize  # noqa: E402

PACKINGS = ("off", "cpp", "python")


def configurations(quick: bool) -> list:
    """(label, world size, flags) of every measured pipeline; N = 2D micro-batches (4 when quick)."""
    configs = []
    for depth in (2, 4):
        for variant in ("direct", "forward-doubling"):
            configs.append((f"chimera {variant} D={depth}", depth, depth, variant))
    configs.append(("1f1b D=4", 4, 4, None))
    result = []
    for label, world_size, depth, variant in configs:
        num_microbatches = depth if quick else 2 * depth
        flags = ["--pipeline-model-parallel-size", str(depth),
                 "--global-batch-size", str(2 * num_microbatches)]
        if variant is None:
            flags += ["--pipeline-schedule", "1f1b"]
        else:
            flags += ["--pipeline-schedule", "chimera", "--chimera-variant", variant]
        result.append((f"{label} N={num_microbatches}", world_size, flags))
    return result


def lowered_message_counts(world_size: int, flags: list) -> dict:
    """What the lowered schedule lets packing merge, counted without processes (lowered as the
    runtime lowers it with packing on).

    ``tensors``: sends over all ranks per iteration (the message count with packing off);
    ``packed``: distinct (communication group, peer) pairs (the message count with packing on);
    ``max_per_message``: the most tensors any packed message carries.
    """
    from megatron.core.pipeline_parallel.planning.lowering import SEND, P2PGroup
    from megatron.core.pipeline_parallel.planning.plan import plan_from_config
    from megatron.training.arguments import parse_args
    from _harness import MODEL_FLAGS

    config = parse_args(MODEL_FLAGS + list(flags), world_size=world_size)
    tensors, per_message = 0, []
    for rank_ops in plan_from_config(config, doubled_step_messages=True).lowered:
        for op in rank_ops:
            if not isinstance(op, P2PGroup):
                continue
            peers: dict = {}
            for p2p in op.ops:
                if p2p.direction == SEND:
                    peers[p2p.peer] = peers.get(p2p.peer, 0) + 1
            tensors += sum(peers.values())
            per_message.extend(peers.values())
    return {"tensors": tensors, "packed": len(per_message),
            "max_per_message": max(per_message, default=0)}


def measure_pipelines(configs: list, warmup: int, iterations: int) -> list:
    """One row per (configuration, packing) with per-iteration messages, bytes and p2p time."""
    rows = []
    for label, world_size, flags in configs:
        variants = [flags + ["--p2p-packing", packing] for packing in PACKINGS]
        per_rank = run_side_by_side(world_size, variants, warmup=warmup, iterations=iterations)
        summaries = [summarize(per_rank, index, iterations) for index in range(len(PACKINGS))]
        off = summaries[0]
        lowered = lowered_message_counts(world_size, flags)
        for packing, summary in zip(PACKINGS, summaries):
            rows.append({"config": label, "packing": packing, **summary, "lowered": lowered,
                         "messages_ratio": off["messages"] / summary["messages"],
                         "p2p_ratio": summary["p2p_seconds"] / off["p2p_seconds"]})
    return rows


def print_pipeline_table(rows: list) -> None:
    table = [[row["config"], row["packing"], f"{row['messages']:.0f}",
              f"{row['bytes'] / 1e6:.2f}", f"{row['p2p_seconds'] * 1e3:.1f}",
              f"{row['seconds'] * 1e3:.0f}", f"{row['messages_ratio']:.2f}",
              f"{row['p2p_ratio']:.2f}"] for row in rows]
    print(format_table(["configuration", "packing", "msgs/iter", "MB/iter", "p2p ms/iter/rank",
                        "iter ms", "msgs off/this", "p2p this/off"], table))


def print_lowered_table(rows: list) -> None:
    """What the lowered schedules allow packing to merge (counted from the lowering)."""
    print("\nWhat the lowering lets packing merge (counted from the lowered schedule, no processes):")
    seen: dict = {}
    for row in rows:
        seen.setdefault(row["config"], row["lowered"])
    print(format_table(["configuration", "tensors sent/iter", "packed messages/iter",
                        "max tensors per packed message"],
                       [[label, c["tensors"], c["packed"], c["max_per_message"]]
                        for label, c in seen.items()]))


def measure_pack_unpack(repeats: int) -> list:
    """Pack + unpack cost, C++ vs Python, on message shapes of this benchmark's pipelines."""
    from megatron.core.pipeline_parallel.execution.packing import microbenchmark_table

    activation = 64 * 2 * 64 * 4  # seq x micro-batch x hidden, float32
    cases = ((1, activation), (2, activation), (4, activation), (1, 4 << 20), (64, 16 << 10))
    return microbenchmark_table(("cpp", "python"), cases, repeats=repeats)


def print_pack_table(rows: list) -> None:
    by_case = {}
    for row in rows:
        if "error" in row:
            print(f"{row['mode']}: unavailable ({row['error']})")
            continue
        by_case.setdefault((row["num_tensors"], row["tensor_nbytes"]), {})[row["mode"]] = row
    table = []
    for (count, size), modes in by_case.items():
        if not {"cpp", "python"} <= modes.keys():
            continue
        cpp, python = modes["cpp"], modes["python"]
        table.append([f"{count} x {size} B", f"{cpp['microseconds_per_mb']:.0f}",
                      f"{python['microseconds_per_mb']:.0f}",
                      f"{cpp['microseconds_per_message']:.1f}",
                      f"{python['microseconds_per_message']:.1f}",
                      f"{python['microseconds_per_message'] / cpp['microseconds_per_message']:.2f}"])
    print(format_table(["message", "C++ us/MB", "Python us/MB", "C++ us/msg", "Python us/msg",
                        "Python/C++"], table))


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="Chimera D=2 direct and 1F1B D=4 only, N=D, fewer iterations")
    parser.add_argument("--warmup", type=int, default=None, help="untimed iterations (default 2, quick 1)")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations (default 5, quick 2)")
    parser.add_argument("--pack-repeats", type=int, default=None,
                        help="rounds of the pack+unpack micro-benchmark (best kept; default 20, quick 5)")
    parser.add_argument("--skip-pipelines", action="store_true",
                        help="only the pack+unpack micro-benchmark (no processes)")
    args = parser.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.iters = args.iters if args.iters is not None else (2 if args.quick else 5)
    args.pack_repeats = args.pack_repeats if args.pack_repeats is not None else (5 if args.quick else 20)
    return args


def main(argv=None) -> dict:
    import torch

    from megatron.core.pipeline_parallel.execution.packing import select_packer

    args = parse_arguments(argv)
    torch.set_num_threads(1)
    # Load (or JIT-compile) the C++ extension once here so forked ranks inherit it.
    print(select_packer("auto").describe())
    configs = configurations(args.quick)
    if args.quick:
        configs = [c for c in configs if c[0].startswith(("chimera direct D=2", "1f1b"))]
    pipeline_rows = []
    if not args.skip_pipelines:
        print(f"\n== Pipelines: per iteration, {args.iters} timed after {args.warmup} warm-up "
              "(tiny GPT: hidden 64, 8 layers, seq 64, micro-batch 2, float32) ==")
        print(oversubscription_note(max(c[1] for c in configs)))
        pipeline_rows = measure_pipelines(configs, args.warmup, args.iters)
        print_pipeline_table(pipeline_rows)
        print("msgs/iter and MB/iter: sent by all ranks; p2p ms: time inside the transport "
              "(pack, send/receive, wait for the peer, unpack), mean over ranks.")
        print_lowered_table(pipeline_rows)
    print(f"\n== Pack + unpack, one thread, best of {args.pack_repeats} (MB = 1e6 payload bytes) ==")
    pack_rows = measure_pack_unpack(args.pack_repeats)
    print_pack_table(pack_rows)
    return {"pipelines": pipeline_rows, "pack_unpack": pack_rows}


if __name__ == "__main__":
    main()
