"""Reference backend: torch.distributed all-to-all on any process group (gloo on CPU, NCCL on GPU).

Each direction is one all-to-all of packed byte rows, one copy of a token per destination rank.
Rows travel as raw bytes, so every dtype (float32, bf16, float8) moves unchanged on every
process-group backend, and a token's data, scales, local expert ids and weights go in one message.
The exchanges run on a process group of the backend's own, each within comm.timeout_s or an
EPTimeoutError naming the ranks that did not arrive (deadline.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence

import torch

from ...layout import dispatch_layout
from ...types import BackendState, DispatchOutput, EPEvent, Handle, counts_from_lists
from ..base import Backend
from .deadline import BoundedGroup


@dataclass
class TorchState(BackendState):
    send_idx: torch.Tensor  # token index of every row sent, ordered by destination rank then position


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [N, bytes per row] uint8 view (t must be contiguous)."""
    if t.numel() == 0:  # no rows (or none wide): an empty tensor's strides may not allow the view
        return torch.empty((t.shape[0], math.prod(t.shape[1:]) * t.element_size()), dtype=torch.uint8, device=t.device)
    return t.reshape(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


def _pack(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([_as_bytes(p) for p in parts], dim=1) if len(parts) > 1 else _as_bytes(parts[0])


def _unpack(buf: torch.Tensor, likes: Sequence[tuple]) -> List[torch.Tensor]:
    """Split packed rows back into tensors of the given (trailing shape, dtype)."""
    out, off = [], 0
    for shape, dtype in likes:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        # A fresh [rows, n] copy: a slice of the packed rows can keep the packed width as its stride,
        # or an odd storage offset (one row, or none, counts as contiguous), which view(dtype) refuses.
        part = buf.new_empty((buf.shape[0], n))
        part.copy_(buf[:, off:off + n])
        out.append(part.view(dtype).reshape(buf.shape[0], *shape))
        off += n
    return out


def all_to_all_rows(group: BoundedGroup, rows: torch.Tensor, out_rows: int, out_splits: List[int],
                    in_splits: List[int], async_op: bool):
    """Exchange byte rows with deadline waits; returns (received rows, work or None)."""
    out = rows.new_empty((out_rows, rows.shape[1]))
    work = group.all_to_all(out, rows, out_splits, in_splits)
    if async_op:
        return out, work
    if rows.is_cuda:  # the stream waits for it; the host checks its deadline later, without blocking
        group.defer(work)
    else:
        work.wait()
    return out, None


def combine_rows(group: BoundedGroup, x: torch.Tensor, handle: Handle, async_op: bool = False):
    """Send each received row back to its source and sum per token there (float32 accumulation).
    Works for rows of any width (the weights' sum too)."""
    num_sent = sum(handle.send_counts)
    back, work = all_to_all_rows(group, _as_bytes(x.contiguous()), num_sent, handle.send_counts,
                                 handle.recv_counts, async_op)
    y = torch.empty((handle.num_tokens,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)

    def finish():
        rows = back.view(x.dtype).reshape((num_sent,) + tuple(x.shape[1:]))
        acc = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
        acc.index_add_(0, handle.state.send_idx, rows.float())
        y.copy_(acc)

    if work is None:
        finish()
        return y, None
    return y, EPEvent([work], on_complete=finish)


class TorchBackend(Backend):
    """Construction is collective over the group's members: it builds the backend's own group."""

    name = "torch"

    def __init__(self, group, cfg, hidden: int, num_experts: int):
        super().__init__(group, cfg, hidden, num_experts)
        self._comm = BoundedGroup(group, cfg.comm.timeout_s)

    def _layout(self, topk_idx: torch.Tensor) -> Handle:
        W, epr = self.world, self.experts_per_rank
        tokens_per_rank, tokens_per_expert, in_rank = dispatch_layout(topk_idx, self.num_experts, W)
        counts = torch.cat([tokens_per_rank.view(W, 1), tokens_per_expert.view(W, epr)], 1).long()
        recv = torch.empty_like(counts)
        self._comm.all_to_all(recv, counts).wait()
        send_counts = tokens_per_rank.tolist()
        recv_host = recv.tolist()
        recv_counts = [row[0] for row in recv_host]
        per_expert = [sum(row[1 + e] for row in recv_host) for e in range(epr)]
        return Handle(backend=self.name, num_tokens=topk_idx.shape[0], num_recv=sum(recv_counts),
                      num_experts=self.num_experts, is_token_in_rank=in_rank, topk_idx=topk_idx,
                      recv_topk_idx=None, num_recv_device=recv[:, 0].sum(),
                      num_tokens_per_expert=recv[:, 1:].sum(0),
                      counts=counts_from_lists(send_counts, recv_counts, per_expert),
                      state=TorchState(send_idx=in_rank.t().nonzero()[:, 1]))

    def dispatch(self, x, scales, topk_idx, topk_weights, handle=None, async_op=False):
        self._comm.arrive("dispatch")
        fresh = handle is None
        if fresh:
            handle = self._layout(topk_idx)
        send_idx = handle.state.send_idx
        parts = [x.index_select(0, send_idx)]
        likes = [((x.shape[1],), x.dtype)]
        if scales is not None:
            parts.append(scales.index_select(0, send_idx))
            likes.append(((scales.shape[1],), scales.dtype))
        K = handle.topk_idx.shape[1]
        if fresh or topk_weights is not None:
            # Local expert ids as the receiver sees them; -1 for experts on other ranks.
            dest = torch.repeat_interleave(torch.arange(self.world, device=send_idx.device),
                                           torch.tensor(handle.send_counts, device=send_idx.device))
            sent = handle.topk_idx.index_select(0, send_idx)
            local = sent - (dest * self.experts_per_rank).unsqueeze(1)
            mine = (sent >= 0) & (local >= 0) & (local < self.experts_per_rank)
        if fresh:
            parts.append(torch.where(mine, local, -1))
            likes.append(((K,), torch.int64))
        if topk_weights is not None:
            w = topk_weights.index_select(0, send_idx).float()
            parts.append(torch.where(mine, w, 0.0))
            likes.append(((K,), torch.float32))

        recv, work = all_to_all_rows(self._comm, _pack(parts), handle.num_recv, handle.recv_counts,
                                     handle.send_counts, async_op)
        out_x = x.new_empty((handle.num_recv, x.shape[1]))
        out_scales = scales.new_empty((handle.num_recv, scales.shape[1])) if scales is not None else None
        out_w = torch.empty((handle.num_recv, K), dtype=torch.float32, device=x.device) if topk_weights is not None else None
        if fresh:
            handle.recv_topk_idx = torch.empty((handle.num_recv, K), dtype=torch.int64, device=x.device)

        def finish():
            got = iter(_unpack(recv, likes))
            out_x.copy_(next(got))
            if out_scales is not None:
                out_scales.copy_(next(got))
            if fresh:
                handle.recv_topk_idx.copy_(next(got))
            if out_w is not None:
                out_w.copy_(next(got))

        event = None
        if work is None:
            finish()
        else:
            event = EPEvent([work], on_complete=finish)
        return DispatchOutput(x=out_x, scales=out_scales, topk_idx=handle.recv_topk_idx, topk_weights=out_w,
                              handle=handle, event=event)

    def combine(self, x, handle, async_op=False):
        self._comm.arrive("combine")
        return combine_rows(self._comm, x, handle, async_op)

    def combine_weights(self, weights, handle, async_op=False, local_only=True):
        self._comm.arrive("combine of the weights")
        w = weights.float()
        local = (torch.where(handle.recv_topk_idx >= 0, w, 0.0) if local_only else w).contiguous()
        return combine_rows(self._comm, local, handle, async_op)

    def check(self) -> None:
        if self._comm.failed is not None:
            raise self._comm.failed
        self._comm.poll_pending(block=False)

    def wait_pending(self) -> None:
        self._comm.poll_pending(block=True)

    def close(self) -> None:
        self._comm.close()
