"""Sequence parallelism under --bf16 / --fp16 (autocast): TP 2 with --sequence-parallel trains one
step like TP 2 without it. The sequence-parallel linear's backward used to multiply the bf16
gradient by the saved fp32 weight and fail ("expected m1 and m2 to have the same dtype"), so a
Megatron script with --bf16 --sequence-parallel stopped at its first backward."""

import pytest

from dist_harness import run_distributed
from pipeline_reference import merge_copies, train_one_step

BATCH = "--micro-batch-size 2 --global-batch-size 4 --tensor-model-parallel-size 2"


@pytest.mark.parametrize("precision", ["--bf16", "--fp16 --loss-scale 1024"])
def test_sequence_parallel_trains_like_plain_tensor_parallel_in_mixed_precision(precision):
    plain = run_distributed(train_one_step, 2, f"{BATCH} {precision}".split(), timeout=240)
    split = run_distributed(train_one_step, 2, f"{BATCH} {precision} --sequence-parallel".split(),
                            timeout=240)
    # The same low-precision matmuls on the same numbers; only where the TP reductions happen
    # differs (measured: equal losses, grad norms equal to 1e-13 relative).
    for want, got in zip(plain, split):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    want_params, got_params = merge_copies(plain, "params"), merge_copies(split, "params")
    assert want_params.keys() == got_params.keys()
    for name, copies in got_params.items():
        for value, reference in zip(copies, want_params[name]):
            assert value.dtype == reference.dtype, name
            assert (value - reference).abs().max().item() <= \
                1e-5 * reference.abs().max().item(), name
