"""benchmarks/protocols.py's host-clock stamps (stamp_summary): the spread of the ranks after the barrier, the
slowest rank's host time in the call and the spread of the returns, medians over iterations; nothing where a
rank has no stamps or the ranks ran different counts."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
try:
    import protocols
finally:
    sys.path.pop(0)


def test_stamp_summary_medians_over_iterations():
    # two ranks, three iterations: (ns after the barrier, ns at the call's return)
    r0 = [(0, 30_000), (1_000_000, 1_020_000), (2_000_000, 2_040_000)]
    r1 = [(10_000, 50_000), (1_000_000, 1_030_000), (2_050_000, 2_060_000)]
    got = protocols.stamp_summary("cold", [r0, r1])
    # spreads after the barrier 10, 0, 50 us; slowest host times 40, 30, 40; return spreads 20, 10, 20
    assert got == {"cold_skew_us": 10.0, "cold_host_us": 40.0, "cold_ret_skew_us": 20.0}


def test_stamp_summary_needs_every_rank_and_equal_counts():
    assert protocols.stamp_summary("hidden", [[(0, 1)], None]) == {}
    assert protocols.stamp_summary("hidden", [[(0, 1)], [(0, 1), (2, 3)]]) == {}
    assert protocols.stamp_summary("hidden", []) == {}


def test_aligned_is_a_protocol():
    assert "aligned" in protocols.PROTOCOLS and set(protocols.STAMPED) <= set(protocols.PROTOCOLS)
