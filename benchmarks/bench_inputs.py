"""Inputs of bench_dispatch's cases: routings (uniform, group-limited), BF16 rows and their FP8 form, and
the traffic each rank sends and receives, computed from the routing alone (no library under test).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

E, K, H = 256, 8, 7168
NUM_GROUPS, GROUP_TOPK = 4, 2
CASES = {"throughput": (4096, "uniform"), "group_limited": (4096, "group_limited"), "latency": (128, "uniform")}


def group_limited_topk(scores: torch.Tensor, k: int, num_groups: int, group_topk: int) -> torch.Tensor:
    """DeepSeek-V3 style: experts in num_groups contiguous groups; a group scores the sum of its top
    k/group_topk experts; each token keeps its best group_topk groups and picks its top-k inside them."""
    T, n = scores.shape
    grouped = scores.view(T, num_groups, n // num_groups)
    group_score = grouped.topk(k // group_topk, dim=-1).values.sum(-1)
    keep = torch.zeros(T, num_groups, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, group_score.topk(group_topk, dim=-1).indices, True)
    masked = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, n)
    return masked.topk(k, dim=-1).indices


def make_routing(T: int, routing: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    idx = scores.topk(K, dim=1).indices if routing == "uniform" else group_limited_topk(scores, K, NUM_GROUPS, GROUP_TOPK)
    return idx.to(torch.int64).contiguous(), torch.rand(T, K, generator=g)


def quantize_fp8(x):
    T = x.shape[0]
    s = x.float().abs().view(T, -1, 128).amax(-1).clamp(min=1e-4) / 448.0
    d = (x.float().view(T, -1, 128) / s.unsqueeze(-1)).view(T, -1).to(torch.float8_e4m3fn)
    return d, s.contiguous()


@dataclass
class Inputs:
    case: str
    T: int
    routing: str
    x: torch.Tensor
    xf8: tuple
    idx: torch.Tensor
    w: torch.Tensor
    in_rank: torch.Tensor           # [T, W] bool: the token reaches that rank
    send: List[int]                 # rows this rank sends to each rank (one per token and rank)
    recv: List[int]                 # rows this rank receives from each rank
    ours_x: Optional[torch.Tensor] = None  # our valid received rows, for DeepEP's comparison


def make_inputs(case: str, rank: int, world: int, device="cuda") -> Inputs:
    """The same inputs on every run: seeded by EP size, rank and case."""
    T, routing = CASES["throughput" if case == "sm_sweep" else case]
    seed = 1000 * world + 10 * rank + list(CASES).index(case if case in CASES else "throughput")
    idx, w = make_routing(T, routing, seed)
    idx, w = idx.to(device), w.to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, H, generator=gen, device=device, dtype=torch.bfloat16)
    in_rank = torch.zeros(T, world, dtype=torch.bool, device=device).scatter_(1, idx // (E // world), True)
    send = in_rank.sum(0)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)  # the counts alone, independent of any library under test
    return Inputs(case, T, routing, x, quantize_fp8(x), idx, w, in_rank, send.tolist(), recv.tolist())
