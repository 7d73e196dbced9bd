"""The dispatch handle DeepEP callers hold: a 6-tuple (they index it, e.g. handle[0] is the rank
prefix matrix) that also carries ep_plugin's own Handle for combine and cached dispatches."""
from __future__ import annotations

from typing import Optional

import torch

from ..types import Handle

_tuple_new = tuple.__new__


class DeepEPHandle(tuple):
    """(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
    is_token_in_rank, send_head), as DeepEP's intranode dispatch returns it.

    rank_prefix_matrix [W, W] int32: entry [i][j] = tokens ranks 0..i send to rank j. recv_src_idx
    [R] int32: the source token of each received row, where the backend keeps it. The channel matrices
    and send_head describe DeepEP's ring buffers, which ep_plugin does not have: None.
    """

    inner: Handle
    num_rows: int  # rows the dispatch returned (exact, or num_worst_tokens)

    def __new__(cls, inner: Handle, rank_prefix_matrix: torch.Tensor, recv_src_idx: Optional[torch.Tensor],
                is_token_in_rank: torch.Tensor, num_rows: int):
        self = super().__new__(cls, (rank_prefix_matrix, None, None, recv_src_idx, is_token_in_rank, None))
        self.inner = inner
        self.num_rows = num_rows
        return self


class DeepEPLowLatencyHandle(tuple):
    """(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts), as DeepEP's
    low_latency_dispatch returns it, carrying ep_plugin's LowLatencyHandle for low_latency_combine.

    src_info [E_l, W*M] int32: the token index on its source rank of each received row.
    layout_range [E_l, W] int64: `(begin << 32) | count` of each source rank's rows per local expert.
    Both are valid once the dispatch has completed (its event waited on, or its hook run).
    """

    inner: object   # ep_plugin.types.LowLatencyHandle
    buffer: object  # the EPBuffer that made it

    def __new__(cls, inner, buffer, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int):
        self = _tuple_new(cls, (inner.src_info, inner.layout_range, num_max_dispatch_tokens_per_rank, hidden,
                                num_experts))
        self.inner = inner
        self.buffer = buffer
        return self


def low_latency_handle(inner, buffer, num_max_dispatch_tokens_per_rank: int, hidden: int,
                       num_experts: int) -> DeepEPLowLatencyHandle:
    """DeepEPLowLatencyHandle(inner, buffer, M, H, E) without the class call (a Python __new__ behind
    type.__call__ costs ~0.5 us of every dispatch's host time)."""
    h = _tuple_new(DeepEPLowLatencyHandle, (inner.src_info, inner.layout_range, num_max_dispatch_tokens_per_rank,
                                            hidden, num_experts))
    h.inner = inner
    h.buffer = buffer
    return h
