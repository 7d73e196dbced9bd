"""The checks of ep_plugin.deep_ep's low-latency calls (DeepEP's low_latency_dispatch / low_latency_combine
and the mask calls), with the key of each call form: a flat tuple of what the checks read, so that a
repeated form costs one tuple and one dict lookup (core.FormMap) and no message is formatted on success.

What a form covers: the tensors' (type, dtype, shape, device, contiguity), the ints with their types, the
flags by value (the calls use only their truth), the current CUDA device for CUDA rows. What it does not
cover is checked on every call by the caller: the handle (its type and buffer, attribute reads) and the
state of the buffers (destroyed, pending errors)."""
from __future__ import annotations

import operator

import torch

from .core import _cuda_device, need

_Tensor = torch.Tensor
_UNSUPPORTED = "ep_plugin.deep_ep: {name} is not supported by ep_plugin's low-latency engine ({why})"
_HOOK_AND_ASYNC = ("async_finish and return_recv_hook cannot both be set (as in DeepEP): the hook receives on the "
                   "current stream")


_OTHER = object()  # an optional argument that is neither None nor a plain tensor: no form, the checks run


def _optional_form(t):
    """The form of an optional tensor argument: None, (dtype, shape, device, contiguity), or _OTHER."""
    if t is None:
        return None
    if type(t) is _Tensor:
        return (t.dtype, t.shape, t.device, t.is_contiguous())
    return _OTHER


def dispatch_key(x, topk_idx, stats, wait_stats, M, E, use_fp8, round_scale, use_ue8m0, async_finish, hook):
    """The form of a low_latency_dispatch call, or None (an argument of another kind, or one that can only
    raise: then the checks run, and raise or pass uncached)."""
    s = _optional_form(stats)
    if type(x) is not _Tensor or type(topk_idx) is not _Tensor or wait_stats is not None or s is _OTHER:
        return None
    return (x.dtype, x.shape, x.device, x.is_contiguous(), _cuda_device() if x.is_cuda else None,
            topk_idx.dtype, topk_idx.shape, topk_idx.device, topk_idx.is_contiguous(), s,
            type(M), M, type(E), E, use_fp8, round_scale, use_ue8m0, async_finish, hook)


def combine_key(x, topk_idx, topk_weights, out, wait_stats, use_logfmt, zero_copy, async_finish, hook, inner):
    """The form of a low_latency_combine call with the sizes of its handle's LowLatencyHandle `inner`
    (num_tokens, topk), or None as for dispatch_key, or when inner is None (no handle of this module). A form
    passes EPBuffer.low_latency_combine's checks only with topk_idx [num_tokens, topk]: a key found means
    they agree. The handle's buffer is compared by the caller."""
    o = _optional_form(out)
    if (inner is None or type(x) is not _Tensor or type(topk_idx) is not _Tensor or type(topk_weights) is not _Tensor
            or wait_stats is not None or use_logfmt or o is _OTHER):
        return None
    return (x.dtype, x.shape, x.device, x.is_contiguous(), _cuda_device() if x.is_cuda else None,
            topk_idx.dtype, topk_idx.shape, topk_idx.device, topk_idx.is_contiguous(),
            topk_weights.dtype, topk_weights.shape, topk_weights.device, topk_weights.is_contiguous(), o,
            zero_copy, async_finish, hook, inner.num_tokens, inner.topk)


def positive_int(name: str, v) -> int:
    try:
        n = operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(v).__name__}") from None
    need(n > 0, ValueError, f"{name} must be positive, got {n}")
    return n


def shape(M, E, world: int):
    """num_max_dispatch_tokens_per_rank and num_experts -> (M, E) as ints."""
    M, E = positive_int("num_max_dispatch_tokens_per_rank", M), positive_int("num_experts", E)
    need(E % world == 0, ValueError, f"num_experts ({E}) must be divisible by the number of ranks ({world})")
    return M, E


