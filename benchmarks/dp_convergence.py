#!/usr/bin/env python
"""Convergence of the data-parallel reducers on the demo corpus: validation loss against all-reduce,
over several seeds (gloo, CPU).

    python tools/build_demo_corpus.py        # once: data/demo/
    python benchmarks/dp_convergence.py [--iters 1000] [--seeds 1 2 3] [--dp 4]
        [--layers 2] [--hidden 64] [--seq-length 64] [--global-batch 16]   # the GPT and batch

Each variant trains the same small GPT from the same seed on the same global batches with one
``--dp-gradient-reducer`` and optimizer: exact all-reduce (Adam and SGD-momentum), A2SGD with Adam
and with SGD-momentum at two sync intervals (also with the flushing sync,
``--a2sgd-sync-flushes-errors``, with or without the optimizer state in the periodic sync,
``--a2sgd-periodic-sync parameters``, rows ``flush params``; per-tensor segments,
``--a2sgd-granularity tensor``, and lower learning rates at the short interval), top-k (error feedback) and QSGD with Adam. The
validation loss (``--eval-iters`` batches every ``--eval-interval`` iterations; a multiple of every
sync interval, so evaluation adds no A2SGD syncs) is recorded per seed. Runs are ordered seed by
seed, variant by variant, and ``results.json`` is rewritten after each run, so a run cut short still
holds whole seeds. ``--report`` prints the table (final validation loss, mean and min-max over
seeds, and the gap to the all-reduce run of the same optimizer with its spread over seeds) and
draws ``loss.png`` (mean curve, shaded min-max) from an existing ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from _harness import DEMO_DATA_FLAGS as DATA_FLAGS  # also puts the repo and tests/ on sys.path
from _harness import REPO_ROOT as REPO
from _harness import parallel_state_for
SCHEDULE_FLAGS = "--lr-decay-style cosine --lr-warmup-iters 10 --clip-grad 1.0 --log-interval 100000"


def model_flags(layers: int, hidden: int, seq_length: int, global_batch: int, dp: int) -> str:
    """The GPT's shape and batch (4 attention heads; one micro-batch per data-parallel rank)."""
    if global_batch % dp:
        raise SystemExit(f"--global-batch {global_batch} must be a multiple of --dp {dp}")
    return (f"--num-layers {layers} --hidden-size {hidden} --num-attention-heads 4 "
            f"--seq-length {seq_length} --max-position-embeddings {seq_length} "
            f"--micro-batch-size {global_batch // dp} --global-batch-size {global_batch} "
            f"{SCHEDULE_FLAGS}")
ADAM = "--optimizer adam --lr 3e-3 --min-lr 3e-4"
SGD = "--optimizer sgd --sgd-momentum 0.9 --lr 0.3 --min-lr 0.03"
# A2SGD's best learning rates in 200-iteration probes (docs/a2sgd.md); the later flag wins
ADAM_LOW_LR = f"{ADAM} --lr 1e-3 --min-lr 1e-4"
SGD_LOW_LR = f"{SGD} --lr 0.03 --min-lr 0.003 --clip-grad 0"


