"""The NVLink half of a hierarchical dispatch when a node has one rank: no exchange, only the
contract's packing (valid rows first, in slot order) of the rail's slots, with no host sync.

The slots already come in the contract's order (by source node = source rank, then position), so a
stable compaction (a prefix sum of the valid flags) is all it takes; combine gathers each slot's row
back.
"""
from __future__ import annotations

import torch

from .rows import gather_rows


class LocalNode:
    def __init__(self, local_experts: int):
        self.local_experts = local_experts
        self._const = {}

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
