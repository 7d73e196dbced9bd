"""Torch tensors over memory the low-latency engine owns: its output sets in the NVSHMEM heap, which the
senders write straight into (csrc/nvshmem/ll_device.cuh, "Output sets"). The tensors do not own that
memory; they are valid while the engine is open (close() frees the heap)."""
from __future__ import annotations

import ctypes
import math
from typing import Sequence

import torch

# a carrier of the same width for each element size: __cuda_array_interface__ has no bfloat16 or FP8
_CARRIER = {1: ("|i1", torch.int8), 2: ("<i2", torch.int16), 4: ("<i4", torch.int32), 8: ("<i8", torch.int64)}


class _DeviceArray:
    def __init__(self, ptr: int, shape: Sequence[int], typestr: str):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (int(ptr), False),
                                         "version": 2}


def heap_tensor(ptr: int, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous `shape` tensor of `dtype` at address `ptr` on `device`, owning nothing. On CPU (the
    host-path tests' fake runtime) ptr is host memory."""
    size = dtype.itemsize
    typestr, carrier = _CARRIER[size]
    if device.type == "cuda":
        t = torch.as_tensor(_DeviceArray(ptr, shape, typestr), device=device)
    else:
        raw = (ctypes.c_char * (math.prod(shape) * size)).from_address(int(ptr))
        t = torch.frombuffer(raw, dtype=carrier).view(tuple(shape))
    return t.view(dtype)
