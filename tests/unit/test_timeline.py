"""The --pipeline-timeline trace and bubble ratios, from hand-made records (no processes)."""

import pytest

from megatron.core.pipeline_parallel.planning.lowering import lower_schedule
from megatron.core.pipeline_parallel.planning.schedules import build_schedule, schedule_layout
from megatron.core.pipeline_parallel.execution.timeline import (chrome_trace, measured_bubble_ratios,
                                                      predicted_bubble_ratios)

RECORDS = [
    {"rank": 0, "pp_rank": 0, "records": [("F0.0.0", 0.0, 1.0), ("[>1:a0.0.0]", 1.0, 1.5),
                                           ("B0.0.0", 3.5, 5.5)]},
    {"rank": 1, "pp_rank": 1, "records": [("[<0:a0.0.0]", 0.0, 1.5), ("F0.1.0", 1.5, 2.5),
                                           ("B0.1.0", 2.5, 4.5), ("WAIT", 4.5, 6.0)]},
]


def test_chrome_trace_has_one_complete_event_per_op_and_named_processes():
    events = chrome_trace(RECORDS)["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 7
    first = complete[0]
    assert (first["name"], first["pid"], first["ts"], first["dur"]) == ("F0.0.0", 0, 0.0, 1e6)
    assert {e["cat"] for e in complete if e["name"].startswith("[")} == {"communication"}
    assert [e["args"]["name"] for e in events if e["ph"] == "M"] == [
        "rank 0 (pipeline rank 0)", "rank 1 (pipeline rank 1)"]


def test_measured_bubble_is_idle_compute_share_of_the_iteration_span():
    # span 6.0; rank 0 computes 3.0, rank 1 computes 3.0 (communication is not compute)
    assert measured_bubble_ratios(RECORDS) == pytest.approx([0.5, 0.5])


def test_prediction_simulates_the_lowered_schedule_with_measured_costs():
    layout = schedule_layout("1f1b", 2)
    lowered = lower_schedule(build_schedule("1f1b", 2, 1), layout)
    # measured F = 1, B = 2: the simulated makespan is 2F + 2B = 6, each rank computes 3
    assert predicted_bubble_ratios(lowered, RECORDS) == pytest.approx([0.5, 0.5])
