"""``--ckpt-format torch_dist`` checkpoints resume in another parallel layout with their optimizer
state: a run saved in one layout (iteration 3 of 6) and resumed in another prints the losses of the
uninterrupted run for iterations 4-6 (fp32, dropout off, 1e-5 relative). Without the optimizer
state (``--no-load-optim``) the same resume must miss those losses, so the check can fail.

Layouts (at most 4 gloo ranks): Chimera PP4 with the distributed optimizer -> 1F1B TP2 x PP2;
interleaved PP2 x DP2 (saved with --async-save) -> PP1 x DP2; Chimera PP2 x DP2 -> Chimera PP2 x TP2;
uneven stages: Chimera PP2 x DP2 with layers [1, 3] and the distributed optimizer -> 1F1B PP2 with
layers [3, 1].

Legacy ``--ckpt-format torch`` checkpoints reshard through the same global keys (the files record
their optimizer state by parameter name): Chimera PP2 with the distributed optimizer -> 1F1B TP2
(replicated optimizer) and -> PP1 x DP2 (distributed optimizer); 1F1B TP2 x PP2 (replicated) ->
Chimera PP2 x DP2 with the distributed optimizer.
"""

from __future__ import annotations

import os

import pytest
from torch.distributed.checkpoint import FileSystemReader

import pretrain_gpt
from dist_harness import run_distributed
from megatron.training.arguments import parse_args
from megatron.training.checkpointing import (Checkpointer, read_tracker, torch_dist,
                                              write_tracker)
from megatron.training.training import pretrain

pytestmark = pytest.mark.distributed

TINY = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 128 --make-vocab-size-divisible-by 64 "
        "--mock-data --seed 7 --micro-batch-size 1 --global-batch-size 8 --lr 3e-3 "
        "--lr-warmup-iters 1 --lr-decay-style cosine --clip-grad 0.5 --weight-decay 0.1 "
        "--train-iters 6 --log-interval 1 --eval-iters 0 --attention-dropout 0 "
        "--hidden-dropout 0 --distributed-timeout-minutes 1 --ckpt-format torch_dist")

CASES = {
    "chimera-pp4-distopt->1f1b-tp2xpp2": (
        "--pipeline-model-parallel-size 4 --pipeline-schedule chimera "
        "--use-distributed-optimizer", 4,
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
        "--pipeline-schedule 1f1b", 4),
    "interleaved-pp2xdp2-async->pp1xdp2": (  # saved in the background (--async-save) every
        # iteration: iteration 3 is written with the save plan cached from the first save
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
        "--async-save --save-interval 1", 4, "", 2),
    "uneven-chimera-pp2xdp2-distopt->uneven-1f1b-pp2": (
        "--pipeline-model-parallel-size 2 --pipeline-schedule chimera "
        "--decoder-first-pipeline-num-layers 1 --use-distributed-optimizer", 4,
        "--pipeline-model-parallel-size 2 --pipeline-schedule 1f1b "
        "--decoder-last-pipeline-num-layers 1", 2),
    "chimera-pp2xdp2->chimera-pp2xtp2": (
        "--pipeline-model-parallel-size 2 --pipeline-schedule chimera", 4,
        "--pipeline-model-parallel-size 2 --pipeline-schedule chimera "
        "--tensor-model-parallel-size 2", 4),
}


def _train(rank, world_size, argv):
    config = parse_args(argv.split(), world_size=world_size)
    lines = []
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step,
                      checkpointing=Checkpointer(config, log=lines.append), log=lambda _: None)
    return {r.iteration: r.losses["lm loss"] for r in result.history}, lines


# Saved with nothing packed: every tensor is a DCP item, so DCP itself cuts the boxes on load
# (the tiny model's tensors are all small enough to be packed otherwise, torch_dist.PACK_LIMIT_BYTES)
UNPACKED = {"chimera-pp4-distopt->1f1b-tp2xpp2"}


def _save_straight_run(source: str, world_size: int, save_dir: str, unpacked: bool = False):
    """Train 6 iterations saving at 3 and 6 (``source`` may save more often), then point the
    tracker at 3; the straight losses."""
    with pytest.MonkeyPatch.context() as patch:  # the forked ranks inherit the limit
        if unpacked:
            patch.setattr(torch_dist, "PACK_LIMIT_BYTES", 0)
        results = run_distributed(_train, world_size,
                                  f"{TINY} --save {save_dir} --save-interval 3 {source}",
                                  timeout=300)
    losses = results[0][0]
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert read_tracker(save_dir) == 6
    write_tracker(save_dir, 3)  # resume from iteration 3; iteration 6 is the straight run's end
    return losses


@pytest.fixture(scope="module", params=sorted(CASES))
def saved_run(request, tmp_path_factory):
    """(case, save dir holding iterations 3 and 6 with the tracker at 3, straight losses)."""
    source, source_world, _, _ = CASES[request.param]
    save_dir = str(tmp_path_factory.mktemp("reshard") / "ckpt")
    losses = _save_straight_run(source, source_world, save_dir, request.param in UNPACKED)
    packed = any(name.startswith(torch_dist.PACKED) for name in _saved_keys(save_dir, 3))
    assert packed == (request.param not in UNPACKED)
    return request.param, save_dir, losses


def _saved_keys(save_dir: str, iteration: int) -> list:
    """Every key in the DCP index of an iteration (tensors and objects)."""
    reader = FileSystemReader(os.path.join(save_dir, f"iter_{iteration:07d}"))
    return list(reader.read_metadata().state_dict_metadata)


def _resume(case: str, save_dir: str, extra: str = ""):
    _, _, target, target_world = CASES[case]
    return _resume_in(target, target_world, save_dir, extra)


