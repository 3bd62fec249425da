"""Tier 0: simulator semantics and the (D, N, variant) grid against chimera.md §4 closed forms.

Grid: D in {2, 4, 6, 8, 16, 32}; N = 1 .. 4D for D <= 8 and a spread of N (1-3, around D/2,
around D, 2D and 4D; 2f > 2 pipelines up to 2D at D = 32) for D = 16 and 32, which keeps the
grid well under a minute on two cores. Costs (F, Bk) in {(1,1), (1,2), (1,3)} for D <= 8,
(1, 2) above. Every schedule family, Chimera variant and 2f pipeline count that the
options allow is built, validated, lowered, simulated without deadlock, and compared with the
closed forms where one exists (interleaved 1F1B with N not a multiple of D runs as one micro-batch
group, G = N).
"""

from __future__ import annotations

import gc
import os

import pytest

from megatron.core.pipeline_parallel.planning.instructions import backward, forward
from megatron.core.pipeline_parallel.planning.lowering import (
    GradSyncStart, GradSyncWait, P2PGroup, parse_lowered)
from megatron.core.pipeline_parallel.planning.simulator import (
    DeadlockError, LoweringError, simulate, simulate_schedule)

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden", "schedules")
DEPTHS = (2, 4, 6, 8, 16, 32)
COSTS = ((1, 1), (1, 2), (1, 3))


