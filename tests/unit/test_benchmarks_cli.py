"""The pipeline benchmarks' command lines: argument parsing, the process-free parts, and tiny runs.

The process-free checks (argument defaults, the simulator-only table against the paper's 1.21x,
the pack+unpack table) take seconds. The two tiny gloo runs (2 ranks, N=2, one timed iteration)
check that a real run produces sane counters; together they stay well under 30 s here.
"""

from __future__ import annotations

import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "benchmarks")
sys.path.insert(0, BENCHMARKS)

import a2sgd as a2sgd_benchmark  # noqa: E402
import chimera_vs_1f1b  # noqa: E402
import p2p_packing  # noqa: E402


def test_p2p_packing_defaults_and_quick():
    args = p2p_packing.parse_arguments([])
    assert (args.warmup, args.iters, args.quick) == (2, 5, False)
    quick = p2p_packing.parse_arguments(["--quick", "--iters", "1"])
    assert (quick.warmup, quick.iters) == (1, 1)
    labels = [label for label, _, _ in p2p_packing.configurations(quick=False)]
    assert labels == ["chimera direct D=2 N=4", "chimera forward-doubling D=2 N=4",
                      "chimera direct D=4 N=8", "chimera forward-doubling D=4 N=8", "1f1b D=4 N=8"]


def test_chimera_vs_1f1b_arguments():
    args = chimera_vs_1f1b.parse_arguments([])
    assert args.microbatches == [4, 8] and args.simulator_depths == [8, 16, 32]
    assert chimera_vs_1f1b.parse_arguments(["--quick"]).microbatches == [4]
    with pytest.raises(ValueError, match="even depths"):
        chimera_vs_1f1b.parse_arguments(["--simulator-depths", "7"])
    two = chimera_vs_1f1b.parse_arguments(["--pipeline-model-parallel-size", "2"])
    assert (two.depth, two.microbatches) == (2, [2, 4])
    with pytest.raises(ValueError, match="even D"):
        chimera_vs_1f1b.parse_arguments(["--pipeline-model-parallel-size", "3"])


def test_measured_variants_skip_undefined_forward_doubling():
    labels = [(label, n) for label, n, *_ in chimera_vs_1f1b.measured_variants(4, [4, 6])]
    assert ("chimera fwd-doubling", 4) in labels
    assert ("chimera fwd-doubling", 6) not in labels  # N must be a multiple of D
    assert ("chimera direct", 6) in labels and ("1f1b", 6) in labels


def test_simulator_table_reproduces_paper_ratio_and_bubbles():
    rows = chimera_vs_1f1b.simulator_table([8, 32])
    by_case = {(row["D"], row["N"]): row for row in rows}
    d32 = by_case[(32, 32)]
    # chimera.md section 4/8: (N+D-1)(F+Bk)/makespan with Bk=2F at D=N=32 is about 1.21.
    expected_makespan = 32 * 3 + 30 * 2
    assert d32["speedups"]["chimera direct"] == pytest.approx(63 * 3 / expected_makespan)
    assert round(d32["speedups"]["chimera direct"], 2) == 1.21
    assert d32["bubbles"]["1f1b"] == pytest.approx(31 / 63)
    assert d32["peaks"]["1f1b"] == (1, 32) and d32["peaks"]["chimera direct"] == (17, 32)
    # The speedup shrinks as N grows (direct concatenation).
    assert by_case[(8, 16)]["speedups"]["chimera direct"] < by_case[(8, 8)]["speedups"]["chimera direct"]


def test_pack_unpack_table_covers_both_implementations():
    rows = p2p_packing.measure_pack_unpack(repeats=1)
    modes = {row["mode"] for row in rows if "error" not in row}
    assert "python" in modes
    assert all(row["microseconds_per_message"] > 0 for row in rows if "error" not in row)


@pytest.mark.distributed
def test_tiny_packing_run_counts_match_the_lowering():
    flags = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
             "--pipeline-schedule", "chimera", "--chimera-variant", "forward-doubling"]
    rows = p2p_packing.measure_pipelines([("chimera fd D=2 N=2", 2, flags)], warmup=0,
                                         iterations=1)
    by_packing = {row["packing"]: row for row in rows}
    assert set(by_packing) == {"off", "cpp", "python"}
    # The wire counts equal what the lowering says: one message per tensor with packing off,
    # one per (communication group, peer) with packing on.
    lowered = rows[0]["lowered"]
    assert lowered == p2p_packing.lowered_message_counts(2, flags)
    assert by_packing["off"]["messages"] == lowered["tensors"] > 0
    assert by_packing["python"]["messages"] == by_packing["cpp"]["messages"] == lowered["packed"]
    assert by_packing["python"]["bytes"] > by_packing["off"]["bytes"]  # headers and padding
    assert all(row["p2p_seconds"] > 0 and row["seconds"] > 0 for row in rows)


@pytest.mark.distributed
def test_tiny_schedule_comparison_reports_speedups_and_peaks():
    rows = chimera_vs_1f1b.run_measured(2, [2], warmup=0, iterations=1, backward_ratio=2.0)
    by_schedule = {row["schedule"]: row for row in rows}
    assert by_schedule["1f1b"]["speedup"] == pytest.approx(1.0)
    assert by_schedule["1f1b"]["peaks"] == [2, 1]  # D - r micro-batches on rank r
    assert by_schedule["chimera direct"]["predicted_bk2"] > 1.0
    assert len(by_schedule["chimera direct"]["peaks"]) == 2


def test_a2sgd_benchmark_arguments_and_variants():
    args = a2sgd_benchmark.parse_arguments([])
    assert (args.iters, args.dp, args.sync_interval) == (50, [2, 4], 10)
    assert [g for _, g in a2sgd_benchmark.VARIANTS] == [None, "model", "bucket", "tensor"]


@pytest.mark.distributed  # starts two gloo ranks
def test_sequence_parallel_memory_quick(capsys):
    import sequence_parallel_memory
    assert sequence_parallel_memory.main(["--quick"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [row[:2] for row in rows] == [["gpt2", "0"], ["gpt2", "1"], ["llama", "0"],
                                         ["llama", "1"]]
    assert all(float(row[4]) > 1.0 for row in rows)  # sequence parallelism stores less
