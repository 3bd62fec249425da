"""--overlap-grad-reduce with a pipeline (PP 2 x DP 2, 4 gloo ranks): each module's buckets launch
from the backward's hooks during its last backward op (the last weight half under split backward),
and the step is bit-identical to the run without the flag: loss, gradient norm, every gradient of
every copy and every parameter after the optimizer step (rtol = atol = 0), and the per-bucket
gradient checks see every bucket once, with the same norms.
"""

import functools

import pytest
import torch

from dist_harness import run_distributed
from pipeline_reference import train_one_step

pytestmark = pytest.mark.distributed

BATCH = "--micro-batch-size 2 --global-batch-size 8"

# (flags, buckets launched from the backward per rank). Every module of these small float64
# models is one bucket. 1F1B: one module per rank. Interleaved 1F1B and Chimera: two modules per
# rank, the second armed once the first (earlier in the sync order) has issued its reduction.
LAYOUTS = [
    ("--pipeline-model-parallel-size 2 --pipeline-schedule 1f1b", 1),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2", 2),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera", 2),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera --split-backward", 2),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera --chimera-variant interleaved "
     "--split-backward", 4),
]


@functools.lru_cache(maxsize=None)
def _run(flags: str) -> list:
    return run_distributed(functools.partial(train_one_step, watch_gradients=True), 4,
                           f"{flags} {BATCH}".split(), timeout=240)


def _assert_identical(overlapped: dict, plain: dict) -> None:
    assert overlapped["loss"] == plain["loss"]
    assert overlapped["grad_norm"] == plain["grad_norm"]
    for field in ("grads", "params"):
        assert overlapped[field].keys() == plain[field].keys()
        for key, value in plain[field].items():
            assert torch.equal(overlapped[field][key], value), (field, key)


@pytest.mark.parametrize("flags,launches", LAYOUTS, ids=[f.replace("--", "") for f, _ in LAYOUTS])
def test_overlap_launches_in_the_backward_and_changes_no_number(flags, launches):
    plain = _run(flags)
    overlapped = _run(f"{flags} --overlap-grad-reduce")
    for rank, (with_overlap, without) in enumerate(zip(overlapped, plain)):
        assert without["backward_launches"] == 0
        assert with_overlap["backward_launches"] == launches, rank
        _assert_identical(with_overlap, without)
        # The gradient checks see every bucket once per iteration, with the same local norms
        # (the order may differ: a module's buckets now go before its GradSyncStart).
        assert sorted(with_overlap["local_grad_norms"]) == sorted(without["local_grad_norms"])
        assert len(without["local_grad_norms"]) >= launches
