"""What a caller holds of the low-latency engine's output sets (low_latency.py, "Held outputs"): the
reference counts the engine watches, and moving a held heap set's tensors to memory of their own."""
from __future__ import annotations

import gc
import operator
import sys

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)  # a storage's references: a caller's views raise it

# torch >= 2.12: a storage's memory can be swapped under every tensor and view of it at once
_CAN_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def move_out(tensors: list, dev) -> bool:
    """The storages of `tensors` (heap memory they do not own) -> fresh allocations holding a copy (queued on
    the current stream), under every tensor and view of them. With torch's storage swap that is one swap
    per storage; without it every Python tensor on such a storage is found (one scan of the garbage
    collector's objects, ~0.1 s: this runs only when a caller holds a set) and set_ onto the copy. False
    when something still holds the heap memory afterwards (a tensor only C++ code sees)."""
    old = [t.untyped_storage() for t in tensors]
    fresh = {}
    for st in old:
        f = torch.empty(st.nbytes(), dtype=torch.uint8, device=dev).untyped_storage()
        f.copy_(st)
        if _CAN_SWAP:
            st._swap_data_ptr_(f)  # `f` now holds the heap pointer (owning nothing) and goes
        else:
            fresh[st.data_ptr()] = (st, f)
    if not fresh:
        return True
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and o.device.type == dev.type:
            hit = _heap_hit(o, fresh)
            if hit is not None:
                o.set_(hit, o.storage_offset(), o.size(), o.stride())
    # what still refers to a heap storage: its wrapper in `old` (one reference), nothing else
    return _use_count is None or all(_use_count(st._cdata) <= 1 for st in old)


def _heap_hit(t: torch.Tensor, fresh: dict):
    """The fresh storage for t's, if t's is one being moved (same address and size), else None."""
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, sparse, wrapper)
        return None
    hit = fresh.get(st.data_ptr())
    return hit[1] if hit is not None and st.nbytes() == hit[0].nbytes() else None


class Watch:
    """What the engine itself holds of one output set: each object's reference count, and each tensor's
    storage use count (which a caller's view of the tensor raises), taken when the set is made. Counts
    above those at the set's next turn: a caller still holds its outputs, or a view of them."""

    __slots__ = ("objs", "stores", "cdata", "base_refs", "base_uses")

    # Every dispatch with output sets asks held() (FP8: 12 counts, BF16: 9), and every combine with output
    # buffers: map over C functions, no Python frame per count (the counts are the same, taken the same way
    # for the base and now: each object passes through a map iterator into sys.getrefcount).
    def __init__(self, objs: list):
        self.objs = objs  # the list itself, not a copy: no other list may hold them while the base is taken
        self.stores = [o.untyped_storage() for o in self.objs if isinstance(o, torch.Tensor)] if _use_count else []
        self.cdata = [st._cdata for st in self.stores]  # kept alive by self.stores
        self.base_refs = list(map(_getrefcount, self.objs))
        self.base_uses = list(map(_use_count, self.cdata)) if _use_count else []

    def held(self) -> bool:
        # the counts against the base as they come: no list built, done at the first one above its base
        return (any(map(_gt, map(_getrefcount, self.objs), self.base_refs))
                or (_use_count is not None and any(map(_gt, map(_use_count, self.cdata), self.base_uses))))


_gt, _getrefcount = operator.gt, sys.getrefcount
