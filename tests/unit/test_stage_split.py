"""Tier 0: uneven pipeline stages follow Megatron-LM's rules, and a bad split is refused by name.

Expected layer counts and offsets are worked by hand from Megatron-LM's
``get_num_layers_to_build`` and ``get_transformer_layer_offset`` (d98e8a6) for the same flags.
"""

import pytest

from megatron.core.pipeline_parallel.planning.stage_split import (StageSplit, stage_layer_counts,
                                                                  stage_layer_ranges)
from megatron.training.arguments import parse_args

TINY = ("--hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--vocab-size 64 --mock-data --lr 1e-3 --train-iters 1 --micro-batch-size 1 "
        "--global-batch-size 8").split()


@pytest.mark.parametrize("num_layers,pp,stages,split,counts", [
    (8, 4, 4, StageSplit(), (2, 2, 2, 2)),
    # Megatron's gpt3_mcore_te_tp1_pp4_vp1_uneven_pipeline: 12 layers, first 2, last 2.
    (12, 4, 4, StageSplit(first=2, last=2), (2, 4, 4, 2)),
    (12, 4, 4, StageSplit(first=3), (3, 3, 3, 3)),
    (10, 4, 4, StageSplit(last=4), (2, 2, 2, 4)),
    (8, 2, 2, StageSplit(first=3), (3, 5)),
    # With v = 2 every position's layers split over its two chunks (model order c x D + r).
    (12, 4, 8, StageSplit(first=2, last=2), (1, 2, 2, 1, 1, 2, 2, 1)),
    # gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split: 6 + 2 units over 8.
    (6, 4, 8, StageSplit(account_for_embedding=True, account_for_loss=True),
     (0, 1, 1, 1, 1, 1, 1, 0)),
    (6, 4, 4, StageSplit(account_for_embedding=True, account_for_loss=True), (1, 2, 2, 1)),
    (7, 2, 2, StageSplit(account_for_embedding=True), (3, 4)),
    (7, 2, 2, StageSplit(account_for_loss=True), (4, 3)),
])
def test_layer_counts_follow_megatron(num_layers, pp, stages, split, counts):
    assert stage_layer_counts(num_layers, pp, stages, split) == counts
    assert sum(counts) == num_layers


def test_offsets_equal_megatrons_layer_offsets():
    # get_transformer_layer_offset, uneven with v = 2 (L 12, PP 4, first 2, last 2): per-chunk
    # first 1, middle 8 // 2 = 4 over 2 ranks, last 1, so 6 per virtual round;
    # offset(r, c) = 6c + 1 + (r - 1) * 2 for r > 0, 6c for r = 0.
    ranges = stage_layer_ranges(stage_layer_counts(12, 4, 8, StageSplit(first=2, last=2)))
    for chunk in range(2):
        for rank in range(4):
            want = 6 * chunk + (0 if rank == 0 else 1 + (rank - 1) * 2)
            assert ranges[chunk * 4 + rank].start == want
    # account-for with v = 2 (L 6, PP 4): 8 units, 1 per virtual stage, offset = 4c + r - 1 but
    # for the very first chunk.
    ranges = stage_layer_ranges(stage_layer_counts(
        6, 4, 8, StageSplit(account_for_embedding=True, account_for_loss=True)))
    for chunk in range(2):
        for rank in range(4):
            want = 4 * chunk + rank - (0 if (chunk, rank) == (0, 0) else 1)
            assert ranges[chunk * 4 + rank].start == want


