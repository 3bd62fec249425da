"""Uneven pipeline stages (Megatron-LM's --decoder-first/last-pipeline-num-layers and
--account-for-embedding/loss-in-pipeline-split) reproduce the single-process model.

One training step (float64, dropout 0.1, clipping on; the harness of test_pipeline_numerics) under
1F1B, interleaved 1F1B and Chimera with stages of different sizes: the loss, gradient norm, every
gradient and every updated parameter (every copy) equal the single-process model's within the same
tolerances (1e-9 relative, 1e-6 for the float32-averaged loss), and each rank holds exactly the
layers Megatron-LM's rules give its stages. (The distributed optimizer with uneven stages:
tests/distributed/test_distributed_optimizer.py.)
"""

import functools
import re

import pytest

from dist_harness import run_distributed
from pipeline_reference import assert_matches_reference, train_one_step

BATCH_N4 = "--micro-batch-size 2 --global-batch-size 8"

LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


@functools.lru_cache(maxsize=None)
def reference(flags: str) -> dict:
    return train_one_step(0, 1, flags.split())


def layers_by_rank(results: list[dict]) -> list[set[int]]:
    """The global transformer-layer indices each rank holds (any pipeline)."""
    return [{int(match.group(1)) for (_, name) in result["params"]
             if (match := LAYER.match(name))} for result in results]


def has_embedding(result: dict) -> bool:
    return any(name.startswith("embedding.position") for (_, name) in result["params"])


# (flags, world size, model flags of the reference, layers each rank holds). The model has 8
# layers (pipeline_reference.MODEL_FLAGS) unless the reference flags say otherwise.
UNEVEN_LAYOUTS = [
    # 1F1B PP4: first 1, last 1, the middle 6 split 3 + 3 (Megatron: [1, 3, 3, 1]).
    ("--pipeline-model-parallel-size 4 --pipeline-schedule 1f1b "
     "--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1", 4, "",
     [{0}, {1, 2, 3}, {4, 5, 6}, {7}]),
    # Only the last stage given (5): the other three split the remaining 3.
    ("--pipeline-model-parallel-size 4 --pipeline-schedule 1f1b "
     "--decoder-last-pipeline-num-layers 5", 4, "",
     [{0}, {1}, {2}, {3, 4, 5, 6, 7}]),
    # Interleaved PP2 x 2 virtual stages: rank 0 holds 2 layers (1 per chunk), rank 1 holds 6 (3
    # per chunk); model order [1, 3, 1, 3].
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
     "--decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 6", 2, "",
     [{0, 4}, {1, 2, 3, 5, 6, 7}]),
    # Interleaved PP4 x 2 with 12 layers, first 2, last 2: [1, 2, 2, 1, 1, 2, 2, 1] in model
    # order (Megatron's offsets, see tests/unit/test_stage_split.py).
    ("--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 "
     "--decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 2", 4,
     "--num-layers 12", [{0, 6}, {1, 2, 7, 8}, {3, 4, 9, 10}, {5, 11}]),
    # Chimera PP4: stages [1, 2, 2, 3]; rank r holds down stage r and up stage 3 - r.
    ("--pipeline-model-parallel-size 4 --pipeline-schedule chimera "
     "--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 3", 4, "",
     [{0, 5, 6, 7}, {1, 2, 3, 4}, {3, 4, 1, 2}, {5, 6, 7, 0}]),
    # Chimera with 2f = 4 pipelines: every rank hosts all four stages [1, 2, 2, 3].
    ("--pipeline-model-parallel-size 4 --pipeline-schedule chimera --chimera-pipelines 4 "
     "--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 3", 4, "",
     [set(range(8))] * 4),
    # Chimera PP2 x DP2: stages [3, 5].
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera "
     "--decoder-first-pipeline-num-layers 3", 4, "",
     [set(range(8))] * 4),
    # Megatron's functional test gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline
    # _split: 6 layers + embedding + loss over 4 x 2 virtual stages of one unit each; the first
    # chunk holds only the embedding, the last only the loss.
    ("--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 "
     "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split", 4,
     "--num-layers 6", [{3}, {0, 4}, {1, 5}, {2}]),
    # The same split under Chimera PP4 (no virtual stages): [1, 2, 2, 1].
    ("--pipeline-model-parallel-size 4 --pipeline-schedule chimera "
     "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split", 4,
     "--num-layers 6", [{0, 5}, {1, 2, 3, 4}, {1, 2, 3, 4}, {0, 5}]),
    # Embedding only, 1F1B PP2 with 7 layers: 8 units, [3, 4].
    ("--pipeline-model-parallel-size 2 --pipeline-schedule 1f1b "
     "--account-for-embedding-in-pipeline-split", 2, "--num-layers 7",
     [{0, 1, 2}, {3, 4, 5, 6}]),
]


@pytest.mark.parametrize("flags,world_size,model,layers", UNEVEN_LAYOUTS,
                         ids=[f"{w}ranks:{f.replace('--', '')}:{m.replace('--', '')}"
                              for f, w, m, _ in UNEVEN_LAYOUTS])
def test_uneven_stages_reproduce_single_process(flags, world_size, model, layers):
    results = run_distributed(train_one_step, world_size,
                              f"{model} {flags} {BATCH_N4}".split(), timeout=240)
    assert layers_by_rank(results) == layers
    assert_matches_reference(results, reference(f"{model} {BATCH_N4}"))


def test_a_chunk_of_only_the_embedding_and_one_of_only_the_loss():
    """The account-for split leaves the first virtual stage no transformer layer: rank 0's first
    chunk is the embedding alone (still trained: its gradients match, see above)."""
    flags = ("--num-layers 6 --pipeline-model-parallel-size 4 "
             "--num-virtual-stages-per-pipeline-rank 2 --account-for-embedding-in-pipeline-split "
             f"--account-for-loss-in-pipeline-split {BATCH_N4}")
    results = run_distributed(train_one_step, 4, flags.split(), timeout=240)
    assert has_embedding(results[0]) and not any(has_embedding(r) for r in results[1:])
    assert any(name.startswith("output_layer") or name.startswith("decoder.final")
               for (_, name) in results[3]["params"])
