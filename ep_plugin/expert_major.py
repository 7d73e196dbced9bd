"""The expert-major layout computed from a rank-major dispatch with torch ops: the reference.

A rank-major dispatch delivers one row per (token, destination rank) with its local expert ids
[R, K]; a grouped GEMM wants one row per (token, local expert), contiguous per expert. Here the
positions are computed on the device with no host sync: route (i, k) of local expert e goes to
``offsets[e] + (number of routes of e in rows before i)``, i.e. inside an expert the rows keep the
received order. Backends without a native expert-major receive (torch) use these functions; the
nvlink kernels write the same layout directly (csrc/nvlink/expert.cu) and are tested against it.

A token naming one expert in several slots gets one row for it, as in the low-latency calls: EPBuffer
merges the repeats first (merge_repeats), so the functions below see distinct experts per token. A
backend whose kernels merge them on the device (Capabilities.merges_repeats: nvlink's notify and stage)
gets the picks as given; where the weights' gradient is recorded EPBuffer passes them through
repeats_share_grad (an identity whose backward gives every slot its expert's gradient).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ._ext import c_op
from ._ext import raw_stream as _raw_stream  # a module name of its own: benchmarks count its calls
from .types import ExpertLayout, padded


def capacity(num_recv: int, top_k: int, num_local_experts: int, alignment: int,
             tokens_per_expert: Optional[List[int]] = None) -> int:
    """Rows of the expert-major tensors: exact from host counts when given, else the worst case that
    `num_recv` received rows allow (each reaching min(K, E_local) local experts, every segment padded)."""
    if tokens_per_expert is not None:
        return sum(padded(tokens_per_expert, alignment))
    pad = num_local_experts * (alignment - 1)
    return num_recv * min(top_k, num_local_experts) + pad


_EARLIER: dict = {}  # (K, device) -> [K, K] bool, True where slot j comes before slot k


def merge_repeats(topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor]):
    """A token naming one expert in several slots keeps the first slot, with the weights of all of them
    summed into it; the later slots become -1 (their weights no longer count: -1 routes nowhere).
    On the GPU one kernel (csrc/layout/merge_repeats.cu) where no gradient is recorded, else five or six
    small torch ops (differentiable in the weights). Inputs without repeats come back with equal ids and
    exactly equal weights of the valid slots."""
    T, K = topk_idx.shape
    if K < 2 or T == 0:
        return topk_idx, topk_weights
    if (topk_idx.is_cuda and topk_idx.dtype == torch.int64 and topk_idx.is_contiguous() and _raw_stream is not None
            and (topk_weights is None or (topk_weights.dtype == torch.float32 and topk_weights.is_contiguous()
                                          and not (topk_weights.requires_grad and torch.is_grad_enabled())))):
        kernel = c_op("merge_repeats")
        if kernel is not None:
            idx = torch.empty_like(topk_idx)
            w = None if topk_weights is None else torch.empty_like(topk_weights)
            kernel(topk_idx.data_ptr(), 0 if w is None else topk_weights.data_ptr(), idx.data_ptr(),
                   0 if w is None else w.data_ptr(), T, K, _raw_stream(topk_idx.device.index))
            return idx, w
    return merge_repeats_torch(topk_idx, topk_weights)


def _earlier(K: int, device) -> torch.Tensor:
    """[K, K] bool, True where slot j comes before slot k (cached per (K, device))."""
    earlier = _EARLIER.get((K, device))
    if earlier is None:
        earlier = _EARLIER[(K, device)] = torch.ones(K, K, dtype=torch.bool, device=device).tril(-1)
    return earlier


def merge_repeats_torch(topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor]):
    """merge_repeats with torch ops: any device, differentiable in the weights; the kernel's reference."""
    T, K = topk_idx.shape
    if K < 2 or T == 0:
        return topk_idx, topk_weights
    same = topk_idx.unsqueeze(2) == topk_idx.unsqueeze(1)  # [T, K, K]: slots k and j name one expert
    idx = topk_idx.masked_fill(torch.any(same & _earlier(K, topk_idx.device), 2), -1)
    if topk_weights is None:
        return idx, None
    return idx, (same * topk_weights.unsqueeze(1)).sum(2)


