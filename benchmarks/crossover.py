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

    python benchmarks/crossover.py --emulate-compute [--sizes 1e6 1e7] [--ratios 0.1 0.5 1 2 10]
        [--gradients fill accumulate] [--timelines device serial] [--profile]

runs the same comparison with emulated compute (benchmarks/_emulated_compute.py): each job's
forward and backward sleep (freeing the core, as a rank waiting for its accelerator would) while its
gradient of ``--sizes`` float32 entries is really all-reduced over gloo; the sleep is chosen so the
all-reduce / compute ratio M / C of one job alone sweeps ``--ratios`` (from the slowest rank's
all-reduce time and C without sleep, then corrected twice by the C and M of job iterations).
``--gradients``: how the emulated backward writes the gradient, ``fill`` (default: overwritten, one
write-only pass, the reducer sums) or ``accumulate`` (zeroed, accumulated and divided by the
reducer: three passes). ``--timelines``: how the sleeps are timed, ``device`` (default: on a fixed
timeline from the step's start, as an accelerator runs queued kernels, so host work and late
wake-ups inside the step are absorbed) or ``serial`` (each sleep after the host work before it).
Several writes and timelines are interleaved in the same rounds. Per point: back to back and
crossover wall time of the pair (median and min-max over interleaved rounds), speed-up, the bound
(C + M) / max(C, M) from the median C and M of the back-to-back iterations, the most a run of
``--iterations`` iterations can reach (:func:`finite_run_ceiling`), and speed-up / bound.
``--profile`` adds, from per-iteration timestamps of both jobs on one timeline (rank 0, last
round), where the time goes: C and its CPU time, the all-reduce, the exposed wait, the hand-off
latency between the jobs, the share of time the link is busy, the process's CPU time per
iteration, and the share of the bound that CPU time leaves reachable on this machine.
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
JOB_NAMES = ("a", "b")  # the two emulated jobs


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


def _emulated_job(model, reducer, compute, iterations: int, after_compute, timings=None,
                  trace=None):
    """One job: ``iterations`` steps of sleeping compute and the real all-reduce (no optimizer
    update, see benchmarks/_emulated_compute.py);
    ``after_compute`` runs between starting the all-reduce and waiting for it (the crossover turn).
    ``timings`` (a list) gets (compute, exposed communication) seconds per iteration; ``trace`` (a
    list) gets one :func:`_traced_iteration` record per iteration. A model that accumulates its
    gradients is zeroed first (:meth:`GradientReducer.zero_grad`); one that fills them is not."""
    zero_first = model.gradient_write == "accumulate"
    for iteration in range(iterations):
        record = _traced_iteration(reducer, trace, iteration)
        started = time.perf_counter()
        cpu_started = time.thread_time()
        if zero_first:
            reducer.zero_grad()
        model.forward_backward(compute, iteration)
        reducer.start()
        computed = time.perf_counter()
        if record is not None:
            record.update(started=started, computed=computed,
                          compute_cpu=time.thread_time() - cpu_started)
            for bucket in reducer.buckets:  # when gloo finished, on gloo's thread
                if hasattr(bucket.handle, "get_future"):
                    bucket.handle.get_future().add_done_callback(
                        lambda _, record=record: record.__setitem__("reduced",
                                                                    time.perf_counter()))
        after_compute()
        resumed = time.perf_counter()
        reducer.wait()
        waited = time.perf_counter()
        if record is not None:
            record.update(resumed=resumed, waited=waited)
        if timings is not None:
            timings.append(((computed - started) + (time.perf_counter() - waited),
                            waited - computed))


def _traced_iteration(reducer, trace, iteration: int):
    """A fresh record appended to ``trace`` (``None`` when not tracing): the ``iteration``, its
    ``started``, ``computed`` (all-reduce launched), ``resumed`` (turn back), ``waited`` and
    ``reduced`` (gloo done) times and ``compute_cpu`` (this thread's CPU seconds in the compute)."""
    if trace is None:
        return None
    record = {"iteration": iteration}
    trace.append(record)
    return record