def variants(short: int, long: int) -> dict:
    """name -> (optimizer label, flags); the A2SGD sync intervals are ``short`` and ``long``."""
    a2sgd = "--dp-gradient-reducer a2sgd --a2sgd-sync-interval"
    flush = "--a2sgd-sync-flushes-errors"
    table = {"allreduce adam": ("adam", ADAM), "allreduce sgd": ("sgd", SGD)}
    for label, flags, low_lr in (("adam", ADAM, ADAM_LOW_LR), ("sgd", SGD, SGD_LOW_LR)):
        for interval in (short, long):
            table[f"a2sgd {label} sync {interval}"] = (label, f"{flags} {a2sgd} {interval}")
        for interval in (short, long):
            table[f"a2sgd {label} flush sync {interval}"] = (
                label, f"{flags} {a2sgd} {interval} {flush}")
            table[f"a2sgd {label} flush params sync {interval}"] = (
                label, f"{flags} {a2sgd} {interval} {flush} --a2sgd-periodic-sync parameters")
        table[f"a2sgd {label} tensor sync {short}"] = (
            label, f"{flags} {a2sgd} {short} --a2sgd-granularity tensor")
        table[f"a2sgd {label} low-lr sync {short}"] = (label, f"{low_lr} {a2sgd} {short}")
        table[f"a2sgd {label} low-lr flush params sync {short}"] = (
            label, f"{low_lr} {a2sgd} {short} {flush} --a2sgd-periodic-sync parameters")
    table[f"a2sgd adam flush params exact-v sync {short}"] = (
        "adam", f"{ADAM} {a2sgd} {short} {flush} --a2sgd-periodic-sync parameters "
                "--a2sgd-second-moment-from-exact-steps")
    table[f"a2sgd adam flush 2 params sync {long}"] = (
        "adam", f"{ADAM} {a2sgd} {long} --a2sgd-flush-interval 2 --a2sgd-periodic-sync parameters")
    table["topk adam"] = ("adam", f"{ADAM} --dp-gradient-reducer topk --topk-ratio 0.01")
    table["qsgd adam"] = ("adam", f"{ADAM} --dp-gradient-reducer qsgd --qsgd-levels 127")
    return table


