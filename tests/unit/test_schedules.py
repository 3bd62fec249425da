"""Tier 0: schedule builders, instruction text form, layout, options and the validator."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import pytest

from megatron.core.pipeline_parallel.planning.instructions import (
    Instruction, Kind, backward, format_schedule, format_schedule_csv, forward, parse_schedule,
    parse_schedule_csv)
from megatron.core.pipeline_parallel.planning.schedules import (
    build_schedule, check_schedule_options, placement, schedule_layout)
from megatron.core.pipeline_parallel.planning.simulator import simulate_schedule
from megatron.core.pipeline_parallel.planning.validator import ScheduleError, validate_schedule

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden", "schedules")


def paper_label(op: Instruction) -> str:
    return f"{op.kind.value}{op.microbatch}{'v' if op.pipeline == 0 else '^'}"


def read_golden_orders(name: str) -> list[list[str]]:
    with open(os.path.join(GOLDEN, name)) as handle:
        return [line.split(":", 1)[1].split() for line in handle
                if line.strip() and not line.startswith("#")]


# ----------------------------------------------------------------------------- golden tables

@pytest.mark.parametrize("golden, depth, num_microbatches, variant", [
    ("chimera_D2_N2.txt", 2, 2, "direct"),
    ("chimera_D4_N4.txt", 4, 4, "direct"),
    ("chimera_D4_N8_direct.txt", 4, 8, "direct"),
    ("chimera_D4_N8_forward-doubling.txt", 4, 8, "forward-doubling"),
])
def test_chimera_reference_tables(golden, depth, num_microbatches, variant):
    schedule = build_schedule("chimera", depth, num_microbatches, variant=variant)
    assert [[paper_label(op) for op in ops] for ops in schedule] == read_golden_orders(golden)


def test_backward_halving_is_forward_doubling_over_half_microbatches():
    # N = 4 micro-batches of size B -> 8 half micro-batches in the forward-doubling order.
    halving = build_schedule("chimera", 4, 4, variant="backward-halving")
    doubling = build_schedule("chimera", 4, 8, variant="forward-doubling")
    assert halving == doubling


# ------------------------------------------------------- closed forms of chimera.md §2 and §3

def closed_form_order(depth: int, rank: int, num_units: int, doubling: bool) -> list[tuple]:
    """Worker ``rank``'s op order written from the closed forms (independent of the builder).

    Returns (kind, pipeline, microbatch) with f = 1 numbering: pipeline p = primary (down if
    rank < D/2), q = the other one."""
    e = min(rank, depth - 1 - rank)
    a, b = depth // 2 - e, e
    p, q = (0, 1) if rank < depth // 2 else (1, 0)
    per_unit = 2 * depth if doubling else depth
    half = depth // 2

    def microbatches(pipeline, unit):
        base = unit * per_unit
        blocks = (0, depth) if doubling else (0,)
        return [base + block + pipeline * half + i for block in blocks for i in range(half)]

    order = []
    for unit in range(num_units):
        fp, fq = iter(microbatches(p, unit)), iter(microbatches(q, unit))
        bp, bq = iter(microbatches(p, unit)), iter(microbatches(q, unit))
        previous_bp = iter(microbatches(p, unit - 1)[-a:]) if unit else None

        def F(pipeline, source):
            count = 2 if doubling else 1
            return [("F", pipeline, next(source)) for _ in range(count)]

        for _ in range(a):
            if previous_bp is not None:
                order.append(("B", p, next(previous_bp)))
            order += F(p, fp)
        for _ in range(b):
            order += F(q, fq) + F(p, fp)
        for _ in range(a):
            order += F(q, fq) + [("B", q, next(bq))]
        for _ in range(b + half if doubling else b):
            order += [("B", p, next(bp)), ("B", q, next(bq))]
        if unit == num_units - 1:
            order += [("B", p, next(bp)) for _ in range(a)]
    return order


@pytest.mark.parametrize("depth", [2, 4, 6, 8, 16])
@pytest.mark.parametrize("num_units", [1, 2, 3])
def test_direct_concatenation_matches_closed_form(depth, num_units):
    schedule = build_schedule("chimera", depth, num_units * depth)
    for rank, ops in enumerate(schedule):
        got = [(op.kind.value, op.pipeline, op.microbatch) for op in ops]
        assert got == closed_form_order(depth, rank, num_units, doubling=False), rank


@pytest.mark.parametrize("depth", [2, 4, 6, 8, 16])
@pytest.mark.parametrize("num_doubling_units", [1, 2])
def test_forward_doubling_matches_closed_form(depth, num_doubling_units):
    schedule = build_schedule("chimera", depth, 2 * num_doubling_units * depth,
                              variant="forward-doubling")
    for rank, ops in enumerate(schedule):
        got = [(op.kind.value, op.pipeline, op.microbatch) for op in ops]
        assert got == closed_form_order(depth, rank, num_doubling_units, doubling=True), rank


def test_forward_doubling_odd_units_end_with_a_basic_unit():
    depth = 4
    schedule = build_schedule("chimera", depth, 3 * depth, variant="forward-doubling")
    doubling = build_schedule("chimera", depth, 2 * depth, variant="forward-doubling")
    for ops, doubling_ops in zip(schedule, doubling):
        basic_unit = {op.microbatch for op in ops} - {op.microbatch for op in doubling_ops}
        assert basic_unit == set(range(8, 12))
        # the doubling unit's ops come first except its final a x [B_p] which interleaves
        first_basic = next(i for i, op in enumerate(ops) if op.microbatch >= 8)
        assert all(op.microbatch < 8 for op in ops[:first_basic])


# ------------------------------------------------------------------ numbering and placement

def test_chimera_microbatch_numbering_f1():
    depth = 6
    schedule = build_schedule("chimera", depth, 3 * depth)
    for ops in schedule:
        for op in ops:
            expected = 0 if op.microbatch % depth < depth // 2 else 1
            assert op.pipeline == expected


def test_chimera_numbering_two_f_pipelines_and_partial_units():
    schedule = build_schedule("chimera", 8, 8, num_pipelines=4)
    owner = {op.microbatch: op.pipeline for ops in schedule for op in ops}
    assert owner == {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2, 6: 3, 7: 3}
    schedule = build_schedule("chimera", 4, 3)  # N < D: split as evenly as possible
    owner = {op.microbatch: op.pipeline for ops in schedule for op in ops}
    assert owner == {0: 0, 1: 0, 2: 1}
    schedule = build_schedule("chimera", 4, 6)  # one full unit, then a partial one
    owner = {op.microbatch: op.pipeline for ops in schedule for op in ops}
    assert owner == {0: 0, 1: 0, 2: 1, 3: 1, 4: 0, 5: 1}


def test_placements():
    assert [placement("1f1b", 4, 0, s) for s in range(4)] == [0, 1, 2, 3]
    assert [placement("chimera", 4, 1, s) for s in range(4)] == [3, 2, 1, 0]
    assert [placement("interleaved-1f1b", 3, 0, s, num_model_chunks=2)
            for s in range(6)] == [0, 1, 2, 0, 1, 2]
    layout = schedule_layout("chimera", 8, num_pipelines=4)
    # down pipeline i starts stage 0 on worker i * D / f and continues cyclically
    assert layout.placements[0] == (0, 1, 2, 3, 4, 5, 6, 7)
    assert layout.placements[2] == (4, 5, 6, 7, 0, 1, 2, 3)
    for pipeline in (1, 3):  # up pipeline i is the exact reverse of down pipeline i
        assert layout.placements[pipeline] == tuple(reversed(layout.placements[pipeline - 1]))
    assert layout.hosted(0) == ((0, 0), (1, 7), (2, 4), (3, 3))
    assert layout.chunk(3, 3) == 3


def test_layout_hosted_and_chunks():
    layout = schedule_layout("chimera", 4)
    assert layout.hosted(1) == ((0, 1), (1, 2))
    interleaved = schedule_layout("interleaved-1f1b", 4, num_model_chunks=3)
    assert interleaved.num_stages == 12
    assert interleaved.hosted(2) == ((0, 2), (0, 6), (0, 10))
    for ops in build_schedule("interleaved-1f1b", 4, 8, num_model_chunks=3):
        for op in ops:
            assert op.chunk == op.stage // 4


@pytest.mark.parametrize("name, options, num_microbatches, micro_batch_size", [
    ("1f1b", {}, 5, 3),
    ("chimera", {"variant": "direct"}, 6, 2),
    ("chimera", {"variant": "backward-halving"}, 8, 4),
])
def test_microbatch_samples_partition_the_rank_share(name, options, num_microbatches,
                                                      micro_batch_size):
    layout = schedule_layout(name, 4, **options)
    count = layout.num_schedule_microbatches(num_microbatches)
    samples = [i for k in range(count) for i in layout.microbatch_samples(k, micro_batch_size)]
    assert samples == list(range(num_microbatches * micro_batch_size))
    schedule = build_schedule(name, 4, num_microbatches, **options)
    assert {op.microbatch for ops in schedule for op in ops} == set(range(count))


def test_backward_halving_needs_even_micro_batch_size():
    with pytest.raises(ValueError, match="even --micro-batch-size"):
        check_schedule_options("chimera", 4, 4, micro_batch_size=3, variant="backward-halving")
    check_schedule_options("chimera", 4, 4, micro_batch_size=2, variant="backward-halving")


# ------------------------------------------------------------------------------ bad options

@pytest.mark.parametrize("name, depth, num_microbatches, options, message", [
    ("chimera", 5, 4, {}, "even --pipeline-model-parallel-size"),
    ("chimera", 8, 8, {"num_pipelines": 6}, "f = 3 to divide D/2 = 4"),
    ("chimera", 8, 8, {"num_pipelines": 3}, "allowed: 2, 4, 8"),
    ("chimera", 4, 6, {"variant": "forward-doubling"}, "multiple of D = 4"),
    ("chimera", 4, 2, {"variant": "backward-halving"}, "multiple of D = 4"),
    ("chimera", 8, 16, {"variant": "forward-doubling", "num_pipelines": 4}, "2 pipelines only"),
    ("chimera", 8, 16, {"variant": "interleaved", "num_pipelines": 4}, "2 pipelines only"),
    ("chimera", 4, 4, {"variant": "sideways"}, "allowed: direct, forward-doubling"),
    ("chimera", 4, 0, {}, "positive int"),
    ("interleaved-1f1b", 4, 6, {"num_model_chunks": 2}, "multiple of"),
    ("interleaved-1f1b", 4, 6, {"num_model_chunks": 2}, "last group of 2 < 4"),
    ("interleaved-1f1b", 4, 3, {"num_model_chunks": 2}, "at least .* micro-batches"),
    ("interleaved-1f1b", 4, 6, {"num_model_chunks": 2, "microbatch_group_size": 3},
     "must lie between"),
    ("interleaved-1f1b", 4, 6, {"num_model_chunks": 2, "microbatch_group_size": 7},
     "must lie between"),
    ("interleaved-1f1b", 4, 9, {"num_model_chunks": 2, "microbatch_group_size": 6},
     "last group of 3 < 4"),
    ("interleaved-1f1b", 4, 8, {"num_model_chunks": 1}, "num_model_chunks >= 2"),
    ("interleaved-1f1b", 4, 8, {}, "num_model_chunks >= 2"),
    ("interleaved-1f1b", 1, 8, {"num_model_chunks": 2}, ">= 2"),
    ("zigzag", 4, 4, {}, "allowed: gpipe, 1f1b"),
    ("1f1b", 4, 4, {"num_chunks": 2}, "unknown schedule option"),
])
def test_bad_options_raise_value_error(name, depth, num_microbatches, options, message):
    with pytest.raises(ValueError, match=message):
        check_schedule_options(name, depth, num_microbatches, **options)
    with pytest.raises(ValueError, match=message):
        build_schedule(name, depth, num_microbatches, **options)


def test_options_of_other_families_and_none_are_ignored():
    check_schedule_options("1f1b", 4, 4, num_pipelines=2, variant="direct", num_model_chunks=None)
    check_schedule_options("chimera", 4, 4, num_model_chunks=2, variant=None)


# --------------------------------------------------------------------- baseline schedules

def test_one_f_one_b_order():
    schedule = build_schedule("1f1b", 4, 6)
    assert " ".join(op_text[0] + op_text.split(".")[-1] for op_text in map(str, schedule[1])) \
        == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5"
    assert " ".join(str(op) for op in schedule[3][:4]) == "F0.3.0 B0.3.0 F0.3.1 B0.3.1"


def test_gpipe_order():
    schedule = build_schedule("gpipe", 2, 3)
    assert format_schedule(schedule) == ("F0.0.0 F0.0.1 F0.0.2 B0.0.0 B0.0.1 B0.0.2\n"
                                         "F0.1.0 F0.1.1 F0.1.2 B0.1.0 B0.1.1 B0.1.2\n")


def test_interleaved_matches_megatron_warmup():
    depth, chunks, num_microbatches = 4, 2, 8
    schedule = build_schedule("interleaved-1f1b", depth, num_microbatches,
                              num_model_chunks=chunks)
    for rank, ops in enumerate(schedule):
        warmup = next(i for i, op in enumerate(ops) if op.kind is Kind.BACKWARD) - 1
        assert warmup == min(2 * (depth - 1 - rank) + (chunks - 1) * depth,
                             num_microbatches * chunks)
    # first forwards of rank 0: micro-batches 0..3 on chunk 0, then 0..3 on chunk 1
    assert [(op.chunk, op.microbatch) for op in schedule[0][:8]] == \
        [(0, m) for m in range(4)] + [(1, m) for m in range(4)]


# Megatron's rule: groups of G with D <= G <= N and N mod G = 0 or >= D; N not a multiple of D
# runs with G = N (one group) or a G whose last group still holds >= D micro-batches.
INTERLEAVED_UNEVEN = [(depth, chunks, n, group)
                      for depth, ns in ((2, (3, 5, 7)), (4, (5, 6, 7, 9, 11, 14)))
                      for chunks in (2, 3) for n in ns
                      for group in range(depth, n + 1)
                      if n % group == 0 or n % group >= depth]


@pytest.mark.parametrize("depth, chunks, num_microbatches, group", INTERLEAVED_UNEVEN)
def test_interleaved_uneven_microbatches_valid_and_deadlock_free(depth, chunks,
                                                                 num_microbatches, group):
    options = {"num_model_chunks": chunks, "microbatch_group_size": group}
    schedule = build_schedule("interleaved-1f1b", depth, num_microbatches, **options)
    validate_schedule(schedule, schedule_layout("interleaved-1f1b", depth, **options),
                      num_microbatches)
    for rank, ops in enumerate(schedule):
        done = collections.Counter((op.kind, op.chunk, op.microbatch) for op in ops)
        assert set(done.values()) == {1} and len(done) == 2 * chunks * num_microbatches
        assert {(op.stage, op.chunk) for op in ops} == {(c * depth + rank, c)
                                                        for c in range(chunks)}
        total = num_microbatches * chunks
        first_backward = next(i for i, op in enumerate(ops) if op.kind is Kind.BACKWARD)
        warmup = min(2 * (depth - 1 - rank) + (chunks - 1) * group, total)
        assert first_backward == warmup + (warmup < total)  # the first 1F1B pair's forward
    for fwd, bwd in ((1, 1), (1, 2)):
        simulate_schedule("interleaved-1f1b", depth, num_microbatches, fwd, bwd, **options)


def test_interleaved_groups_follow_megatron_schedule_table():
    # Megatron's docstring example: PP=2, VP=2, group 3, 5 micro-batches -> 0 1 2 0 1 2 3 4 3 4
    forwards = [op for op in build_schedule("interleaved-1f1b", 2, 5, num_model_chunks=2,
                                            microbatch_group_size=3)[0]
                if op.kind is Kind.FORWARD]
    assert [op.microbatch for op in forwards] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [op.chunk for op in forwards] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


# ------------------------------------------------------------------------ text round trips

def test_instruction_text_round_trip():
    ops = [forward(0, 2, 5), backward(1, 0, 3, chunk=1),
           Instruction(Kind.BACKWARD_INPUT, 0, 1, 7), Instruction(Kind.BACKWARD_WEIGHT, 3, 2, 0, 2)]
    assert [str(op) for op in ops] == ["F0.2.5", "B1.0.3.1", "I0.1.7", "W3.2.0.2"]
    assert [Instruction.parse(str(op)) for op in ops] == ops
    with pytest.raises(ValueError, match="cannot parse instruction"):
        Instruction.parse("X0.1.2")


@pytest.mark.parametrize("name, options", [("chimera", {"variant": "forward-doubling"}),
                                           ("interleaved-1f1b", {"num_model_chunks": 2}),
                                           ("1f1b", {})])
def test_schedule_text_and_csv_round_trip(name, options):
    schedule = build_schedule(name, 4, 8, **options)
    assert parse_schedule(format_schedule(schedule)) == schedule
    assert parse_schedule_csv(format_schedule_csv(schedule)) == schedule
    empty = [[], [forward(0, 1, 0)]]
    assert parse_schedule(format_schedule(empty)) == empty
    assert parse_schedule_csv(format_schedule_csv(empty)) == empty


# ------------------------------------------------------------------------------ validator

def _chimera_4():
    return build_schedule("chimera", 4, 4), schedule_layout("chimera", 4)


def test_validator_accepts_builders():
    schedule, layout = _chimera_4()
    validate_schedule(schedule, layout, 4)


def test_validator_wrong_rank_marks_the_step():
    schedule, layout = _chimera_4()
    schedule[0][0], schedule[1][0] = schedule[1][0], schedule[0][0]
    with pytest.raises(ScheduleError, match="placed on rank") as error:
        validate_schedule(schedule, layout, 4)
    assert ">F0.1.0<" in str(error.value) and "rank x step grid" in str(error.value)


def test_validator_missing_and_duplicate():
    schedule, layout = _chimera_4()
    del schedule[2][-1]
    with pytest.raises(ScheduleError, match="no backward"):
        validate_schedule(schedule, layout, 4)
    schedule, layout = _chimera_4()
    schedule[0].append(schedule[0][0])
    with pytest.raises(ScheduleError, match="appears twice"):
        validate_schedule(schedule, layout, 4)
    schedule, layout = _chimera_4()
    with pytest.raises(ScheduleError, match="expected micro-batches 0..7"):
        validate_schedule(schedule, layout, 8)


def test_validator_backward_before_forward():
    schedule, layout = _chimera_4()
    schedule[3][2], schedule[3][3] = schedule[3][3], schedule[3][2]  # B0v before F0v on P3
    with pytest.raises(ScheduleError, match="runs before"):
        validate_schedule(schedule, layout, 4)


def test_validator_out_of_order_microbatches():
    schedule, layout = _chimera_4()
    schedule[0][0], schedule[0][1] = schedule[0][1], schedule[0][0]  # F1v before F0v on P0
    with pytest.raises(ScheduleError, match="in order"):
        validate_schedule(schedule, layout, 4)


def test_validator_uneven_split():
    layout = schedule_layout("chimera", 2)
    schedule = [[forward(0, 0, 0), forward(0, 0, 1), backward(0, 0, 0), backward(0, 0, 1)],
                [forward(0, 1, 0), backward(0, 1, 0), forward(0, 1, 1), backward(0, 1, 1)]]
    with pytest.raises(ScheduleError, match="not split evenly"):
        validate_schedule(schedule, layout, 2)


def test_validator_circular_wait_is_reported_with_grid():
    layout = schedule_layout("1f1b", 2)
    # Rank 0 runs B0.0.0 (needs rank 1's B0.1.0) before F0.0.1; rank 1 runs F0.1.1 (needs
    # rank 0's F0.0.1) before B0.1.0: a circular wait.
    schedule = [[forward(0, 0, 0), backward(0, 0, 0), forward(0, 0, 1), backward(0, 0, 1)],
                [forward(0, 1, 0), forward(0, 1, 1), backward(0, 1, 0), backward(0, 1, 1)]]
    with pytest.raises(ScheduleError, match="circular wait") as error:
        validate_schedule(schedule, layout, 2)
    assert ">B0.0.0<" in str(error.value) and ">F0.1.1<" in str(error.value)


@pytest.mark.distributed  # starts a process
def test_no_torch_import():
    code = ("import sys; import megatron.core.pipeline_parallel.planning.schedules, "
            "megatron.core.pipeline_parallel.planning.validator, megatron.core.pipeline_parallel.planning.lowering, "
            "megatron.core.pipeline_parallel.planning.simulator; print('torch' in sys.modules)")
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    output = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                            text=True, check=True).stdout
    assert output.strip() == "False"


def test_interleaved_chimera_needs_layers_for_2d_stages():
    from megatron.training.arguments import parse_args
    base = ("--hidden-size 32 --num-attention-heads 4 --seq-length 8 --max-position-embeddings 8 "
            "--vocab-size 64 --lr 1e-3 --train-iters 1 --mock-data --micro-batch-size 1 "
            "--global-batch-size 8 --pipeline-model-parallel-size 4 --pipeline-schedule chimera "
            "--chimera-variant interleaved").split()
    with pytest.raises(ValueError, match="not a multiple of 8"):
        parse_args(["--num-layers", "4"] + base, world_size=4)
    config = parse_args(["--num-layers", "8"] + base, world_size=4)
    assert config.parallel.chimera_variant == "interleaved"
