"""The two autograd functions of EPBuffer: dispatch's backward is a combine of the row gradients
(and a weight reduction for topk_weights); combine's backward is a dispatch on the saved layout."""
from __future__ import annotations

import torch


class DispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend, x, topk_weights, topk_idx, handle, async_op):
        out = backend.dispatch(x, None, topk_idx, topk_weights, handle, async_op)
        ctx.backend, ctx.handle, ctx.x_dtype = backend, out.handle, x.dtype
        return out.x, out.topk_weights, out

    @staticmethod
    def backward(ctx, grad_x, grad_w, _):
        backend, handle = ctx.backend, ctx.handle
        gx = gw = None
        if ctx.needs_input_grad[1] and grad_x is not None:
            gx, _ = backend.combine(grad_x.to(ctx.x_dtype).contiguous(), handle)
        if ctx.needs_input_grad[2] and grad_w is not None:
            gw, _ = backend.combine_weights(grad_w, handle)
        return None, gx, gw, None, None, None


class CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend, x, handle, async_op):
        y, event = backend.combine(x, handle, async_op)
        ctx.backend, ctx.handle, ctx.x_dtype = backend, handle, x.dtype
        return y, event

    @staticmethod
    def backward(ctx, grad_y, _):
        out = ctx.backend.dispatch(grad_y.to(ctx.x_dtype).contiguous(), None, ctx.handle.topk_idx, None,
                                   ctx.handle, False)
        return None, out.x, None, None
