"""EPPluginExchange: the exchange AutoEP's MoE layer drives, over EPBuffer instead of DeepEP V2.

DeepSpeed's AutoEP layer (``deepspeed/module_inject/auto_ep_layer.py``, DeepSpeed 0.19.8) has one
route besides its collective all-to-all: it hands the tokens to an *exchange* (``DeepEPExchange``
in ``auto_ep_comm.py``) and wraps the exchange's calls in its own autograd functions
(``deepep_dispatch`` / ``deepep_combine``), which call, and only call:

    dispatch(tokens, topk_idx, topk_weights)      -> (rows, weights, handle)   expert-grouped rows
    replay_dispatch(tokens, topk_idx, weights, h) -> (rows, weights, h)        checkpoint recompute
    dispatch_with_handle(grad, h)                 -> rows                      combine's backward
    combine(rows, h)                              -> [T, H]
    combine_with_weight_grad(rows, h, wgrad)      -> ([T, H], [T, K])          dispatch's backward
    release() / destroy()                                                      engine.destroy()

plus the attributes ``last_handle`` and ``last_pending`` that those functions read and write. This
class keeps that contract over one EPBuffer, so every ep_plugin backend serves AutoEP: the torch
backend (gloo on CPU, NCCL), nvlink, nvshmem when built. None of these methods records autograd;
DeepSpeed's functions do.

Layout: the layer's grouped GEMM wants one row per (token, local expert), grouped by expert (what
AutoEP asks DeepEP for with ``do_expand=True``, ``expert_alignment=1``): EPBuffer's expert-major
dispatch (``layout="expert"``) delivers exactly that, and its combine sums each token's rows (on
nvlink inside the kernels, with no permute pass). The layout lives in EPBuffer's handle, so the
backward passes and a checkpoint recompute reuse it.

Dtypes: rows travel in the model's dtype when the backend moves it (torch: any), else as BF16 and are
cast back (nvlink with a float32 model; a warning says so once).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from ...buffer import EPBuffer
from ...config import EPConfig
from ...types import Handle
from ..buffer_cache import buffer_key, get_buffer
from .layer import _warn_cast, wire_dtype

logger = logging.getLogger("ep_plugin.deepspeed")


@dataclass
class AutoEPHandle:
    """One dispatch's layout, as AutoEP's layer reads it (``num_expanded_tokens``,
    ``psum_num_recv_tokens_per_expert``, ``topk_idx``, ``do_expand``) plus what EPBuffer needs back.
    Valid until the exchange is destroyed."""

    inner: Handle             # EPBuffer's (expert-major) handle: combine and cached dispatches
    num_expanded_tokens: int  # N: expert-grouped rows this rank received
    do_expand: bool = True    # rows are expert-grouped, one per (token, local expert)

    @property
    def psum_num_recv_tokens_per_expert(self) -> torch.Tensor:
        """[E_local] int64 inclusive prefix sum of the rows per local expert (DeepEP's form)."""
        return torch.cumsum(self.inner.num_tokens_per_expert, 0)

    @property
    def topk_idx(self) -> torch.Tensor:
        """[T, K] int64 global expert ids the dispatch was given (a recompute must route the same)."""
        return self.inner.topk_idx

    @property
    def num_recv_tokens_per_expert(self) -> torch.Tensor:
        """[E_local] int32 rows per local expert (the grouped GEMM's group sizes)."""
        return self.inner.num_tokens_per_expert.to(torch.int32)


class EPPluginExchange:
    """DeepEPExchange's contract over one EPBuffer; shared by the AutoEP layers that fit it.

    Build it with :func:`shared_exchange`. ``buffer`` is the EPBuffer of (group, cfg, hidden) from
    the integrations' cache, which other layers (and the other integrations) may share: ``destroy``
    lets go of it, ``ep_plugin.deepspeed.release_buffers()`` closes it.
    """

    def __init__(self, key: tuple, buffer: EPBuffer, top_k: int):
        self.key = key
        self.buffer = buffer
        self.num_experts = buffer.num_experts
        self.num_local_experts = buffer.num_local_experts
        self.top_k = top_k
        self.num_max_tokens_per_rank = buffer.cfg.comm.max_tokens_per_rank
        # Written by DeepSpeed's autograd functions (see auto_ep_comm.deepep_dispatch): the handle of
        # the latest dispatch, and the checkpoint-replay entry its combine takes over.
        self.last_handle: Optional[AutoEPHandle] = None
        self.last_pending = None
        self.holders = 0
        self.destroyed = False

    # ------------------------------------------------------------------ dtypes
    def _wire(self, dtype: torch.dtype, combine: bool = False) -> torch.dtype:
        caps = self.buffer.capabilities
        sent = wire_dtype(dtype, caps.row_dtypes)
        combined = wire_dtype(dtype, caps.combine_dtypes)
        if sent != dtype or combined != dtype:
            _warn_cast(self.buffer.backend_name, dtype, sent, combined)
        return combined if combine else sent

    def _live(self) -> EPBuffer:
        if self.destroyed:
            raise RuntimeError("this AutoEP ep_plugin exchange was destroyed (engine.destroy() or "
                               "destroy_exchanges); its layers build a new one on their next forward")
        return self.buffer

    # ------------------------------------------------------------------ forward
    def dispatch(self, tokens: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        """tokens [T, H], topk_idx [T, K] global ids, topk_weights [T, K] -> (rows [N, H] grouped by
        local expert, their weights [N] float32, AutoEPHandle)."""
        buf = self._live()
        sent = self._wire(tokens.dtype)
        with torch.no_grad():
            res = buf.dispatch(tokens.to(sent).contiguous(), topk_idx.to(torch.int64).contiguous(),
                               topk_weights.float().contiguous(), async_op=False, layout="expert")
        # The host counts are needed anyway: the layer's autograd checks gradient shapes against N.
        n = int(sum(res.tokens_per_expert))
        handle = AutoEPHandle(inner=res.handle, num_expanded_tokens=n)
        self.last_handle = handle
        return res.x[:n].to(tokens.dtype), res.topk_weights[:n], handle

    def replay_dispatch(self, tokens: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        handle: AutoEPHandle):
        """The forward dispatch again, on its own layout (activation-checkpoint recompute). The routing
        must be the forward's: checked on the device, as DeepSpeed does for DeepEP."""
        buf = self._live()
        recorded = handle.topk_idx
        if tuple(topk_idx.shape) != tuple(recorded.shape):
            raise RuntimeError(f"activation checkpointing recomputed an AutoEP dispatch with routing of shape "
                               f"{tuple(topk_idx.shape)}, but its forward routed {tuple(recorded.shape)}")
        torch._assert_async((topk_idx.to(recorded.dtype) == recorded).all(),
                            "activation checkpointing recomputed a different AutoEP routing")
        sent = self._wire(tokens.dtype)
        weights = None if topk_weights is None else topk_weights.float().contiguous()
        with torch.no_grad():
            res = buf.dispatch(tokens.to(sent).contiguous(), None, weights, handle=handle.inner, async_op=False)
        self.last_handle = handle
        n = handle.num_expanded_tokens
        return res.x[:n].to(tokens.dtype), None if weights is None else res.topk_weights[:n], handle

    def combine(self, rows: torch.Tensor, handle: AutoEPHandle) -> torch.Tensor:
        """[N, H] expert-grouped outputs (already weighted by the layer) -> [T, H] summed per token."""
        return self._combine(rows, handle, None)[0]

    # ------------------------------------------------------------------ backward
    def dispatch_with_handle(self, tokens: torch.Tensor, handle: AutoEPHandle) -> torch.Tensor:
        """Combine's backward: [T, H] gradient -> [N, H] expert-grouped rows, on the forward's layout."""
        buf = self._live()
        sent = self._wire(tokens.dtype)
        with torch.no_grad():
            res = buf.dispatch(tokens.to(sent).contiguous(), handle=handle.inner, async_op=False)
        return res.x[:handle.num_expanded_tokens].to(tokens.dtype)

    def combine_with_weight_grad(self, rows: torch.Tensor, handle: AutoEPHandle,
                                 weight_grads: Optional[torch.Tensor] = None):
        """Dispatch's backward: ([T, H] row gradients summed per token, [T, K] weight gradients or
        None). Each weight travelled to the one rank owning its expert, so its gradient is the sum of
        the (single) copy, which is what EPBuffer's weight reduction computes."""
        return self._combine(rows, handle, weight_grads)

    def _combine(self, rows: torch.Tensor, handle: AutoEPHandle, weight_grads: Optional[torch.Tensor]):
        buf = self._live()
        wire = self._wire(rows.dtype, combine=True)
        x = rows.to(wire).contiguous()
        with torch.no_grad():
            if weight_grads is None:
                return buf.combine(x, handle.inner, async_op=False).to(rows.dtype), None
            y, wsum = buf.combine(x, handle.inner, weight_grads.float().contiguous(), async_op=False)
        return y.to(rows.dtype), wsum

    # ------------------------------------------------------------------ lifetime
    def release(self) -> None:
        """One holder lets go; the last one destroys the exchange (every rank releases alike)."""
        self.holders = max(self.holders - 1, 0)
        if self.holders == 0:
            self.destroy()

    def destroy(self) -> None:
        """Drop the exchange and its handles' buffer reference. Local: the EPBuffer stays in the
        shared cache until ``ep_plugin.deepspeed.release_buffers()`` closes it (collectively)."""
        if self.destroyed:
            return
        self.destroyed = True
        self.holders = 0
        self.last_handle = self.last_pending = None
        if _EXCHANGES.get(self.key) is self:
            del _EXCHANGES[self.key]


# Live exchanges by everything two layers must agree on to share one.
_EXCHANGES: Dict[tuple, EPPluginExchange] = {}


def shared_exchange(scope: int, ep_group, cfg: EPConfig, hidden: int, top_k: int) -> EPPluginExchange:
    """The exchange of (AutoEP scope, EP group, layer config, hidden, top-k); built on first ask.

    ``scope`` is AutoEP's per-model sharing scope (``layer.deepep_scope``): layers of one model share
    an exchange, two models do not (their ``last_handle`` must not interleave). ``cfg`` is the layer's
    EPConfig (``moe.num_experts`` = the layer's experts). Building the EPBuffer is collective, and every
    rank runs the same layers in the same order, so a hit on one rank is a hit on all.
    """
    key = (scope, top_k) + buffer_key(ep_group, cfg, hidden)
    exchange = _EXCHANGES.get(key)
    if exchange is None:
        buffer = get_buffer(ep_group, cfg, hidden)
        exchange = EPPluginExchange(key, buffer, top_k)
        _EXCHANGES[key] = exchange
        logger.info("AutoEP ep_plugin exchange: backend=%s hidden=%d experts=%d top_k=%d max_tokens_per_rank=%d",
                    buffer.backend_name, hidden, buffer.num_experts, top_k, exchange.num_max_tokens_per_rank)
    exchange.holders += 1
    return exchange


def live_exchanges() -> list:
    """The exchanges not yet destroyed, in the order they were built."""
    return list(_EXCHANGES.values())


__all__ = ["AutoEPHandle", "EPPluginExchange", "shared_exchange", "live_exchanges"]
