import shutil

import torch


def pytest_report_header(config):
    import ep_plugin._ext as ext
    c = f"built (CUDA runtime {ext.get_c().cuda_runtime_version()})" if ext.has_c() else "not built"
    return [f"ep_plugin._C: {c}; torch {torch.__version__}; CUDA GPUs: {torch.cuda.device_count()}; "
            f"nvcc: {shutil.which('nvcc') or 'absent'}"]
