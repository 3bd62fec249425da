"""The --pipeline-timeline trace and bubble ratios, from hand-made records (no processes)."""

import pytest

from megatron.core.pipeline_parallel.planning.lowering import lower_schedule
from megatron.core.pipeline_parallel.planning.schedules import build_schedule, schedule_layout
from megatron.core.pipeline_parallel.execution.interpreter import MessageRecord
from megatron.core.pipeline_parallel.execution.timeline import (chrome_trace, describe_hops,
                                                                hop_summary, measured_bubble_ratios,
                                                                message_hops,
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


A0, G0, A1 = ("activation", 0, 0, 0), ("gradient", 0, 1, 0), ("activation", 0, 0, 1)
# rank 0 sends two activations, rank 1 sends a gradient; absolute seconds of one shared clock.
MESSAGES = [
    [MessageRecord(A0, "send", 1.000, 1.001, 1.002), MessageRecord(A1, "send", 2.000, 2.010, 2.011),
     MessageRecord(G0, "receive", 0.5, 3.000, 3.000)],  # arrived before it was asked for
    [MessageRecord(A0, "receive", 0.9, 1.000, 1.004),  # waited 4 ms, 3 ms after the post
     MessageRecord(A1, "receive", 2.020, 2.020, 2.031),  # receive posted late; waited 11 ms
     MessageRecord(G0, "send", 2.5, 2.501, 2.502)],
]


def test_message_hops_pair_sends_with_receives_across_ranks():
    hops = {hop.key: hop for hop in message_hops(MESSAGES)}
    assert (hops[A0].producer_rank, hops[A0].consumer_rank) == (0, 1)
    assert hops[A0].delay == pytest.approx(0.003) and hops[A0].waited
    assert hops[A1].delay == pytest.approx(0.021) and hops[A1].receive_posted == 2.020
    assert not hops[G0].waited and hops[G0].producer_rank == 1


def test_hop_summary_counts_only_hops_whose_consumer_waited():
    summary = hop_summary(message_hops(MESSAGES))
    assert (summary["messages"], summary["waited"], summary["late_receives"]) == (3, 2, 1)
    assert summary["delay_median"] == pytest.approx(0.012)  # of 3 ms and 21 ms
    assert summary["delay_p90"] == pytest.approx(0.021)
    assert summary["post_lag_max"] == pytest.approx(0.010)
    assert summary["post_max"] == pytest.approx(0.001)
    assert summary["transfer_median"] == pytest.approx((0.003 + 0.011) / 2)
    assert "2 of 3 consumers waited" in describe_hops(summary)


def test_message_hops_refuse_records_of_more_than_one_iteration_or_a_lost_message():
    with pytest.raises(ValueError, match="recorded twice"):
        message_hops([MESSAGES[0], MESSAGES[1] + [MESSAGES[1][0]]])
    with pytest.raises(ValueError, match="sent but not received"):
        message_hops([MESSAGES[0], MESSAGES[1][:1]])
