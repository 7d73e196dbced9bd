"""The NVSHMEM part of ep_plugin._C (issue 11): built when the matching nvidia-nvshmem wheel is installed.

No GPU here: these tests check the build and the argument checks that run before any NVSHMEM call,
never nvshmem_init itself.
"""
import importlib.metadata as md
import os
import re
import shutil
import subprocess

import pytest

NAMES = ("nvshmem_unique_id", "nvshmem_unique_id_size", "nvshmem_init", "nvshmem_finalize", "nvshmem_initialized",
         "nvshmem_my_pe", "nvshmem_n_pes", "nvshmem_malloc", "nvshmem_free", "nvshmem_put_ints",
         "nvshmem_barrier_all_on_stream")


def compiled_module():
    import ep_plugin._ext as ext
    if not ext.has_c():
        pytest.skip("ep_plugin._C is not built")
    return ext.get_c()


def cuda_major():
    """What setup.py matches the wheel against: torch's CUDA major, nvcc's for a CPU torch."""
    import torch
    if torch.version.cuda:
        return int(torch.version.cuda.split(".")[0])
    nvcc = shutil.which("nvcc")
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout if nvcc else ""
    m = re.search(r"release (\d+)\.", out)
    return int(m.group(1)) if m else None


def matching_wheel():
    major = cuda_major()
    installed = []
    for m in (12, 13):
        try:
            md.version(f"nvidia-nvshmem-cu{m}")
            installed.append(m)
        except md.PackageNotFoundError:
            pass
    return installed == [major] and major is not None


def test_has_nvshmem_is_a_bool():
    C = compiled_module()
    assert isinstance(C.HAS_NVSHMEM, bool)
    assert C.HAS_NVSHMEM == all(hasattr(C, n) for n in NAMES)


def test_built_with_nvshmem_when_the_wheel_is_installed():
    C = compiled_module()
    if not matching_wheel():
        pytest.skip("no nvidia-nvshmem wheel matching the CUDA major is installed")
    if os.environ.get("EP_PLUGIN_WITH_NVSHMEM", "").lower() in ("0", "false", "no", "off"):
        pytest.skip("EP_PLUGIN_WITH_NVSHMEM=0 builds _C without NVSHMEM")
    assert C.HAS_NVSHMEM, "the wheel is installed but _C was built without it: rebuild (scripts/setup.sh)"
    data = open(C.__file__, "rb").read()
    assert b"libnvshmem_host.so.3" in data and b"libtorch" not in data


def test_nvshmem_calls_before_init_fail_cleanly():
    C = compiled_module()
    if not C.HAS_NVSHMEM:
        pytest.skip("_C is built without NVSHMEM")
    assert C.nvshmem_initialized() is False and C.nvshmem_unique_id_size() > 0
    for call in (C.nvshmem_my_pe, lambda: C.nvshmem_malloc(1024), lambda: C.nvshmem_put_ints(0, 0, 1, 0, 0)):
        with pytest.raises(RuntimeError, match="nvshmem_init first"):
            call()
    with pytest.raises(ValueError, match="bytes"):
        C.nvshmem_init(0, 2, b"short")
    C.nvshmem_finalize()  # a no-op before init
