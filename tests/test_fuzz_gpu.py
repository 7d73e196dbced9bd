"""The call-form fuzzers (fuzz_cases.py, fuzz_ll_cases.py) on GPUs, >= 1000 cases each: the nvlink
backend, the low-latency calls (NVSHMEM engine) and the internode backend (comm.backend: nvshmem with
virtual nodes). One process per GPU, one NCCL group and a few buffers per run (one NVSHMEM job per
process). Run on the device machine:

    python3 -m pytest -q -s -m gpu tests/test_fuzz_gpu.py      # worlds 2 and 4 where the GPUs exist
"""
import os

import pytest
import torch

from tests._dist import spawn, spawn_parts

pytest.importorskip("hypothesis")
pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("EP_FUZZ_EXAMPLES", 1000))
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


@pytest.fixture(scope="module", params=WORLDS)
def nvlink_ll_parts(request, tmp_path_factory):
    """The nvlink and the low-latency fuzz of a world in one spawn (one process start and NCCL init); the
    internode one keeps its own processes (a second NVSHMEM job in a process is not what it tests)."""
    from tests.fuzz_cases import fuzz_body

    world = request.param
    _need(world)
    root = tmp_path_factory.mktemp(f"fuzz{world}")
    # hidden a multiple of 128 in [256, 16384]; two buffers of 2W experts, for handles of another buffer
    shapes = [(256, 2 * world), (384, 2 * world), (512, world)]
    parts = [("nvlink", fuzz_body, ("nvlink", shapes, "cuda", 8, EXAMPLES, str(root / "nvlink.count")))]
    import ep_plugin._ext as ext
    if ext.get_c().HAS_NVSHMEM:
        parts.append(("low_latency", fuzz_body, ("auto", [(256, 2 * world)], "cuda", 8, EXAMPLES,
                                                 str(root / "low_latency.count"), None, True)))
    return world, root, spawn_parts(parts, world, str(root), backend="nccl", timeout=1200)


def test_fuzz_nvlink(nvlink_ll_parts):
    world, root, parts = nvlink_ll_parts
    parts["nvlink"].check()
    _count(root / "nvlink.count", f"nvlink fuzz, {world} GPUs")


def test_fuzz_low_latency(nvlink_ll_parts):
    world, root, parts = nvlink_ll_parts
    _need(world, nvshmem=True)
    parts["low_latency"].check()
    _count(root / "low_latency.count", f"low-latency fuzz, {world} GPUs")


@pytest.mark.parametrize("world", WORLDS)
def test_fuzz_internode(world, tmp_path):
    _need(world, nvshmem=True)
    from tests.fuzz_cases import fuzz_body

    out = tmp_path / "count"
    spawn(fuzz_body, world, "nvshmem", [(256, 2 * world)], "cuda", 8, EXAMPLES, str(out),
          {"ranks_per_node": world // 2}, backend="nccl", timeout=1200)
    _count(out, f"internode (nvshmem, {world // 2} GPUs per virtual node) fuzz, {world} GPUs")