def _rank_train(rank, world_size, argv):
    """One run on this gloo rank: (validation losses by iteration, training losses, seconds)."""
    import torch

    import pretrain_gpt
    from megatron.training.arguments import parse_args
    from megatron.training.training import pretrain

    torch.set_num_threads(1)
    config = parse_args(argv, world_size=world_size)
    pretrain_gpt.build_run_tokenizer(config)  # fills the padded vocabulary size
    state = parallel_state_for(rank, world_size, [argv])
    started = time.perf_counter()
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=state, log=lambda _: None)
    seconds = time.perf_counter() - started
    validation = {label.split()[1]: losses["lm loss"] for label, losses in result.validation
                  if label.startswith("iteration ")}  # not the end-of-training "validation set"
    return {"validation": validation, "train": [r.losses["lm loss"] for r in result.history],
            "seconds": seconds}


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--sync-intervals", type=int, nargs=2, default=[5, 25],
                        help="A2SGD's short and long --a2sgd-sync-interval")
    parser.add_argument("--eval-interval", type=int, default=50,
                        help="a multiple of both sync intervals")
    parser.add_argument("--eval-iters", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--only", nargs="*", default=None, help="run only these variant names")
    parser.add_argument("--out", default="runs/dp_convergence")
    parser.add_argument("--report", action="store_true",
                        help="only print the table and draw the plot from results.json")
    return parser.parse_args(argv)


def _train_flags(args, seed: int, flags: str) -> list:
    shape = model_flags(args.layers, args.hidden, args.seq_length, args.global_batch, args.dp)
    return (f"{shape} {DATA_FLAGS} {flags} --seed {seed} --train-iters {args.iters} "
            f"--eval-interval {args.eval_interval} --eval-iters {args.eval_iters}").split()


def run(args) -> dict:
    from dist_harness import run_distributed
    path = os.path.join(args.out, "results.json")
    results = {"args": vars(args), "runs": {}}
    if os.path.exists(path):
        with open(path) as handle:
            results["runs"] = json.load(handle).get("runs", {})
    table = variants(*args.sync_intervals)
    if any(interval <= 0 or args.eval_interval % interval for interval in args.sync_intervals):
        sys.exit(f"--eval-interval {args.eval_interval} must be a multiple of both sync "
                 f"intervals {args.sync_intervals} (an evaluation syncs A2SGD's replicas)")
    unknown = sorted(set(args.only or ()) - set(table))
    if unknown:
        sys.exit(f"--only: no variant named {', '.join(map(repr, unknown))}; the variants are: "
                 + ", ".join(table))
    for seed in args.seeds:
        for name, (_, flags) in table.items():
            if args.only and name not in args.only:
                continue
            key = f"{name} | seed {seed}"
            if key in results["runs"]:
                continue
            ranks = run_distributed(_rank_train, args.dp, _train_flags(args, seed, flags),
                                    timeout=7200)
            logged = ranks[-1]
            logged["seconds"] = max(r["seconds"] for r in ranks)
            results["runs"][key] = logged
            final = logged["validation"].get(str(args.iters))
            print(f"{key:<32} final validation loss {final:.4f}  "
                  f"({logged['seconds']:.0f} s)", flush=True)
            with open(path, "w") as handle:
                json.dump(results, handle, indent=1)
    return results


def summarise(results: dict) -> list:
    """Rows (variant, seeds, final validation loss mean, min-max, gap to all-reduce of the same
    optimizer: mean and min-max over seeds)."""
    args = results["args"]
    table = variants(*args["sync_intervals"])
    by_variant: dict = {}
    for key, run in results["runs"].items():
        name, seed = key.split(" | seed ")
        final = run["validation"].get(str(args["iters"]))
        if final is not None:
            by_variant.setdefault(name, {})[int(seed)] = final
    rows = []
    # every variant in the file, not only those of the last invocation's sync intervals
    names = list(table) + sorted(name for name in by_variant if name not in table)
    for name in names:
        optimizer = table[name][0] if name in table else name.split()[1]
        finals = by_variant.get(name, {})
        if not finals:
            continue
        reference = by_variant.get(f"allreduce {optimizer}", {})
        gaps = [finals[seed] - reference[seed] for seed in finals if seed in reference]
        values = list(finals.values())
        rows.append({"variant": name, "seeds": sorted(finals), "mean": statistics.mean(values),
                     "min": min(values), "max": max(values),
                     "gap": statistics.mean(gaps) if gaps else None,
                     "gap_min": min(gaps) if gaps else None,
                     "gap_max": max(gaps) if gaps else None})
    return rows


def print_report(results: dict) -> None:
    print(f"{'variant':<38} {'seeds':<9} {'final val loss: mean (min-max)':<32} "
          f"{'gap to all-reduce: mean (min-max)':<34}")
    for row in summarise(results):
        gap = ("-" if row["gap"] is None else
               f"{row['gap']:+.4f} ({row['gap_min']:+.4f} .. {row['gap_max']:+.4f})")
        seeds = ",".join(str(s) for s in row["seeds"])
        print(f"{row['variant']:<38} {seeds:<9} "
              f"{row['mean']:.4f} ({row['min']:.4f}-{row['max']:.4f}){'':<10} {gap}")


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    curves: dict = {}
    for key, run in results["runs"].items():
        name = key.split(" | seed ")[0]
        curves.setdefault(name, []).append(
            sorted((int(it), loss) for it, loss in run["validation"].items()))
    figure, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for axis in axes:  # more variants than the default ten colours
        axis.set_prop_cycle(color=plt.get_cmap("tab20").colors)
    for name, runs in curves.items():
        axis = axes[0] if "sgd" not in name.split()[1:2] else axes[1]
        iterations = [it for it, _ in runs[0]]
        per_point = list(zip(*[[loss for _, loss in run] for run in runs
                               if len(run) == len(iterations)]))
        mean = [statistics.mean(point) for point in per_point]
        axis.plot(iterations, mean, label=f"{name} ({len(runs)} seeds)")
        axis.fill_between(iterations, [min(p) for p in per_point], [max(p) for p in per_point],
                          alpha=0.2)
    for axis, title in zip(axes, ("Adam", "SGD, momentum 0.9")):
        axis.set(title=f"{title}: DP {results['args']['dp']}, demo corpus", xlabel="iteration",
                 ylabel="validation lm loss (mean, min-max over seeds)")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv=None) -> None:
    args = parse_arguments(argv)
    os.chdir(REPO)
    os.makedirs(args.out, exist_ok=True)
    if args.report:
        with open(os.path.join(args.out, "results.json")) as handle:
            results = json.load(handle)
    else:
        if not os.path.exists("data/demo/corpus_text_document.idx"):
            sys.exit("data/demo/ is missing; run `python tools/build_demo_corpus.py` first")
        results = run(args)
    print_report(results)
    try:
        plot(results, os.path.join(args.out, "loss.png"))
        print(f"wrote {args.out}/loss.png")
    except ImportError:
        print("matplotlib is not installed: no plot (the table above has the numbers)")


if __name__ == "__main__":
    main()
