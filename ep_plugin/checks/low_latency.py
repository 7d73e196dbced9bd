"""The argument checks of EPBuffer's low-latency calls (docs/LOW_LATENCY.md): BF16 rows into the fixed
layout [E_l, W*M, H], a handle that names its buffer. Run once per call form (core.Forms), except the
handle's, which is compared every call (attribute reads only).

The key of a call form (dispatch_key, combine_key) is what its checks read: for plain tensors a flat tuple
(no loop, no nested tuples: a repeated form costs one tuple and one set lookup, the few us of host time a
cold call at 128 tokens feels), else call_form's."""
from __future__ import annotations

from typing import Optional

import torch

from ..backends.base import group_device_problem
from ..types import FP8_BLOCK, LowLatencyHandle
from .calls import CallChecks
from .core import _cuda_device, call_form, need

LOW_LATENCY_MAX_TOPK = 32  # the largest top-k the low-latency calls take (an engine may declare fewer: max_topk)

_Tensor = torch.Tensor
# the kinds of key in a buffer's Forms, first in each key: a flat key's length and layout follow from its kind
_DISPATCH, _DISPATCH_STATS, _COMBINE, _COMBINE_OUT = "ll_dispatch", "ll_dispatch+stats", "ll_combine", "ll_combine+out"


def dispatch_key(x, topk_idx, recv_stats, use_fp8, round_scale):
    """The form of a low_latency_dispatch call (dispatch() reads nothing else but the buffer's constants and,
    for CUDA x, the current device), or None (an argument call_form cannot describe: the checks run, and
    raise). Plain tensors and bool flags: one flat tuple; else call_form's nested one."""
    if type(x) is _Tensor and type(topk_idx) is _Tensor and type(use_fp8) is bool and type(round_scale) is bool:
        if recv_stats is None:
            return (_DISPATCH, x.dtype, x.shape, x.device, x.is_contiguous(), _cuda_device() if x.is_cuda else None,
                    topk_idx.dtype, topk_idx.shape, topk_idx.device, topk_idx.is_contiguous(), use_fp8, round_scale)
        if type(recv_stats) is _Tensor:
            return (_DISPATCH_STATS, x.dtype, x.shape, x.device, x.is_contiguous(),
                    _cuda_device() if x.is_cuda else None, topk_idx.dtype, topk_idx.shape, topk_idx.device,
                    topk_idx.is_contiguous(), use_fp8, round_scale, recv_stats.dtype, recv_stats.shape,
                    recv_stats.device, recv_stats.is_contiguous())
    form = call_form(x, topk_idx, recv_stats, use_fp8, round_scale)
    return None if form is None else (_DISPATCH, form)


def device(group, x: torch.Tensor) -> None:
    """x on a device the group's process-group backend moves: CUDA (the current device) with NCCL, CPU else."""
    problem = group_device_problem(group, x.device)
    need(problem is None, ValueError, f"x {problem}")


def dispatch(c: CallChecks, M: int, num_local_experts: int, x, topk_idx, use_fp8, round_scale, recv_stats,
             device_check) -> None:
    """device_check(x): the buffer's device rule (device() on its group)."""
    H = c.hidden
    need(isinstance(x, torch.Tensor), TypeError, f"x must be a torch.Tensor, got {type(x).__name__}")
    need(x.dtype == torch.bfloat16, TypeError,
         f"low_latency_dispatch takes BF16 x, got {x.dtype} (FP8 is cast inside: use_fp8=True)")
    need(x.dim() == 2 and x.shape[1] == H, ValueError, f"x must have shape [num_tokens, {H}], got {tuple(x.shape)}")
    need(x.is_contiguous(), ValueError, "x must be contiguous")
    need(x.shape[0] <= M, ValueError,
         f"x has {x.shape[0]} tokens, more than comm.low_latency.max_tokens_per_rank={M}")
    need(H % 8 == 0, ValueError,
         f"the low-latency calls need rows of a multiple of 16 bytes (hidden % 8 == 0), got hidden={H}")
    need(isinstance(use_fp8, bool), TypeError, f"use_fp8 must be a bool, got {use_fp8!r}")
    need(isinstance(round_scale, bool), TypeError, f"round_scale must be a bool, got {round_scale!r}")
    need(not use_fp8 or H % FP8_BLOCK == 0, ValueError,
         f"use_fp8 needs hidden divisible by {FP8_BLOCK} (one scale per {FP8_BLOCK} channels), got "
         f"hidden={H}: pass use_fp8=False")
    need(use_fp8 or not round_scale, ValueError, "round_scale applies to the FP8 cast: it needs use_fp8=True")
    device_check(x)
    topk(topk_idx, x.shape[0], None, x.device)
    if recv_stats is not None:
        E_l = num_local_experts
        need(isinstance(recv_stats, torch.Tensor), TypeError,
             f"recv_stats must be a torch.Tensor, got {type(recv_stats).__name__}")
        need(recv_stats.dtype == torch.int32, TypeError, f"recv_stats must be int32, got {recv_stats.dtype}")
        need(tuple(recv_stats.shape) == (E_l,), ValueError,
             f"recv_stats must have shape [{E_l}] (the local experts), got {tuple(recv_stats.shape)}")
        need(recv_stats.device == x.device, ValueError, f"recv_stats is on {recv_stats.device}, x on {x.device}")
        need(recv_stats.is_contiguous(), ValueError, "recv_stats must be contiguous")


