"""--use-mup (issue 27's MuP configuration) reproduces the single-process model in every layout.

One training step (float64, dropout on, clipping on) with MuP at width multiplier 2 (hidden 32 over
a base of 16: scaled initialisation, 1/d attention, embedding and logit multipliers, learning rate
and Adam epsilon of the hidden matrices divided by 2): loss, gradient norm, gradients and stepped
parameters of every copy must equal the single-process run's (tolerances of
tests/distributed/test_pipeline_numerics.py: 1e-9 relative, 1e-6 for the float32-averaged loss).
"""

import pytest

from dist_harness import run_distributed
from pipeline_reference import assert_matches_reference, train_one_step

MUP_FLAGS = ("--use-mup --mup-base-hidden-size 16 --mup-embedding-mult 2.0 --adam-eps 1e-4 "
             "--micro-batch-size 2 --global-batch-size 8")
LAYOUTS = [
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
     "--pipeline-schedule chimera --use-distributed-optimizer", 4),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera", 2),
]


@pytest.fixture(scope="module")
def reference():
    return train_one_step(0, 1, MUP_FLAGS.split())


@pytest.mark.parametrize("flags,world_size", LAYOUTS, ids=[f"{w}ranks:{f.replace('--', '')}"
                                                           for f, w in LAYOUTS])
def test_mup_layout_reproduces_single_process(reference, flags, world_size):
    results = run_distributed(train_one_step, world_size, f"{MUP_FLAGS} {flags}".split(),
                              timeout=240)
    fields = ("params",) if "distributed-optimizer" in flags else ("grads", "params")
    assert_matches_reference(results, reference, fields)  # loss 1e-6, grads/params 1e-9 relative
