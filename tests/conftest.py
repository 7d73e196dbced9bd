import shutil

import pytest
import torch
import torch.distributed as dist


def pytest_report_header(config):
    import ep_plugin._ext as ext
    c = f"built (CUDA runtime {ext.get_c().cuda_runtime_version()})" if ext.has_c() else "not built"
    return [f"ep_plugin._C: {c}; torch {torch.__version__}; CUDA GPUs: {torch.cuda.device_count()}; "
            f"nvcc: {shutil.which('nvcc') or 'absent'}"]


@pytest.fixture(scope="module")
def solo():
    """A one-rank gloo group in this process (for calls whose checks never reach a collective)."""
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()
