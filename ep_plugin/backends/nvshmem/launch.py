"""What both NVSHMEM engines (low_latency.py, rail.py) pass to their kernels: the current stream as an
integer, tensors as pointers, and the phases of a launch."""
from __future__ import annotations

from typing import Optional

import torch

from ..._ext import get_c
from ...errors import BackendUnavailableError

SEND, RECV = 1, 2  # phases of one launch (csrc/nvshmem/*: kSend, kRecv)
MIN_TOPK_CAPACITY = 16  # top-k slots per token the buffers hold: the config's topk or this, if larger

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# torch.cuda.current_device() is this behind a Python-level lazy-init check; CUDA is initialised
# once an engine exists (it queried the device), so the check is dead weight on every call
_get_device = getattr(torch._C, "_cuda_getDevice", None)


def current_stream() -> int:
    """The current CUDA stream of the current device as an integer: torch's raw accessor (no Stream
    object built per call: the cold-call path is host-bound), else the public API."""
    if _raw_stream is not None:
        return _raw_stream(_get_device() if _get_device is not None else torch.cuda.current_device())
    return torch.cuda.current_stream().cuda_stream


def ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def require_kernels(what: str, hidden: int) -> None:
    """BackendUnavailableError unless ep_plugin._C has the NVSHMEM kernels and CUDA GPUs are here;
    ValueError for rows the kernels cannot move (they copy 16 bytes at a time)."""
    if not getattr(get_c(), "HAS_NVSHMEM", False):
        raise BackendUnavailableError("ep_plugin._C is built without NVSHMEM")
    if not torch.cuda.is_available():
        raise BackendUnavailableError(f"the NVSHMEM {what} kernels need CUDA GPUs")
    if hidden % 8:
        raise ValueError(f"the NVSHMEM {what} kernels need hidden % 8 == 0 (16-byte rows), got {hidden}")
