"""DeepEP V1's internode calls (tag v1.2.1) over ep_plugin's internode backend.

DeepEP routes `Buffer.dispatch` / `combine` to `internode_dispatch` / `internode_combine` when the
group spans more than one RDMA rank (node), and `get_dispatch_layout` then also returns
`num_tokens_per_rdma_rank`. Here the nodes are ep_plugin's: `comm.ranks_per_node` of the Buffer's
`ep_config` (a number: virtual nodes of that many consecutive ranks; `auto`: counted from the hosts),
and the EPBuffers the Buffer builds pick the internode backend (`comm.backend: auto` or `nvshmem`)
for a group of several nodes. The calls themselves are the intranode mapping of buffer.py -- the
contract is the same for every backend -- with DeepEP's internode handle layout:

    handle = (is_token_in_rank, None, None, None, recv_rdma_rank_prefix_sum, None,
              recv_gbl_rank_prefix_sum, None, None, None)

- `recv_gbl_rank_prefix_sum` [W] int32 (handle[-4]): rows received from ranks 0..i, inclusive, as
  DeepEP's (rows arrive ordered by source rank, then position).
- `recv_rdma_rank_prefix_sum` [N] int32: tokens this rank's rail forwarded from nodes 0..s
  (inclusive), where the backend keeps them (the hierarchical backends), else None.
- The channel matrices, `recv_src_meta` and the send heads describe DeepEP's RDMA/NVLink ring
  buffers, which ep_plugin does not have: None. Cached dispatch and combine take the handle back.
"""
from __future__ import annotations

from typing import Optional

import torch

from .handle import DeepEPHandle


def num_nodes(buffer) -> int:
    """Nodes of the Buffer's group: from comm.ranks_per_node of its ep_config, or (auto) the hosts.
    The first call with `auto` asks every rank for its host (a collective: every rank makes it, as
    every rank calls get_dispatch_layout / dispatch); the answer is kept."""
    nodes = getattr(buffer, "_num_nodes", None)
    if nodes is None:
        from ..backends.hierarchical.nodes import resolve_ranks_per_node

        try:
            per_node, _ = resolve_ranks_per_node(buffer.group, buffer._cfg.comm.ranks_per_node)
        except ValueError:
            if buffer._cfg.comm.ranks_per_node != "auto":
                raise
            per_node = buffer.group_size  # hosts not laid out node by node: no internode backend; one "node"
        nodes = buffer._num_nodes = buffer.group_size // per_node
    return nodes


def _one_node(buffer, what: str) -> NotImplementedError:
    return NotImplementedError(
        f"ep_plugin.deep_ep: {what} is for a Buffer that spans nodes, but this Buffer's group is one node "
        f"({buffer.group_size} ranks, ep_config comm.ranks_per_node={buffer._cfg.comm.ranks_per_node}); set "
        "comm.ranks_per_node in ep_config to split it into nodes, or use the intranode calls (get_dispatch_layout "
        "returns num_tokens_per_rdma_rank=None on one node)")


def check_rdma_arg(buffer, num_tokens_per_rdma_rank) -> None:
    """num_tokens_per_rdma_rank is for a Buffer that spans nodes (DeepEP's get_dispatch_layout returns
    None on one node): refused on one node, before anything moves."""
    if num_tokens_per_rdma_rank is not None and num_nodes(buffer) <= 1:
        raise _one_node(buffer, "num_tokens_per_rdma_rank (internode dispatch)")


def tokens_per_node(buffer, is_token_in_rank: torch.Tensor) -> Optional[torch.Tensor]:
    """num_tokens_per_rdma_rank [N] int32: tokens that select a rank on node n (once per node), or
    None on one node (DeepEP's get_dispatch_layout returns None there too)."""
    N = num_nodes(buffer)
    if N <= 1:
        return None
    T, W = is_token_in_rank.shape
    return is_token_in_rank.view(T, N, W // N).any(2).sum(0, dtype=torch.int32)


class InternodeHandle(DeepEPHandle):
    """DeepEP's 10-tuple internode handle (module docstring), carrying what buffer.py's cached
    dispatch and combine read (`inner`, `num_rows`, `buffer`), as DeepEPHandle does."""

    def __new__(cls, intra: DeepEPHandle, rank: int, nodes: int):
        rank_prefix = intra[0]
        recv_gbl = rank_prefix[:, rank].contiguous() if rank_prefix is not None else None
        slot_valid = getattr(intra.inner.state, "slot_valid", None)  # the hierarchical backends' rail slots
        recv_rdma = None
        if slot_valid is not None and slot_valid.numel() % nodes == 0:
            recv_rdma = slot_valid.view(nodes, -1).sum(1).cumsum(0).to(torch.int32)
        self = tuple.__new__(cls, (intra[4], None, None, None, recv_rdma, None, recv_gbl, None, None, None))
        self.inner = intra.inner
        self.num_rows = intra.num_rows
        self.buffer = getattr(intra, "buffer", None)
        return self


def as_internode(buffer, handle: DeepEPHandle, num_tokens_per_rdma_rank) -> DeepEPHandle:
    """The handle of a fresh dispatch in DeepEP's internode layout when the Buffer spans nodes (or the
    caller passed num_tokens_per_rdma_rank), else unchanged."""
    if isinstance(handle, InternodeHandle):
        return handle
    if num_tokens_per_rdma_rank is None and num_nodes(buffer) <= 1:
        return handle
    return InternodeHandle(handle, buffer.rank, num_nodes(buffer))


def internode_dispatch(buffer, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                       is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                       expert_alignment: int = 1, config=None, previous_event=None, async_finish: bool = False,
                       allocate_on_comm_stream: bool = False):
    """DeepEP's Buffer.internode_dispatch: Buffer.dispatch with the internode handle (computing
    num_tokens_per_rdma_rank from is_token_in_rank when it is not given)."""
    if handle is None:
        if num_nodes(buffer) <= 1:
            raise _one_node(buffer, "internode_dispatch")
        if num_tokens_per_rdma_rank is None and is_token_in_rank is not None:
            num_tokens_per_rdma_rank = tokens_per_node(buffer, is_token_in_rank)
    return buffer.dispatch(x, handle=handle, num_tokens_per_rank=num_tokens_per_rank,
                           num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                           num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                           expert_alignment=expert_alignment, config=config, previous_event=previous_event,
                           async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)


def internode_combine(buffer, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                      async_finish: bool = False, allocate_on_comm_stream: bool = False):
    """DeepEP's Buffer.internode_combine: Buffer.combine (the handle carries the EPBuffer's)."""
    return buffer.combine(x, handle, topk_weights=topk_weights, bias=bias, config=config,
                          previous_event=previous_event, async_finish=async_finish,
                          allocate_on_comm_stream=allocate_on_comm_stream)
