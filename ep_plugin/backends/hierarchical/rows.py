"""Row moves of the hierarchical backend (the reorder to the contract's order, the one-rank node's
packing and their inverses in combine), done on whole machine words.

torch's index_copy_ / index_select run one thread per element: a BF16 row of 7168 is 7168 threads,
each with its own index arithmetic, and the reorder of a 2x2 dispatch (16k rows of 14 KB) ran at
~1 TB/s on an H200 (466 us; docs/INTERNODE.md). The same rows seen as int64 words are 4x fewer
elements (8x for FP8 rows) with the same bytes moved, and the copy is bit-exact whatever the dtype
(index_copy_ has no FP8 kernels at all).
"""
from __future__ import annotations

import math

import torch

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def as_words(t: torch.Tensor) -> torch.Tensor:
    """t [R, ...] seen as [R, n] of the widest integer word that divides a row's bytes and t's
    address (t itself where it is not a contiguous tensor of rows)."""
    if t.dim() < 2 or not t.is_contiguous() or t.numel() == 0:
        return t
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    for size, dtype in _WORDS:
        if size >= t.element_size() and row_bytes % size == 0 and t.data_ptr() % size == 0:
            if t.dim() > 2:  # rows of one dimension first (2-D, the usual case, costs one view op on the host)
                t = t.reshape(t.shape[0], row_bytes // t.element_size())
            return t.view(dtype)
    return t


def scatter_rows(t, index: torch.Tensor):
    """out[index[i]] = t[i] for every row i (index: a permutation of t's rows); None stays None."""
    if t is None:
        return None
    out = torch.empty_like(t)
    if t.numel() == 0:
        return out
    as_words(out).index_copy_(0, index, as_words(t))
    return out


def gather_rows(t, index: torch.Tensor):
    """t[index] (rows); None stays None."""
    if t is None:
        return None
    picked = as_words(t).index_select(0, index)
    return picked.view(t.dtype).view(index.shape[0], *t.shape[1:])
