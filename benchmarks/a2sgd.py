#!/usr/bin/env python
"""A2SGD vs exact all-reduce: bytes per step, time per step and loss on the demo corpus (gloo, CPU).

    python tools/build_demo_corpus.py          # once: data/demo/
    python benchmarks/a2sgd.py [--iters 50] [--dp 2 4] [--out runs/a2sgd]

For each data-parallel size (no pipeline) it forks that many gloo ranks and trains the same tiny GPT
from the same seed on the same global batches with: exact all-reduce, and A2SGD at each averaging
granularity (whole model portion = the paper's, per bucket of 4096 elements, per tensor). Per
variant it reports the bytes each worker hands to data-parallel collectives per step (all-reduce:
the whole gradient; A2SGD: 4 float64 per segment, plus the exact average of parameters and optimizer
state amortised over ``--a2sgd-sync-interval``), the mean wall time per step, and the lm loss after the last step
(mean of the last 5 iterations, to damp batch noise). Writes ``results.json`` and a loss plot
``loss.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO, os.path.join(REPO, "tests")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from dist_harness import run_distributed  # noqa: E402  (tests/ helper, shared on purpose)

DATA_FLAGS = ("--data-path data/demo/corpus_text_document --split 949,50,1 "
              "--tokenizer-type SentencePieceTokenizer --tokenizer-model data/demo/tokenizer.model")
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
    from megatron.core.parallel_state import RankLayout, create_parallel_state
    from megatron.core.runtimes import select_runtime_class
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import set_random_seeds
    from megatron.training.training import (TrainingState, _build_datasets,
                                            setup_model_and_optimizer, train)

    config = parse_args(argv, world_size=world_size)
    pretrain_gpt.build_run_tokenizer(config)  # fills the padded vocabulary size
    runtime_class = select_runtime_class(config)
    layout = RankLayout.from_world_size(world_size, 1, 1)
    state = create_parallel_state(layout, rank, "gloo",
                                  extra_group_ranks=runtime_class.required_group_ranks(config,
                                                                                       layout))
    set_random_seeds(config.training.seed)
    runtime = runtime_class(config, state, torch.device("cpu"))
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
    return parser.parse_args(argv)


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
