"""Tier 0: lowering of schedules into p2p groups and gradient-sync instructions."""

from __future__ import annotations

import os
from collections import Counter

import pytest

from megatron.core.pipeline_parallel.planning.dependencies import ACTIVATION, GRADIENT
from megatron.core.pipeline_parallel.planning.instructions import Instruction
from megatron.core.pipeline_parallel.planning.lowering import (
    RECV, SEND, GradSyncStart, GradSyncWait, P2PGroup, format_lowered, lower_schedule,
    parse_lowered)
from megatron.core.pipeline_parallel.planning.schedules import build_schedule, schedule_layout

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden", "schedules")

CONFIGS = [
    ("gpipe", 4, 5, {}),
    ("1f1b", 4, 3, {}),
    ("1f1b", 8, 16, {}),
    ("interleaved-1f1b", 4, 8, {"num_model_chunks": 2}),
    ("interleaved-1f1b", 3, 6, {"num_model_chunks": 3}),
    ("chimera", 2, 2, {}),
    ("chimera", 4, 4, {}),
    ("chimera", 6, 5, {}),
    ("chimera", 8, 24, {}),
    ("chimera", 8, 20, {}),
    ("chimera", 4, 12, {"variant": "forward-doubling"}),
    ("chimera", 8, 16, {"variant": "forward-doubling"}),
    ("chimera", 6, 12, {"variant": "backward-halving"}),
    ("chimera", 8, 8, {"num_pipelines": 4}),
    ("chimera", 8, 13, {"num_pipelines": 8}),
    ("chimera", 8, 3, {"num_pipelines": 4}),  # one pipeline without micro-batches
    ("chimera", 2, 1, {}),
    ("chimera", 4, 8, {"variant": "interleaved"}),
    ("chimera", 6, 5, {"variant": "interleaved"}),  # N not a multiple of D
    ("chimera", 8, 3, {"variant": "interleaved"}),  # N < D
]


def lowered_for(name, depth, num_microbatches, options, policy="eager-opt"):
    schedule = build_schedule(name, depth, num_microbatches, **options)
    layout = schedule_layout(name, depth, **options)
    return schedule, layout, lower_schedule(schedule, layout, policy)


def link_sequences(lowered):
    """{(sender, receiver): [[messages of one group on that link], ...]} from each side."""
    sent, received = {}, {}
    for rank, ops in enumerate(lowered):
        for op in ops:
            if not isinstance(op, P2PGroup):
                continue
            per_link_send, per_link_recv = {}, {}
            for p2p in op.ops:
                if p2p.direction == SEND:
                    per_link_send.setdefault((rank, p2p.peer), []).append(p2p.message)
                else:
                    per_link_recv.setdefault((p2p.peer, rank), []).append(p2p.message)
            for link, messages in per_link_send.items():
                sent.setdefault(link, []).append(messages)
            for link, messages in per_link_recv.items():
                received.setdefault(link, []).append(messages)
    return sent, received


@pytest.mark.parametrize("name, depth, num_microbatches, options", CONFIGS)
def test_groups_match_on_both_sides_of_every_link(name, depth, num_microbatches, options):
    schedule, layout, lowered = lowered_for(name, depth, num_microbatches, options)
    for ops in lowered:
        for op in ops:
            if isinstance(op, P2PGroup):
                assert op.ops, "empty group"
                # deterministic order inside a group: sorted, no duplicates
                assert len(set(op.ops)) == len(op.ops)
    sent, received = link_sequences(lowered)
    # identical groups message for message, in the same order, on every directed link
    assert sent == received
    all_sent = Counter(m for groups in sent.values() for group in groups for m in group)
    assert all(count == 1 for count in all_sent.values())


@pytest.mark.parametrize("name, depth, num_microbatches, options", CONFIGS)
def test_messages_are_exactly_the_cross_stage_edges(name, depth, num_microbatches, options):
    schedule, layout, lowered = lowered_for(name, depth, num_microbatches, options)
    expected = set()
    for ops in schedule:
        for op in ops:
            if op.kind.is_forward and not layout.is_last_stage(op.stage):
                expected.add((ACTIVATION, op.pipeline, op.stage, op.microbatch))
            if not op.kind.is_forward and not layout.is_first_stage(op.stage):
                expected.add((GRADIENT, op.pipeline, op.stage, op.microbatch))
    got = set()
    for rank, ops in enumerate(lowered):
        for op in ops:
            if isinstance(op, P2PGroup):
                for p2p in op.ops:
                    message = p2p.message
                    producer = layout.placement(message.pipeline, message.stage)
                    consumer = layout.placement(message.pipeline, message.consumer_stage)
                    assert (rank, p2p.peer) == ((producer, consumer) if p2p.direction == SEND
                                                else (consumer, producer))
                    got.add((message.kind, message.pipeline, message.stage, message.microbatch))
    assert got == expected


