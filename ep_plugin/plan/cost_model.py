"""A cost model of internode high-throughput dispatch/combine (NVLink + RDMA forwarding), for the scale
that cannot be run here (docs/COST_MODEL.md).

The kernel shape it models is DeepEP's (and issue 12's): a token bound for another node crosses RDMA
once per destination node, to the GPU with the same local index, which forwards it over NVLink to
each destination GPU of that node; combine reduces inside the node first and sends one row per node
back. The RDMA and NVLink stages are pipelined, so a call takes as long as its slowest stage plus a
fixed term:

    t = max(t_rdma, t_nvlink, t_sms) + latency
    t_rdma   = T * remote_nodes_per_token * row_bytes / (nic_gbps / 8 * nic_efficiency)
    t_nvlink = T * ranks_per_token        * row_bytes / nvlink_gbps
    t_sms    = T * ranks_per_token        * row_bytes / (num_sms / 2 * sm_gbps)    (only if num_sms given)

per GPU, with T tokens per GPU. ``ranks_per_token`` / ``nodes_per_token`` are the expected number of
distinct GPUs / nodes a token reaches (its own included), ``remote_nodes_per_token`` the nodes other
than its own (``nodes_per_token * (N-1)/N`` for routing that treats nodes alike). They come from the
routing: exact for uniform random top-k (hypergeometric), sampled for group-limited top-k. Row bytes:
BF16 ``2H``; FP8 ``H + 4H/128`` (data + one float32 scale per 128 values, as DeepEP counts).

``nvlink_gbps`` is applied to the rows a GPU receives (DeepEP's "logical" NVLink bytes, which include
the 1/8 a forwarder keeps for itself), so it is the per-GPU figure an intranode kernel reaches on
those bytes (DeepEP: ~160 GB/s on H800, measured 153/158 GB/s). The RDMA bandwidth DeepEP reports
is also logical: ``T * nodes_per_token * row_bytes / t``, own node included; ``predict`` returns it.

Assumptions (named fields of :class:`Hardware`, not fitted to the figures it is compared with):
``nic_efficiency`` 0.9 (what a pipelined kernel keeps of a 400 Gb/s line rate after chunk flow
control, signalling and the tail), ``latency_us`` 20 (launch, the cross-node barriers at the start
and end of a call, filling the pipeline), ``sm_gbps`` 13 (GB/s one forwarding SM moves over NVLink:
DeepEP V1 reached 153 GB/s with 12 channels; ep_plugin's nvlink pull kernel ~320 GB/s with 24 SMs).
Not modelled: load imbalance between ranks (the slowest rank's share above the mean), NIC or switch
congestion, and the notify/layout step that precedes a non-cached dispatch.

``suggest()`` turns the model into the ``auto`` choices of the internode backend: SMs and QPs per peer.
CLI: ``python -m ep_plugin.plan.cost_model --nodes 2 4 8`` (``--deepep`` for the comparison table).
"""
from __future__ import annotations

import argparse
import functools
import math
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional, Sequence

import torch

FP8_SCALE_BLOCK = 128


@dataclass(frozen=True)
class Hardware:
    """Per-GPU bandwidths and the model's fixed terms."""

    nvlink_gbps: float = 478.0  # GB/s per GPU on the received (logical) rows; H200 (NV18)
    nic_gbps: float = 400.0  # Gb/s line rate of the GPU's NIC (CX7 400G: 50 GB/s)
    nic_efficiency: float = 0.9  # fraction of the line rate the RDMA stage keeps
    latency_us: float = 20.0  # fixed per call
    sm_gbps: float = 13.0  # GB/s one forwarding SM moves over NVLink (half the SMs forward)
    sm_count: int = 132  # SMs of the GPU (H100/H200/H800 SXM)

    @property
    def nic_gb_per_s(self) -> float:
        """Usable RDMA bandwidth, GB/s."""
        return self.nic_gbps / 8.0 * self.nic_efficiency


HARDWARE: Dict[str, Hardware] = {
    # DeepEP's test bed: H800 (~160 GB/s NVLink as DeepEP states it), one CX7 400 Gb/s IB NIC per GPU
    "h800-cx7": Hardware(nvlink_gbps=160.0),
    # H200 NV18 (478 GB/s: the NVLink floor benchmarks/NOTES_nvlink.md uses), one CX7 400 Gb/s per GPU
    "h200-cx7": Hardware(nvlink_gbps=478.0),
}

