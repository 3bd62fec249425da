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


def _stalled_wait(rank, world_size, timeout_s, stall_s, what):
    """Rank 0 waits on rank 1 (a pipeline receive, or a gradient all-reduce); rank 1 stalls."""
    from megatron.core.distributed.gradient_reducer import GradientReducer
    from megatron.core.pipeline_parallel.execution.transport import ExpectedTensor, TensorTransport

    state = create_parallel_state(RankLayout(1, 1, 2), rank, "gloo",
                                  extra_group_ranks=[[0, 1]],
                                  timeout=datetime.timedelta(seconds=timeout_s))
    if rank == 1:
        time.sleep(stall_s)
        return None
    try:
        if what == "receive":
            transport = TensorTransport(state, torch.device("cpu"))
            pending = transport.start([], [ExpectedTensor(1, (2, 3), torch.float32,
                                                          "the forward activation of (F 0 0)")])
            pending.wait_received()
        else:
            weight = torch.nn.Parameter(torch.ones(3))
            weight.grad = torch.ones(3)
            reducer = GradientReducer([weight], state.group_for([0, 1]))
            reducer.wait()
    except RuntimeError as error:
        return type(error).__name__, str(error)
    return None, None


def test_a_timed_out_pipeline_receive_names_the_peer_and_the_group():
    kind, message = run_distributed(_stalled_wait, 2, 2.0, 8.0, "receive", timeout=60)[0]
    assert kind == "CommunicationTimeout", (kind, message)
    assert message.startswith("rank 0: timed out waiting for the receive of the forward "
                              "activation of (F 0 0) from pipeline rank 1 (global rank 1)"), message
    assert "pipeline group (global ranks [0, 1]), waiting for global rank(s) [1]" in message
    assert "--distributed-timeout-minutes" in message


def test_a_timed_out_gradient_all_reduce_names_the_group():
    kind, message = run_distributed(_stalled_wait, 2, 2.0, 8.0, "all-reduce", timeout=60)[0]
    assert kind == "CommunicationTimeout", (kind, message)
    assert ("timed out waiting for the gradient all-reduce on the gradient-replica group "
            "(global ranks [0, 1]), waiting for global rank(s) [1]") in message, message