@pytest.mark.parametrize("name, depth, num_microbatches, options", CONFIGS)
@pytest.mark.parametrize("policy", ["eager-opt", "eager", "end"])
def test_grad_sync_once_per_module_then_wait(name, depth, num_microbatches, options, policy):
    schedule, layout, lowered = lowered_for(name, depth, num_microbatches, options, policy)
    for rank, ops in enumerate(lowered):
        assert isinstance(ops[-1], GradSyncWait)
        assert sum(isinstance(op, GradSyncWait) for op in ops) == 1
        syncs = [op for op in ops if isinstance(op, GradSyncStart)]
        assert sorted((s.pipeline, s.stage) for s in syncs) == sorted(layout.hosted(rank))
        assert all(s.chunk == layout.chunk(s.pipeline, s.stage) for s in syncs)
        # late stage first on every rank, so ranks sharing a group issue the same order
        assert [s.stage for s in syncs] == sorted((s.stage for s in syncs), reverse=True)
        # a sync starts only after the last backward of its module
        for index, op in enumerate(ops):
            if isinstance(op, GradSyncStart):
                assert not any(isinstance(later, Instruction) and later.module == op_module(op)
                               for later in ops[index:])
        # compute order is untouched
        assert [op for op in ops if isinstance(op, Instruction)] == schedule[rank]


def op_module(sync):
    return (sync.pipeline, sync.stage)


def syncs_before_last_compute(ops):
    last_compute = max(i for i, op in enumerate(ops) if isinstance(op, Instruction))
    return [str(op) for op in ops[:last_compute] if isinstance(op, GradSyncStart)]


def test_grad_sync_policies_on_chimera_d4():
    # eager-opt: ranks 0 and 3 start their late stage's sync early, middle ranks at the end.
    _, _, lowered = lowered_for("chimera", 4, 4, {}, "eager-opt")
    assert [syncs_before_last_compute(ops) for ops in lowered] == [["S1.3.1"], [], [], ["S0.3"]]
    _, _, lowered = lowered_for("chimera", 4, 4, {}, "eager")
    assert [syncs_before_last_compute(ops) for ops in lowered] == \
        [["S1.3.1"], ["S1.2.1"], ["S0.2"], ["S0.3"]]
    _, _, lowered = lowered_for("chimera", 4, 4, {}, "end")
    assert [syncs_before_last_compute(ops) for ops in lowered] == [[], [], [], []]
    assert [str(op) for op in lowered[1][-3:]] == ["S1.2.1", "S0.1", "WAIT"]


@pytest.mark.parametrize("policy", ["eager-opt", "eager"])
def test_non_chimera_schedules_sync_at_the_end(policy):
    _, _, lowered = lowered_for("interleaved-1f1b", 4, 8, {"num_model_chunks": 2}, policy)
    for rank, ops in enumerate(lowered):
        assert [str(op) for op in ops[-3:]] == [f"S0.{4 + rank}.1", f"S0.{rank}", "WAIT"]


def test_first_and_last_stage_have_no_data_or_loss_p2p():
    _, layout, lowered = lowered_for("1f1b", 3, 2, {})
    # rank 0 never receives an activation; the last rank never receives a gradient
    for p2p in (p2p for op in lowered[0] if isinstance(op, P2PGroup) for p2p in op.ops):
        assert not (p2p.direction == RECV and p2p.message.kind == ACTIVATION)
    for p2p in (p2p for op in lowered[2] if isinstance(op, P2PGroup) for p2p in op.ops):
        assert not (p2p.direction == RECV and p2p.message.kind == GRADIENT)


def test_lowered_text_round_trip_and_golden():
    _, _, lowered = lowered_for("chimera", 4, 4, {})
    text = format_lowered(lowered)
    assert parse_lowered(text) == lowered
    with open(os.path.join(GOLDEN, "chimera_D4_N4_lowered.txt")) as handle:
        golden = [line for line in handle if not line.startswith("#")]
    assert text == "".join(golden)


def test_unknown_policy():
    schedule = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="allowed: eager-opt, eager, end"):
        lower_schedule(schedule, schedule_layout("1f1b", 2), "later")


@pytest.mark.parametrize("depth,num_microbatches,variant", [
    (2, 4, "forward-doubling"), (4, 8, "forward-doubling"), (4, 12, "forward-doubling"),
    (8, 16, "forward-doubling"), (4, 4, "backward-halving")])
