"""Our pipeline schedules vs torch.distributed.pipelining on the identical GPT, side by side.

One command: ``python benchmarks/vs_torch_pipelining.py [--size issue|tiny] [--rounds R] [--iters I]``.

1. Single process (one forked process, one thread): our training step (``train_step`` of
   ``pretrain_gpt``'s model, world size 1), the same GPTModel driven by a plain PyTorch loop (the
   "same code" as the PyTorch pipeline), and a plain nanoGPT-style model of the same shape
   (``_plain_gpt``): tokens/s, interleaved in rounds. ``ours / plain`` is issue 10's overhead ratio.
2. Pipelined, D ranks (default 2: one gloo rank per core on a 2-core machine): ours (1F1B,
   interleaved 1F1B, every Chimera variant x gradient-sync policy) and PyTorch's Schedule1F1B,
   ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV
   at N = 2, 4, 8 micro-batches, all built once in one process group, then timed in rounds: every
   round runs every configuration for ``--iters`` iterations, so a slow phase of a shared machine
   hits all of them. Per configuration: tokens/s (median over all timed iterations and the spread
   min-max), efficiency = tokens/s / (D x single-process tokens/s of the same code: ours for ours,
   the plain loop over GPTModel for PyTorch; timed inside the rounds with every rank running the whole
   model alone at the same moment, so it sees the same machine load), measured bubble = 1 - efficiency (it includes p2p and
   framework costs), simulated bubble (ours: our simulator; PyTorch: its own ``pipeline_order``
   list-scheduled; both F = 1, B = 2, zero p2p cost) and peak saved-activation MB per rank.

Configurations a schedule refuses (e.g. DualPipeV with N < 2D, Chimera forward doubling with N not a
multiple of D) are listed as skipped with the reason.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import format_table, oversubscription_note, run_distributed  # noqa: E402
from _torch_pipelining import TORCH_SCHEDULES  # noqa: E402

#: Model flags: "issue" is issue 10's model, "tiny" is for smoke tests.
MODEL_SIZES = {
    "issue": "--num-layers 8 --hidden-size 256 --num-attention-heads 4 --seq-length 128 "
             "--max-position-embeddings 128 --vocab-size 1024 --micro-batch-size 4",
    "tiny": "--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
            "--max-position-embeddings 32 --vocab-size 128 --micro-batch-size 2",
}
COMMON_FLAGS = ("--make-vocab-size-divisible-by 128 --untie-embeddings-and-output-weights "
                "--hidden-dropout 0 --attention-dropout 0 --lr 1e-3 --train-iters 1000 "
                "--mock-data --seed 1234 --eval-iters 0")

#: Single-process baselines timed inside the rounds: every rank runs the whole model on its own at
#: the same moment, so "D x single-process tokens/s" sees the same machine load as the pipelines.
IN_ROUND_BASELINES = (("single process, ours, on every rank", "single-ours"),
                      ("single process, GPTModel plain loop, on every rank", "single-torch"))

OUR_SCHEDULES = [("ours 1F1B", ["--pipeline-schedule", "1f1b"])]
OUR_SCHEDULES += [(f"ours chimera {variant} sync={policy}",
                   ["--pipeline-schedule", "chimera", "--chimera-variant", variant,
                    "--chimera-grad-sync", policy])
                  for variant in ("direct", "forward-doubling", "backward-halving")
                  for policy in ("eager-opt", "eager", "end")]


def model_flags(size: str) -> list:
    return (MODEL_SIZES[size] + " " + COMMON_FLAGS).split()


def our_schedules(size: str, depth: int) -> list:
    """(label, flags) of our schedules; interleaved 1F1B uses two model chunks per rank."""
    layers = int(MODEL_SIZES[size].split("--num-layers ")[1].split()[0])
    interleaved = ("ours interleaved 1F1B",
                   ["--num-layers-per-virtual-pipeline-stage", str(layers // (2 * depth))])
    return OUR_SCHEDULES[:1] + [interleaved] + OUR_SCHEDULES[1:]


def configurations(size: str, depth: int, microbatch_counts: list, torch_labels: list,
                   ours_filter: str = "") -> tuple:
    """(runnable, skipped): dicts with label, N, kind, flags / reason, simulated bubble (ours)."""
    from megatron.training.arguments import parse_args

    runnable, skipped = [], []
    for num_microbatches in microbatch_counts:
        batch_flags = ["--pipeline-model-parallel-size", str(depth), "--global-batch-size",
                       str(num_microbatches * micro_batch_size(size))]
        for label, flags in our_schedules(size, depth):
            if ours_filter not in label:
                continue
            try:
                config = parse_args(model_flags(size) + batch_flags + flags, world_size=depth)
                bubble = our_simulated_bubble(config, depth, num_microbatches)
            except ValueError as error:
                skipped.append({"label": label, "N": num_microbatches, "reason": str(error)})
                continue
            runnable.append({"label": label, "N": num_microbatches, "kind": "ours",
                             "flags": batch_flags + flags, "simulated_bubble": bubble})
        for label in torch_labels:
            runnable.append({"label": label, "N": num_microbatches, "kind": "torch",
                             "flags": batch_flags})
    return runnable, skipped


def micro_batch_size(size: str) -> int:
    return int(MODEL_SIZES[size].split("--micro-batch-size ")[1].split()[0])


def our_simulated_bubble(config, depth: int, num_microbatches: int) -> float:
    """Our simulator's bubble ratio of the configured schedule, F = 1, B = 2, zero p2p cost."""
    from megatron.core.pipeline_parallel.planning.schedules import schedule_from_config
    from megatron.core.pipeline_parallel.planning.simulator import simulate_schedule

    name, options = schedule_from_config(config.parallel)
    policy = getattr(config.parallel, "chimera_grad_sync", None) or "eager-opt"
    _, _, result = simulate_schedule(name, depth, num_microbatches, 1.0, 2.0,
                                     grad_sync_policy=policy, **options)
    return result.bubble_ratio


