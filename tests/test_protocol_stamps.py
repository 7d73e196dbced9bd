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


class _FakeEvent:
    clock = 0.0

    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = _FakeEvent.clock

    def elapsed_time(self, other):  # ms, as torch's
        return other.t - self.t


def _skewed_run(monkeypatch, rank, world=4):
    """protocols.Protocols.skewed on a fake GPU whose clock advances only in sleeps (SKEW_CYCLES -> 0.05 ms)
    and in the call (0.5 ms); returns (times us, delays us, sleeps)."""
    sleeps = []

    def sleep(cycles):
        sleeps.append(cycles)
        _FakeEvent.clock += 0.05 if cycles == protocols.SKEW_CYCLES else 0.0

    def call():
        _FakeEvent.clock += 0.5

    cuda = protocols.torch.cuda
    monkeypatch.setattr(cuda, "Event", _FakeEvent)
    monkeypatch.setattr(cuda, "_sleep", sleep)
    monkeypatch.setattr(cuda, "synchronize", lambda: None)
    monkeypatch.setattr(protocols.dist, "barrier", lambda: None)
    monkeypatch.setattr(protocols.dist, "all_reduce", lambda t: None)
    monkeypatch.setattr(protocols.dist, "get_rank", lambda: rank)
    monkeypatch.setattr(protocols.dist, "get_world_size", lambda: world)
    proto = object.__new__(protocols.Protocols)
    proto.warmup, proto.iters, proto.kinds = 1, 3, ("skewed",)
    proto._flush = protocols.torch.zeros(4)
    proto._tok = protocols.torch.zeros(1)
    proto.stamps, proto.delays = {}, []
    times = proto.skewed(call)
    return times, proto.delays, sleeps


def test_skewed_delays_only_the_last_rank(monkeypatch):
    times, delays, sleeps = _skewed_run(monkeypatch, rank=3)
    assert [round(t, 3) for t in times] == [550.0] * 3  # the delay is inside the late rank's timed span
    assert [round(d, 3) for d in delays] == [50.0] * 3
    assert sleeps.count(protocols.SKEW_CYCLES) == 3 and sleeps.count(protocols.SLEEP_CYCLES) == 3
    times, delays, sleeps = _skewed_run(monkeypatch, rank=0)
    assert [round(t, 3) for t in times] == [500.0] * 3 and delays == []
    assert protocols.SKEW_CYCLES not in sleeps
    assert "skewed" in protocols.PROTOCOLS and "skewed" in protocols.STAMPED


def test_traced_runs_each_cold_call_between_markers(monkeypatch):
    """protocols.Protocols.traced on a fake GPU: every timed call runs after the flush and the barrier, between two
    marker launches, inside bench_decode_pair.kernel_trace (faked: it records what ran and returns one trace per call);
    the traces are kept for measure, and the times are the calls' events."""
    log = []
    cuda = protocols.torch.cuda
    monkeypatch.setattr(cuda, "Event", _FakeEvent)
    monkeypatch.setattr(cuda, "synchronize", lambda: None)
    monkeypatch.setattr(protocols.dist, "barrier", lambda: log.append("barrier"))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    try:
        import bench_decode_pair
    finally:
        sys.path.pop(0)

    def fake_trace(fn, n):
        for i in range(n):
            fn(lambda: log.append("marker"))
        return [{"t0": float(i), "kernels": []} for i in range(n)]

    monkeypatch.setattr(bench_decode_pair, "kernel_trace", fake_trace)

    def call():
        log.append("call")
        _FakeEvent.clock += 0.25

    proto = object.__new__(protocols.Protocols)
    proto.warmup, proto.iters, proto.kinds = 1, 2, ("traced",)
    proto._flush = protocols.torch.zeros(4)
    proto.stamps, proto.delays, proto.traces = {}, [], []
    times = proto.traced(call)
    assert [round(t, 3) for t in times] == [250.0, 250.0]
    assert log == ["call"] + ["barrier", "marker", "call", "marker"] * 2  # the warm-up call, then two traced ones
    assert [t["t0"] for t in proto.traces] == [0.0, 1.0]
    assert "traced" in protocols.PROTOCOLS and "traced" not in protocols.STAMPED
