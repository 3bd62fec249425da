"""Checkpointing on two gloo ranks (DP=2 and TP=2): exact resume in a fresh set of processes, one
file per tensor-parallel rank, RNG states of every data-parallel rank, a save failing on one rank
raising on both, and loading with a different layout."""

import json

import pytest
import torch

import pretrain_gpt
from dist_harness import run_distributed
from megatron.core.parallel_state import ParallelState
from megatron.training import checkpointing
from megatron.training.arguments import parse_args
from megatron.training.checkpointing import Checkpointer, checkpoint_file, read_tracker
from megatron.training.initialize import initialize_megatron
from megatron.core.runtimes import NoPipelineRuntime
from megatron.core.tensor_parallel.utils import shard_of
from megatron.training.training import pretrain, setup_model_and_optimizer

pytestmark = pytest.mark.distributed

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 128 --make-vocab-size-divisible-by 64 "
        "--mock-data --seed 7 --micro-batch-size 2 --global-batch-size 8 --log-interval 1 "
        "--lr 3e-3 --lr-decay-style cosine --lr-warmup-iters 1 --clip-grad 0.5 "
        "--train-iters 5 --eval-interval 2 --eval-iters 1 --distributed-timeout-minutes 0.5 "
        "--ckpt-format torch")  # the legacy layout
LAYOUTS = {"dp2": "", "tp2": "--tensor-model-parallel-size 2"}


def _train(argv: str, world_size: int):
    config = parse_args(argv.split(), world_size=world_size)
    parallel_state = initialize_megatron(config, env={})
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=parallel_state,
                      checkpointing=Checkpointer(config, log=lambda _: None), log=lambda _: None)
    records = [(r.iteration, r.losses["lm loss"], r.learning_rate, r.grad_norm)
               for r in result.history]
    # numpy, not tensors: tensors may travel through shared memory a finished rank takes away
    params = {name: value.numpy().copy()
              for name, value in result.components.model_chunks[0].state_dict().items()}
    return records, result.validation, params


def _straight_and_first_part(rank, world_size, argv, save_dir):
    straight = _train(argv, world_size)
    first = _train(f"{argv} --save {save_dir} --exit-interval 3", world_size)
    return straight, first


def _second_part(rank, world_size, argv, save_dir):
    return _train(f"{argv} --load {save_dir} --save {save_dir}", world_size)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def resumed_runs(request, tmp_path_factory):
    """(layout name, save dir, per-rank (straight, first part), per-rank second part)."""
    argv = f"{TINY} {LAYOUTS[request.param]}"
    save_dir = str(tmp_path_factory.mktemp(request.param) / "ckpt")
    first = run_distributed(_straight_and_first_part, 2, argv, save_dir, timeout=180)
    second = run_distributed(_second_part, 2, argv, save_dir, timeout=120)
    return request.param, save_dir, first, second


def test_resume_in_fresh_processes_is_bitwise_identical(resumed_runs):
    _, _, first, second = resumed_runs
    for (straight, part_one), part_two in zip(first, second):
        straight_records, straight_validation, straight_params = straight
        assert part_one[0] + part_two[0] == straight_records
        assert part_one[1] + part_two[1] == straight_validation
        assert part_two[2].keys() == straight_params.keys()
        for name, value in straight_params.items():
            assert (part_two[2][name] == value).all(), name


def test_files_per_tensor_parallel_rank_and_rng_per_data_parallel_rank(resumed_runs):
    layout, save_dir, _, _ = resumed_runs
    assert read_tracker(save_dir) == 5
    metadata = json.load(open(f"{save_dir}/iter_0000005/metadata.json"))
    if layout == "tp2":
        assert sorted(metadata["files"]) == ["mp_rank_00/model_optim_rng.pt",
                                             "mp_rank_01/model_optim_rng.pt"]
        shards = [torch.load(checkpoint_file(save_dir, 5, tp, 0, 1), weights_only=True)
                  for tp in range(2)]
        name = "embedding.word_embeddings.weight"  # vocabulary-parallel: each holds half
        assert shards[0]["model"][name].shape == (64, 32)
        assert not torch.equal(shards[0]["model"][name], shards[1]["model"][name])
        assert all(len(shard["rng_state"]) == 1 for shard in shards)
    else:
        assert sorted(metadata["files"]) == ["mp_rank_00/model_optim_rng.pt"]
        payload = torch.load(checkpoint_file(save_dir, 5, 0, 0, 1), weights_only=True)
        assert payload["data_parallel_size"] == 2 and len(payload["rng_state"]) == 2


def _load_in_one_process(save_dir, extra=""):
    config = parse_args(f"{TINY} --load {save_dir} {extra}".split(), world_size=1)
    parallel_state, device = ParallelState.single_process(), torch.device("cpu")
    components = setup_model_and_optimizer(
        config, parallel_state, NoPipelineRuntime(config, parallel_state, device),
        pretrain_gpt.model_provider, device)
    state = Checkpointer(config, log=lambda _: None).load(components)
    return components, state


def test_another_tensor_parallel_size_loads_through_the_global_keys(resumed_runs):
    """One process loads the TP=2 checkpoint (another layout: weights and optimizer state read by
    name and merged) or the DP=2 one (replicated): each rank's saved weights are its block of the
    loaded ones, and the optimizer state is there."""
    layout, save_dir, _, second = resumed_runs
    components, state = _load_in_one_process(save_dir)
    assert state.iteration == 5
    assert len(components.optimizer.optimizer.state) > 0
    chunk = components.model_chunks[0]
    params = dict(chunk.named_parameters())
    loaded = chunk.state_dict()
    for tp_rank, (_, _, saved) in enumerate(second):
        for name, value in saved.items():
            param = params.get(name)
            expected = loaded[name]
            if layout == "tp2" and getattr(param, "tensor_model_parallel", False):
                expected = shard_of(expected, param.partition_dim, tp_rank, 2)
            assert (expected.numpy() == value).all(), (tp_rank, name)


def _save_fails_on_rank_one(rank, world_size, argv, save_dir, failing_function):
    _train(f"{argv} --save {save_dir} --exit-interval 2", world_size)
    if rank == 1:
        def broken(*args, **kwargs):
            raise OSError(5, "Input/output error (injected)")
        setattr(checkpointing.checkpointer, failing_function, broken)  # where the hook calls it
    try:
        _train(f"{argv} --load {save_dir} --save {save_dir} --exit-interval 4", world_size)
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.parametrize("layout,failing_function", [("tp2", "save_file"),
                                                     ("dp2", "capture_rng_state")],
                         ids=["writer-fails", "non-writer-fails"])
def test_a_save_failing_on_one_rank_raises_on_every_rank(tmp_path, layout, failing_function):
    save_dir = str(tmp_path / "ckpt")
    messages = run_distributed(_save_fails_on_rank_one, 2, f"{TINY} {LAYOUTS[layout]}", save_dir,
                               failing_function, timeout=120)
    for message in messages:
        assert message is not None and "rank 1: OSError" in message and "injected" in message
    assert read_tracker(save_dir) == 2
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "iter_0000002", "latest_checkpointed_iteration.txt"]