def _data(config, num_microbatches: int) -> list:
    """The global batch of iteration 0 as micro-batches (the data every configuration trains on)."""
    import torch

    import pretrain_gpt
    from megatron.core.parallel_state import ParallelState
    from megatron.training.microbatches import build_microbatches

    batch = config.training.micro_batch_size * num_microbatches
    dataset, _, _ = pretrain_gpt.datasets_provider(config, ParallelState.single_process(),
                                                   (batch, 0, 0))
    return build_microbatches(dataset, 0, config.training.micro_batch_size, 1, 0,
                              num_microbatches, torch.device("cpu"))


class OurRun:
    """One of our configurations on this rank: the training step of pretrain_gpt."""

    def __init__(self, rank: int, world_size: int, flags: list, parallel_state):
        from _harness import _build

        self.components, self.microbatches = _build(rank, world_size, flags, parallel_state)
        self.description = self.components.runtime.describe()

    def step(self) -> None:
        import pretrain_gpt
        from megatron.training.training import train_step

        train_step(self.components, pretrain_gpt.forward_step, self.microbatches)

    def peak_bytes(self) -> int:
        interpreter = getattr(self.components.runtime, "last_interpreter", None)
        return getattr(interpreter, "peak_bytes", 0) or 0


class PlainLoopRun:
    """Our GPTModel, whole, driven by a plain PyTorch loop (the PyTorch pipeline's single process)."""

    def __init__(self, config, microbatches: list):
        import torch

        from _torch_pipelining import build_chunk, cross_entropy_loss

        self.model = build_chunk(config, 0, 1)
        self.loss = cross_entropy_loss
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.optimizer.lr)
        self.microbatches = microbatches
        self.description = "GPTModel + plain loop + torch.optim.Adam"

    def step(self) -> None:
        self.optimizer.zero_grad()
        for batch in self.microbatches:
            logits = self.model(batch["tokens"])
            (self.loss(logits, batch["labels"]) / len(self.microbatches)).backward()
        self.optimizer.step()


