"""Rows a dispatch moves over each domain, per rank, from the routing alone (no library under test).

Hierarchical (comm.backend: nvshmem): a token of rank (n, l) crosses to each other node m it selects
an expert on once, to its rail peer (m, l) -- the RDMA domain -- and that forwarder sends it over
NVLink to every other rank of node m that owns one of its experts. Flat (one all-to-all): a token
goes straight to every rank it selects, so each remote rank is a separate RDMA row. Combine moves
the same rows back. Group-limited gating with num_groups equal to the node count bounds the nodes a
token reaches, which is what cuts the RDMA rows.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch


def _hit(idx: torch.Tensor, per: int, n: int) -> torch.Tensor:
    """[T, n] bool: the token selects an expert in domain d (domains of `per` experts)."""
    valid = idx >= 0
    out = torch.zeros(idx.shape[0], n + 1, dtype=torch.bool)
    out.scatter_(1, torch.where(valid, idx // per, n), True)
    return out[:, :n]


def hierarchical_rows(topk_idx: Sequence[torch.Tensor], num_experts: int, ranks_per_node: int) -> Dict[str, List[int]]:
    """Per rank (index = rank): rows it sends over RDMA (`rdma_sent`), receives over RDMA
    (`rdma_recv`), forwards over NVLink to other ranks of its node (`nvlink_sent`, rows it received
    over the rail or its own), keeps for its own experts (`local`); `flat_rdma_sent`: the RDMA rows of
    a flat all-to-all of the same routing. topk_idx: every rank's [T, K] routing (-1 = none)."""
    world = len(topk_idx)
    P = ranks_per_node
    N = world // P
    epr = num_experts // world
    out = {k: [0] * world for k in ("rdma_sent", "rdma_recv", "nvlink_sent", "local", "flat_rdma_sent")}
    for g, idx in enumerate(topk_idx):
        idx = idx.long().cpu()
        n, l = divmod(g, P)
        ranks = _hit(idx, epr, world)                 # [T, W]
        nodes = ranks.view(-1, N, P).any(2)           # [T, N]
        remote_nodes = nodes.clone()
        remote_nodes[:, n] = False
        out["rdma_sent"][g] += int(remote_nodes.sum())
        remote_ranks = ranks.clone()
        remote_ranks[:, n * P:(n + 1) * P] = False
        out["flat_rdma_sent"][g] += int(remote_ranks.sum())
        for m in range(N):
            f = m * P + l                             # the forwarder on node m
            if m != n:
                out["rdma_recv"][f] += int(remote_nodes[:, m].sum())
            in_m = ranks[:, m * P:(m + 1) * P]        # [T, P]: ranks of node m the token selects
            out["local"][f] += int(in_m[:, l].sum())
            others = in_m.clone()
            others[:, l] = False
            out["nvlink_sent"][f] += int(others.sum())
    return out
