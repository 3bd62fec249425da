#!/usr/bin/env python
"""What ``--async-save`` at a save every iteration costs, on the README demo model.

    python benchmarks/async_save.py                      # 5 rounds x 20 timed iterations
    python benchmarks/async_save.py --rounds 1 --iterations 4 --warmup 2   # a quick check

The README demo (examples/demo_chimera.sh: Chimera PP 4, 8 layers, hidden 64, sequence 64,
4 CPU processes through torchrun) runs ``pretrain_gpt.py`` in two configurations, interleaved in
rounds (the order alternates from round to round, so a slow phase of a shared machine hits both):

- ``no-save``: no checkpointing;
- ``async-save``: ``--save DIR --save-interval 1 --async-save`` (the default ``--ckpt-format
  torch_dist``): every iteration copies the state and starts a background write; each save first
  waits for and publishes the previous one.

``--sync`` adds the same saves in the foreground, ``--worker`` the background saves written by a
persistent writer process per rank (``--use-persistent-ckpt-worker``). The time of an iteration
is the log line's ``elapsed time per iteration`` at ``--log-interval 1``, which includes the save
that followed the previous iteration; warm-up iterations (process groups, the first save's
set-up) are dropped. Per round and configuration the mean over the timed iterations; printed: each
round's ratio to ``no-save``, their median and spread (min-max). The demo corpus is replaced by
``--mock-data`` with the demo tokenizer's vocabulary size (4096): the model and its checkpoint are
the same size.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: examples/demo_chimera.sh's flags (model, schedule, batch, optimizer); data: mock, same vocab.
DEMO_FLAGS = ("--pipeline-model-parallel-size 4 --pipeline-schedule chimera "
              "--num-layers 8 --hidden-size 64 --num-attention-heads 4 "
              "--seq-length 64 --max-position-embeddings 64 "
              "--micro-batch-size 2 --global-batch-size 16 "
              "--lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 5 --clip-grad 1.0 "
              "--mock-data --vocab-size 4096 --seed 1234 --eval-iters 0 --log-interval 1").split()
NUM_PROCESSES = 4
ITERATION = re.compile(r" iteration +(\d+)/ *\d+ \|.*? elapsed time per iteration \(ms\): "
                       r"([0-9.]+) \|")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def configurations(save_dir: str, with_sync: bool, with_worker: bool = False) -> dict:
    configs = {"no-save": [],
               "async-save": ["--save", save_dir, "--save-interval", "1", "--async-save"]}
    if with_worker:
        configs["async-save-worker"] = configs["async-save"] + ["--use-persistent-ckpt-worker"]
    if with_sync:
        configs["sync-save"] = ["--save", save_dir, "--save-interval", "1"]
    return configs


def run_once(flags: list, warmup: int, iterations: int) -> float:
    """Mean milliseconds per timed iteration of one torchrun job with ``flags``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(NUM_PROCESSES), "--master-port", str(_free_port()), "pretrain_gpt.py",
               *DEMO_FLAGS, "--train-iters", str(warmup + iterations), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    times = [float(ms) for iteration, ms in ITERATION.findall(done.stdout + done.stderr)
             if int(iteration) > warmup]
    if len(times) != iterations:
        raise RuntimeError(f"expected {iterations} timed iteration lines, found {len(times)}")
    return statistics.fmean(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=20, help="timed iterations per run")
    parser.add_argument("--warmup", type=int, default=3, help="iterations dropped per run")
    parser.add_argument("--sync", action="store_true", help="also time foreground saves")
    parser.add_argument("--worker", action="store_true",
                        help="also time background saves by a persistent writer process")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="async_save_bench_")
    try:
        means: dict = {}
        for round_index in range(args.rounds):
            configs = list(configurations(os.path.join(work, "ckpt"), args.sync,
                                          args.worker).items())
            if round_index % 2:
                configs.reverse()
            for name, flags in configs:
                shutil.rmtree(os.path.join(work, "ckpt"), ignore_errors=True)
                means.setdefault(name, []).append(run_once(flags, args.warmup, args.iterations))
            line = ", ".join(f"{name} {values[-1]:.1f} ms" for name, values in means.items())
            print(f"round {round_index + 1}/{args.rounds}: {line} (load average "
                  f"{os.getloadavg()[0]:.1f})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{NUM_PROCESSES} processes on {os.cpu_count()} core(s); mean ms per iteration per "
          f"round, {args.iterations} timed iterations after {args.warmup} warm-up")
    for name in means:
        if name == "no-save":
            continue
        ratios = [saved / plain for saved, plain in zip(means[name], means["no-save"])]
        print(f"{name} / no-save: median {statistics.median(ratios):.3f} (spread "
              f"{min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} rounds; "
              f"{'+' if statistics.median(ratios) >= 1 else ''}"
              f"{(statistics.median(ratios) - 1) * 100:.1f}% iteration time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