def topk(topk_idx, T: int, K: Optional[int], device) -> None:
    need(isinstance(topk_idx, torch.Tensor), TypeError,
         f"topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}")
    need(topk_idx.dtype == torch.int64, TypeError, f"topk_idx must be int64, got {topk_idx.dtype}")
    need(topk_idx.dim() == 2 and topk_idx.shape[0] == T and (K is None or topk_idx.shape[1] == K),
         ValueError, f"topk_idx must have shape [{T}, {'K' if K is None else K}], got {tuple(topk_idx.shape)}")
    need(1 <= topk_idx.shape[1] <= LOW_LATENCY_MAX_TOPK, ValueError,
         f"the low-latency calls take 1 <= topk <= {LOW_LATENCY_MAX_TOPK}, got {topk_idx.shape[1]}")
    need(topk_idx.device == device, ValueError, f"topk_idx is on {topk_idx.device}, x on {device}")
    need(topk_idx.is_contiguous(), ValueError, "topk_idx must be contiguous")


def combine_key(buffer_id: int, x, topk_idx, topk_weights, out, handle):
    """The form of a low_latency_combine call with the handle's part of combine()'s verdict, or None (a handle
    that is no LowLatencyHandle of this buffer, or an argument call_form cannot describe: the checks run).

    The handle is compared on every call (attribute reads): its type and buffer here, its (num_tokens, topk)
    as part of the key -- combine() passed that form only with topk_idx [num_tokens, topk], so a key found
    means they agree. One engine per buffer: a handle of this buffer has its engine, hidden, experts and M."""
    if type(handle) is not LowLatencyHandle or handle.buffer_id != buffer_id:
        return None
    if type(x) is _Tensor and type(topk_idx) is _Tensor and type(topk_weights) is _Tensor:
        if out is None:
            return (_COMBINE, x.dtype, x.shape, x.device, x.is_contiguous(), _cuda_device() if x.is_cuda else None,
                    topk_idx.dtype, topk_idx.shape, topk_idx.device, topk_idx.is_contiguous(), topk_weights.dtype,
                    topk_weights.shape, topk_weights.device, topk_weights.is_contiguous(), handle.num_tokens,
                    handle.topk)
        if type(out) is _Tensor:
            return (_COMBINE_OUT, x.dtype, x.shape, x.device, x.is_contiguous(),
                    _cuda_device() if x.is_cuda else None, topk_idx.dtype, topk_idx.shape, topk_idx.device,
                    topk_idx.is_contiguous(), topk_weights.dtype, topk_weights.shape, topk_weights.device,
                    topk_weights.is_contiguous(), handle.num_tokens, handle.topk, out.dtype, out.shape, out.device,
                    out.is_contiguous())
    form = call_form(x, topk_idx, topk_weights, out)
    return None if form is None else (_COMBINE, form, handle.num_tokens, handle.topk)


def combine(c: CallChecks, num_local_experts: int, x, topk_idx, topk_weights, handle, out) -> None:
    need(isinstance(handle, LowLatencyHandle), TypeError,
         f"handle must be the LowLatencyHandle of a low_latency_dispatch, got {type(handle).__name__}")
    # one engine per buffer: a handle of this buffer has its engine, hidden, experts and M
    need(handle.buffer_id == c.buffer_id, ValueError,
         "handle comes from another EPBuffer's low_latency_dispatch: combine on the buffer that dispatched")
    E_l, W, M, H, T = num_local_experts, c.world, handle.max_tokens, c.hidden, handle.num_tokens
    dev = handle.src_info.device
    need(isinstance(x, torch.Tensor), TypeError, f"x must be a torch.Tensor, got {type(x).__name__}")
    need(x.dtype == torch.bfloat16, TypeError, f"low_latency_combine takes BF16 x, got {x.dtype}")
    need(tuple(x.shape) == (E_l, W * M, H), ValueError,
         f"x must have the dispatch's shape [{E_l}, {W * M}, {H}] (local experts, ranks * max tokens, "
         f"hidden), got {tuple(x.shape)}")
    need(x.is_contiguous(), ValueError, "x must be contiguous")
    need(x.device == dev, ValueError, f"x is on {x.device}, but the handle's dispatch ran on {dev}")
    topk(topk_idx, T, handle.topk, dev)
    need(isinstance(topk_weights, torch.Tensor), TypeError,
         f"topk_weights must be a torch.Tensor, got {type(topk_weights).__name__}")
    need(topk_weights.dtype == torch.float32, TypeError, f"topk_weights must be float32, got {topk_weights.dtype}")
    need(tuple(topk_weights.shape) == (T, handle.topk), ValueError,
         f"topk_weights must have shape [{T}, {handle.topk}], got {tuple(topk_weights.shape)}")
    need(topk_weights.device == dev, ValueError, f"topk_weights is on {topk_weights.device}, x on {dev}")
    need(topk_weights.is_contiguous(), ValueError, "topk_weights must be contiguous")
    if out is not None:
        need(isinstance(out, torch.Tensor), TypeError, f"out must be a torch.Tensor, got {type(out).__name__}")
        need(out.dtype == torch.bfloat16, TypeError, f"out must be BF16, got {out.dtype}")
        need(tuple(out.shape) == (T, H), ValueError, f"out must have shape [{T}, {H}], got {tuple(out.shape)}")
        need(out.device == dev, ValueError, f"out is on {out.device}, x on {dev}")
        need(out.is_contiguous(), ValueError, "out must be contiguous")
