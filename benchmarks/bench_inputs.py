"""Inputs of bench_dispatch's cases: routings (uniform, group-limited), BF16 rows and their FP8 form, and
the traffic each rank sends and receives, computed from the routing alone (no library under test);
the EPBuffer config the benchmarks share, and which low-latency engine a buffer ended up with.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

E, K, H = 256, 8, 7168
NUM_GROUPS, GROUP_TOPK = 4, 2
# group-limited routings: (num_groups, group_topk); "group_limited" is 4 groups / top-2, "group_limited8"
# DeepSeek-V3's 8 groups / top-4
GROUPINGS = {"group_limited": (NUM_GROUPS, GROUP_TOPK), "group_limited8": (8, 4)}
CASES = {"throughput": (4096, "uniform"), "group_limited": (4096, "group_limited"),
         "group_limited8": (4096, "group_limited8"), "latency": (128, "uniform")}
MAX_TOKENS = 4096  # comm.max_tokens_per_rank of every benchmark buffer


def ep_config(backend: str, num_sms: int, *, host_sync: bool = False, ll_max_tokens: Optional[int] = None,
              ll_output_buffers: int = 0) -> Dict:
    """The EPBuffer config of the benchmark rows; ll_max_tokens sets comm.low_latency.max_tokens_per_rank
    (the low-latency rows' buffers: the same config plus that key), ll_output_buffers its output_buffers."""
    comm: Dict = {"backend": backend, "max_tokens_per_rank": MAX_TOKENS, "timeout_s": 15.0, "num_sms": num_sms}
    if host_sync:
        comm["host_sync"] = True
    if ll_max_tokens is not None:
        comm["low_latency"] = {"max_tokens_per_rank": ll_max_tokens}
        if ll_output_buffers:
            comm["low_latency"]["output_buffers"] = ll_output_buffers
    return {"moe": {"num_experts": E, "topk": K}, "comm": comm}


def ll_engine(buf, handle=None) -> str:
    """Which low-latency engine served an EPBuffer (known after its first low-latency call): "nvshmem"
    (the kernels), "torch reference" (backends/torch_ref/low_latency.py: collectives and host syncs,
    hook() does the whole exchange), else what the handle or the buffer says, "unknown (...)" at worst.
    handle: a low_latency_dispatch handle, whose `backend` names the engine that made it (else the
    buffer's `low_latency_backend_name`)."""
    names = {"torch": "torch reference", "nvshmem": "nvshmem"}
    said = getattr(handle, "backend", None) or getattr(buf, "low_latency_backend_name", None)
    if isinstance(said, str) and said:
        return names.get(said, said)
    for v in vars(buf).values():  # no handle: an attribute of the buffer that looks like an engine
        cls = type(v)
        mod, name = cls.__module__ or "", cls.__name__
        if "low_latency" not in mod and "LowLatency" not in name:
            continue
        if "torch_ref" in mod or name.lower().startswith("torch"):
            return "torch reference"
        if "nvshmem" in mod or name.lower().startswith("nvshmem"):
            return "nvshmem"
        return f"unknown ({mod}.{name})"
    return "unknown (no engine attribute found on the EPBuffer)"


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
    idx = scores.topk(K, dim=1).indices if routing == "uniform" else group_limited_topk(scores, K, *GROUPINGS[routing])
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
    copies_send: List[int]          # low-latency copies (one per token and expert) this rank sends to each rank
    copies_recv: List[int]          # low-latency copies this rank receives from each rank
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
    owner = idx[idx >= 0] // (E // world)
    copies = torch.bincount(owner, minlength=world).to(send.dtype)
    counts = torch.stack([send, copies])  # [2, W]: rows and copies to each rank
    got = torch.empty_like(counts.t().contiguous())
    dist.all_to_all_single(got, counts.t().contiguous())  # the counts alone, independent of any library under test
    recv, copies_recv = got[:, 0], got[:, 1]
    return Inputs(case, T, routing, x, quantize_fp8(x), idx, w, in_rank, send.tolist(), recv.tolist(),
                  copies.tolist(), copies_recv.tolist())
