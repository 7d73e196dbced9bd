"""The call-form fuzzers (fuzz_cases.py, fuzz_ll_cases.py) on GPUs, >= 1000 cases each: the nvlink
backend, the low-latency calls (NVSHMEM engine) and the internode backend (comm.backend: nvshmem with
virtual nodes). One process per GPU, one NCCL group and a few buffers per run (one NVSHMEM job per
process). Run on the device machine:

    python3 -m pytest -q -s -m gpu tests/test_fuzz_gpu.py      # worlds 2 and 4 where the GPUs exist
"""
import os

import pytest
import torch

from tests._dist import spawn
from tests._need import need_installed

need_installed("hypothesis")
pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("EP_FUZZ_EXAMPLES", 1000))
TIMEOUT = float(os.environ.get("EP_FUZZ_TIMEOUT", 300))  # a hung spawn fails after this
WORLDS = [2, 4]


def _need(world, nvshmem=False):
    import ep_plugin._ext as ext

    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    if not ext.has_c():
        pytest.skip("needs ep_plugin._C")
    if nvshmem and not ext.get_c().HAS_NVSHMEM:
        pytest.skip("ep_plugin._C is built without NVSHMEM")


def _count(out, what):
    count, seconds = out.read_text().split()
    print(f"{what}: {count} cases in {seconds} s")
    assert int(count) >= EXAMPLES
    return int(count)


@pytest.mark.parametrize("world", WORLDS)
def test_fuzz_nvlink(world, tmp_path):
    _need(world)
    from tests.fuzz_cases import fuzz_body

    # hidden a multiple of 128 in [256, 16384]; two buffers of 2W experts, for handles of another buffer
    shapes = [(256, 2 * world), (384, 2 * world), (512, world)]
    out = tmp_path / "count"
    spawn(fuzz_body, world, "nvlink", shapes, "cuda", 8, EXAMPLES, str(out), backend="nccl", timeout=TIMEOUT)
    _count(out, f"nvlink fuzz, {world} GPUs")


@pytest.mark.parametrize("world", WORLDS)
def test_fuzz_low_latency(world, tmp_path):
    _need(world, nvshmem=True)
    from tests.fuzz_cases import fuzz_body

    out = tmp_path / "count"
    spawn(fuzz_body, world, "auto", [(256, 2 * world)], "cuda", 8, EXAMPLES, str(out), None, True, backend="nccl",
          timeout=TIMEOUT)
    _count(out, f"low-latency fuzz, {world} GPUs")


@pytest.mark.parametrize("world", WORLDS)
def test_fuzz_internode(world, tmp_path):
    _need(world, nvshmem=True)
    from tests.fuzz_cases import fuzz_body

    out = tmp_path / "count"
    spawn(fuzz_body, world, "nvshmem", [(256, 2 * world)], "cuda", 8, EXAMPLES, str(out),
          {"ranks_per_node": world // 2}, backend="nccl", timeout=TIMEOUT)
    _count(out, f"internode (nvshmem, {world // 2} GPUs per virtual node) fuzz, {world} GPUs")
