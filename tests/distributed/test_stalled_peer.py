"""A stalled peer ends a collective on a subgroup within the subgroup's timeout (the timeout that
initialize_megatron passes from --distributed-timeout-minutes), not torch's 30-minute default."""

import datetime
import time

import torch

from dist_harness import run_distributed
from megatron.core.parallel_state import RankLayout, create_parallel_state


def _all_reduce_with_a_stalled_peer(rank, world_size, timeout_s, stall_s):
    state = create_parallel_state(RankLayout(1, 1, 2), rank, "gloo",
                                  extra_group_ranks=[[0, 1]],
                                  timeout=datetime.timedelta(seconds=timeout_s))
    if rank == 1:
        time.sleep(stall_s)  # the stalled peer never joins the all-reduce
        return None
    started = time.monotonic()
    try:
        torch.distributed.all_reduce(torch.ones(4), group=state.group_for([0, 1]))
    except RuntimeError as error:
        return time.monotonic() - started, str(error)
    return time.monotonic() - started, None


def test_a_stalled_peer_times_out_on_a_subgroup():
    elapsed, message = run_distributed(_all_reduce_with_a_stalled_peer, 2, 2.0, 8.0,
                                       timeout=60)[0]
    assert message is not None, "the all-reduce with a stalled peer returned"
    assert elapsed < 6.0, f"the 2 s subgroup timeout took {elapsed:.1f} s"
    assert "timed out" in message.lower() or "timeout" in message.lower(), message
