"""Row moves of the hierarchical backend (the reorder to the contract's order, the one-rank node's
packing and their inverses in combine), done on whole machine words where rows are long.

torch's index_copy_ / index_select run one thread per element: a BF16 row of 7168 is 7168 threads,
each with its own index arithmetic, and the reorder of a 2x2 dispatch (16k rows of 14 KB) ran at
~1 TB/s on an H100 (364 us for the cached dispatch's; 171 us as int64 words, docs/INTERNODE.md). The
same rows seen as int64 words are 4x fewer elements (8x for FP8 rows) with the same bytes moved, and
the copy is bit-exact whatever the dtype (index_copy_ has no FP8 kernels at all). Short rows (scales,
ids, weights) keep their dtype: each view is a torch op on the host, and on a host-bound fresh 2x1
dispatch four tensors' views cost more host time than their copies take on the GPU (2x H100).
"""
from __future__ import annotations

import torch

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
MIN_ROW_BYTES = 1024  # below it a row's copy is too short for the element count to matter


def as_words(t: torch.Tensor) -> torch.Tensor:
    """t [R, C] seen as [R, n] of the widest integer word that divides a row's bytes and t's address,
    for long rows and for 1-byte rows (FP8: no index kernels); t itself otherwise (short rows, 8-byte
    elements, anything not a contiguous 2-D tensor)."""
    size = t.element_size()
    if t.dim() != 2 or size >= 8 or not t.is_contiguous() or t.numel() == 0:
        return t
    row_bytes = t.shape[1] * size
    if size > 1 and row_bytes < MIN_ROW_BYTES:
        return t
    for word, dtype in _WORDS:
        if word >= size and row_bytes % word == 0 and t.data_ptr() % word == 0:
            if word == size and (size > 1 or dtype == t.dtype):
                return t  # the same element count: a view would only cost a host op (FP8 needs its bytes)
            return t.view(dtype)
    return t


def scatter_rows(t, index: torch.Tensor):
    """out[index[i]] = t[i] for every row i (index: a permutation of t's rows); None stays None."""
    if t is None:
        return None
    out = torch.empty_like(t)
    if t.numel() == 0:
        return out
    w = as_words(t)
    (out if w is t else out.view(w.dtype)).index_copy_(0, index, w)
    return out


def gather_rows(t, index: torch.Tensor):
    """t[index] (rows); None stays None."""
    if t is None:
        return None
    w = as_words(t)
    picked = w.index_select(0, index)
    return picked if w is t else picked.view(t.dtype)
