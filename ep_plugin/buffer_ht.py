"""EPBuffer's high-throughput calls: dispatch (fresh or cached, rank- or expert-major) and combine.

Each call passes its arguments through the buffer's checks (ep_plugin.checks, once per call form),
then goes to the backend, through autograd when an input requires grad (autograd.py)."""
from __future__ import annotations

from typing import Optional

import torch

from .autograd import CombineFn, DispatchFn
from .checks import need
from .expert_major import merge_repeats, repeats_share_grad
from .types import DispatchResult, ExpertDispatchResult, Handle, XInput


class HighThroughputCalls:
    """Mixed into EPBuffer: dispatch and combine (DESIGN.md, "The core contract")."""

    def dispatch(self, x: XInput, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, *, handle: Optional[Handle] = None,
                 async_op: Optional[bool] = None, layout: Optional[str] = None,
                 expert_alignment: int = 1):
        """Send each token to the ranks that own its experts. With `handle`, reuse that dispatch's
        layout (cached mode; topk_idx may be omitted). With async_op, outputs are valid once
        `result.event.current_stream_wait()` has been called.

        layout "rank" (the default): one row per (token, destination rank), ordered by source rank ->
        DispatchResult. layout "expert": one row per (token, local expert), grouped by expert, each
        segment padded to a multiple of `expert_alignment` -> ExpertDispatchResult (what a grouped
        GEMM takes; combine then takes rows in the same layout). A cached dispatch uses its handle's."""
        self._raise_pending()
        checks = self._checks
        given = None
        cached = handle is not None
        grad_on = torch.is_grad_enabled()
        if cached:
            data, scales = checks.rows(x)
            checks.handle(handle, num_tokens=data.shape[0])
            topk_idx = checks.cached(data, topk_idx, topk_weights, handle)
            if topk_weights is not None:
                if handle.given_topk_idx is not None:  # merged as the handle's ids
                    topk_weights = merge_repeats(handle.given_topk_idx, topk_weights)[1]
                elif (grad_on and topk_weights.requires_grad and handle.expert is not None
                      and checks.caps.merges_repeats):  # as below
                    topk_weights = repeats_share_grad(handle.topk_idx, topk_weights)
            alignment = checks.layout(layout, expert_alignment, handle)
        else:
            data, scales, alignment = checks.fresh(x, topk_idx, topk_weights, layout, expert_alignment)
            if alignment is not None:  # one row per (token, expert)
                if not checks.caps.merges_repeats:
                    given = topk_idx
                    topk_idx, topk_weights = merge_repeats(topk_idx, topk_weights)
                elif grad_on and topk_weights is not None and topk_weights.requires_grad:
                    # the backend merges on the device, unseen by autograd: each slot's gradient is its row's
                    topk_weights = repeats_share_grad(topk_idx, topk_weights)
        async_op = self.cfg.overlap.async_dispatch if async_op is None else bool(async_op)
        if grad_on and (data.requires_grad or (topk_weights is not None and topk_weights.requires_grad)):
            need(scales is None, TypeError, "FP8 dispatch is not differentiable: pass a BF16/float32 x for training")
            rx, rw, out = DispatchFn.apply(self._backend, data, topk_weights, topk_idx, handle, async_op, alignment)
        else:
            # torch.no_grad() only where an input would be recorded (FP8 scales that require grad): with
            # nothing requiring grad nothing is recorded, and its context costs a few us before notify
            if grad_on and scales is not None and scales.requires_grad:
                with torch.no_grad():
                    out = self._backend_dispatch(data, scales, topk_idx, topk_weights, handle, async_op, alignment)
            else:
                out = self._backend_dispatch(data, scales, topk_idx, topk_weights, handle, async_op, alignment)
            rx, rw = out.x, out.topk_weights
        h = out.handle
        h.buffer_id = self._id
        if given is not None and given is not topk_idx:
            h.given_topk_idx = given
        if h.exact and not cached:  # the host has waited already: surface a bad id now
            self._raise_pending()
        rows = (rx, out.scales) if scales is not None else rx
        if out.event is not None:
            out.event._check = self.check_finished
        if alignment is not None:
            return ExpertDispatchResult(x=rows, topk_weights=rw, handle=h, event=out.event)
        return DispatchResult(x=rows, topk_idx=out.topk_idx, topk_weights=rw, handle=h, event=out.event)

    def _backend_dispatch(self, data, scales, topk_idx, topk_weights, handle, async_op, alignment):
        if alignment is None:
            return self._backend.dispatch(data, scales, topk_idx, topk_weights, handle, async_op)
        return self._backend.dispatch_expert(data, scales, topk_idx, topk_weights, handle, async_op, alignment)

    def combine(self, x: torch.Tensor, handle: Handle, topk_weights: Optional[torch.Tensor] = None, *,
                async_op: Optional[bool] = None, weights_local_only: bool = True):
        """Sum, for each original token, the rows the ranks it reached send back: [T, H]. x is laid out
        as the handle's dispatch delivered it (rank-major [R, H] or expert-major [N, H]).

        With topk_weights ([R, K] float32, e.g. the dispatched weights after the experts changed
        them), also returns their per-token sum over ranks, [T, K]: (y, weights). Each (token, k) counts
        on the rank owning expert k only, unless weights_local_only=False (then every entry sent back is
        summed, as DeepEP's combine does). Async calls append the event: (y, event) or (y, weights, event).

        A rank-major x may also be cut to the valid rows of a worst-case-sized dispatch (at least
        sum(handle.recv_counts): that host count is read, waiting for its pinned copy only)."""
        self._raise_pending()
        expert = self._checks.combine(x, handle, topk_weights)
        is_async = self.cfg.overlap.async_dispatch if async_op is None else bool(async_op)
        if torch.is_grad_enabled() and x.requires_grad:
            y, event = CombineFn.apply(self._backend, x, handle, is_async)
        else:  # as in dispatch: no torch.no_grad() needed when nothing requires grad
            y, event = (self._backend.combine_expert if expert else self._backend.combine)(x, handle, is_async)
        out = (y,)
        if topk_weights is not None:
            if event is not None:  # the weights' exchange goes after the rows', as on one stream
                event.current_stream_wait()
                event = None
            with torch.no_grad():
                if expert:
                    need(weights_local_only, ValueError,
                         "weights_local_only=False takes rank-major weights; an expert-major row has one weight")
                    weights, event = self._backend.combine_weights_expert(topk_weights, handle, is_async)
                else:
                    weights, event = self._backend.combine_weights(topk_weights, handle, is_async,
                                                                   weights_local_only)
            out += (weights,)
        if event is not None:
            event._check = self.check_finished
        if is_async:
            out += (event,)
        return out if len(out) > 1 else y
