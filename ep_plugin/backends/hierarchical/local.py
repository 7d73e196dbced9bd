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

    def order(self, topk_f: torch.Tensor, valid: torch.Tensor):
        """valid [S]: the slots that hold a token -> (order [S]: the slots, valid ones first, each group
        in slot order; place [S]: each slot's position in `order` (its inverse); num_recv [] int64;
        tokens_per_expert [E_l] int64)."""
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
        return place.clamp(max=max(rows - 1, 0))

    @staticmethod
    def to_slots(rows: torch.Tensor, slot_row: torch.Tensor, slots: int) -> torch.Tensor:
        """Combine's input back in slot order: a gather (a scatter is twice as slow on the GPU)."""
        if rows.shape[0] == 0:
            return rows.new_zeros((slots, rows.shape[1]))
        return gather_rows(rows, slot_row)
