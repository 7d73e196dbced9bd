"""TorchRail: the reference of the internode half of a hierarchical dispatch/combine (the "rail").

W ranks form N = W / P nodes of P ranks; rank g = n*P + l. A rank's rail peers are the ranks with
its local index l on every node (itself included). Node m owns experts [m*EN, (m+1)*EN), EN = E / N.

dispatch(x, scales, topk_idx, topk_weights) -> (xf, sf, topk_f, wf), each with N*M slots
(M = max_tokens): slot s*M + t holds token t of rail peer (s, l) when that token selects an expert
on this rank's node n; then topk_f holds its ids on node n made node-local (id - n*EN), -1 for the
others, and wf the matching weights (0 elsewhere). Every other slot has topk_f all -1 and wf 0; its
xf/sf rows are undefined. Ids outside [-1, E) count as -1 (and are reported by take_bad_expert_ids).

combine(y_f, slot_valid, topk_idx, T, y_rows=None) -> y [T, H] bf16: the forwarder (m, l) sends back the
row of each slot it received (slot_valid), y_f[i] for slot i, or y_f[y_rows[i]] where y_rows (int64
[N*M]) is given; y[t] is the float32 sum, over the nodes m that token t selected (ascending m), of
forwarder m's row for it, rounded once to bf16; 0 for a token that selected nothing.

combine_targets(pull=False) -> None: this rail has no memory a caller could write the rows into (the NVSHMEM
rail's combine_targets / combine_placed). combine(..., pull=True): the NVSHMEM rail's pulled form (the origin
reads the forwarders' rows instead of receiving them); the result is defined to be the same, and here the
exchange is the same either way (can_pull is True, so the hierarchical backend's pulled path runs on CPU).

Rows travel as bytes in one all_to_all_single over the whole group (M rows to each rail peer, none
to anyone else), so it runs on gloo and NCCL alike. The NVSHMEM kernels (backends/nvshmem/rail.py)
must equal it bit for bit.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist


def node_hits(topk_idx: torch.Tensor, num_experts: int, num_nodes: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(valid [T, K] bool: id in [0, E), hit [T, N] bool: the token selects an expert on node m)."""
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    node = torch.where(valid, topk_idx // (num_experts // num_nodes), num_nodes)  # N = "nowhere"
    hit = torch.zeros((topk_idx.shape[0], num_nodes + 1), dtype=torch.bool, device=topk_idx.device)
    hit.scatter_(1, node, True)
    return valid, hit[:, :num_nodes]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).view(torch.uint8)


