#!/usr/bin/env python
"""Crossover scheduling vs running two jobs back to back, over a sweep of communication/compute.

    python benchmarks/crossover.py                 # full sweep (a few minutes on 2 cores)
    python benchmarks/crossover.py --quick         # tiny sizes, seconds (the CLI test runs this)

Two identical data-parallel jobs (DP = 2 on 2 ranks, different seeds, as in a hyper-parameter
sweep) train ``--iterations`` iterations each, either one after the other or together under
crossover scheduling (:mod:`megatron.training.crossover`), in interleaved rounds. The sweep changes
the global batch: the gradient all-reduce has the same size at every point while the compute grows
with the batch, so small batches are communication-bound.

Per point it prints the aggregate tokens/s of the pair (back to back and crossover, median and
spread over rounds), the per-job iteration time under crossover, and the analytical bound of the
speedup (C + M) / max(C, M) from the compute time C (forward, backward, optimizer step) and the
exposed communication M (time waiting for the gradient all-reduce) of one job measured alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))

from _harness import format_table, oversubscription_note  # noqa: E402
from dist_harness import run_distributed  # noqa: E402

WORLD_SIZE = 2


def job_flags(hidden: int, layers: int, global_batch: int, iterations: int, seed: int) -> list:
    return (f"--num-layers {layers} --hidden-size {hidden} --num-attention-heads 4 "
            f"--seq-length 64 --max-position-embeddings 64 --vocab-size 256 "
            f"--make-vocab-size-divisible-by 64 --micro-batch-size 2 --global-batch-size "
            f"{global_batch} --lr 1e-3 --train-iters {iterations} --mock-data --seed {seed} "
            f"--eval-iters 0 --log-interval 1000").split()


def _train(argv: list, after_compute=None) -> None:
    import pretrain_gpt
    from megatron.training.arguments import parse_args
    from megatron.training.training import pretrain
    config = parse_args(argv, world_size=WORLD_SIZE)
    pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
             pretrain_gpt.forward_step, log=lambda _: None, after_compute=after_compute)


def _profile_one_job(argv: list, iterations: int) -> tuple[float, float]:
    """(compute C, exposed communication M) per iteration of one job alone, in seconds: C is the
    forward/backward and optimizer step, M the wait for the gradient all-reduce."""
    import pretrain_gpt
    import torch
    from megatron.core.parallel_state import RankLayout, create_parallel_state
    from megatron.core.runtimes import select_runtime_class
    from megatron.training.arguments import parse_args
    from megatron.training.training import iteration_microbatches, setup_model_and_optimizer
    config = parse_args(argv, world_size=WORLD_SIZE)
    state = create_parallel_state(RankLayout.from_world_size(WORLD_SIZE, 1, 1),
                                  torch.distributed.get_rank(), "gloo")
    runtime = select_runtime_class(config)(config, state, torch.device("cpu"))
    components = setup_model_and_optimizer(config, state, runtime, pretrain_gpt.model_provider,
                                           torch.device("cpu"))
    train, _, _ = pretrain_gpt.datasets_provider(config, state, (1000, 0, 0))
    compute, wait = [], []
    for iteration in range(iterations):
        microbatches = iteration_microbatches(components, train, 0)
        torch.distributed.barrier()
        start = time.perf_counter()
        components.optimizer.zero_grad()
        runtime.forward_backward(forward_step_func=pretrain_gpt.forward_step,
                                 model_chunks=components.model_chunks, microbatches=microbatches,
                                 scale_loss=components.optimizer.scale_loss,
                                 gradient_reducers=components.gradient_reducers,
                                 forward_only=False)
        computed = time.perf_counter()
        for reducer in components.gradient_reducers:
            reducer.wait()
        waited = time.perf_counter()
        components.optimizer.step()
        stepped = time.perf_counter()
        if iteration > 0:  # the first iteration warms up
            compute.append((computed - start) + (stepped - waited))
            wait.append(waited - computed)
    return statistics.median(compute), statistics.median(wait)


def _rank(rank: int, world_size: int, points: list, iterations: int, rounds: int) -> list:
    import torch.distributed as dist
    from megatron.training.crossover import CrossoverJob, run_crossover
    results = []
    for point in points:
        flags_a = job_flags(*point, iterations, seed=1)
        flags_b = job_flags(*point, iterations, seed=2)
        compute, exposed = _profile_one_job(flags_a, min(iterations, 4))
        back_to_back, crossover = [], []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            _train(flags_a)
            _train(flags_b)
            dist.barrier()
            back_to_back.append(time.perf_counter() - start)
            jobs = [CrossoverJob("a", tuple(flags_a)), CrossoverJob("b", tuple(flags_b))]
            dist.barrier()
            start = time.perf_counter()
            run_crossover(jobs, lambda job, after, log: _train(list(job.args), after),
                          log=lambda _: None)
            dist.barrier()
            crossover.append(time.perf_counter() - start)
        results.append({"compute": compute, "exposed": exposed, "back_to_back": back_to_back,
                        "crossover": crossover})
    return results


def _spread(values: list) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        points, iterations, rounds = [(32, 2, 4)], args.iterations or 3, args.rounds or 1
    else:
        points = [(256, 4, 4), (256, 4, 16), (256, 4, 64)]
        iterations, rounds = args.iterations or 6, args.rounds or 3
    import torch
    torch.set_num_threads(1)
    per_rank = run_distributed(_rank, WORLD_SIZE, points, iterations, rounds, timeout=3600)
    rows = []
    for index, (hidden, layers, global_batch) in enumerate(points):
        measured = per_rank[-1][index]
        tokens = 2 * iterations * global_batch * 64  # two jobs
        sequential = [tokens / seconds for seconds in measured["back_to_back"]]
        shared = [tokens / seconds for seconds in measured["crossover"]]
        compute, exposed = measured["compute"], measured["exposed"]
        bound = (compute + exposed) / max(compute, exposed)
        per_job_ms = [1000 * seconds / iterations for seconds in measured["crossover"]]
        rows.append([f"h{hidden} L{layers} GB{global_batch}", f"{exposed / compute:.2f}",
                     _spread(sequential), _spread(shared),
                     f"{statistics.median(shared) / statistics.median(sequential):.2f}",
                     f"{bound:.2f}", f"{statistics.median(per_job_ms):.0f}"])
    print(format_table(["point", "M/C", "back to back tok/s", "crossover tok/s", "speedup",
                        "bound (C+M)/max(C,M)", "crossover ms/iter (both jobs)"], rows))
    print(f"{iterations} iterations per job, {rounds} interleaved round(s); C and M of one job "
          f"alone (median); medians with (min-max) over rounds.")
    print(oversubscription_note(WORLD_SIZE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
