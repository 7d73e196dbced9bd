"""benchmarks/ll_stamps.py: the low-latency kernels' phase stamps -> per boundary min / median / max over
the blocks after the rank's first dispatch entry, the samples' medians, the stamps turned off after."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
try:
    import ll_stamps
finally:
    sys.path.pop(0)


def _stamps(base_ns: int, blocks: int = 3) -> torch.Tensor:
    st = torch.zeros(2, 1024, 8, dtype=torch.int64)
    for b in range(blocks):
        st[0, b, 0] = base_ns + 1000 * b          # entries 0, 1, 2 us
        st[0, b, 1] = base_ns + 5000 + 1000 * b   # routing 5, 6, 7 us
    st[0, 2, 5] = base_ns + 20_000                # the signal: one block only
    st[1, 0, 0] = base_ns + 30_000                # the combine's entry, one block
    return st


def test_summarize_is_relative_to_the_first_dispatch_entry():
    got = ll_stamps.summarize(_stamps(10**12))
    assert got["t0_ns"] == 10**12
    assert got["dispatch.entry"] == [0.0, 1.0, 2.0]
    assert got["dispatch.routing"] == [5.0, 6.0, 7.0]
    assert got["dispatch.signal"] == [20.0, 20.0, 20.0]
    assert got["combine.entry"] == [30.0, 30.0, 30.0]
    assert "dispatch.placed" not in got and "combine.done" not in got  # never written: left out
    assert ll_stamps.summarize(torch.zeros(2, 1024, 8, dtype=torch.int64)) == {}


class _Engine:
    """Writes a sample's stamps on the call that follows a zeroing, as the kernels would."""

    def __init__(self):
        self.buf, self.on, self.calls = None, False, 0

    def phase_stamps(self, on=True):
        self.on = on
        self.buf = torch.zeros(2, 1024, 8, dtype=torch.int64) if on else None
        return self.buf

    def pair(self):
        self.calls += 1
        if self.on and int(self.buf.abs().sum()) == 0:
            self.buf.copy_(_stamps(10**9 * self.calls, blocks=2 + (self.calls // 2) % 2))


def test_collect_medians_over_samples_and_turns_the_stamps_off():
    eng = _Engine()
    got = ll_stamps.collect(eng, eng.pair, samples=3, pairs=2, sync=lambda: None, barrier=lambda: None)
    assert eng.calls == 6 and not eng.on
    assert got["samples"] == 3 and got["pairs_per_sample"] == 2
    # samples of 3, 2, 3 blocks: entry max 2, 1, 2 us -> median 2
    assert got["dispatch.entry"] == [0.0, 1.0, 2.0]
    assert got["dispatch.signal"] == [20.0, 20.0, 20.0]
    text = "\n".join(ll_stamps.lines([got, got]))
    assert "stamps r1 dispatch" in text and "signal 20.0 (20.0)" in text


def test_collect_without_stamps_is_none():
    assert ll_stamps.collect(None, lambda: None, 3, 3, lambda: None, lambda: None) is None
    assert ll_stamps.collect(object(), lambda: None, 3, 3, lambda: None, lambda: None) is None