def test_doubled_step_messages_pair_the_activations_of_a_doubled_step(depth, num_microbatches,
                                                                      variant):
    from megatron.core.pipeline_parallel.planning.simulator import simulate
    layout = schedule_layout("chimera", depth, variant=variant)
    schedule = build_schedule("chimera", depth, num_microbatches, variant=variant)
    plain = lower_schedule(schedule, layout)
    paired = lower_schedule(schedule, layout, doubled_step_messages=True)

    def messages(lowered):  # one per (group, peer, direction): what packing puts on the wire
        return sum(len({(op.peer, op.direction) for op in group.ops})
                   for ops in lowered for group in ops if isinstance(group, P2PGroup))

    def tensors(lowered):
        return sum(len(group.ops) for ops in lowered for group in ops
                   if isinstance(group, P2PGroup))

    assert tensors(paired) == tensors(plain)
    assert messages(plain) == tensors(plain)  # without pairing no group holds two for a peer
    doubled_units = num_microbatches * (2 if variant == "backward-halving" else 1) // (2 * depth)
    # Every doubled step past stage 0 (D/2 per pipeline, 2 pipelines, per doubling unit)
    # receives its two activations as one message; both the sender and the receiver count it.
    saved = doubled_units * 2 * (depth // 2) * (depth - 1) * 2
    assert messages(plain) - messages(paired) == saved
    simulate(paired, 1, 2)  # deadlock-free


def test_reference_timeline_charges_a_message_latency_between_ranks_only():
    from megatron.core.pipeline_parallel.planning.lowering import reference_timeline
    schedule = build_schedule("1f1b", 2, 1)  # F on rank 0, F + B on rank 1, B on rank 0
    free = reference_timeline(schedule, 2)
    late = reference_timeline(schedule, 2, message_latency=0.25)
    end = lambda timeline: max(stop for rank in timeline for _, stop in rank)  # noqa: E731
    assert end(free) == 6 and end(late) == 6.5  # two hops, each 0.25 later
    assert late[1][1][0] - late[1][0][1] == 0  # rank 1's backward follows its own forward at once


def _sync_orders(lowered):
    return [[(s.pipeline, s.stage) for s in ops if isinstance(s, GradSyncStart)]
            for ops in lowered]


@pytest.mark.parametrize("name, options", [("chimera", {}),
                                           ("chimera", {"variant": "interleaved"}),
                                           ("chimera", {"num_pipelines": 4})])
@pytest.mark.parametrize("policy", ["eager-opt", "eager", "end"])
def test_split_backward_syncs_follow_one_readiness_order_on_every_rank(name, options, policy):
    from megatron.core.pipeline_parallel.planning.plan import make_plan
    plan = make_plan(name, 4, 8, options, grad_sync_policy=policy, split_backward=0)
    stage_order = {}
    for rank, order in enumerate(_sync_orders(plan.lowered)):
        stages = [stage for _, stage in order]
        assert sorted(order) == sorted(plan.layout.hosted(rank))
        # ranks sharing stages issue them in the same relative order
        for first, second in zip(stages, stages[1:]):
            assert stage_order.setdefault((first, second), True)
            assert (second, first) not in stage_order
        for index, op in enumerate(plan.lowered[rank]):  # after the module's last backward
            if isinstance(op, GradSyncStart):
                assert not any(isinstance(later, Instruction) and later.module == op_module(op)
                               for later in plan.lowered[rank][index:])
        assert [op for op in plan.lowered[rank] if isinstance(op, Instruction)] == \
            list(plan.schedule[rank])


def test_split_chimera_d4_overlaps_one_sync_with_the_last_weight_half():
    # Each rank's gradient of one stage is complete one weight half before the end: eager-opt
    # starts that stage's sync there (a weight half sends nothing), whichever stage it is.
    from megatron.core.pipeline_parallel.planning.plan import make_plan
    plan = make_plan("chimera", 4, 8, grad_sync_policy="eager-opt", split_backward=0)
    for ops in plan.lowered:
        last = max(i for i, op in enumerate(ops) if isinstance(op, Instruction))
        assert ops[last].kind.name == "BACKWARD_WEIGHT"
        assert len(syncs_before_last_compute(ops)) == 1
    assert [syncs_before_last_compute(ops) for ops in plan.lowered] == \
        [["S0.0"], ["S1.2.1"], ["S0.2"], ["S1.0.1"]]
    plan = make_plan("chimera", 4, 8, grad_sync_policy="end", split_backward=0)
    assert [syncs_before_last_compute(ops) for ops in plan.lowered] == [[], [], [], []]
