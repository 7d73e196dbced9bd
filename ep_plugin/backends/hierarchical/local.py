"""The NVLink half of a hierarchical dispatch when a node has one rank: no exchange, only the
contract's packing (valid rows first, in slot order) of the rail's slots, with no host sync.

The slots already come in the contract's order (by source node = source rank, then position), so a
stable compaction (a prefix sum of the valid flags) is all it takes; combine gathers each slot's row
back.
"""
from __future__ import annotations

import torch

from ..._ext import c_op
from ..._ext import raw_stream as _raw_stream
from .rows import gather_rows

_MAX_SLOTS, _MAX_EXPERTS, _MAX_NODES = 32768, 1024, 1024  # csrc/layout/local_pack.h
# The local_pack kernel matched the torch form on 4x H100 (2026-11-27, session 8 call 1) and cut the fresh 2x1
# dispatch's layout stage from ~400 us to ~50-80 (docs/INTERNODE.md); False routes GPUs through the torch form.
USE_LOCAL_PACK_KERNEL = True


class LocalNode:
    def __init__(self, local_experts: int):
        self.local_experts = local_experts
        self._const = {}

    def pack(self, topk_f: torch.Tensor, nodes: int, max_tokens: int):
        """topk_f [S, K] (S = nodes * max_tokens slots, node-local ids, -1: not here) -> (valid [S] bool,
        node_counts [nodes] int64: valid slots per source node, then order()'s four results). On the GPU
        one launch (csrc/layout/local_pack.cu) where the torch form is ~13 (the fresh 2x1 dispatch is
        host-bound, docs/INTERNODE.md); the same values either way."""
        S, K = topk_f.shape if topk_f.dim() == 2 else (topk_f.numel(), 1)
        kernel = c_op("local_pack") if USE_LOCAL_PACK_KERNEL and topk_f.is_cuda and _raw_stream is not None else None
        if (kernel is None or topk_f.dtype != torch.int64 or not topk_f.is_contiguous() or topk_f.dim() != 2
                or S != nodes * max_tokens or S > _MAX_SLOTS or nodes > _MAX_NODES
                or not 1 <= self.local_experts <= _MAX_EXPERTS or K < 1):
            return self.pack_torch(topk_f, nodes, max_tokens)
        dev = topk_f.device
        valid = torch.empty(S, dtype=torch.bool, device=dev)
        ints = torch.empty(2 * S + 1 + self.local_experts + nodes, dtype=torch.int64, device=dev)  # one allocation
        order, place = ints[:S], ints[S:2 * S]
        e = 2 * S + 1 + self.local_experts
        num, tpe, node_counts = ints[2 * S], ints[2 * S + 1:e], ints[e:]
        kernel(topk_f.data_ptr(), S, K, self.local_experts, max_tokens, valid.data_ptr(), order.data_ptr(),
               place.data_ptr(), num.data_ptr(), tpe.data_ptr(), node_counts.data_ptr(), _raw_stream(dev.index))
        return valid, node_counts, order, place, num, tpe

    def pack_torch(self, topk_f: torch.Tensor, nodes: int, max_tokens: int, before: bool = False):
        """pack() in torch ops (CPU, or no kernel); before=True: with order_torch, the launches of the form
        before the kernel (benchmarks/bench_internode.py --host-path before)."""
        valid = (topk_f >= 0).any(1)
        order, place, num, tpe = (self.order_torch if before else self.order)(topk_f, valid)
        return (valid, valid.view(nodes, max_tokens).sum(1), order, place, num, tpe)

    def order(self, topk_f: torch.Tensor, valid: torch.Tensor):
        """valid [S]: the slots that hold a token -> (order [S]: the slots, valid ones first, each group
        in slot order; place [S]: each slot's position in `order` (its inverse); num_recv [] int64;
        tokens_per_expert [E_l] int64).

        Nine launches (order_torch, the form before, took fourteen plus four views): on the GPU hosts
        measured, the fresh 2x1 dispatch is host-bound and each torch op costs ~20-40 us of its critical
        path (docs/INTERNODE.md, session 7). A valid slot goes to (valid slots up to it) - 1, an invalid
        one to num + slot - (valid slots up to it); the per-expert counts scatter a cached ones tensor
        at bucketize's column (0 for ids < 0, e + 1 for expert e)."""
        S = valid.numel()
        incl = valid.cumsum(0)  # int64: valid slots up to and including each
        num = incl[-1] if S else incl.new_zeros(())
        slot, ones, bounds = self._consts(S, topk_f.numel(), topk_f.dtype, topk_f.device)
        place = torch.where(valid, incl - 1, torch.sub(slot, incl).add_(num))
        order = torch.empty_like(place).scatter_(0, place, slot)
        col = torch.bucketize(topk_f, bounds, right=True).view(-1)
        per_expert = torch.zeros(self.local_experts + 1, dtype=torch.int64, device=topk_f.device)
        per_expert.scatter_add_(0, col, ones)
        return order, place, num, per_expert[1:]

    def _consts(self, slots: int, ids: int, dtype, device):
        """(arange(slots), ones(ids) int64, [0, 1, ..., E_l - 1]), made once per shape and device."""
        key = (slots, ids, dtype, device)
        c = self._const.get(key)
        if c is None:
            c = self._const[key] = (torch.arange(slots, device=device),
                                    torch.ones(ids, dtype=torch.int64, device=device),
                                    torch.arange(self.local_experts, dtype=dtype, device=device))
        return c

    def order_torch(self, topk_f: torch.Tensor, valid: torch.Tensor):
        """order() as it was before (the reference its tests compare against)."""
        v = valid.long()
        before = v.cumsum(0) - v  # valid slots ahead of each slot
        num = v.sum()
        slot = torch.arange(v.numel(), device=v.device)
        place = torch.where(valid, before, num + slot - before)  # invalid ones after all valid ones
        order = torch.empty_like(place).scatter_(0, place, slot)
        per_expert = torch.zeros(self.local_experts + 1, dtype=torch.int64, device=topk_f.device)
        per_expert.scatter_add_(0, (topk_f + 1).clamp_(min=0).view(-1), torch.ones_like(topk_f).view(-1))
        return order, place, num, per_expert[1:]

    @staticmethod
    def gather(t, order):
        return gather_rows(t, order)

    @staticmethod
    def slot_rows(place: torch.Tensor, rows: int) -> torch.Tensor:
        """[S] int64: the received row of each slot, clamped to the `rows` rows a dispatch returned;
        slots without a row point anywhere (combine sends them nowhere)."""
        if rows >= place.numel():  # the worst case: place already lies in [0, rows), no launch
            return place
        return place.clamp(max=max(rows - 1, 0))

    @staticmethod
    def to_slots(rows: torch.Tensor, slot_row: torch.Tensor, slots: int) -> torch.Tensor:
        """Combine's input back in slot order: a gather (a scatter is twice as slow on the GPU)."""
        if rows.shape[0] == 0:
            return rows.new_zeros((slots, rows.shape[1]))
        return gather_rows(rows, slot_row)