@pytest.fixture(scope="module", autouse=True)
def frozen_heap():
    """The grid allocates millions of small objects; with torch imported by conftest, every
    cyclic-GC pass also scans torch's large heap, doubling the run time. Freeze the objects
    that exist now (moved out of GC scans) and unfreeze them after this module."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def microbatch_counts(depth):
    if depth <= 8:
        return range(1, 4 * depth + 1)
    return sorted({1, 2, 3, depth // 2 - 1, depth // 2, depth // 2 + 1, depth - 1, depth,
                   depth + 1, 2 * depth, 4 * depth})


def grid_cases():
    for depth in DEPTHS:
        for num_microbatches in microbatch_counts(depth):
            yield "gpipe", depth, num_microbatches, {}
            yield "1f1b", depth, num_microbatches, {}
            if depth >= 2 and num_microbatches % depth == 0:
                yield "interleaved-1f1b", depth, num_microbatches, {"num_model_chunks": 2}
            elif depth >= 2 and num_microbatches > depth:  # Megatron's G = N (one group)
                yield "interleaved-1f1b", depth, num_microbatches, {
                    "num_model_chunks": 2, "microbatch_group_size": num_microbatches}
            yield "chimera", depth, num_microbatches, {}
            if num_microbatches % depth == 0:
                for variant in ("forward-doubling", "backward-halving"):
                    yield "chimera", depth, num_microbatches, {"variant": variant}
            for f in range(2, depth // 2 + 1):
                # 2f > 2 pipelines at D = 32 only up to N = 2D (keeps the grid fast)
                if (depth // 2) % f == 0 and (depth < 32 or num_microbatches <= 2 * depth):
                    yield "chimera", depth, num_microbatches, {"num_pipelines": 2 * f}


def expected_makespan(name, depth, num_microbatches, options, fwd, bwd):
    """chimera.md §4 exact makespans (zero p2p cost), or None where no closed form exists."""
    n, d = num_microbatches, depth
    if name in ("gpipe", "1f1b"):
        return (n + d - 1) * (fwd + bwd)
    if name != "chimera" or options.get("variant", "direct") != "direct":
        return None
    f = options.get("num_pipelines", 2) // 2
    if f == 1 and n % d == 0:
        k = n // d
        return k * d * (fwd + bwd) + (d - 2) * bwd + (k - 1) * (d - 2) * (bwd - fwd)
    if f > 1 and n == d:
        return n * (fwd + bwd) + (d // f - 2) * bwd
    return None


def expected_peaks(name, depth, num_microbatches, options):
    """chimera.md §4 peak live activations per worker, or None."""
    n, d = num_microbatches, depth
    e = [min(r, d - 1 - r) for r in range(d)]
    if name == "gpipe":
        return [n] * d
    if name == "1f1b":
        return [min(d - r, n) for r in range(d)]
    if name != "chimera" or options.get("num_pipelines", 2) != 2 or n % d:
        return None
    variant = options.get("variant", "direct")
    doubled = variant == "backward-halving" or (variant == "forward-doubling" and n >= 2 * d)
    # backward halving counts half micro-batches: same count, half the memory each
    return [(d + d // 2 + 1 + x) if doubled else (d // 2 + 1 + x) for x in e]


@pytest.mark.parametrize("depth", DEPTHS)
def test_grid_valid_deadlock_free_and_closed_forms(depth):
    checked = 0
    for name, d, num_microbatches, options in grid_cases():
        if d != depth:
            continue
        for fwd, bwd in (COSTS if depth <= 8 else ((1, 2),)):
            # simulate_schedule validates, lowers and simulates (raises on any failure)
            schedule, lowered, result = simulate_schedule(name, depth, num_microbatches, fwd, bwd,
                                                          **options)
            label = f"{name} D={depth} N={num_microbatches} {options} F={fwd} B={bwd}"
            work = sum(result.compute_time)
            assert result.bubble_ratio == pytest.approx(1 - work / (depth * result.makespan))
            expected = expected_makespan(name, depth, num_microbatches, options, fwd, bwd)
            if expected is not None:
                assert result.makespan == pytest.approx(expected), label
                checked += 1
            peaks = expected_peaks(name, depth, num_microbatches, options)
            if peaks is not None:
                assert result.peak_activations == peaks, label
            if name == "chimera" and options.get("num_pipelines", 2) > 2:
                f = options["num_pipelines"] // 2
                low = depth - depth // (2 * f) + 1
                if num_microbatches % depth == 0:
                    assert all(low <= p <= depth for p in result.peak_activations), label
    assert checked > 0


@pytest.mark.parametrize("depth", [4, 8, 16, 32])
def test_chimera_bubble_ratio_closed_forms(depth):
    # Table 2 assumes Bk = F: (D - 2) / (2N + D - 2); with Bk = 2F and N = D:
    # (D - 2) / (3N / 2 + D - 2).
    n = depth
    _, _, result = simulate_schedule("chimera", depth, n, 1, 1)
    assert result.bubble_ratio == pytest.approx((depth - 2) / (2 * n + depth - 2))
    _, _, result = simulate_schedule("chimera", depth, n, 1, 2)
    assert result.bubble_ratio == pytest.approx((depth - 2) / (3 * n / 2 + depth - 2))
    for f in (2, 4):
        if (depth // 2) % f == 0:
            _, _, result = simulate_schedule("chimera", depth, n, 1, 1, num_pipelines=2 * f)
            assert result.bubble_ratio == pytest.approx(
                (depth - 2 * f) / (2 * f * n + depth - 2 * f))
    _, _, result = simulate_schedule("1f1b", depth, n, 1, 2)
    assert result.bubble_ratio == pytest.approx((depth - 1) / (n + depth - 1))


def test_chimera_d4_timeline_matches_reference():
    _, _, result = simulate_schedule("chimera", 4, 4, 1, 2)
    assert result.makespan == 16 and result.bubble_ratio == pytest.approx(0.25)
    with open(os.path.join(GOLDEN, "chimera_D4_N4_timeline.txt")) as handle:
        golden = [line.split(":", 1)[1].split() for line in handle if line.startswith("P")]
    for rank, timeline in enumerate(result.compute_timelines()):
        cells = ["."] * 16
        for entry in timeline:
            label = f"{entry.op.kind.value}{entry.op.microbatch}{'v' if entry.op.pipeline == 0 else '^'}"
            for column in range(int(entry.start), int(entry.end)):
                cells[column] = label
        assert cells == golden[rank], rank


def test_forward_doubling_and_backward_halving_costs():
    # A backward-halving instruction is a half micro-batch: F/2 and Bk/2 per instruction, so
    # the total work equals N (F + Bk) per rank.
    _, _, result = simulate_schedule("chimera", 4, 8, 1, 2, variant="backward-halving")
    assert result.compute_time == [pytest.approx(8 * 3)] * 4
    _, _, result = simulate_schedule("chimera", 4, 8, 1, 2, variant="forward-doubling")
    assert result.compute_time == [pytest.approx(8 * 3)] * 4


def test_p2p_cost_rendezvous():
    lowered = parse_lowered(
        "F0.0.0 [>1:a0.0.0] [<1:g0.1.0] B0.0.0 S0.0 WAIT\n"
        "[<0:a0.0.0] F0.1.0 B0.1.0 [>0:g0.1.0] S0.1 WAIT\n")
    result = simulate(lowered, forward_cost=1, backward_cost=2, p2p_cost=0.5)
    # F 0-1, send completes 1.5, F 1.5-2.5, B 2.5-4.5, gradient at 5, B 5-7
    assert result.makespan == pytest.approx(7)
    assert [(str(e.op), e.start, e.end) for e in result.timelines[0]][:3] == \
        [("F0.0.0", 0, 1), ("[>1:a0.0.0]", 1, 1.5), ("[<1:g0.1.0]", 1.5, 5)]
    assert result.bubble_ratio == pytest.approx(1 - 6 / 14)


def test_allreduce_waits_for_all_replicas():
    lowered = [[forward(0, 0, 0), backward(0, 0, 0), GradSyncStart(0, 0), GradSyncWait()],
               [forward(1, 0, 0), GradSyncStart(1, 0), GradSyncWait()]]
    result = simulate(lowered, forward_cost=1, backward_cost=2, allreduce_cost=4)
    # stage 0's all-reduce spans both ranks; it starts when the later one (t = 3) starts it
    assert result.makespan == pytest.approx(7)
    assert result.timelines[1][-1].end == pytest.approx(7)


def test_naive_blocking_p2p_deadlocks_with_grid():
    # chimera.md §6: blocking send-then-receive deadlocks on crossing traffic.
    lowered = parse_lowered(
        "F0.0.0 [>1:a0.0.0] [<1:a1.0.1] F1.1.1.1 B1.1.1.1 [>1:g1.1.1] [<1:g0.1.0] B0.0.0 WAIT\n"
        "F1.0.1.1 [>0:a1.0.1] [<0:a0.0.0] F0.1.0 B0.1.0 [>0:g0.1.0] [<0:g1.1.1] B1.0.1.1 WAIT\n")
    with pytest.raises(DeadlockError) as error:
        simulate(lowered)
    text = str(error.value)
    assert ">[>1:a0.0.0]<" in text and ">[>0:a1.0.1]<" in text and "rank x step grid" in text


def test_compute_without_its_message_is_a_lowering_error():
    lowered = [[forward(0, 0, 0), backward(0, 0, 0), GradSyncWait()],
               [forward(0, 1, 0), backward(0, 1, 0), GradSyncWait()]]
    with pytest.raises(LoweringError, match="without having received"):
        simulate(lowered)


def test_peak_activations_counts_stored_forwards():
    _, _, result = simulate_schedule("chimera", 8, 8)
    assert result.peak_activations == [5, 6, 7, 8, 8, 7, 6, 5]  # chimera.md §4, D = 8
    # forwards of a GPipe rank all stay stored until the backwards start
    _, _, result = simulate_schedule("gpipe", 3, 5)
    assert result.peak_activations == [5, 5, 5]


def test_empty_group_is_rejected():
    with pytest.raises(AssertionError):
        P2PGroup(())


def test_default_lowering_reaches_closed_forms_for_other_costs():
    # The runtime lowers once with the default planning costs (F = 1, Bk = 2); the grouping must
    # stay deadlock-free and optimal when the real costs differ.
    from megatron.core.pipeline_parallel.planning.lowering import lower_schedule
    from megatron.core.pipeline_parallel.planning.schedules import build_schedule, schedule_layout

    checked = 0
    for name, depth, num_microbatches, options in grid_cases():
        if depth > 6:
            continue
        layout = schedule_layout(name, depth, **options)
        lowered = lower_schedule(build_schedule(name, depth, num_microbatches, **options), layout)
        fraction = float(layout.microbatch_fraction)
        for fwd, bwd in ((1, 1), (1, 3), (2, 3)):
            result = simulate(lowered, fwd * fraction, bwd * fraction)
            expected = expected_makespan(name, depth, num_microbatches, options, fwd, bwd)
            if expected is not None:
                assert result.makespan == pytest.approx(expected), (name, depth,
                                                                    num_microbatches, options)
                checked += 1
    assert checked > 100