def _timed_rounds(runs: list, warmup: int, rounds: int, iterations: int, barrier,
                  cpu_seconds: list = None, on_round=None) -> list:
    """Seconds of every timed iteration per run; runs interleaved round by round.

    ``cpu_seconds`` (optional, one list per run) receives this process's CPU time per iteration:
    on a machine shared with other jobs it varies far less than wall time (one thread, no waits).
    """
    for run in runs:
        for _ in range(warmup):
            run.step()
    seconds = [[] for _ in runs]
    for round_index in range(rounds):
        if on_round is not None:
            on_round(round_index)
        for index, run in enumerate(runs):
            for _ in range(iterations):
                barrier()
                start, cpu_start = time.perf_counter(), time.process_time()
                run.step()
                barrier()
                seconds[index].append(time.perf_counter() - start)
                if cpu_seconds is not None:
                    cpu_seconds[index].append(time.process_time() - cpu_start)
    return seconds


def _single_rank(rank: int, world_size: int, size: str, num_microbatches: int, warmup: int,
                 rounds: int, iterations: int) -> list:
    import torch

    from _harness import _parallel_state
    from _plain_gpt import PlainTraining
    from megatron.training.arguments import parse_args

    torch.set_num_threads(1)
    flags = model_flags(size) + ["--global-batch-size",
                                 str(num_microbatches * micro_batch_size(size))]
    parallel_state = _parallel_state(rank, 1, [flags])
    config = parse_args(flags, world_size=1)
    microbatches = _data(config, num_microbatches)
    runs = [OurRun(rank, 1, flags, parallel_state), PlainLoopRun(config, microbatches),
            PlainTraining(config, microbatches)]
    cpu_seconds = [[] for _ in runs]
    seconds = _timed_rounds(runs, warmup, rounds, iterations, lambda: None, cpu_seconds)
    return [{"seconds": s, "cpu_seconds": c, "description": run.description}
            for s, c, run in zip(seconds, cpu_seconds, runs)]


def _single_run(config: dict, flags: list, rank: int):
    """A single-process baseline that every rank runs at once, on its own (no communication)."""
    from megatron.core.parallel_state import ParallelState
    from megatron.training.arguments import parse_args

    single_flags = [f for f in flags]
    depth_at = single_flags.index("--pipeline-model-parallel-size")
    del single_flags[depth_at:depth_at + 2]
    if config["kind"] == "single-ours":
        return OurRun(rank, 1, single_flags, ParallelState.single_process())
    parsed = parse_args(single_flags, world_size=1)
    return PlainLoopRun(parsed, _data(parsed, config["N"]))


