#!/usr/bin/env python
"""A2SGD vs exact all-reduce: bytes per step, time per step and loss on the demo corpus (gloo, CPU).

    python tools/build_demo_corpus.py          # once: data/demo/
    python benchmarks/a2sgd.py [--iters 50] [--dp 2 4] [--out runs/a2sgd]

For each data-parallel size (no pipeline) it forks that many gloo ranks and trains the same tiny GPT
from the same seed on the same global batches with: exact all-reduce, and A2SGD at each averaging
granularity (whole model portion = the paper's, per bucket of 4096 elements, per tensor). Per
variant it reports the bytes each worker hands to data-parallel collectives per step (all-reduce:
the whole gradient; A2SGD: 4 float64 per segment, plus the exact average of parameters and optimizer
state amortised over ``--a2sgd-sync-interval``), the mean wall time per step, and the lm loss after
the last step
(mean of the last 5 iterations, to damp batch noise). Writes ``results.json`` and a loss plot
``loss.png`` to ``--out``.

    python benchmarks/a2sgd.py --emulate-compute [--dp 2 4] [--sizes 1e6 1e7 3e7]
                               [--ratios 0.1 0.5 1 2 10] [--rounds 3] [--steps 2]

instead sweeps gradient size and communication / compute with sleeping compute and real gloo
collectives (benchmarks/_emulated_compute.py, benchmarks/_reducer_sweep.py): exact all-reduce (also
overlapped with the backward), A2SGD (whole model, whole model with its statistics overlapped with
the backward, per bucket), top-k and QSGD; step time (median and min-max over rounds), bytes per
worker per step, where each starts to beat all-reduce, and a closing summary of the speed-ups.
Writes ``emulated.json`` to ``--out``. ``--reducers ... "a2sgd torch"`` adds A2SGD with its torch
passes instead of the fused kernel. A (DP, size) point whose estimated memory exceeds 90% of the
available memory is skipped with a message (on 24 GiB: 100 M floats only at DP 2; see
docs/a2sgd.md for the limits).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from _harness import DEMO_DATA_FLAGS as DATA_FLAGS  # also puts the repo and tests/ on sys.path
from _harness import REPO_ROOT as REPO
from _harness import oversubscription_note, parallel_state_for, run_distributed
MODEL_FLAGS = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
               "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 16 "
               "--lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 5 "
               "--clip-grad 1.0 --eval-iters 0 --log-interval 1000 --seed 1234")
VARIANTS = [("allreduce", None), ("a2sgd model", "model"), ("a2sgd bucket", "bucket"),
            ("a2sgd tensor", "tensor")]
BUCKET = 4096


def _train_variant(rank, world_size, argv, granularity):
    """Build and train one variant in the current process group; returns its measurements."""
    import torch

    import pretrain_gpt
    from megatron.core.distributed.a2sgd import a2sgd_reducers
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import set_random_seeds
    from megatron.training.training import (TrainingState, _build_datasets, select_runtime_class,
                                            setup_model_and_optimizer, train)

    config = parse_args(argv, world_size=world_size)
    pretrain_gpt.build_run_tokenizer(config)  # fills the padded vocabulary size
    state = parallel_state_for(rank, world_size, [argv])
    set_random_seeds(config.training.seed)
    runtime = select_runtime_class(config)(config, state, torch.device("cpu"))
    components = setup_model_and_optimizer(config, state, runtime, pretrain_gpt.model_provider,
                                           torch.device("cpu"))
    for reducer in a2sgd_reducers(components.gradient_reducers):
        reducer.granularity, reducer.bucket_size = granularity, BUCKET
    datasets = _build_datasets(config, state, pretrain_gpt.datasets_provider)
    torch.distributed.barrier()
    started = time.perf_counter()
    result = train(components, pretrain_gpt.forward_step, datasets[0], None, TrainingState(),
                   log=lambda _: None)
    torch.distributed.barrier()
    seconds = (time.perf_counter() - started) / config.training.train_iters
    grad_bytes = sum(p.numel() * p.element_size() for chunk in components.model_chunks
                     for p in chunk.parameters())
    found = a2sgd_reducers(components.gradient_reducers)
    if found:
        stats_bytes = sum(r.bytes_last_step for r in found)
        state_bytes = sum(value.numel() * value.element_size()
                          for per_param in components.optimizer.optimizer.state.values()
                          for value in per_param.values()
                          if torch.is_tensor(value) and value.is_floating_point())
        # the sync averages parameters and optimizer state (scalar 'step' entries included)
        sync_bytes = (grad_bytes + state_bytes) / config.parallel.a2sgd_sync_interval
        step_bytes = stats_bytes + sync_bytes
    else:
        stats_bytes, step_bytes = 0, grad_bytes
    return {"losses": [r.losses["lm loss"] for r in result.history], "seconds": seconds,
            "grad_bytes": grad_bytes, "stats_bytes": stats_bytes, "step_bytes": step_bytes}


def _rank_all_variants(rank, world_size, base_argv, variants):
    import torch
    torch.set_num_threads(1)
    results = {}
    for label, granularity in variants:
        argv = list(base_argv)
        if granularity is not None:
            argv += ["--dp-gradient-reducer", "a2sgd"]
        results[label] = _train_variant(rank, world_size, argv, granularity)
    return results


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sync-interval", type=int, default=10)
    parser.add_argument("--out", default="runs/a2sgd")
    parser.add_argument("--emulate-compute", action="store_true",
                        help="sweep gradient size and communication/compute with sleeping compute")
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 3e7],
                        help="with --emulate-compute: gradient sizes in float32 entries")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.5, 1, 2, 10],
                        help="with --emulate-compute: target communication / compute")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
    parser.add_argument("--reducers", nargs="+", default=None,
                        help="with --emulate-compute: a subset of the reducers")
    parser.add_argument("--max-size", nargs=2, type=float, action="append", default=[],
                        metavar=("DP", "FLOATS"),
                        help="with --emulate-compute: skip sizes above FLOATS at this DP size "
                             "(memory and time caps; repeatable)")
    args = parser.parse_args(argv)
    args.dp_size_cap = {int(dp): int(floats) for dp, floats in args.max_size}
    return args


def emulated_main(args) -> None:
    """The --emulate-compute sweep (see benchmarks/_reducer_sweep.py)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _reducer_sweep import (REDUCERS, available_memory_bytes, bytes_per_step, combine_ranks,
                                crossings, rank_sweep, resident_bytes_per_rank)

    from megatron.core.distributed import a2sgd_kernel
    reducers = args.reducers or list(REDUCERS)
    sizes = [int(size) for size in args.sizes]
    everything = {}
    for dp in args.dp:
        combined = everything.setdefault(dp, {})
        for numel in sizes:
            if dp in args.dp_size_cap and numel > args.dp_size_cap[dp]:
                continue
            needed = dp * resident_bytes_per_rank(reducers, numel, dp,
                                                  fused=a2sgd_kernel.fused_ops() is not None)
            available = available_memory_bytes()
            if needed > 0.9 * available:
                print(f"\nDP {dp}, {numel:,} floats: skipped, it needs about "
                      f"{needed / 2**30:.1f} GiB ({dp} ranks) and {available / 2**30:.1f} GiB "
                      f"are available; run fewer --reducers, a smaller --dp, or cap the size "
                      f"with --max-size", flush=True)
                continue
            per_rank = run_distributed(rank_sweep, dp, [numel], args.ratios, reducers,
                                       args.rounds, args.steps, timeout=7200)
            result = combine_ranks(per_rank, reducers, args.ratios)[numel]
            combined[numel] = result
            print(f"\nDP {dp}, {numel:,} floats: all-reduce alone M = "
                  f"{result['communication'] * 1000:.1f} ms, compute besides sleep C0 = "
                  f"{result['fixed_compute'] * 1000:.1f} ms; ms/step median (min-max of "
                  f"{args.rounds} round medians), x = speed-up over all-reduce")
            print(f"{'M/C':>6} " + " ".join(f"{name:>26}" for name in reducers))
            for row in result["rows"].values():
                base = row["allreduce"][0]
                cells = [f"{row[n][0] * 1e3:7.1f} ({row[n][1] * 1e3:.0f}-{row[n][2] * 1e3:.0f}) "
                         f"x{base / row[n][0]:.2f}" for n in reducers]
                print(f"{row['ratio']:>6.2f} " + " ".join(f"{c:>26}" for c in cells))
            print("bytes/worker/step: " + ", ".join(
                f"{name} {bytes_per_step(name, numel, dp):,.0f}" for name in reducers))
            print("beats all-reduce: " + ", ".join(
                f"{name} {crossings(result['rows'], name)}" for name in reducers
                if name != "allreduce"))
            with open(os.path.join(args.out, "emulated.json"), "w") as handle:  # after each
                json.dump({"args": vars(args), "results": {
                    dp: {numel: {**result, "rows": {str(r): v for r, v in result["rows"].items()}}
                         for numel, result in combined.items()}
                    for dp, combined in everything.items()}}, handle, indent=1)
        print(oversubscription_note(dp), flush=True)
    print("\nSummary: speed-up over the exact all-reduce (median of round medians; its min-max "
          "over rounds: the slowest round of one against the fastest of all-reduce, and back)")
    print(f"{'DP':>3} {'floats':>11} {'M/C':>5} " + " ".join(f"{n:>22}" for n in reducers
                                                           if n != "allreduce"))
    for dp, combined in everything.items():
        for numel, result in combined.items():
            for row in result["rows"].values():
                base = row["allreduce"]
                cells = [f"x{base[0] / row[n][0]:.2f} ({base[1] / row[n][2]:.2f}-"
                         f"{base[2] / row[n][1]:.2f})" for n in reducers if n != "allreduce"]
                print(f"{dp:>3} {numel:>11,} {row['ratio']:>5.2f} "
                      + " ".join(f"{c:>22}" for c in cells))
    print(f"wrote {args.out}/emulated.json")


