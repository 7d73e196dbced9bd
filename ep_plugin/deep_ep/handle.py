"""The dispatch handle DeepEP callers hold: a 6-tuple (they index it, e.g. handle[0] is the rank
prefix matrix) that also carries ep_plugin's own Handle for combine and cached dispatches."""
from __future__ import annotations

from typing import Optional

import torch

from ..types import Handle


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
