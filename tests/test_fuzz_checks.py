"""The call-form fuzzer (tests/fuzz_cases.py) on the torch backend: a world-2 gloo group, made once for
the whole run, >= 1000 hypothesis cases, valid ones against tests/reference.py, invalid ones refused
with an error naming the argument before anything moves."""
import os

import pytest

from tests._dist import spawn_parts
from tests._need import installed

# the fuzzer is the checks' proof: a missing hypothesis must not turn it into a silent skip (its ranks import it)
if not installed("hypothesis"):
    raise ImportError("tests/test_fuzz_checks.py needs hypothesis: scripts/setup.sh installs it "
                      "(or pip install hypothesis)")

# odd widths; 256 takes FP8 pairs; two buffers of 4 experts, for handles of another buffer
SHAPES = [(3, 2), (17, 4), (64, 4), (256, 2)]
EXAMPLES = int(os.environ.get("EP_FUZZ_EXAMPLES", 1000))


@pytest.fixture(scope="module")
def fuzz_parts(tmp_path_factory):
    """Both fuzzers in one spawn (one group for the whole run, as each fuzzer already keeps one)."""
    from tests.fuzz_cases import fuzz_body

    root = tmp_path_factory.mktemp("fuzz")
    n_ll = int(os.environ.get("EP_FUZZ_LL_EXAMPLES", 300))
    parts = [("torch", fuzz_body, ("torch", SHAPES, "cpu", 8, EXAMPLES, str(root / "torch.count"))),
             ("low_latency", fuzz_body, ("torch", [(128, 4), (64, 4)], "cpu", 8, n_ll, str(root / "ll.count"), None,
                                         True))]
    return root, n_ll, spawn_parts(parts, 2, str(root), timeout=1200)


def _cases_run(fuzz_parts, part, count_file, what):
    """The part's result checked, then the number of cases its fuzzer ran (printed with its time)."""
    root, _, parts = fuzz_parts
    parts[part].check()
    count, seconds = (root / count_file).read_text().split()
    print(f"{what}: {count} cases in {seconds} s")
    return int(count)


def test_fuzz_torch_backend(fuzz_parts):
    assert _cases_run(fuzz_parts, "torch", "torch.count", "torch backend fuzz") >= EXAMPLES


def test_fuzz_low_latency_torch_engine(fuzz_parts):
    """The low-latency calls' fuzzer on the torch engine (gloo): the same protocol, fewer cases (CI time)."""
    assert _cases_run(fuzz_parts, "low_latency", "ll.count", "low-latency torch engine fuzz") >= fuzz_parts[1]
