"""The expert-grouped ("expanded") layout that framework experts take, built from a dispatch result.

``EPBuffer.dispatch`` delivers one row per (token, destination rank); a grouped GEMM wants one row per
(token, local expert), contiguous per expert. Both integrations go from one to the other the same way:
sort the received (row, top-k slot) routes by local expert, stably, so that inside an expert the rows
keep the received order (source rank, then position on the source) -- the order an all-to-all
dispatcher produces, so grouped-GEMM reductions see the rows in the same order as on those paths.
Routes with local expert -1 (another rank's expert, or the padding rows of a worst-case-sized
dispatch) sort last and are cut off.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertOrder:
    """Where each expert-grouped row comes from.

    routes: [N] int64 flat index ``row * K + slot`` into the [R, K] dispatch outputs.
    rows:   [N] int64 received row of each route (``routes // K``).
    """

    routes: torch.Tensor
    rows: torch.Tensor

    def __len__(self) -> int:
        return self.routes.numel()


def expert_order(recv_topk_idx: torch.Tensor, num_local_experts: int, num_routes: int) -> ExpertOrder:
    """Sort the routes of ``recv_topk_idx`` ([R, K] int64 local ids, -1 = not here) by local expert.

    ``num_routes``: how many routes are valid (the sum of the dispatch's ``tokens_per_expert``, a host
    int, so that cutting the invalid ones off needs no device sync).
    """
    K = recv_topk_idx.shape[1]
    flat = recv_topk_idx.reshape(-1)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, num_local_experts))
    routes = torch.sort(key, stable=True).indices[:num_routes]
    return ExpertOrder(routes=routes, rows=torch.div(routes, K, rounding_mode="floor"))


def expand(rows: torch.Tensor, order: ExpertOrder) -> torch.Tensor:
    """[R, ...] received rows -> [N, ...] expert-grouped rows (a row reaching two local experts twice)."""
    return rows.index_select(0, order.rows)


def expand_weights(topk_weights: torch.Tensor, order: ExpertOrder) -> torch.Tensor:
    """[R, K] dispatched weights -> [N] weight of each expert-grouped row."""
    return topk_weights.reshape(-1).index_select(0, order.routes)


def collapse(expanded: torch.Tensor, order: ExpertOrder, num_rows: int) -> torch.Tensor:
    """[N, H] expert-grouped rows -> [num_rows, H]: each received row gets the float32 sum of its
    local experts' rows (rows that reached no local expert are 0), in the input's dtype."""
    acc = torch.zeros((num_rows,) + tuple(expanded.shape[1:]), dtype=torch.float32, device=expanded.device)
    acc.index_add_(0, order.rows, expanded.float())
    return acc.to(expanded.dtype)


def collapse_weights(expanded: torch.Tensor, order: ExpertOrder, num_rows: int, top_k: int) -> torch.Tensor:
    """[N] per-row values -> [num_rows, top_k] float32 at their (row, slot) places, 0 elsewhere."""
    out = torch.zeros(num_rows * top_k, dtype=torch.float32, device=expanded.device)
    out.index_copy_(0, order.routes, expanded.reshape(-1).float())
    return out.view(num_rows, top_k)


__all__ = ["ExpertOrder", "expert_order", "expand", "expand_weights", "collapse", "collapse_weights"]