def _pipelined_rank(rank: int, world_size: int, size: str, configs: list, warmup: int,
                    rounds: int, iterations: int) -> list:
    import logging

    import torch
    import torch.distributed as dist

    from _harness import _parallel_state
    from _torch_pipelining import SavedActivationPeak, TorchPipelineRun
    from megatron.training.arguments import parse_args

    torch.set_num_threads(1)
    logging.getLogger("megatron.training.config_validation").setLevel(logging.ERROR)
    ours = [model_flags(size) + c["flags"] for c in configs if c["kind"] == "ours"]
    parallel_state = _parallel_state(rank, world_size, ours or [model_flags(size) + configs[0]["flags"]])
    torch_group = dist.new_group(list(range(world_size)))
    runs = []
    for config in configs:
        flags = model_flags(size) + config["flags"]
        if config["kind"] == "ours":
            runs.append(OurRun(rank, world_size, flags, parallel_state))
        elif config["kind"].startswith("single"):
            runs.append(_single_run(config, flags, rank))
        else:
            parsed = parse_args(flags, world_size=world_size)
            try:  # PyTorch refuses some (schedule, N): every rank decides the same
                runs.append(TorchPipelineRun(config["label"], parsed, rank, world_size,
                                             torch_group, _data(parsed, config["N"])))
            except ValueError as error:
                runs.append(str(error))
    timed = [run for run in runs if not isinstance(run, str)]
    def progress(round_index):
        if rank == 0:
            print(f"  round {round_index + 1}/{rounds} of {len(timed)} configurations "
                  f"({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)

    seconds = iter(_timed_rounds(timed, warmup, rounds, iterations, dist.barrier,
                                 on_round=progress))
    results = []
    for run in runs:
        if isinstance(run, str):
            results.append({"skipped": run})
            continue
        result = {"seconds": next(seconds), "description": run.description}
        if isinstance(run, TorchPipelineRun):
            with SavedActivationPeak(run.parameters) as tracker:
                run.step()
            result["peak_bytes"] = tracker.peak_bytes
            result["simulated_bubble"] = run.simulated_bubble()
        else:
            result["peak_bytes"] = run.peak_bytes() if hasattr(run, "peak_bytes") else 0
        results.append(result)
    return results


def tokens_per_iteration(size: str, num_microbatches: int) -> int:
    seq = int(MODEL_SIZES[size].split("--seq-length ")[1].split()[0])
    return num_microbatches * micro_batch_size(size) * seq


def throughput(seconds: list, tokens: int) -> dict:
    """Median tokens/s over the timed iterations and the spread (min, max)."""
    rates = [tokens / s for s in seconds]
    return {"tokens_per_s": statistics.median(rates), "min": min(rates), "max": max(rates)}


def run_single(args) -> dict:
    """Single-process tokens/s of our step, the plain loop over GPTModel, and the plain model."""
    num_microbatches = max(args.microbatches)
    [results] = run_distributed(_single_rank, 1, args.size, num_microbatches, args.warmup,
                                args.rounds, args.iters, timeout=args.timeout)
    tokens = tokens_per_iteration(args.size, num_microbatches)
    rows = {name: {**throughput(r["seconds"], tokens), "description": r["description"],
                   "tokens_per_cpu_s": throughput(r["cpu_seconds"], tokens)["tokens_per_s"]}
            for name, r in zip(("ours", "plain loop", "plain model"), results)}
    ours, plain = rows["ours"], rows["plain model"]
    ours["vs_plain_model"] = ours["tokens_per_s"] / plain["tokens_per_s"]
    ours["cpu_vs_plain_model"] = ours["tokens_per_cpu_s"] / plain["tokens_per_cpu_s"]
    return rows


def run_pipelined(args, configs: list) -> tuple:
    """Measure the configurations and the in-round baselines side by side; (rows, skipped,
    baselines)."""
    num_microbatches = max(args.microbatches)
    batch_flags = ["--pipeline-model-parallel-size", str(args.depth), "--global-batch-size",
                   str(num_microbatches * micro_batch_size(args.size))]
    configs = configs + [{"label": label, "N": num_microbatches, "kind": kind, "flags": batch_flags}
                         for label, kind in IN_ROUND_BASELINES]
    per_rank = run_distributed(_pipelined_rank, args.depth, args.size, configs, args.warmup,
                               args.rounds, args.iters, timeout=args.timeout)
    rows, skipped = [], []
    for index, config in enumerate(configs):
        results = [rank_results[index] for rank_results in per_rank]
        if "skipped" in results[0]:
            skipped.append({"label": config["label"], "N": config["N"],
                            "reason": results[0]["skipped"]})
            continue
        seconds = [max(times) for times in zip(*(r["seconds"] for r in results))]
        row = {**config, **throughput(seconds, tokens_per_iteration(args.size, config["N"])),
               "peak_mb": [r["peak_bytes"] / 1e6 for r in results],
               "description": results[0]["description"]}
        if config["kind"] == "torch":
            row["simulated_bubble"] = results[0]["simulated_bubble"]
        rows.append(row)
    baselines = {row["kind"]: row for row in rows if row["kind"].startswith("single")}
    for row in rows:
        if not row["kind"].startswith("single"):
            base = baselines["single-ours" if row["kind"] == "ours" else "single-torch"]
            row["efficiency"] = row["tokens_per_s"] / (args.depth * base["tokens_per_s"])
    return [row for row in rows if not row["kind"].startswith("single")], skipped, \
        list(baselines.values())


def print_single(single: dict, num_microbatches: int) -> None:
    table = [[name, f"{row['tokens_per_s']:.0f}", f"{row['min']:.0f}-{row['max']:.0f}",
              f"{row['tokens_per_cpu_s']:.0f}", row["description"]]
             for name, row in single.items()]
    print(format_table(["single process", "tokens/s", "spread", "tokens/CPU-s", "what"], table))
    print(f"ours / plain model = {single['ours']['vs_plain_model']:.3f} by wall time, "
          f"{single['ours']['cpu_vs_plain_model']:.3f} by CPU time (issue 10 asks >= 0.97); "
          f"N = {num_microbatches}")


def print_pipelined(rows: list, skipped: list) -> None:
    for num_microbatches in sorted({row["N"] for row in rows}):
        subset = [row for row in rows if row["N"] == num_microbatches]
        table = []
        for row in sorted(subset, key=lambda r: -r["tokens_per_s"]):
            efficiency = row.get("efficiency")
            table.append([row["label"], f"{row['tokens_per_s']:.0f}",
                          f"{row['min']:.0f}-{row['max']:.0f}",
                          f"{efficiency:.2f}" if efficiency else "-",
                          f"{1 - efficiency:.2f}" if efficiency else "-",
                          f"{row['simulated_bubble']:.2f}",
                          " ".join(f"{mb:.1f}" for mb in row["peak_mb"])])
        print(f"\nN = {num_microbatches}")
        print(format_table(["configuration", "tokens/s", "spread", "efficiency",
                            "bubble measured", "bubble simulated", "peak MB/rank"], table))
    for entry in skipped:
        print(f"skipped: {entry['label']} N={entry['N']}: {entry['reason']}")


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(MODEL_SIZES), default="issue",
                        help="model: 'issue' (8 layers, hidden 256, seq 128, vocab 1024, "
                             "micro-batch 4; the default) or 'tiny' (smoke tests)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8],
                        help="N values (default 2 4 8)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    parser.add_argument("--iters", type=int, default=2,
                        help="timed iterations per configuration and round (default 2)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed iterations per configuration (default 1)")
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=2, dest="depth",
                        help="D, one gloo rank per stage (default 2: one rank per core here)")
    parser.add_argument("--torch-schedules", nargs="*", default=None,
                        choices=[label.split(" ", 1)[1] for label in TORCH_SCHEDULES],
                        help="PyTorch schedules to run (default all)")
    parser.add_argument("--ours", default="",
                        help="only our configurations whose label contains this text")
    parser.add_argument("--skip-single", action="store_true",
                        help="skip the single-process phase (the overhead ratio vs the plain model)")
    parser.add_argument("--single-only", action="store_true",
                        help="only the single-process phase (the overhead ratio)")
    parser.add_argument("--timeout", type=float, default=3000.0,
                        help="seconds before the ranks are killed (default 3000)")
    args = parser.parse_args(argv)
    for name in ("rounds", "iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1 (got {getattr(args, name)})")
    if args.depth < 2 or args.depth % 2:
        raise ValueError(f"--pipeline-model-parallel-size needs an even D >= 2 (got {args.depth})")
    args.torch_labels = [f"torch {name}" for name in (
        args.torch_schedules if args.torch_schedules is not None
        else [label.split(" ", 1)[1] for label in TORCH_SCHEDULES])]
    return args