class TorchRail:
    name = "torch"

    def __init__(self, group, cfg, hidden: int, num_experts: int, ranks_per_node: int, max_tokens: int,
                 fp8: bool):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.world % ranks_per_node:
            raise ValueError(f"comm.ranks_per_node={ranks_per_node} does not divide the group's {self.world} ranks")
        self.P = ranks_per_node
        self.N = self.world // ranks_per_node
        if num_experts % self.N:
            raise ValueError(f"{num_experts} experts do not split evenly over {self.N} nodes")
        self.node, self.local = divmod(self.rank, self.P)
        self.hidden = hidden
        self.num_experts = num_experts
        self.EN = num_experts // self.N
        self.M = max_tokens
        self.fp8 = fp8
        self._bad = False
        # the group ranks this rank exchanges with, by node
        self.peers = [m * self.P + self.local for m in range(self.N)]

    def _exchange(self, blocks: torch.Tensor) -> torch.Tensor:
        """blocks [N, M, B] uint8 (block m for rail peer m) -> [N, M, B] (block s from rail peer s)."""
        rows = blocks.shape[1]
        splits = [0] * self.world
        for p in self.peers:
            splits[p] = rows
        out = torch.empty_like(blocks)
        dist.all_to_all_single(out.view(-1, blocks.shape[2]), blocks.reshape(-1, blocks.shape[2]),
                               output_split_sizes=splits, input_split_sizes=splits, group=self.group)
        return out

    def dispatch(self, x: torch.Tensor, scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                 topk_weights: Optional[torch.Tensor]):
        T, K = topk_idx.shape
        N, M, dev = self.N, self.M, topk_idx.device
        if T > M:
            raise ValueError(f"{T} tokens exceed the rail's max_tokens={M}")
        valid, hit = node_hits(topk_idx, self.num_experts, N)
        self._bad |= bool(((topk_idx < -1) | (topk_idx >= self.num_experts)).any())
        node_of = torch.where(valid, topk_idx // self.EN, -1)
        # per destination node m: ids on m made m-local, -1 elsewhere; slots past T are -1
        m_ids = torch.arange(N, device=dev).view(N, 1, 1)
        on = valid.unsqueeze(0) & (node_of.unsqueeze(0) == m_ids)                  # [N, T, K]
        ids = torch.full((N, M, K), -1, dtype=torch.int64, device=dev)
        ids[:, :T] = torch.where(on, topk_idx.unsqueeze(0) - m_ids * self.EN, -1)
        parts = [_bytes(ids.view(N * M, K))]
        if topk_weights is not None:
            w = torch.zeros((N, M, K), dtype=torch.float32, device=dev)
            w[:, :T] = torch.where(on, topk_weights.float().unsqueeze(0), 0.0)
            parts.append(_bytes(w.view(N * M, K)))
        rows = torch.zeros((M, x.shape[1]), dtype=x.dtype, device=dev)
        rows[:T] = x
        parts.append(_bytes(rows).unsqueeze(0).expand(N, M, -1).reshape(N * M, -1))
        if scales is not None:
            s = torch.zeros((M, scales.shape[1]), dtype=torch.float32, device=dev)
            s[:T] = scales
            parts.append(_bytes(s).unsqueeze(0).expand(N, M, -1).reshape(N * M, -1))
        widths = [p.shape[1] for p in parts]
        got = self._exchange(torch.cat(parts, 1).view(N, M, -1)).view(N * M, -1)
        outs, at = [], 0
        for wdt in widths:
            outs.append(got[:, at:at + wdt].contiguous())
            at += wdt
        topk_f = outs.pop(0).view(torch.int64)
        wf = outs.pop(0).view(torch.float32) if topk_weights is not None else None
        xf = outs.pop(0).view(x.dtype)
        sf = outs.pop(0).view(torch.float32) if scales is not None else None
        return xf, sf, topk_f, wf

    can_pull = True

    def combine(self, y_f: torch.Tensor, slot_valid: torch.Tensor, topk_idx: torch.Tensor,
                num_tokens: int, y_rows: Optional[torch.Tensor] = None, pull: bool = False) -> torch.Tensor:
        N, M, H = self.N, self.M, y_f.shape[1]
        if y_rows is not None:
            y_f = y_f.index_select(0, y_rows)
        send = torch.where(slot_valid.bool().view(N * M, 1), y_f, 0).to(torch.bfloat16)
        back = self._exchange(_bytes(send).view(N, M, -1)).view(N, M, -1).view(torch.bfloat16)
        T = num_tokens
        _, hit = node_hits(topk_idx, self.num_experts, N)
        acc = torch.zeros((T, H), dtype=torch.float32, device=y_f.device)
        for m in range(N):  # ascending node: the order the kernels sum in
            acc = torch.where(hit[:, m:m + 1], acc + back[m, :T].float(), acc)
        return acc.to(torch.bfloat16)

    def combine_targets(self, pull: bool = False) -> None:
        return None

    # the engine interface the NVSHMEM rail shares
    def take_bad_expert_ids(self) -> bool:
        bad, self._bad = self._bad, False
        return bad

    def check(self) -> None:
        if self.take_bad_expert_ids():
            raise ValueError(f"topk_idx values must lie in [-1, {self.num_experts}); ids outside were treated as "
                             "routed nowhere")

    def set_mask(self, ranks) -> None:
        raise NotImplementedError("the torch rail has no mask: its collectives need every rank")

    def close(self) -> None:
        pass

