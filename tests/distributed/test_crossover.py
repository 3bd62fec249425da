"""Crossover scheduling: two jobs share two ranks, each job's numbers bit-identical to running alone.

Data parallel (DP 2) and Chimera (PP 2). The jobs differ in seed, width and length, so the
rotation also covers a job leaving it early.
"""

from __future__ import annotations

import json

import pytest

import pretrain_gpt
from dist_harness import run_distributed
from megatron.training.arguments import parse_args
from megatron.training.crossover import (Baton, CrossoverJob, load_crossover_jobs,
                                         run_crossover)
from megatron.training.training import pretrain

COMMON = ("--num-layers 2 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
          "--vocab-size 128 --make-vocab-size-divisible-by 64 --mock-data --micro-batch-size 2 "
          "--global-batch-size 8 --lr 1e-2 --log-interval 1 --eval-iters 1 --eval-interval 2")
JOB_A = COMMON + " --hidden-size 32 --seed 7 --train-iters 4"
JOB_B = COMMON + " --hidden-size 64 --seed 11 --train-iters 3"


def _history(result) -> list:
    return [(r.losses["lm loss"], r.grad_norm, r.learning_rate) for r in result.history] + \
        [(prefix, losses["lm loss"]) for prefix, losses in result.validation]


def _run_job(argv: list[str], after_compute=None):
    config = parse_args(argv, world_size=2)
    return _history(pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                             pretrain_gpt.forward_step, log=lambda _: None,
                             after_compute=after_compute))


def _alone(rank, world_size, argv):
    return _run_job(argv)


def _crossover(rank, world_size, jobs):
    results = run_crossover(jobs, lambda job, after_compute, log: _run_job(list(job.args),
                                                                           after_compute))
    return results


@pytest.mark.parametrize("layout", ["", "--pipeline-model-parallel-size 2 "
                                        "--pipeline-schedule chimera"], ids=["dp2", "chimera-pp2"])
def test_each_job_is_bit_identical_to_running_alone(layout):
    jobs = [CrossoverJob("a", tuple(f"{JOB_A} {layout}".split())),
            CrossoverJob("b", tuple(f"{JOB_B} {layout}".split()))]
    shared = run_distributed(_crossover, 2, jobs, timeout=240)
    for job in jobs:
        alone = run_distributed(_alone, 2, list(job.args), timeout=240)
        for rank in range(2):
            assert shared[rank][job.name] == alone[rank], (job.name, rank)
    # iterations, evaluations every 2 iterations, then the final validation and test losses
    assert len(shared[0]["a"]) == 4 + 2 + 2 and len(shared[0]["b"]) == 3 + 1 + 2


def test_baton_rotates_and_skips_jobs_that_left():
    import threading
    baton, order = Baton(["a", "b", "c"]), []

    def job(name, turns):
        baton.wait_for_turn(name)
        for _ in range(turns):
            order.append(name)
            baton.pass_turn(name)
        order.append(name + " done")
        baton.leave(name)

    threads = [threading.Thread(target=job, args=(name, turns))
               for name, turns in (("a", 2), ("b", 1), ("c", 2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert order == ["a", "b", "c", "a", "b done", "c", "a done", "c done"]


def test_each_job_keeps_its_own_random_streams_across_turns():
    """The hand-off swaps python's, numpy's and torch's global generators: two jobs that seed and
    draw in alternating turns get exactly the numbers each would draw alone."""
    import random
    import threading

    import numpy as np
    import torch
    from megatron.training.crossover import _JobTurns

    def draws(seed, after_each=lambda: None):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        values = []
        for _ in range(3):
            values.append((random.random(), float(np.random.rand()), float(torch.rand(()))))
            after_each()
        return values

    alone = {name: draws(seed) for name, seed in (("a", 1), ("b", 2))}
    baton, shared = Baton(["a", "b"]), {}

    def job(name, seed):
        baton.wait_for_turn(name)
        shared[name] = draws(seed, _JobTurns(baton, name))
        baton.leave(name)

    threads = [threading.Thread(target=job, args=item) for item in (("a", 1), ("b", 2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert shared == alone and alone["a"] != alone["b"]


def test_crossover_benchmark_emulated_run_prints_its_tables(capsys):
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import crossover as benchmark
    assert benchmark.main(["--emulate-compute", "--sizes", "2e4", "--ratios", "1",
                           "--iterations", "2", "--rounds", "1", "--gradients", "fill",
                           "accumulate", "--profile"]) == 0
    text = capsys.readouterr().out
    assert "speed-up / bound" in text and "20,000" in text
    assert "accumulate" in text and "fill" in text
    assert "hand-off ms" in text and "CPU ceiling" in text and "all-reduce alone" in text


def test_jobs_file_errors_name_the_problem(tmp_path):
    path = tmp_path / "jobs.json"
    path.write_text(json.dumps({"jobs": [{"name": "a", "args": "--seed 1"},
                                         {"name": "b", "args": ["--seed", "2"]}]}))
    assert load_crossover_jobs(str(path)) == [CrossoverJob("a", ("--seed", "1")),
                                              CrossoverJob("b", ("--seed", "2"))]
    path.write_text(json.dumps({"jobs": [{"name": "a", "args": "--seed 1"}]}))
    with pytest.raises(ValueError, match="at least two jobs"):
        load_crossover_jobs(str(path))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_crossover_jobs(str(path))
    with pytest.raises(ValueError, match="no such file"):
        load_crossover_jobs(str(tmp_path / "missing.json"))


def test_crossover_benchmark_quick_run_prints_its_table(capsys):
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import crossover as benchmark
    assert benchmark.main(["--quick"]) == 0
    text = capsys.readouterr().out
    assert "bound (C+M)/max(C,M)" in text and "h32 L2 GB4" in text