# DeepEP V1's published internode figures (docs/legacy.md of deepseek-ai/DeepEP): H800 + CX7 IB
# 400 Gb/s, 4096 tokens per GPU, hidden 7168, 256 experts, top-8, FP8 dispatch, BF16 combine, 24 SMs,
# group-limited routing with num_groups = nodes, group_topk = min(nodes, 4), group score = the max
# expert score of the group (tests/legacy/test_internode.py). RDMA "logical" GB/s: dispatch, combine.
DEEPEP_H800_CX7 = {16: (43.0, 43.0), 32: (58.0, 57.0), 64: (51.0, 50.0)}
DEEPEP_NUM_SMS = 24


# ---------------------------------------------------------------------------------------- routing

@dataclass(frozen=True)
class Fanout:
    """How far a token spreads: expected distinct nodes and GPUs it reaches (its own included)."""

    nodes_per_token: float
    ranks_per_token: float
    remote_nodes_per_token: float
    method: str  # "exact" or "sampled (n tokens)" or "measured"


def _distinct(domains: int, experts: int, topk: int) -> float:
    """E[distinct domains] when ``topk`` distinct experts are drawn uniformly from ``experts`` split
    evenly over ``domains`` (hypergeometric: 1 - P(a domain gets none))."""
    per = experts // domains
    return domains * (1.0 - math.comb(experts - per, topk) / math.comb(experts, topk))


