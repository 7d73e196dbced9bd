"""Access to the compiled module ep_plugin._C, with one clear error when it is missing."""
import torch

from .errors import BackendUnavailableError

try:
    from . import _C  # noqa: F401
    _IMPORT_ERROR = None
except ImportError as exc:  # pure-Python install
    _C = None
    _IMPORT_ERROR = exc

HOW_TO_BUILD = (
    "ep_plugin._C is not built. Install on a machine with nvcc (CUDA 12.x/13.x) with "
    "`EP_PLUGIN_BUILD_C=1 pip install --no-build-isolation -e .` (or `pip install -e .`), "
    "or use `comm.backend: torch`."
)


def has_c() -> bool:
    return _C is not None


def get_c():
    if _C is None:
        raise BackendUnavailableError(f"{HOW_TO_BUILD} (import error: {_IMPORT_ERROR})")
    return _C


def c_op(name: str):
    """_C.<name>, or None where _C is missing or older than that op (the caller then runs torch ops)."""
    return getattr(_C, name, None)


# The current stream's cudaStream_t as an int, without building a torch.cuda.Stream (the kernels' callers
# pass it on every launch); None on a torch without CUDA bindings.
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