def dispatch_args(world: int, x, topk_idx, stats, wait_stats, M, E, use_fp8, round_scale, use_ue8m0, async_finish,
                  hook):
    """What the deep_ep layer checks of a dispatch (EPBuffer.low_latency_dispatch checks the rest) -> (M, E)."""
    if wait_stats is not None:
        raise NotImplementedError(_UNSUPPORTED.format(
            name="dispatch_wait_recv_cost_stats", why="it has no per-rank wait timers"))
    M, E = shape(M, E, world)
    need(isinstance(x, torch.Tensor) and x.dim() == 2, ValueError,
         f"x must be a [num_tokens, hidden] tensor, got {tuple(getattr(x, 'shape', ())) or type(x).__name__}")
    need(x.dtype == torch.bfloat16, TypeError, f"x must be bfloat16, got {x.dtype}")
    T, H = x.shape
    need(T <= M, ValueError, f"x has {T} tokens, more than num_max_dispatch_tokens_per_rank={M}")
    need(isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 and topk_idx.shape[0] == T,
         ValueError, f"topk_idx must have shape [{T}, num_topk], got {tuple(getattr(topk_idx, 'shape', ()))}")
    need(not (async_finish and hook), ValueError, _HOOK_AND_ASYNC)
    if use_fp8 and use_ue8m0:
        need(round_scale, ValueError, "use_ue8m0=True needs round_scale=True (UE8M0 holds powers of two)")
        need(H % 512 == 0, ValueError, f"use_ue8m0=True needs hidden divisible by 512, got {H}")
    if stats is not None:
        E_l = E // world
        need(isinstance(stats, torch.Tensor), TypeError,
             f"cumulative_local_expert_recv_stats must be a torch.int tensor, got {type(stats).__name__}")
        need(stats.dtype == torch.int32, TypeError,
             f"cumulative_local_expert_recv_stats must be torch.int, got {stats.dtype}")
        need(stats.dim() == 1 and stats.shape[0] == E_l and stats.is_contiguous(), ValueError,
             f"cumulative_local_expert_recv_stats must be a contiguous [{E_l}] tensor, got {tuple(stats.shape)}")
    return M, E


def handle(h, handle_type, buffers) -> None:
    """Every combine (values, not forms): a DeepEP low-latency handle of one of this Buffer's EPBuffers."""
    if not isinstance(h, handle_type):
        raise TypeError(f"handle must come from this module's low_latency_dispatch, got {type(h).__name__}")
    if all(h.buffer is not b for b in buffers):
        raise ValueError("handle comes from another Buffer's low_latency_dispatch")


def combine_args(world: int, h, handle_type, buffers, x, topk_idx, topk_weights, out, wait_stats, use_logfmt,
                 async_finish, hook) -> None:
    """What the deep_ep layer checks of a combine of handle h, the handle included (handle() above);
    EPBuffer.low_latency_combine checks the rest."""
    if use_logfmt:
        raise NotImplementedError(_UNSUPPORTED.format(
            name="use_logfmt", why="combine sends BF16 rows; LogFMT-10 is DeepEP's own wire format"))
    if wait_stats is not None:
        raise NotImplementedError(_UNSUPPORTED.format(
            name="combine_wait_recv_cost_stats", why="it has no per-rank wait timers"))
    handle(h, handle_type, buffers)
    _, _, M, H, E = h
    want = (E // world, world * M, H)
    need(isinstance(x, torch.Tensor) and tuple(x.shape) == want, ValueError,
         f"x must have shape {list(want)} (num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, "
         f"hidden), got {tuple(getattr(x, 'shape', ())) or type(x).__name__}")
    need(x.dtype == torch.bfloat16, TypeError, f"x must be bfloat16, got {x.dtype}")
    need(isinstance(topk_weights, torch.Tensor) and topk_weights.dtype == torch.float32, TypeError,
         f"topk_weights must be a float32 tensor, got {getattr(topk_weights, 'dtype', type(topk_weights).__name__)}")
    need(isinstance(topk_idx, torch.Tensor) and topk_weights.shape == topk_idx.shape, ValueError,
         f"topk_weights must have topk_idx's shape {tuple(getattr(topk_idx, 'shape', ()))}, "
         f"got {tuple(topk_weights.shape)}")
    need(topk_idx.dim() == 2 and topk_idx.shape[0] <= M, ValueError,
         f"topk_idx must be [num_tokens <= {M}, num_topk], got {tuple(topk_idx.shape)}")
    if out is not None:
        T = topk_idx.shape[0]
        need(isinstance(out, torch.Tensor) and tuple(out.shape) == (T, H) and out.dtype == torch.bfloat16
             and out.is_contiguous(), ValueError,
             f"out must be a contiguous bfloat16 [{T}, {H}] tensor, got "
             f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")
    need(not (async_finish and hook), ValueError, _HOOK_AND_ASYNC)


def mask_rank(rank, world: int) -> None:
    need(isinstance(rank, int) and 0 <= rank < world, ValueError,
         f"rank_to_mask must be a rank in [0, {world}), got {rank!r}")


def mask_status(t, world: int) -> None:
    need(isinstance(t, torch.Tensor) and t.dtype == torch.int32 and tuple(t.shape) == (world,), ValueError,
         f"mask_status must be a [{world}] torch.int tensor")
