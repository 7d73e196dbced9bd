"""The two autograd functions of EPBuffer: dispatch's backward is a combine of the row gradients
(and a weight reduction for topk_weights); combine's backward is a dispatch on the saved layout.
Both layouts go through them: `alignment` None is rank-major, an int is expert-major (then the
handle carries the ExpertLayout and the backward uses the same layout)."""
from __future__ import annotations

import torch


class DispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend, x, topk_weights, topk_idx, handle, async_op, alignment=None):
        if alignment is None:
            out = backend.dispatch(x, None, topk_idx, topk_weights, handle, async_op)
        else:
            out = backend.dispatch_expert(x, None, topk_idx, topk_weights, handle, async_op, alignment)
        ctx.backend, ctx.handle, ctx.x_dtype = backend, out.handle, x.dtype
        return out.x, out.topk_weights, out

    @staticmethod
    def backward(ctx, grad_x, grad_w, _):
        backend, handle = ctx.backend, ctx.handle
        expert = handle.expert is not None
        gx = gw = None
        if ctx.needs_input_grad[1] and grad_x is not None:
            combine = backend.combine_expert if expert else backend.combine
            gx, _ = combine(grad_x.to(ctx.x_dtype).contiguous(), handle)
        if ctx.needs_input_grad[2] and grad_w is not None:
            combine_weights = backend.combine_weights_expert if expert else backend.combine_weights
            gw, _ = combine_weights(grad_w.contiguous(), handle)
        return None, gx, gw, None, None, None, None


class CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend, x, handle, async_op):
        combine = backend.combine_expert if handle.expert is not None else backend.combine
        y, event = combine(x, handle, async_op)
        ctx.backend, ctx.handle, ctx.x_dtype, ctx.rows = backend, handle, x.dtype, x.shape[0]
        return y, event

    @staticmethod
    def backward(ctx, grad_y, _):
        h, g = ctx.handle, grad_y.to(ctx.x_dtype).contiguous()
        if h.expert is not None:
            out = ctx.backend.dispatch_expert(g, None, h.topk_idx, None, h, False, h.expert.alignment)
        else:
            out = ctx.backend.dispatch(g, None, h.topk_idx, None, h, False)
        return None, out.x[:ctx.rows], None, None  # expert-major x may have been cut to the rows in use