def _resume_in(target: str, world_size: int, save_dir: str, extra: str = ""):
    """(losses, rank 0's checkpoint log lines) of the run resumed from ``save_dir``."""
    results = run_distributed(_train, world_size, f"{TINY} {target} --load {save_dir} {extra}",
                              timeout=300)
    return results[0]


def _relative_errors(resumed: dict, straight: dict) -> list[float]:
    assert sorted(resumed) == [4, 5, 6]
    return [abs(resumed[i] - straight[i]) / abs(straight[i]) for i in (4, 5, 6)]


def test_resume_in_another_layout_prints_the_straight_losses(saved_run):
    case, save_dir, straight = saved_run
    resumed, lines = _resume(case, save_dir)
    assert any("resharding from" in line for line in lines), lines
    errors = _relative_errors(resumed, straight)
    assert max(errors) < 1e-5, (case, resumed, straight)


def test_dropping_the_optimizer_state_misses_the_straight_losses(saved_run):
    case, save_dir, straight = saved_run
    resumed, _ = _resume(case, save_dir, "--no-load-optim")
    errors = _relative_errors(resumed, straight)
    assert max(errors) > 1e-5, (case, resumed, straight)


def test_the_checkpoint_holds_global_keys_once(saved_run):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron.training.checkpointing.dcp_io import PieceLoadPlanner, unpack_boxes

    _, save_dir, _ = saved_run
    iteration_dir = os.path.join(save_dir, "iter_0000003")
    metadata = FileSystemReader(iteration_dir).read_metadata()
    # {key: (global shape, [box sizes])}: DCP's items, and the boxes of every rank's packed object
    boxes = {key: (tuple(entry.size), [tuple(chunk.sizes) for chunk in entry.chunks])
             for key, entry in metadata.state_dict_metadata.items()
             if isinstance(entry, TensorStorageMetadata)}
    packs = [key for key in metadata.state_dict_metadata if key.startswith(torch_dist.PACKED)]
    planner = PieceLoadPlanner([], packs)
    dcp.load({}, storage_reader=FileSystemReader(iteration_dir), planner=planner, no_dist=True)
    for pack in packs:
        for key, shape, _, tensor in unpack_boxes(planner.objects[pack]):
            assert key not in boxes or boxes[key][0] == tuple(shape), key
            boxes.setdefault(key, (tuple(shape), []))[1].append(tuple(tensor.shape))
    # one key per parameter of the whole model, with its global shape
    assert boxes["model.embedding.word_embeddings.weight"][0] == (128, 32)
    assert boxes["model.decoder.layers.3.mlp.linear_fc1.weight"][0] == (128, 32)
    for name in ("exp_avg", "exp_avg_sq", "step"):
        assert f"optimizer.state.{name}.decoder.layers.0.self_attention.linear_qkv.weight" \
            in boxes
    for key, (shape, sizes) in boxes.items():  # every element written exactly once
        assert sum(_volume(size) for size in sizes) == _volume(shape), key


def _volume(shape) -> int:
    result = 1
    for size in shape:
        result *= size
    return result


# ---- legacy (--ckpt-format torch) checkpoints through the global keys ---------------------------

LEGACY = "--ckpt-format torch"
LEGACY_SOURCES = {  # saved layout, world size; {target name: (target layout, world size)}
    "chimera-pp2-distopt": (
        "--pipeline-model-parallel-size 2 --pipeline-schedule chimera "
        "--use-distributed-optimizer", 2,
        {"1f1b-tp2": ("--tensor-model-parallel-size 2", 2),  # distributed optimizer off
         "pp1xdp2-distopt": ("--use-distributed-optimizer", 2)}),  # shards recut
    "1f1b-tp2xpp2": (  # replicated optimizer, tensor-parallel files
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
        "--pipeline-schedule 1f1b", 4,
        {"chimera-pp2xdp2-distopt": ("--pipeline-model-parallel-size 2 --pipeline-schedule "
                                     "chimera --use-distributed-optimizer", 4)}),
}


@pytest.fixture(scope="module", params=sorted(LEGACY_SOURCES))
def legacy_run(request, tmp_path_factory):
    """(source name, legacy save dir with the tracker at 3, straight losses)."""
    source, world_size, _ = LEGACY_SOURCES[request.param]
    save_dir = str(tmp_path_factory.mktemp("legacy") / "ckpt")
    losses = _save_straight_run(f"{source} {LEGACY}", world_size, save_dir)
    iteration_dir = os.path.join(save_dir, "iter_0000003")
    assert not os.path.exists(os.path.join(iteration_dir, ".metadata"))  # no DCP: the torch files
    assert any(name.startswith("mp_rank_") for name in os.listdir(iteration_dir))
    return request.param, save_dir, losses


def _legacy_targets(legacy_run):
    source, save_dir, straight = legacy_run
    return [(target, *LEGACY_SOURCES[source][2][target], save_dir, straight)
            for target in sorted(LEGACY_SOURCES[source][2])]


def test_legacy_checkpoint_resumes_in_another_layout_with_its_optimizer_state(legacy_run):
    for name, target, world_size, save_dir, straight in _legacy_targets(legacy_run):
        resumed, lines = _resume_in(target, world_size, save_dir)
        assert any("resharding from" in line and "optimizer state" in line
                   for line in lines), lines
        errors = _relative_errors(resumed, straight)
        assert max(errors) < 1e-5, (legacy_run[0], name, resumed, straight)


def test_legacy_checkpoint_without_its_optimizer_state_misses_the_straight_losses(legacy_run):
    for name, target, world_size, save_dir, straight in _legacy_targets(legacy_run):
        resumed, _ = _resume_in(target, world_size, save_dir, "--no-load-optim")
        errors = _relative_errors(resumed, straight)
        assert max(errors) > 1e-5, (legacy_run[0], name, resumed, straight)
