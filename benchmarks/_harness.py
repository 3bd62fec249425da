"""Shared machinery of the pipeline benchmarks: tiny-model runs on forked gloo ranks, measured side by side.

``run_side_by_side(world_size, variants, ...)`` forks ``world_size`` gloo ranks once (through
``tests/dist_harness.run_distributed``), builds one training setup per *variant* (a list of extra
Megatron flags, e.g. a schedule or a packing mode) inside the same process group, and then runs the
variants round-robin: warm-up iterations first, then ``iterations`` timed ones, variant after variant
inside each round. Interleaving matters on a shared, noisy machine: a slow phase of the machine hits
every variant instead of whichever ran at that moment.

Per variant and rank it returns the wall time of every timed iteration (measured between two
barriers, so it is the pipeline's iteration time, not one rank's share), the transport counters of
the timed iterations only (messages, bytes, exchanges, seconds inside point-to-point), and the
interpreter's peak stored activations of the last iteration.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO_ROOT, os.path.join(REPO_ROOT, "tests")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from dist_harness import run_distributed  # noqa: E402  (tests/ helper, shared on purpose)

#: The README demo's corpus and tokenizer (``python tools/build_demo_corpus.py`` builds them).
DEMO_DATA_FLAGS = ("--data-path data/demo/corpus_text_document --split 949,50,1 "
                   "--tokenizer-type SentencePieceTokenizer "
                   "--tokenizer-model data/demo/tokenizer.model")

#: The tiny GPT both benchmarks run (hidden 64, 8 layers, sequence 64, micro-batch 2).
MODEL_FLAGS = ("--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
               "--max-position-embeddings 64 --vocab-size 256 --make-vocab-size-divisible-by 64 "
               "--micro-batch-size 2 --lr 1e-3 --train-iters 1000 --mock-data --seed 1234 --eval-iters 0").split()

OVERSUBSCRIPTION_NOTE = (
    "Measured on CPU with gloo: {ranks} ranks on {cores} core(s){over}. These are ratios of this "
    "machine, not the paper's GPU ratios.")


def oversubscription_note(num_ranks: int) -> str:
    """One honest line about how many processes share how many cores."""
    cores = os.cpu_count() or 1
    over = " (oversubscribed: ranks wait for a core, so compute is slower and noisier)" \
        if num_ranks > cores else ""
    return OVERSUBSCRIPTION_NOTE.format(ranks=num_ranks, cores=cores, over=over)


@dataclass
class VariantResult:
    """What one variant measured on one rank over the timed iterations."""

    iteration_seconds: list = field(default_factory=list)
    messages: int = 0
    bytes: int = 0
    exchanges: int = 0
    p2p_seconds: float = 0.0
    peak_stored: int = 0
    peak_bytes: int = 0
    description: str = ""


def build_variant(world_size: int, argv: list, parallel_state):
    """Config, runtime, model/optimizer and micro-batches of one configuration (full flags)."""
    import pretrain_gpt
    from megatron.training.arguments import parse_args
    from megatron.training.training import (iteration_microbatches, select_runtime_class,
                                            setup_model_and_optimizer)

    config = parse_args(list(argv), world_size=world_size)
    device = torch.device("cpu")
    runtime = select_runtime_class(config)(config, parallel_state, device)
    components = setup_model_and_optimizer(config, parallel_state, runtime,
                                           pretrain_gpt.model_provider, device)
    train, _, _ = pretrain_gpt.datasets_provider(config, parallel_state,
                                                 (config.training.global_batch_size, 0, 0))
    microbatches = iteration_microbatches(components, train, 0)
    return components, microbatches


def parallel_state_for(rank: int, world_size: int, argvs: list):
    """One process group for several configurations (full flags): the union of their groups."""
    from megatron.core.parallel_state import RankLayout, create_parallel_state
    from megatron.training.arguments import parse_args
    from megatron.training.training import select_runtime_class

    extra, layouts = [], set()
    for argv in argvs:
        config = parse_args(list(argv), world_size=world_size)
        layout = RankLayout.from_world_size(world_size,
                                            config.parallel.tensor_model_parallel_size,
                                            config.parallel.pipeline_model_parallel_size)
        layouts.add((layout.world_size, config.parallel.tensor_model_parallel_size,
                     config.parallel.pipeline_model_parallel_size))
        extra.extend(select_runtime_class(config).required_group_ranks(config, layout))
    if len(layouts) != 1:
        raise ValueError(f"variants measured side by side must share one rank layout, got {layouts}; "
                         "run differing layouts in separate calls")
    return create_parallel_state(layout, rank, "gloo", extra_group_ranks=extra)


def _side_by_side_rank(rank: int, world_size: int, variants: list, warmup: int,
                       iterations: int) -> list:
    import logging

    import torch.distributed as dist
    from megatron.training.training import train_step
    import pretrain_gpt

    torch.set_num_threads(1)
    # Configuration advice (e.g. forward doubling without recomputation) would repeat once per
    # rank and variant; the benchmark chooses its configurations on purpose.
    logging.getLogger("megatron.training.config_validation").setLevel(logging.ERROR)
    parallel_state = parallel_state_for(rank, world_size,
                                        [MODEL_FLAGS + list(argv) for argv in variants])
    built = [build_variant(world_size, MODEL_FLAGS + list(argv), parallel_state)
             for argv in variants]
    results = [VariantResult(description=components.runtime.describe()) for components, _ in built]
    for _ in range(warmup):
        for components, microbatches in built:
            train_step(components, pretrain_gpt.forward_step, microbatches)
    for _ in range(iterations):
        for (components, microbatches), result in zip(built, results):
            stats = components.runtime.transport.stats
            before = (stats.messages, stats.bytes, stats.exchanges, stats.seconds)
            dist.barrier()
            start = time.perf_counter()
            train_step(components, pretrain_gpt.forward_step, microbatches)
            dist.barrier()
            result.iteration_seconds.append(time.perf_counter() - start)
            result.messages += stats.messages - before[0]
            result.bytes += stats.bytes - before[1]
            result.exchanges += stats.exchanges - before[2]
            result.p2p_seconds += stats.seconds - before[3]
    for (components, _), result in zip(built, results):
        interpreter = getattr(components.runtime, "last_interpreter", None)
        result.peak_stored = getattr(interpreter, "peak_stored", 0) or 0
        result.peak_bytes = getattr(interpreter, "peak_bytes", 0) or 0
    return results


def run_side_by_side(world_size: int, variants: list, *, warmup: int = 1, iterations: int = 3,
                     timeout: float = 240.0) -> list:
    """Measure every variant (a list of extra flags) on ``world_size`` gloo ranks, interleaved.

    Returns ``results[rank][variant]`` (:class:`VariantResult`). Raises ``AssertionError`` with every
    rank's traceback if a rank fails or the run exceeds ``timeout`` seconds.
    """
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1 (got {iterations}); pass --iters 1 or more")
    torch.set_num_threads(1)  # forked ranks hang if the parent ran multi-threaded ops
    return run_distributed(_side_by_side_rank, world_size, [list(v) for v in variants], warmup,
                           iterations, timeout=timeout)


def summarize(per_rank: list, variant_index: int, iterations: int) -> dict:
    """Per-iteration numbers of one variant, combined over ranks.

    ``seconds``: median over iterations of the slowest rank's iteration time (between barriers all
    ranks see nearly the same time); ``messages``/``bytes``: sent by all ranks per iteration;
    ``p2p_seconds``: mean over ranks of the time inside point-to-point per iteration;
    ``peaks``: peak stored activations per rank.
    """
    results = [rank_results[variant_index] for rank_results in per_rank]
    per_iteration = [max(r.iteration_seconds[i] for r in results) for i in range(iterations)]
    return {
        "seconds": statistics.median(per_iteration),
        "messages": sum(r.messages for r in results) / iterations,
        "bytes": sum(r.bytes for r in results) / iterations,
        "exchanges": sum(r.exchanges for r in results) / iterations,
        "p2p_seconds": statistics.mean(r.p2p_seconds for r in results) / iterations,
        "peaks": [r.peak_stored for r in results],
        "peak_bytes": [r.peak_bytes for r in results],
        "description": results[0].description,
    }


def format_table(headers: list, rows: list) -> str:
    """A plain right-aligned text table (first column left-aligned)."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for index, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))))
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


#: torch.distributed.pipelining schedules that run one stage per rank; the others run two.
SINGLE_STAGE_TORCH_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")


def torch_stage_ids(schedule_name: str, rank: int, depth: int) -> tuple[int, list]:
    """The number of PipelineStages and the ids of ``rank``'s stages for a PyTorch schedule:
    one stage per rank, or two in the V placement (ZB-V, DualPipeV) or the loop placement
    (the interleaved schedules)."""
    if schedule_name in SINGLE_STAGE_TORCH_SCHEDULES:
        return depth, [rank]
    num_stages = 2 * depth
    if schedule_name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        return num_stages, [rank, num_stages - 1 - rank]
    return num_stages, [rank, rank + depth]