class _RepeatsShareGrad(torch.autograd.Function):
    """Identity on the weights (a view: nothing is copied or launched); in backward each slot takes the
    gradient of the first slot of its token naming the same id (the one whose position carries the sum)."""

    @staticmethod
    def forward(ctx, topk_weights, topk_idx):
        ctx.save_for_backward(topk_idx)
        return topk_weights.view_as(topk_weights)

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        same = idx.unsqueeze(2) == idx.unsqueeze(1)  # [T, K, K]; slot k matches itself, so a first exists
        return grad.gather(1, same.to(torch.uint8).argmax(2)), None  # argmax: the first maximal index


def repeats_share_grad(topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The weights for a backend that merges repeats in its kernels (Capabilities.merges_repeats) when their
    gradient is recorded: the same values (a view), and in backward every slot gets the gradient of its
    expert's first slot, as through merge_repeats_torch (the backend's merge is invisible to autograd; its
    weight gradient is the row's at the first slot, 0 at the repeats, whose positions are -1)."""
    T, K = topk_idx.shape
    if K < 2 or T == 0:
        return topk_weights
    return _RepeatsShareGrad.apply(topk_weights, topk_idx)


def plan(recv_topk_idx: torch.Tensor, num_local_experts: int, alignment: int, num_rows: int) -> ExpertLayout:
    """Positions of every received (row, slot) in the expert-major rows; device ops only."""
    R, K = recv_topk_idx.shape
    EL, dev = num_local_experts, recv_topk_idx.device
    flat = recv_topk_idx.reshape(-1)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, EL))
    counts = torch.zeros(EL + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))[:EL]
    seg = (counts + alignment - 1) // alignment * alignment
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    offsets = torch.cat([zero, torch.cumsum(seg, 0)])
    starts = torch.cat([zero, torch.cumsum(counts, 0)])  # where each expert's routes begin in sorted order
    order = torch.sort(key, stable=True).indices
    ks = key[order]
    e = ks.clamp(max=EL - 1)
    j = torch.arange(R * K, dtype=torch.int64, device=dev)
    dest = torch.where(ks < EL, offsets[e] + (j - starts[e]), torch.full_like(j, -1))
    positions = torch.empty(R * K, dtype=torch.int32, device=dev)
    positions[order] = dest.to(torch.int32)
    return ExpertLayout(positions=positions.view(R, K), offsets=offsets, num_rows=num_rows, alignment=alignment)


def _targets(layout: ExpertLayout, scratch: int) -> torch.Tensor:
    """[R, K] int64 positions with -1 sent to a scratch row (index `scratch`)."""
    p = layout.positions.long()
    return torch.where(p >= 0, p, torch.full_like(p, scratch))


def expand(rows: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """[R, C] rank-major rows -> [N, C] expert-major rows (padding rows zero)."""
    if rows.element_size() == 1 and rows.dtype != torch.uint8:  # FP8: index_copy_ moves bytes
        return expand(rows.view(torch.uint8), layout).view(rows.dtype)
    out = rows.new_zeros((layout.num_rows + 1,) + tuple(rows.shape[1:]))
    tgt = _targets(layout, layout.num_rows)
    for k in range(tgt.shape[1]):  # one [R, C] copy per slot: no [R*K, C] temporary
        out.index_copy_(0, tgt[:, k], rows)
    return out[:layout.num_rows]


def expand_weights(weights: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """[R, K] dispatched weights -> [N] float32 weight of each expert-major row (0 on padding)."""
    out = torch.zeros(layout.num_rows + 1, dtype=torch.float32, device=weights.device)
    out.index_copy_(0, _targets(layout, layout.num_rows).reshape(-1), weights.reshape(-1).float())
    return out[:layout.num_rows]


def collapse(x: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """[N, H] expert-major rows -> [R, H]: each received row gets the float32 sum of its local experts'
    rows in slot order (what the nvlink combine computes on the fly), in x's dtype. x may be cut to
    the rows the segments use."""
    tgt = _targets(layout, x.shape[0])
    xp = torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))])
    acc = torch.zeros((tgt.shape[0],) + tuple(x.shape[1:]), dtype=torch.float32, device=x.device)
    for k in range(tgt.shape[1]):
        acc += xp.index_select(0, tgt[:, k]).float()
    return acc.to(x.dtype)


def collapse_weights(weights: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """[N] per-row values -> [R, K] float32 at their (row, slot) places, 0 elsewhere."""
    wp = torch.cat([weights.reshape(-1).float(), weights.new_zeros(1, dtype=torch.float32)])
    return wp[_targets(layout, weights.numel())]


__all__ = ["capacity", "merge_repeats", "repeats_share_grad", "plan", "expand", "expand_weights", "collapse",
           "collapse_weights", "padded"]