def fanout_of(topk_idx: torch.Tensor, num_experts: int, num_nodes: int, gpus_per_node: int,
              src_node: Optional[torch.Tensor] = None) -> Fanout:
    """The fan-out of a routing ``topk_idx`` ``[T, K]`` (-1 = none). ``src_node`` ``[T]``: each
    token's own node (default: nodes are assumed alike, remote = nodes * (N-1)/N)."""
    world = num_nodes * gpus_per_node
    idx = topk_idx.long()
    valid = idx >= 0

    def distinct(dom: torch.Tensor, n: int) -> torch.Tensor:  # [T, n] bool: domain reached
        hit = torch.zeros(idx.shape[0], n + 1, dtype=torch.bool)  # column n collects the -1s
        hit.scatter_(1, torch.where(valid, dom, torch.full_like(dom, n)), True)
        return hit[:, :n]

    rank_hit = distinct(idx // (num_experts // world), world)
    node_hit = distinct(idx // (num_experts // num_nodes), num_nodes)
    nodes = node_hit.sum(1).double()
    if src_node is None:
        remote = nodes.mean().item() * (num_nodes - 1) / num_nodes
    else:
        own = node_hit.gather(1, src_node.long().view(-1, 1)).squeeze(1).double()
        remote = (nodes - own).mean().item()
    return Fanout(nodes.mean().item(), rank_hit.sum(1).double().mean().item(), remote, "measured")


@functools.lru_cache(maxsize=256)
def fanout(num_nodes: int, gpus_per_node: int, topk: int, num_experts: int,
           num_groups: Optional[int] = None, group_topk: Optional[int] = None,
           group_score: str = "sum", samples: int = 1 << 15, seed: int = 0) -> Fanout:
    """Fan-out of top-``topk`` routing over ``num_experts`` experts on ``num_nodes`` x ``gpus_per_node``
    GPUs, for scores i.i.d. over experts (a balanced router). Without a group limit (or with
    ``group_topk >= num_groups``) the choice is a uniform random ``topk``-subset: exact. Group-limited
    (each token keeps its best ``group_topk`` of ``num_groups`` contiguous groups, then its top-k in
    them): sampled with ``samples`` tokens, scores ``|N(0,1)| + 1`` as DeepEP's test draws them.
    ``group_score``: "sum" = the sum of a group's top ``topk // group_topk`` scores (DeepSeek-V3,
    ``ep_plugin.routing``), "max" = its best score (DeepEP's benchmark)."""
    world = num_nodes * gpus_per_node
    if num_experts % world:
        raise ValueError(f"num_experts ({num_experts}) must split evenly over {world} GPUs")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be in 1..num_experts, got {topk}")
    if (num_groups is None) != (group_topk is None):
        raise ValueError("num_groups and group_topk go together (group-limited routing needs both)")
    if num_groups is None or group_topk >= num_groups:
        nodes = _distinct(num_nodes, num_experts, topk)
        return Fanout(nodes, _distinct(world, num_experts, topk), nodes * (num_nodes - 1) / num_nodes, "exact")
    if num_experts % num_groups or group_topk < 1 or topk > group_topk * (num_experts // num_groups):
        raise ValueError(f"bad group-limited routing: {num_experts} experts, {num_groups} groups, "
                         f"group_topk {group_topk}, topk {topk}")
    if group_score not in ("sum", "max"):
        raise ValueError(f"group_score must be 'sum' or 'max', got {group_score!r}")
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(samples, num_experts, generator=gen).abs() + 1
    if group_score == "sum":
        from ..routing import group_limited_topk

        idx = group_limited_topk(scores, topk, num_groups, group_topk)[1]
    else:
        grouped = scores.view(samples, num_groups, -1)
        best = grouped.amax(-1).topk(group_topk, dim=-1).indices
        keep = torch.zeros(samples, num_groups, dtype=torch.bool).scatter_(1, best, True)
        masked = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(samples, num_experts)
        idx = masked.topk(topk, dim=-1).indices
    f = fanout_of(idx, num_experts, num_nodes, gpus_per_node)
    return replace(f, method=f"sampled ({samples} tokens)")


# ------------------------------------------------------------------------------------------ model

def row_bytes(hidden: int, dtype: str) -> float:
    """Bytes of one row on the wire: bf16 2H; fp8 H data + one float32 scale per 128 values."""
    if dtype == "bf16":
        return 2.0 * hidden
    if dtype == "fp8":
        return hidden * (1.0 + 4.0 / FP8_SCALE_BLOCK)
    raise ValueError(f"dtype must be 'bf16' or 'fp8', got {dtype!r}")


def predict(num_nodes: int, gpus_per_node: int, tokens: int, hidden: int, fan: Fanout,
            hw: Hardware = HARDWARE["h200-cx7"], dtype: str = "bf16",
            num_sms: Optional[int] = None) -> Dict[str, float]:
    """Time of one call (dispatch with ``dtype`` rows, or combine: BF16 rows the same way back) on the
    slowest stage. Returns microseconds, per-GPU bytes by domain and DeepEP's logical bandwidths."""
    if num_nodes < 2:
        raise ValueError(f"the internode model needs at least 2 nodes, got {num_nodes}")
    b = row_bytes(hidden, dtype)
    rdma_wire = tokens * fan.remote_nodes_per_token * b
    rdma_logical = tokens * fan.nodes_per_token * b
    nvlink = tokens * fan.ranks_per_token * b
    stages = {"rdma": rdma_wire / (hw.nic_gb_per_s * 1e3), "nvlink": nvlink / (hw.nvlink_gbps * 1e3)}
    if num_sms is not None:
        stages["sms"] = nvlink / (max(1, num_sms // 2) * hw.sm_gbps * 1e3)
    bottleneck = max(stages, key=stages.get)
    t_us = stages[bottleneck] + hw.latency_us
    return {
        "time_us": t_us,
        "bottleneck": bottleneck,
        **{f"{k}_us": v for k, v in stages.items()},
        "rdma_bytes": rdma_wire,
        "rdma_logical_bytes": rdma_logical,
        "nvlink_bytes": nvlink,
        "rdma_logical_gbps": rdma_logical / (t_us * 1e3),
        "nvlink_logical_gbps": nvlink / (t_us * 1e3),
    }


def suggest(num_nodes: int, gpus_per_node: int, tokens: int, hidden: int, topk: int, num_experts: int,
            num_groups: Optional[int] = None, group_topk: Optional[int] = None, nic_gbps: float = 400.0,
            nvlink_gbps: float = 478.0, *, dispatch_dtype: str = "bf16", nic_efficiency: float = 0.9,
            latency_us: float = 20.0, sm_gbps: float = 13.0, sm_count: int = 132,
            max_sms: Optional[int] = None, min_sms: int = 4, nic_ports: int = 2,
            group_score: str = "sum") -> Dict[str, object]:
    """The ``auto`` choices of the internode backend, and what the model predicts with them.

    ``num_sms``: the fewest (even) SMs whose forwarding half keeps up with the bottleneck the NIC and
    NVLink set (``nvlink_bytes / max(t_rdma, t_nvlink)`` GB/s at ``sm_gbps`` per forwarding SM),
    between ``min_sms`` and ``max_sms`` (default a quarter of ``sm_count``, as the nvlink planner):
    more SMs would not make the call faster, and every SM left goes to the experts.
    ``qps_per_peer``: one RC QP per CTA that may write to a peer, ``num_sms`` (NVSHMEM hands QPs to
    CTAs round-robin, ``NVSHMEM_IBGDA_RC_MAP_BY=cta``; DeepEP V1 likewise uses ``num_qps_per_rank =
    num_sms``), at least ``nic_ports``, so that a bonded dual-port NIC hashes QPs onto both ports.

    Returns ``num_sms``, ``qps_per_peer``, ``dispatch_us``, ``combine_us``, their bottlenecks, the
    fan-out, per-GPU bytes by domain, DeepEP-style logical RDMA bandwidths, and ``why`` (one line).
    """
    hw = Hardware(nvlink_gbps=nvlink_gbps, nic_gbps=nic_gbps, nic_efficiency=nic_efficiency,
                  latency_us=latency_us, sm_gbps=sm_gbps, sm_count=sm_count)
    fan = fanout(num_nodes, gpus_per_node, topk, num_experts, num_groups, group_topk, group_score)
    cap = max_sms if max_sms is not None else max(2, sm_count // 4)
    free = predict(num_nodes, gpus_per_node, tokens, hidden, fan, hw, dispatch_dtype)
    pace_us = max(free["rdma_us"], free["nvlink_us"])  # the stage the SMs have to keep up with
    need_gbps = free["nvlink_bytes"] / (pace_us * 1e3) if pace_us > 0 else 0.0
    channels = max(1, math.ceil(need_gbps / sm_gbps - 1e-9))
    num_sms = min(max(2 * channels, min_sms), cap)
    num_sms -= num_sms % 2
    qps = max(num_sms, nic_ports)
    d = predict(num_nodes, gpus_per_node, tokens, hidden, fan, hw, dispatch_dtype, num_sms)
    c = predict(num_nodes, gpus_per_node, tokens, hidden, fan, hw, "bf16", num_sms)
    limit = free["bottleneck"]
    why = (f"{num_nodes}x{gpus_per_node} GPUs, {fan.nodes_per_token:.2f} nodes / {fan.ranks_per_token:.2f} GPUs "
           f"per token: {limit}-bound ({'NIC ' + format(hw.nic_gb_per_s, '.1f') + ' GB/s' if limit == 'rdma' else 'NVLink ' + format(nvlink_gbps, '.0f') + ' GB/s'}); "
           f"the forwarders must move {need_gbps:.0f} GB/s -> {num_sms} SMs"
           + (f" (capped at {cap})" if 2 * channels > cap else "") + f", {qps} QPs per peer")
    return {
        "num_sms": num_sms,
        "qps_per_peer": qps,
        "dispatch_us": d["time_us"],
        "combine_us": c["time_us"],
        "dispatch_bottleneck": d["bottleneck"],
        "combine_bottleneck": c["bottleneck"],
        "nodes_per_token": fan.nodes_per_token,
        "ranks_per_token": fan.ranks_per_token,
        "remote_nodes_per_token": fan.remote_nodes_per_token,
        "bytes": {"dispatch": {k: d[k] for k in ("rdma_bytes", "rdma_logical_bytes", "nvlink_bytes")},
                  "combine": {k: c[k] for k in ("rdma_bytes", "rdma_logical_bytes", "nvlink_bytes")}},
        "rdma_logical_gbps": {"dispatch": d["rdma_logical_gbps"], "combine": c["rdma_logical_gbps"]},
        "hardware": asdict(hw),
        "why": why,
    }


# ------------------------------------------------------------------------------- DeepEP comparison

def deepep_comparison(hw: Hardware = HARDWARE["h800-cx7"],
                      num_sms: Optional[int] = DEEPEP_NUM_SMS) -> List[Dict[str, object]]:
    """The model against DeepEP V1's published H800 + CX7 figures, in DeepEP's setup (see
    ``DEEPEP_H800_CX7``; ``num_sms`` None = no SM limit): one row per EP size with predicted and
    published logical RDMA GB/s."""
    rows = []
    for ep, (pub_d, pub_c) in sorted(DEEPEP_H800_CX7.items()):
        nodes = ep // 8
        fan = fanout(nodes, 8, 8, 256, nodes, min(nodes, 4), "max")
        d = predict(nodes, 8, 4096, 7168, fan, hw, "fp8", num_sms)
        c = predict(nodes, 8, 4096, 7168, fan, hw, "bf16", num_sms)
        rows.append({
            "ep": ep, "nodes": nodes, "nodes_per_token": fan.nodes_per_token, "ranks_per_token": fan.ranks_per_token,
            "dispatch_us": d["time_us"], "combine_us": c["time_us"],
            "dispatch_bottleneck": d["bottleneck"], "combine_bottleneck": c["bottleneck"],
            "dispatch_gbps": d["rdma_logical_gbps"], "combine_gbps": c["rdma_logical_gbps"],
            "published_dispatch_gbps": pub_d, "published_combine_gbps": pub_c,
            "dispatch_error": d["rdma_logical_gbps"] / pub_d - 1, "combine_error": c["rdma_logical_gbps"] / pub_c - 1,
        })
    return rows


# ---------------------------------------------------------------------------------------------- CLI

def _table(rows: Sequence[Sequence[object]], head: Sequence[str]) -> str:
    cells = [[str(h) for h in head]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in cells[1:]])


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ep_plugin.plan.cost_model", description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8], help="node counts (default 2 4 8)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per GPU")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--group-topk", type=int, default=4,
                   help="group-limited routing with num_groups = nodes (0 = no group limit; default 4)")
    p.add_argument("--group-score", choices=("sum", "max"), default="sum")
    p.add_argument("--hardware", choices=sorted(HARDWARE), default="h200-cx7")
    p.add_argument("--nvlink-gbps", type=float, help="override the preset's NVLink GB/s")
    p.add_argument("--nic-gbps", type=float, help="override the preset's NIC Gb/s")
    p.add_argument("--dispatch-dtype", choices=("bf16", "fp8"), default="fp8")
    p.add_argument("--deepep", action="store_true", help="print the comparison with DeepEP's H800 figures")
    a = p.parse_args(argv)
    if a.deepep:
        rows = deepep_comparison()
        print("DeepEP V1, H800 + CX7 400 Gb/s, 4096 tokens, hidden 7168, top-8, groups = nodes, "
              f"group_topk = min(nodes, 4), {DEEPEP_NUM_SMS} SMs; RDMA logical GB/s, model vs published")
        print(_table([[r["ep"], f"{r['nodes_per_token']:.2f}", f"{r['ranks_per_token']:.2f}",
                       f"{r['dispatch_gbps']:.1f}", r["published_dispatch_gbps"], f"{r['dispatch_error']:+.0%}",
                       f"{r['combine_gbps']:.1f}", r["published_combine_gbps"], f"{r['combine_error']:+.0%}",
                       r["dispatch_bottleneck"]] for r in rows],
                     ["EP", "nodes/token", "GPUs/token", "dispatch", "published", "error", "combine",
                      "published", "error", "bound"]))
        return 0
    hw = HARDWARE[a.hardware]
    nvl = a.nvlink_gbps if a.nvlink_gbps is not None else hw.nvlink_gbps
    nic = a.nic_gbps if a.nic_gbps is not None else hw.nic_gbps
    out = []
    for n in a.nodes:
        groups = (n, min(a.group_topk, n)) if a.group_topk > 0 else (None, None)
        s = suggest(n, a.gpus_per_node, a.tokens, a.hidden, a.topk, a.experts, *groups, nic_gbps=nic,
                    nvlink_gbps=nvl, dispatch_dtype=a.dispatch_dtype, nic_efficiency=hw.nic_efficiency,
                    latency_us=hw.latency_us, sm_gbps=hw.sm_gbps, sm_count=hw.sm_count, group_score=a.group_score)
        out.append([n * a.gpus_per_node, f"{s['nodes_per_token']:.2f}", f"{s['ranks_per_token']:.2f}",
                    f"{s['dispatch_us']:.0f}", f"{s['combine_us']:.0f}",
                    f"{s['rdma_logical_gbps']['dispatch']:.1f}", f"{s['rdma_logical_gbps']['combine']:.1f}",
                    s["dispatch_bottleneck"], s["num_sms"], s["qps_per_peer"]])
    print(f"{a.hardware} (NVLink {nvl:.0f} GB/s, NIC {nic:.0f} Gb/s x {hw.nic_efficiency}), {a.tokens} tokens x "
          f"{a.hidden}, top-{a.topk} of {a.experts}, dispatch {a.dispatch_dtype}, combine bf16, "
          + (f"num_groups = nodes, group_topk = min({a.group_topk}, nodes)" if a.group_topk > 0 else "no group limit"))
    print(_table(out, ["EP", "nodes/token", "GPUs/token", "dispatch us", "combine us", "RDMA GB/s disp",
                       "RDMA GB/s comb", "bound", "num_sms", "qps_per_peer"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