def main(argv=None) -> dict:
    args = parse_arguments(argv)
    import torch

    torch.set_num_threads(1)  # forked ranks hang if the parent ran multi-threaded ops
    print(f"== {args.size} model: {MODEL_SIZES[args.size]} {COMMON_FLAGS}; rounds {args.rounds} x "
          f"{args.iters} timed iterations, {args.warmup} warm-up ==")
    single = {} if args.skip_single else run_single(args)
    if single:
        print_single(single, max(args.microbatches))
    if args.single_only:
        return {"single": single, "pipelined": [], "skipped": []}
    configs, skipped = configurations(args.size, args.depth, args.microbatches, args.torch_labels,
                                      args.ours)
    print(f"\n== Pipelined, D={args.depth}: {len(configs)} configurations, interleaved ==")
    print(oversubscription_note(args.depth))
    rows, refused, baselines = run_pipelined(args, configs)
    skipped += refused
    print_pipelined(rows, skipped)
    for base in baselines:
        print(f"{base['label']} (N={base['N']}): {base['tokens_per_s']:.0f} tokens/s per rank "
              f"({base['min']:.0f}-{base['max']:.0f})")
    print("efficiency = tokens/s / (D x single-process tokens/s of the same code, timed on every rank "
          "at once inside the rounds); measured bubble "
          "= 1 - efficiency; simulated bubble: F=1, B=2, zero p2p cost; peak MB = saved "
          "activations held at once per rank.")
    return {"single": single, "pipelined": rows, "skipped": skipped, "baselines": baselines}


if __name__ == "__main__":
    main()
