"""EPBuffer: the one dispatch/combine contract (DESIGN.md, "The core contract") over every backend.

This layer refuses bad input before any transport runs, and makes both directions differentiable:
dispatch's backward is a combine of the row gradients, combine's backward is a cached dispatch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .backends import make_backend
from .backends.base import EPEvent, Handle
from .backends.torch import combine_rows

FP8_BLOCK = 128  # channels per FP8 scale
ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))

XInput = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


@dataclass
class DispatchResult:
    x: XInput                           # [R, H], or (data [R, H], scales [R, H/128]) for FP8 input
    topk_idx: torch.Tensor              # [R, K] int64 local expert ids, -1 where not on this rank
    topk_weights: Optional[torch.Tensor]  # [R, K] float32, 0 where topk_idx is -1
    tokens_per_expert: List[int]        # rows per local expert (host values)
    handle: Handle                      # what combine and a cached dispatch need
    event: Optional[EPEvent] = None     # set for async calls: wait before using the outputs


def _combine_weights(group, weights: torch.Tensor, handle: Handle, async_op: bool = False):
    """Per-token sum over ranks of [R, K] weights: each (token, k) lives on the rank owning the expert,
    so the other ranks' entries count as 0. A small exchange: the reference collective serves every
    backend. Returns ([T, K] float32, event or None)."""
    local = torch.where(handle.recv_topk_idx >= 0, weights.float(), 0.0).contiguous()
    return combine_rows(group, local, handle, async_op)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buf, x, topk_weights, scales, topk_idx, handle, async_op):
        out = buf._backend.dispatch(x, scales, topk_idx, topk_weights, handle, async_op)
        ctx.buf, ctx.handle = buf, out.handle
        ctx.x_dtype = x.dtype
        if out.topk_weights is None:
            return out.x, None, out
        return out.x, out.topk_weights, out

    @staticmethod
    def backward(ctx, grad_x, grad_w, _):
        buf, handle = ctx.buf, ctx.handle
        gx = gw = None
        if ctx.needs_input_grad[1] and grad_x is not None:
            gx, _ = buf._backend.combine(grad_x.to(ctx.x_dtype).contiguous(), handle)
        if ctx.needs_input_grad[2] and grad_w is not None:
            gw, _ = _combine_weights(buf.group, grad_w, handle)
        return None, gx, gw, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buf, x, handle, async_op):
        y, event = buf._backend.combine(x, handle, async_op)
        ctx.buf, ctx.handle = buf, handle
        return y, event

    @staticmethod
    def backward(ctx, grad_y, _):
        out = ctx.buf._backend.dispatch(grad_y.contiguous(), None, ctx.handle.topk_idx, None, ctx.handle, False)
        return None, out.x, None, None


def _need(cond: bool, exc, msg: str):
    if not cond:
        raise exc(msg)


class EPBuffer:
    """Dispatch tokens to the ranks owning their top-k experts, and combine the results back.

    group: the expert-parallel ProcessGroup (None = WORLD). cfg: EPConfig, dict, YAML path or preset
    name. hidden: row width H. Rank r owns experts [r*E/W, (r+1)*E/W).
    """

    def __init__(self, group=None, cfg=None, hidden: int = None, *, num_experts: Optional[int] = None):
        from .config import load_config

        _need(dist.is_available() and dist.is_initialized(), RuntimeError,
              "torch.distributed must be initialized before creating an EPBuffer")
        _need(isinstance(hidden, int) and hidden > 0, ValueError, f"hidden must be a positive int, got {hidden!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.cfg = load_config(cfg, {"moe.num_experts": num_experts} if num_experts is not None else None)
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.num_experts = self.cfg.moe.num_experts
        self.cfg.check_ep_size(self.world)
        self.hidden = hidden
        self.num_local_experts = self.num_experts // self.world
        self._backend = make_backend(self.group, self.cfg, hidden, self.num_experts)

    @property
    def backend_name(self) -> str:
        return self._backend.name

    # ---------------------------------------------------------------- validation
    def _check_rows(self, x: XInput):
        if isinstance(x, (tuple, list)):
            _need(len(x) == 2, TypeError, "x must be a tensor or a (x_fp8, scales) pair")
            data, scales = x
            _need(isinstance(data, torch.Tensor) and data.dtype in FP8_DTYPES, TypeError,
                  f"x[0] (FP8 data) must be a float8 tensor, got {getattr(data, 'dtype', type(data))}")
            _need(isinstance(scales, torch.Tensor) and scales.dtype == torch.float32, TypeError,
                  f"x[1] (FP8 scales) must be a float32 tensor, got {getattr(scales, 'dtype', type(scales))}")
            _need(self.hidden % FP8_BLOCK == 0, ValueError,
                  f"FP8 dispatch needs hidden divisible by {FP8_BLOCK}, got hidden={self.hidden}")
            _need(scales.dim() == 2 and scales.shape == (data.shape[0], self.hidden // FP8_BLOCK), ValueError,
                  f"x[1] (FP8 scales) must have shape [{data.shape[0]}, {self.hidden // FP8_BLOCK}], got {tuple(scales.shape)}")
            _need(scales.is_contiguous(), ValueError, "x[1] (FP8 scales) must be contiguous")
            _need(scales.device == data.device, ValueError, "x[1] (FP8 scales) must be on x's device")
        else:
            data, scales = x, None
            _need(isinstance(data, torch.Tensor), TypeError, f"x must be a torch.Tensor, got {type(data).__name__}")
            _need(data.dtype in ROW_DTYPES, TypeError,
                  f"x must be float32, bfloat16 or float16 (or an FP8 (data, scales) pair), got {data.dtype}")
        _need(data.dim() == 2 and data.shape[1] == self.hidden, ValueError,
              f"x must have shape [num_tokens, {self.hidden}], got {tuple(data.shape)}")
        _need(data.is_contiguous(), ValueError, "x must be contiguous")
        _need(data.shape[0] <= self.cfg.comm.max_tokens_per_rank, ValueError,
              f"x has {data.shape[0]} tokens, more than comm.max_tokens_per_rank={self.cfg.comm.max_tokens_per_rank} "
              "the buffer was sized for")
        return data, scales

    def _check_routing(self, data, topk_idx, topk_weights):
        T = data.shape[0]
        _need(isinstance(topk_idx, torch.Tensor), TypeError, "topk_idx must be a torch.Tensor")
        _need(topk_idx.dtype == torch.int64, TypeError, f"topk_idx must be int64, got {topk_idx.dtype}")
        _need(topk_idx.dim() == 2 and topk_idx.shape[0] == T, ValueError,
              f"topk_idx must have shape [{T}, K], got {tuple(topk_idx.shape)}")
        _need(topk_idx.device == data.device, ValueError, f"topk_idx is on {topk_idx.device}, x on {data.device}")
        _need(topk_idx.is_contiguous(), ValueError, "topk_idx must be contiguous")
        capturing = data.is_cuda and torch.cuda.is_current_stream_capturing()
        if topk_idx.numel() and not capturing:
            lo, hi = torch.stack(torch.aminmax(topk_idx)).tolist()  # one device->host sync for both
            _need(lo >= -1 and hi < self.num_experts, ValueError,
                  f"topk_idx values must lie in [-1, {self.num_experts}), got min {lo}, max {hi}")
        if topk_weights is not None:
            _need(isinstance(topk_weights, torch.Tensor), TypeError, "topk_weights must be a torch.Tensor")
            _need(topk_weights.dtype == torch.float32, TypeError, f"topk_weights must be float32, got {topk_weights.dtype}")
            _need(topk_weights.shape == topk_idx.shape, ValueError,
                  f"topk_weights must have topk_idx's shape {tuple(topk_idx.shape)}, got {tuple(topk_weights.shape)}")
            _need(topk_weights.device == data.device, ValueError, "topk_weights must be on x's device")
            _need(topk_weights.is_contiguous(), ValueError, "topk_weights must be contiguous")

    def _check_handle(self, handle, num_tokens=None, num_rows=None):
        _need(isinstance(handle, Handle), TypeError, f"handle must be a Handle from dispatch, got {type(handle).__name__}")
        _need(handle.num_experts == self.num_experts, ValueError, "handle comes from a buffer with another expert count")
        if num_tokens is not None:
            _need(handle.num_tokens == num_tokens, ValueError,
                  f"handle was made for {handle.num_tokens} tokens, x has {num_tokens}")
        if num_rows is not None:
            _need(handle.num_recv == num_rows, ValueError,
                  f"x must have the {handle.num_recv} rows that dispatch delivered, got {num_rows}")

    def _async(self, async_op):
        return self.cfg.overlap.async_dispatch if async_op is None else bool(async_op)

    # ---------------------------------------------------------------- API
    def dispatch(self, x: XInput, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, *, handle: Optional[Handle] = None,
                 async_op: Optional[bool] = None) -> DispatchResult:
        """Send each token to the ranks that own its experts. With `handle`, reuse that dispatch's
        layout (cached mode; topk_idx may be omitted). With async_op, outputs are valid once
        `result.event.current_stream_wait()` has been called."""
        data, scales = self._check_rows(x)
        if handle is not None:
            self._check_handle(handle, num_tokens=data.shape[0])
            topk_idx = handle.topk_idx if topk_idx is None else topk_idx
        _need(topk_idx is not None, ValueError, "topk_idx is required unless a handle is given")
        self._check_routing(data, topk_idx, topk_weights)
        async_op = self._async(async_op)
        grad = torch.is_grad_enabled() and (data.requires_grad or (topk_weights is not None and topk_weights.requires_grad))
        if grad:
            _need(scales is None, TypeError, "FP8 dispatch is not differentiable: pass a BF16/float32 x for training")
            rx, rw, out = _Dispatch.apply(self, data, topk_weights, None, topk_idx, handle, async_op)
        else:
            with torch.no_grad():
                out = self._backend.dispatch(data, scales, topk_idx, topk_weights, handle, async_op)
            rx, rw = out.x, out.topk_weights
        rows = (rx, out.scales) if scales is not None else rx
        return DispatchResult(x=rows, topk_idx=out.topk_idx, topk_weights=rw,
                              tokens_per_expert=out.tokens_per_expert, handle=out.handle, event=out.event)

    def combine(self, x: torch.Tensor, handle: Handle, topk_weights: Optional[torch.Tensor] = None, *,
                async_op: Optional[bool] = None):
        """Sum, for each original token, the rows the ranks it reached send back: [T, H].

        With topk_weights ([R, K] float32, e.g. the dispatched weights after the experts changed
        them), also returns their per-token sum over ranks, [T, K] (as DeepEP's combine does):
        (y, weights). Async calls append the event: (y, event) or (y, weights, event)."""
        _need(isinstance(x, torch.Tensor), TypeError, f"x must be a torch.Tensor, got {type(x).__name__}")
        _need(x.dtype in ROW_DTYPES, TypeError, f"combine's x must be float32, bfloat16 or float16, got {x.dtype}")
        _need(x.dim() == 2 and x.shape[1] == self.hidden, ValueError,
              f"x must have shape [num_rows, {self.hidden}], got {tuple(x.shape)}")
        _need(x.is_contiguous(), ValueError, "x must be contiguous")
        self._check_handle(handle, num_rows=x.shape[0])
        _need(handle.is_token_in_rank.device == x.device, ValueError,
              f"x is on {x.device} but the handle's dispatch ran on {handle.is_token_in_rank.device}")
        if topk_weights is not None:
            _need(isinstance(topk_weights, torch.Tensor) and topk_weights.dtype == torch.float32, TypeError,
                  "combine's topk_weights must be a float32 tensor")
            _need(topk_weights.shape == handle.recv_topk_idx.shape, ValueError,
                  f"combine's topk_weights must have shape {tuple(handle.recv_topk_idx.shape)}, "
                  f"got {tuple(topk_weights.shape)}")
            _need(topk_weights.device == x.device, ValueError, "combine's topk_weights must be on x's device")
        is_async = self._async(async_op)
        if torch.is_grad_enabled() and x.requires_grad:
            y, event = _Combine.apply(self, x, handle, is_async)
        else:
            with torch.no_grad():
                y, event = self._backend.combine(x, handle, is_async)
        out = (y,)
        if topk_weights is not None:
            if event is not None:  # the weights' exchange goes after the rows', as on one stream
                event.current_stream_wait()
                event = None
            with torch.no_grad():
                weights, event = _combine_weights(self.group, topk_weights, handle, is_async)
            out += (weights,)
        if is_async:
            out += (event,)
        return out if len(out) > 1 else y

    def close(self) -> None:
        self._backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