def _plot(all_results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, len(all_results), figsize=(6 * len(all_results), 4),
                                squeeze=False)
    for axis, (dp, results) in zip(axes[0], all_results.items()):
        for label, values in results.items():
            axis.plot(range(1, len(values["losses"]) + 1), values["losses"], label=label)
        axis.set(title=f"DP={dp}, demo corpus", xlabel="iteration", ylabel="lm loss")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv=None) -> None:
    args = parse_arguments(argv)
    os.chdir(REPO)
    if args.emulate_compute:
        os.makedirs(args.out, exist_ok=True)
        emulated_main(args)
        return
    if not os.path.exists("data/demo/corpus_text_document.idx"):
        sys.exit("data/demo/ is missing; run `python tools/build_demo_corpus.py` first")
    os.makedirs(args.out, exist_ok=True)
    base = (MODEL_FLAGS + " " + DATA_FLAGS).split() + [
        "--train-iters", str(args.iters), "--a2sgd-sync-interval", str(args.sync_interval)]
    all_results = {}
    print(f"{'DP':>3} {'variant':<14} {'bytes/step/worker':>18} {'ms/step':>9} "
          f"{'final loss':>10}")
    for dp in args.dp:
        ranks = run_distributed(_rank_all_variants, dp, base, VARIANTS, timeout=3000)
        results = ranks[-1]
        for label, values in results.items():
            values["seconds"] = max(r[label]["seconds"] for r in ranks)
            values["final_loss"] = sum(values["losses"][-5:]) / len(values["losses"][-5:])
            print(f"{dp:>3} {label:<14} {values['step_bytes']:>18,.0f} "
                  f"{values['seconds'] * 1000:>9.1f} {values['final_loss']:>10.4f}")
        all_results[dp] = results
    with open(os.path.join(args.out, "results.json"), "w") as handle:
        json.dump({"args": vars(args), "results": all_results}, handle, indent=1)
    _plot(all_results, os.path.join(args.out, "loss.png"))
    print(f"wrote {args.out}/results.json and {args.out}/loss.png")


if __name__ == "__main__":
    main()
