"""Rank arithmetic at large world sizes, without processes."""

import pytest

from megatron.core.parallel_state import GroupSpec, ParallelState, RankCoords, RankLayout, create_parallel_state


def test_megatron_order_tensor_fastest_then_data_then_pipeline():
    layout = RankLayout(tensor_parallel_size=2, data_parallel_size=3, pipeline_parallel_size=4)
    assert layout.coords(0) == RankCoords(0, 0, 0)
    assert layout.coords(1) == RankCoords(1, 0, 0)
    assert layout.coords(2) == RankCoords(0, 1, 0)
    assert layout.coords(6) == RankCoords(0, 0, 1)
    assert layout.tensor_group(5) == [4, 5]
    assert layout.data_group(1) == [1, 3, 5]
    assert layout.pipeline_group(3) == [3, 9, 15, 21]


@pytest.mark.parametrize("tp,dp,pp", [(8, 64, 8), (4, 128, 8), (1, 4096, 1), (2, 32, 64)])
def test_groups_partition_the_world_at_4096_ranks(tp, dp, pp):
    layout = RankLayout(tp, dp, pp)
    assert layout.world_size == 4096
    for axis, size in (("tp", tp), ("dp", dp), ("pp", pp)):
        groups = layout.all_groups(axis)
        assert len(groups) == 4096 // size
        assert sorted(r for g in groups for r in g) == list(range(4096))
    for rank in (0, 1, 777, 4095):
        assert layout.rank(layout.coords(rank)) == rank
        assert rank in layout.tensor_group(rank)
        assert layout.tensor_group(rank) == list(range(rank - rank % tp, rank - rank % tp + tp))


def test_chimera_replica_group_spans_mirror_pipeline_ranks_and_data_parallel():
    layout = RankLayout(tensor_parallel_size=2, data_parallel_size=2, pipeline_parallel_size=4)
    # stage 1 lives on pipeline ranks 1 (down) and 2 (up); rank 9 is tp 1, dp 0, pp 2
    assert layout.pipeline_ranks_group([1, 2], 9) == [5, 7, 9, 11]
    assert layout.all_pipeline_ranks_groups([1, 2]) == [[4, 6, 8, 10], [5, 7, 9, 11]]


def test_bad_world_size_says_how_to_fix():
    with pytest.raises(ValueError, match="not divisible by tensor-model-parallel-size 2"):
        RankLayout.from_world_size(6, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert RankLayout.from_world_size(8, 2, 2).data_parallel_size == 2


def test_group_creation_walks_every_group_in_the_same_order():
    created = []

    def fake_new_group(ranks, timeout=None):
        created.append(tuple(ranks))
        return tuple(ranks)

    layout = RankLayout(2, 2, 2)
    state = create_parallel_state(layout, rank=5, backend="gloo", extra_group_ranks=[[0, 5], [5, 0], GroupSpec("stage-1", (5, 0))],
                                  new_group=fake_new_group)
    assert state.tensor_group == (4, 5) and state.data_group == (5, 7)
    assert state.pipeline_group == (1, 5)
    assert state.group_for([5]) is None
    assert state.group_for([5, 0]) == (0, 5)
    assert created.count((0, 5)) == 2  # the labelled group is a separate process group
    assert state.group_for([0, 5], label="stage-1") is not state.group_for([0, 5])
    with pytest.raises(KeyError, match="no process group"):
        state.group_for([1, 5])
    assert ParallelState.single_process().world_size == 1


def test_every_group_gets_the_distributed_timeout():
    """Subgroups without timeout= get torch's 30-minute default: a stalled peer would hang."""
    import datetime
    timeouts = []

    def fake_new_group(ranks, timeout=None):
        timeouts.append(timeout)
        return tuple(ranks)

    limit = datetime.timedelta(minutes=1)
    create_parallel_state(RankLayout(2, 1, 2), rank=0, backend="gloo",
                          extra_group_ranks=[[0, 3]], new_group=fake_new_group, timeout=limit)
    assert len(timeouts) == 2 + 4 + 2 + 1  # tp, dp (4 singletons), pp, extra
    assert set(timeouts) == {limit}


@pytest.mark.parametrize("tp,dp,pp", [(1, 1, 1), (2, 3, 2), (3, 2, 4), (1, 4, 3), (4, 1, 2)])
def test_all_groups_equals_the_per_rank_groups(tp, dp, pp):
    layout = RankLayout(tp, dp, pp)
    per_rank = {"tp": layout.tensor_group, "dp": layout.data_group, "pp": layout.pipeline_group}
    for axis, group_of in per_rank.items():
        expected = sorted({tuple(group_of(rank)) for rank in range(layout.world_size)})
        groups = layout.all_groups(axis)
        assert [g[0] for g in groups] == sorted(g[0] for g in groups)  # same order on every rank
        assert sorted(tuple(g) for g in groups) == expected
