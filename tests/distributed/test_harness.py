"""The gloo harness itself: results come back, failures and hangs are reported, not waited on."""

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_distributed


def _all_reduce_rank(rank, world_size):
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return value.item()


def _fail_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _hang_on_one(rank, world_size):
    if rank == 1:
        import time
        time.sleep(60)
    return rank


def test_results_come_back_per_rank():
    assert run_distributed(_all_reduce_rank, 3) == [3.0, 3.0, 3.0]


def test_exception_is_reported_with_traceback():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_distributed(_fail_on_one, 2, timeout=20)


def test_hanging_rank_is_killed():
    with pytest.raises(AssertionError, match=r"ranks \[1\] did not finish"):
        run_distributed(_hang_on_one, 2, timeout=3)


def _many_tensors(rank, world_size):
    return {f"t{i}": torch.full((64, 64), float(rank + i)) for i in range(40)}


def test_tensors_come_back_after_the_rank_exits():
    results = run_distributed(_many_tensors, 2, timeout=30)
    assert results[1]["t39"][0, 0].item() == 40.0