def _emulated_rank(rank: int, world_size: int, sizes: list, ratios: list, writes: list,
                   iterations: int, rounds: int, profile: bool, timelines: tuple = ("device",)
                   ) -> dict:
    """The emulated-compute sweep on one rank: per (size, gradient write, timeline, ratio) the
    pair's wall times, the C, M of job a's back-to-back iterations and (``profile``) the
    per-iteration traces of the last round and the process CPU seconds of each pair run. The
    gradient writes and timelines (and the ratios) are interleaved round by round, so their
    comparison shares the same minutes."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    groups = {name: dist.new_group(list(range(world_size))) for name in JOB_NAMES}  # one per job
    results = {}
    variants = [(write, timeline) for write in writes for timeline in timelines]
    for numel in sizes:
        setups = {variant: _emulated_setup(rank, world_size, numel, *variant, groups, ratios,
                                           profile)
                  for variant in variants}
        for round_index in range(rounds):
            last = profile and round_index == rounds - 1
            for ratio in ratios:
                for variant in variants:
                    models, reducers, computes, points = setups[variant]
                    _emulated_pair(models, reducers, computes[ratio], iterations, points[ratio],
                                   traced=last)
        for variant in variants:
            results[(numel, *variant)] = setups[variant][3]
    return results



def _emulated_setup(rank: int, world_size: int, numel: int, write: str, timeline: str,
                    groups: dict, ratios: list, profile: bool) -> tuple:
    """Both jobs' models and reducers for one (size, gradient write, timeline), the calibrated
    compute per ratio and the empty per-ratio results: ``(models, reducers, computes, points)``."""
    import torch.distributed as dist
    from _emulated_compute import ComputeTime, EmulatedModel, median_seconds
    from megatron.core.distributed.gradient_reducer import GradientReducer
    # "fill" stands for gradients already divided by P: the reducer sums (see
    # benchmarks/_emulated_compute.py); "accumulate" divides, as training does
    divide_by = world_size if write == "accumulate" else 1
    models = {name: EmulatedModel(numel, seed=100 * index + rank, gradient_write=write,
                                  timeline=timeline)
              for index, name in enumerate(JOB_NAMES)}
    reducers = {name: GradientReducer(models[name].parameters(), groups[name],
                                      divide_by=divide_by) for name in JOB_NAMES}
    models["a"].forward_backward(ComputeTime(0.0), 0)
    communication = _slowest_rank(median_seconds(
        lambda: (reducers["a"].start(), reducers["a"].wait()), 5, dist.barrier))
    fixed = _measured_iteration(models["a"], reducers["a"], ComputeTime(0.0))[0]
    computes = {ratio: _calibrated_compute(models["a"], reducers["a"], ratio, communication,
                                           fixed)
                for ratio in ratios}
    communication_cpu = _all_reduce_cpu(reducers["a"]) if profile else None
    points = {ratio: {"back_to_back": [], "crossover": [], "timings": [], "fixed": fixed,
                      "communication": communication, "communication_cpu": communication_cpu,
                      "sleep": computes[ratio].seconds,
                      "cpu": {"back_to_back": [], "crossover": []}}
              for ratio in ratios}
    return models, reducers, computes, points


def _emulated_pair(models: dict, reducers: dict, compute, iterations: int, point: dict,
                   traced: bool) -> None:
    """One round of one point: the two jobs back to back, then under crossover scheduling; their
    wall and process CPU times go to ``point`` (job a's back-to-back C, M to its timings; with
    ``traced``, both runs' per-iteration traces to ``point["traces"]``)."""
    import torch.distributed as dist
    from megatron.training.crossover import CrossoverJob, run_crossover
    traces = {"back_to_back": [], "crossover": []} if traced else None
    dist.barrier()
    cpu_started, started = time.process_time(), time.perf_counter()
    for name in JOB_NAMES:
        _emulated_job(models[name], reducers[name], compute, iterations, lambda: None,
                      point["timings"] if name == "a" else None,
                      traces["back_to_back"] if traces else None)
    dist.barrier()
    point["back_to_back"].append(time.perf_counter() - started)
    point["cpu"]["back_to_back"].append(time.process_time() - cpu_started)
    jobs = [CrossoverJob(name, ()) for name in JOB_NAMES]
    dist.barrier()
    cpu_started, started = time.process_time(), time.perf_counter()
    run_crossover(jobs, lambda job, after, log: _emulated_job(
        models[job.name], reducers[job.name], compute, iterations, after,
        trace=traces["crossover"] if traces else None), log=lambda _: None)
    dist.barrier()
    point["crossover"].append(time.perf_counter() - started)
    point["cpu"]["crossover"].append(time.process_time() - cpu_started)
    if traces:
        point["traces"] = traces


def _slowest_rank(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (all ranks must call it): the ranks agree."""
    import torch
    import torch.distributed as dist
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _measured_iteration(model, reducer, compute, iterations: int = 4) -> tuple[float, float]:
    """(C, M) as the benchmark measures them, in seconds: C everything but the all-reduce wait
    (zeroing, the sleeping forward/backward, the gradient write, launching the all-reduce), M the
    exposed wait; the medians over ``iterations`` of job a alone, the slowest rank's."""
    import torch.distributed as dist
    timings: list = []
    dist.barrier()
    _emulated_job(model, reducer, compute, iterations, lambda: None, timings)
    return (_slowest_rank(statistics.median(timing[0] for timing in timings)),
            _slowest_rank(statistics.median(timing[1] for timing in timings)))


def _calibrated_compute(model, reducer, ratio: float, communication: float, floor: float,
                        corrections: int = 2):
    """The sleep whose iterations have M / C = ``ratio``: first ``communication / ratio - floor``
    (``communication``: one all-reduce alone, ``floor``: C without sleep), then ``corrections``
    times moved by ``M / ratio - C``, with C measured in job iterations with the current sleep (the
    sleeps' wake-up overshoot, the write that the device timeline absorbs) and M the median of
    ``communication`` and the exposed waits measured so far (the all-reduce as it runs after a
    compute rather than after a barrier; the median keeps one disturbed measurement from moving
    the target). Below the floor the sleep is 0 and C stays at the floor."""
    from _emulated_compute import ComputeTime
    sleep = max(communication / ratio - floor, 0.0)
    waits = [communication]
    for _ in range(corrections):
        if sleep == 0.0:
            break
        compute, exposed = _measured_iteration(model, reducer, ComputeTime(sleep))
        waits.append(exposed)
        sleep = max(sleep + statistics.median(waits) / ratio - compute, 0.0)
    return ComputeTime(sleep)


def _all_reduce_cpu(reducer, repeats: int = 3) -> float:
    """The median CPU seconds this process (its gloo threads included) spends on one all-reduce of
    the reducer's gradient, each started after a barrier."""
    import torch.distributed as dist
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        started = time.process_time()
        reducer.start()
        reducer.wait()
        seconds.append(time.process_time() - started)
    return statistics.median(seconds)


def emulated_main(args) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sizes = [int(size) for size in args.sizes]
    iterations, rounds = args.iterations or 6, args.rounds or 3
    per_rank = run_distributed(_emulated_rank, WORLD_SIZE, sizes, args.ratios, args.gradients,
                               iterations, rounds, args.profile, tuple(args.timelines),
                               timeout=7200)
    rows, profile_rows = [], []
    for numel in sizes:
        for write in args.gradients:
            for timeline in args.timelines:
                key = (numel, write, timeline)
                for ratio in args.ratios:
                    row, profile = _emulated_rows(per_rank, key, ratio, iterations, rounds,
                                                  args.profile)
                    rows.append(row)
                    profile_rows.extend(profile)
    print(format_table(["floats", "gradients", "timeline", "target M/C", "M/C", "C ms", "M ms",
                        "back to back ms/iter", "crossover ms/iter", "speed-up (round min-max)",
                        "bound", f"{iterations}-iteration ceiling", "speed-up / bound"], rows))
    print(f"Emulated compute (sleep), real gloo all-reduce; two DP {WORLD_SIZE} jobs, "
          f"{iterations} iterations each, {rounds} interleaved round(s); ms per iteration of one "
          f"job (pair time / {2 * iterations}), median (min-max) over rounds; C and M are job a's "
          f"back-to-back medians. Gradients: 'fill' overwrites .grad (one write pass, summed), "
          f"'accumulate' zeroes, accumulates and divides (three passes); timeline 'serial': "
          f"each sleep starts after the host's work before it, 'device': the sleeps end on a "
          f"fixed timeline from the step's start; see benchmarks/_emulated_compute.py. "
          f"{iterations}-iteration ceiling: the most a run of {iterations} iterations per job "
          f"can reach, 2n(C + M) / (2n max(C, M) + min(C, M)) with n = {iterations} (the first "
          f"compute and the last all-reduce of the pair cannot overlap anything).")
    if profile_rows:
        print()
        print(format_table(["point", "run", "C ms", "of it CPU ms", "sleep ms", "all-reduce ms",
                            "exposed wait ms", "hand-off ms", "link busy", "rank CPU ms/iter",
                            "CPU ceiling"], profile_rows))
        print("Profile (rank 0, last round, medians over both jobs' iterations): C = start of an "
              "iteration to the launch of its all-reduce, of it CPU = the job thread's CPU time "
              "in it (zeroing, gradient writes, reducer start, Python); all-reduce = launch to "
              "gloo's completion callback; exposed wait = turn back to all-reduce done; hand-off "
              "= one job passing the turn to the other resuming (RNG swap and thread wake-up); "
              "link busy = share of the pair run with an all-reduce in flight; rank CPU ms/iter "
              "= this process's CPU time (gloo's threads included) per job iteration; CPU "
              "ceiling = max(C, M) / max(max(C, M), that CPU / cores per rank): the share of the "
              "bound a rank can reach when one iteration's CPU work (gradient write + gloo) does "
              "not fit in the bound's cycle; all-reduce alone = the calibration's wall time and "
              "this rank's CPU time for one all-reduce.")
    print(oversubscription_note(WORLD_SIZE))
    return 0


def _emulated_rows(per_rank: list, key: tuple, ratio: float, iterations: int, rounds: int,
                   profile: bool) -> tuple[list, list]:
    """The results-table row of one point (``key``: size, gradient write, timeline) and, with
    ``profile``, its profile rows. Pair times are the slowest rank's per round."""
    point = per_rank[-1][key][ratio]
    back = [max(r[key][ratio]["back_to_back"][i] for r in per_rank) for i in range(rounds)]
    cross = [max(r[key][ratio]["crossover"][i] for r in per_rank) for i in range(rounds)]
    compute = statistics.median(t[0] for t in point["timings"])
    exposed = statistics.median(t[1] for t in point["timings"])
    bound = (compute + exposed) / max(compute, exposed)
    ceiling = finite_run_ceiling(compute, exposed, iterations)
    speedup = statistics.median(back) / statistics.median(cross)
    per_round = sorted(b / c for b, c in zip(back, cross))
    numel, write, timeline = key
    row = [f"{numel:,}", write, timeline, f"{ratio:g}", f"{exposed / compute:.2f}",
           f"{compute * 1e3:.0f}", f"{exposed * 1e3:.0f}",
           _spread([1e3 * b / (2 * iterations) for b in back]),
           _spread([1e3 * c / (2 * iterations) for c in cross]),
           f"{speedup:.2f} ({per_round[0]:.2f}-{per_round[-1]:.2f})",
           f"{bound:.2f}", f"{ceiling:.2f} ({ceiling / bound:.0%})", f"{speedup / bound:.0%}"]
    profile_rows = _profile_rows(f"{numel:,} {write} {timeline} {ratio:g}", point, compute,
                                 exposed, iterations) if profile else []
    return row, profile_rows


def finite_run_ceiling(compute: float, exposed: float, iterations: int) -> float:
    """The largest speed-up two jobs of ``iterations`` iterations each can reach under crossover
    over running back to back, with compute C and exposed communication M per iteration and the
    link carrying one all-reduce at a time: back to back takes 2n (C + M); crossover at best
    2n max(C, M) + min(C, M), because min(C, M) cannot overlap anything: at M >= C the first
    compute of the pair (no all-reduce is in flight yet), at M < C the last all-reduce (no compute
    is left). It tends to the bound (C + M) / max(C, M) as n grows (at M = C it is
    2n / (n + 1/2): 94% of the bound at n = 8, 98% at n = 24)."""
    return 2 * iterations * (compute + exposed) / (
        2 * iterations * max(compute, exposed) + min(compute, exposed))


def _profile_rows(label: str, point: dict, compute: float, exposed: float, iterations: int
                  ) -> list:
    """Rows (back to back, crossover, the lone all-reduce) of the phase medians of rank 0's
    last-round traces; ``compute``, ``exposed``: the point's C and M (seconds)."""
    cores_per_rank = (os.cpu_count() or 1) / WORLD_SIZE
    rows = []
    for run in ("back_to_back", "crossover"):
        trace = point["traces"][run]
        turn_events = []  # (time, kind): a turn begins at a job's start or resume, ends at a pass
        for record in trace:
            turn_events.append((record["computed"], "pass"))
            turn_events.append((record["resumed"], "resume"))
        turn_events.extend((r["started"], "resume") for r in trace if r["iteration"] == 0)
        turn_events.sort()
        hand_offs = [later[0] - earlier[0]
                     for earlier, later in zip(turn_events, turn_events[1:])
                     if earlier[1] == "pass" and later[1] == "resume"] if run == "crossover" else []
        span = max(r["waited"] for r in trace) - min(r["started"] for r in trace)
        link_busy = _covered([(r["computed"], r["reduced"]) for r in trace if "reduced" in r])
        cpu_per_iteration = point["cpu"][run][-1] / (2 * iterations)
        ceiling = ""
        if run == "back_to_back":  # the CPU one iteration needs against the bound's cycle
            cycle = max(compute, exposed)
            ceiling = f"{cycle / max(cycle, cpu_per_iteration / cores_per_rank):.0%}"

        def median_ms(values):
            return f"{1e3 * statistics.median(values):.1f}" if values else "-"
        rows.append([label if run == "back_to_back" else "", run.replace("_", " "),
                     median_ms([r["computed"] - r["started"] for r in trace]),
                     median_ms([r["compute_cpu"] for r in trace]),
                     f"{1e3 * point['sleep']:.1f}",
                     median_ms([r["reduced"] - r["computed"] for r in trace if "reduced" in r]),
                     median_ms([r["waited"] - r["resumed"] for r in trace]),
                     median_ms(hand_offs), f"{link_busy / span:.0%}",
                     f"{1e3 * cpu_per_iteration:.1f}", ceiling])
    rows.append(["", "C without sleep", f"{1e3 * point['fixed']:.1f}", "", "", "", "", "", "",
                 "", ""])
    rows.append(["", "all-reduce alone", "", "", "", f"{1e3 * point['communication']:.1f}", "",
                 "", "", f"{1e3 * point['communication_cpu']:.1f}", ""])
    return rows


def _covered(intervals: list) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, reached = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total


def _spread(values: list) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--emulate-compute", action="store_true",
                        help="sleeping compute, real gloo all-reduce, swept M/C")
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7],
                        help="with --emulate-compute: gradient sizes (float32 entries)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.5, 1, 2, 10],
                        help="with --emulate-compute: target communication / compute")
    parser.add_argument("--gradients", nargs="+", choices=("fill", "accumulate"),
                        default=["fill"],
                        help="with --emulate-compute: how the emulated backward writes the "
                             "gradient: 'fill' overwrites it (one write pass, summed by the "
                             "reducer), 'accumulate' zeroes, accumulates and divides it (three "
                             "passes); several are interleaved in the same rounds")
    parser.add_argument("--timelines", nargs="+", choices=("serial", "device"),
                        default=["device"],
                        help="with --emulate-compute: how the emulated compute's sleeps are "
                             "timed: 'device' (default) ends them on a fixed timeline from the "
                             "step's start, as an accelerator's queued kernels would, so the "
                             "host's gradient writes and late wake-ups inside the compute do not "
                             "lengthen it; 'serial' starts each sleep after the host's work "
                             "before it (host delays add up); several are interleaved in the "
                             "same rounds")
    parser.add_argument("--profile", action="store_true",
                        help="with --emulate-compute: also print where each iteration's time "
                             "goes (compute CPU, all-reduce, exposed wait, hand-off latency)")
    args = parser.parse_args(argv)
    if args.emulate_compute:
        return emulated_main(args)
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
