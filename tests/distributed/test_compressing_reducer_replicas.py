"""Top-k and QSGD as the data-parallel reducer on gloo ranks: DP 2, and Chimera PP 2 x DP 2.

Every replica applies the same decompressed average, so unlike A2SGD nothing drifts: after
training every copy of every parameter (data-parallel replicas, Chimera's two copies of a stage, the
tied embedding copies) must be bitwise identical. Top-k keeping every entry is the exact all-reduce,
so its losses must match ``allreduce``'s.
"""

import math

import pytest

import pretrain_gpt
from dist_harness import run_distributed
from megatron.core.parallel_state import RankLayout, create_parallel_state
from megatron.core.runtimes import select_runtime_class
from megatron.training.arguments import parse_args
from megatron.training.training import pretrain

pytestmark = pytest.mark.distributed

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 128 --make-vocab-size-divisible-by 64 "
        "--mock-data --seed 7 --micro-batch-size 1 --global-batch-size 8 --lr 1e-2 "
        "--log-interval 1 --eval-iters 0 --train-iters 3")

REDUCERS = {"allreduce": "", "topk-all": "--dp-gradient-reducer topk --topk-ratio 1.0",
            "topk": "--dp-gradient-reducer topk --topk-ratio 0.1",
            "qsgd": "--dp-gradient-reducer qsgd --qsgd-levels 4 --qsgd-bucket-size 64"}


def _train(rank, world_size, argv):
    config = parse_args(argv.split(), world_size=world_size)
    runtime_class = select_runtime_class(config)
    layout = RankLayout.from_world_size(world_size, 1,
                                        config.parallel.pipeline_model_parallel_size)
    state = create_parallel_state(layout, rank, "gloo",
                                  extra_group_ranks=runtime_class.required_group_ranks(config,
                                                                                       layout))
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=state, log=lambda _: None)
    components = result.components
    keys = getattr(components.runtime, "keys", [None] * len(components.model_chunks))
    params = {}
    for key, chunk in zip(keys, components.model_chunks):
        stage = 0 if key is None else key.stage
        for name, param in chunk.named_parameters():
            params[(stage, name)] = param.detach().clone()
    return [r.losses["lm loss"] for r in result.history], params


def _rank_all_reducers(rank, world_size, flags):
    return {name: _train(rank, world_size, f"{TINY} {flags} {extra}")
            for name, extra in REDUCERS.items()}


LAYOUTS = [("", 2), ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera", 4)]


@pytest.mark.parametrize("flags,world_size", LAYOUTS, ids=["dp2", "chimera-pp2-dp2"])
def test_compressing_reducers_train_and_keep_every_copy_identical(flags, world_size):
    results = run_distributed(_rank_all_reducers, world_size, flags, timeout=400)
    last_stage_losses = [r for r in results if r["allreduce"][0]]
    reference = last_stage_losses[0]["allreduce"][0]
    assert len(reference) == 3
    for by_reducer in last_stage_losses:
        # top-k keeping everything is the exact average (summed in another order)
        for mine, exact in zip(by_reducer["topk-all"][0], reference):
            assert math.isclose(mine, exact, rel_tol=1e-5), (by_reducer["topk-all"][0], reference)
        for name in ("topk", "qsgd"):
            losses = by_reducer[name][0]
            assert all(math.isfinite(loss) for loss in losses), (name, losses)
            assert losses[0] == pytest.approx(reference[0], rel=1e-6)  # same start
    for name in REDUCERS:
        copies = {}
        for result in results:
            for key, value in result[name][1].items():
                copies.setdefault(key, []).append(value)
        for key, values in copies.items():
            assert all((value == values[0]).all() for value in values[1:]), \
                f"{name}: {key} differs between the ranks holding it"
        if name != "allreduce":  # it trained: the parameters moved away from allreduce's
            moved = [key for key, values in copies.items()
                     if not (values[0] == results[0]["allreduce"][1].get(key, values[0])).all()]
            assert moved or name == "topk-all", f"{name} changed nothing"


def test_emulated_compute_sweeps_run_and_print_their_tables(capsys, tmp_path):
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import a2sgd
    import crossover
    a2sgd.main(["--emulate-compute", "--dp", "2", "--sizes", "20000", "--ratios", "1",
                "--rounds", "1", "--steps", "1", "--out", str(tmp_path)])
    text = capsys.readouterr().out
    assert "bytes/worker/step" in text and "qsgd" in text and "beats all-reduce" in text
    assert "Summary: speed-up" in text and "a2sgd overlap" in text
    assert os.path.exists(tmp_path / "emulated.json")
    assert crossover.main(["--emulate-compute", "--sizes", "20000", "--ratios", "1",
                           "--iterations", "2", "--rounds", "1"]) == 0
    assert "speed-up / bound" in capsys.readouterr().out


def _rank_resume(rank, world_size, argv, save_dir):
    """A straight run, and the same run saved at iteration 3 and resumed (new process groups)."""
    from megatron.training.checkpointing import Checkpointer

    def run(extra):
        config = parse_args(f"{argv} {extra}".split(), world_size=world_size)
        runtime_class = select_runtime_class(config)
        layout = RankLayout.from_world_size(world_size, 1, 1)
        state = create_parallel_state(layout, rank, "gloo",
                                      extra_group_ranks=runtime_class.required_group_ranks(
                                          config, layout))
        result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                          pretrain_gpt.forward_step, parallel_state=state, log=lambda _: None,
                          checkpointing=Checkpointer(config, log=lambda _: None))
        return [r.losses["lm loss"] for r in result.history]
    straight = run("")
    run(f"--save {save_dir} --exit-interval 3")
    return straight, run(f"--load {save_dir}")


@pytest.mark.parametrize("name", ["topk", "qsgd"])
def test_resume_restores_each_ranks_error_or_random_stream_exactly(name, tmp_path):
    argv = f"{TINY.replace('--train-iters 3', '--train-iters 5')} {REDUCERS[name]}"
    results = run_distributed(_rank_resume, 2, argv, str(tmp_path / "ckpt"), timeout=240)
    for straight, resumed in results:
        assert resumed == straight[3:]