@pytest.mark.parametrize("num_layers,pp,stages,split,message", [
    (12, 4, 4, StageSplit(first=3, last=2),
     r"the layers left after --decoder-first-pipeline-num-layers and "
     r"--decoder-last-pipeline-num-layers for the 2 middle pipeline stages \(7\) cannot be split "
     r"evenly over 2; choose"),
    (4, 4, 4, StageSplit(first=2, last=2), r"leave 0 of --num-layers 4 for 2 middle"),
    (8, 2, 2, StageSplit(first=3, last=3), r"leave 2 of --num-layers 8 for 0 middle"),
    (8, 4, 4, StageSplit(first=0), r"--decoder-first-pipeline-num-layers 0 must be >= 1"),
    (12, 4, 8, StageSplit(first=3, last=3),
     r"--decoder-first-pipeline-num-layers of pipeline stage 0 \(3\) cannot be split evenly "
     r"over 2; with --num-virtual-stages-per-pipeline-rank 2"),
    (8, 4, 4, StageSplit(first=2, account_for_loss=True), r"cannot be combined with"),
    (7, 4, 8, StageSplit(account_for_embedding=True, account_for_loss=True),
     r"\(9\) cannot be split evenly over 8; .* 2 short of a multiple of 8 \(e\.g\. 6 or 14\)"),
    (6, 4, 4, StageSplit(), r"--num-layers \(6\) cannot be split evenly over 4; use a multiple of 4 layers"),
])
def test_a_bad_split_names_the_flags_and_the_fix(num_layers, pp, stages, split, message):
    with pytest.raises(ValueError, match=message):
        stage_layer_counts(num_layers, pp, stages, split)


def _parse(flags: str, world_size: int = 4):
    return parse_args(TINY + flags.split(), world_size=world_size)


def test_the_flags_parse_and_select_the_schedule():
    config = _parse("--num-layers 12 --pipeline-model-parallel-size 4 "
                    "--decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 2")
    assert config.parallel.pipeline_schedule == "1f1b"
    config = _parse("--num-layers 6 --pipeline-model-parallel-size 4 "
                    "--num-virtual-stages-per-pipeline-rank 2 "
                    "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split")
    assert config.parallel.pipeline_schedule == "interleaved-1f1b"
    assert config.parallel.virtual_pipeline_model_parallel_size == 2
    # --num-layers-per-virtual-pipeline-stage counts the embedding and loss as layers too.
    config = _parse("--num-layers 6 --pipeline-model-parallel-size 4 "
                    "--num-layers-per-virtual-pipeline-stage 1 "
                    "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split")
    assert config.parallel.virtual_pipeline_model_parallel_size == 2
    # One virtual stage per rank is the plain pipeline (as in Megatron-LM).
    config = _parse("--num-layers 8 --pipeline-model-parallel-size 4 "
                    "--num-virtual-stages-per-pipeline-rank 1")
    assert config.parallel.pipeline_schedule == "1f1b"
    config = _parse("--num-layers 8 --pipeline-model-parallel-size 4 --pipeline-schedule chimera "
                    "--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 3")
    assert config.parallel.pipeline_schedule == "chimera"


@pytest.mark.parametrize("flags,message", [
    ("--num-layers 12 --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 3 "
     "--decoder-last-pipeline-num-layers 2", "cannot be split evenly over 2"),
    ("--num-layers 12 --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 2 "
     "--num-layers-per-virtual-pipeline-stage 1",
     "need the virtual pipeline's size as --num-virtual-stages-per-pipeline-rank"),
    ("--num-layers 8 --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1 "
     "--num-virtual-stages-per-pipeline-rank 2", "both give the virtual pipeline's size"),
    ("--num-layers 8 --pipeline-model-parallel-size 4 --pipeline-schedule chimera "
     "--num-virtual-stages-per-pipeline-rank 2",
     "--num-virtual-stages-per-pipeline-rank selects the interleaved-1f1b schedule"),
    ("--num-layers 7 --pipeline-model-parallel-size 4 --pipeline-schedule chimera "
     "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
     r"\(9\) cannot be split evenly over 4"),
    ("--num-layers 12 --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 "
     "--decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 3",
     "pipeline stage 0 \\(3\\) cannot be split evenly over 2"),
])
def test_validation_refuses_a_bad_split(flags, message):
    with pytest.raises(ValueError, match=message):
        _parse(flags)


def test_block_recomputation_is_bounded_by_the_largest_stage():
    flags = ("--num-layers 12 --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 2 "
             "--decoder-last-pipeline-num-layers 2 --recompute-granularity full "
             "--recompute-method block --recompute-num-layers")
    assert _parse(f"{flags} 4").recompute.recompute_num_layers == 4
    with pytest.raises(ValueError, match="exceeds the 4 layers of a pipeline stage"):
        _parse(f"{flags} 5")
