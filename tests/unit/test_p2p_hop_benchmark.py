"""benchmarks/p2p_hop.py: its arguments and a tiny ring run through every transport mode."""

from __future__ import annotations

import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "benchmarks")
sys.path.insert(0, BENCHMARKS)

import p2p_hop  # noqa: E402


def test_arguments_defaults_and_errors():
    args = p2p_hop.parse_args([])
    assert (args.world, args.floats, args.laps, args.runs) == (2, 1 << 14, 300, 2)
    assert args.modes == list(p2p_hop.MODES)
    for bad in (["--world", "1"], ["--laps", "5"], ["--runs", "0"], ["--modes", "nccl"]):
        with pytest.raises(SystemExit):
            p2p_hop.parse_args(bad)


@pytest.mark.distributed
def test_ring_of_three_through_every_mode():
    """Every mode passes the token round a ring of 3 (so each rank sends to one peer and receives
    from another) without hanging; each lap is timed after the 10 warm-up laps."""
    measured = p2p_hop.measure(3, list(p2p_hop.MODES), laps=20, floats=64, runs=1,
                             timeout=120)
    assert set(measured) == set(p2p_hop.MODES)
    for mode, laps in measured.items():
        assert len(laps) == 10, mode
        assert all(wall > 0 and cpu >= 0 for wall, cpu in laps), mode
