"""The call-form fuzzer (tests/fuzz_cases.py) on the torch backend: a world-2 gloo group, made once for
the whole run, >= 1000 hypothesis cases, valid ones against tests/reference.py, invalid ones refused
with an error naming the argument before anything moves."""
import os

import pytest

from tests._dist import spawn

pytest.importorskip("hypothesis")

# odd widths; 256 takes FP8 pairs; two buffers of 4 experts, for handles of another buffer
SHAPES = [(3, 2), (17, 4), (64, 4), (256, 2)]
EXAMPLES = int(os.environ.get("EP_FUZZ_EXAMPLES", 1000))


def test_fuzz_torch_backend(tmp_path):
    from tests.fuzz_cases import fuzz_body

    out = tmp_path / "count"
    spawn(fuzz_body, 2, "torch", SHAPES, "cpu", 8, EXAMPLES, str(out))
    count, seconds = out.read_text().split()
    print(f"torch backend fuzz: {count} cases in {seconds} s")
    assert int(count) >= EXAMPLES


def test_fuzz_low_latency_torch_engine(tmp_path):
    """The low-latency calls' fuzzer on the torch engine (gloo): the same protocol, fewer cases (CI time)."""
    from tests.fuzz_cases import fuzz_body

    out = tmp_path / "count"
    n = int(os.environ.get("EP_FUZZ_LL_EXAMPLES", 300))
    spawn(fuzz_body, 2, "torch", [(128, 4), (64, 4)], "cpu", 8, n, str(out), None, True)
    count, seconds = out.read_text().split()
    print(f"low-latency torch engine fuzz: {count} cases in {seconds} s")
    assert int(count) >= n
