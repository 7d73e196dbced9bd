"""The NVSHMEM rail's ``auto`` choices: how many blocks (SMs) its kernels take and how many RC queue
pairs each peer gets, from the internode cost model (``ep_plugin.plan.cost_model.suggest``).

Across hosts the rail's traffic crosses the NIC: ``comm.num_sms: auto`` takes the fewest SMs that keep
up with the bottleneck the model predicts for this group (nodes x ranks per node, tokens, hidden,
top-k, group-limited routing), and ``comm.rdma.qps_per_peer: auto`` one QP per block that writes to a
peer (at least two, so a bonded dual-port NIC hashes them onto both ports). On one host (virtual nodes)
the rail runs over NVLink P2P, which the NIC model does not describe: ``auto`` then means
``AUTO_BLOCKS`` blocks and no QP setting (no NIC is used).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

AUTO = "auto"
AUTO_BLOCKS = 24  # comm.num_sms: auto on one host (as the nvlink backend's cap)
NIC_PORTS = 2     # QPs per peer at least: both ports of a dual-port NIC


@dataclass(frozen=True)
class RailPlan:
    num_blocks: int
    auto_qps: Optional[int]  # what comm.rdma.qps_per_peer: auto resolves to; None: NVSHMEM's default
    why: str


def plan_rail(cfg: Any, num_nodes: int, ranks_per_node: int, max_tokens: int, hidden: int, num_experts: int,
              fp8: bool, sm_count: int, one_host: bool) -> RailPlan:
    """The rail's blocks and QPs for a validated config ``cfg`` (its comm.num_sms, comm.rdma.qps_per_peer,
    moe.topk / num_groups / group_topk) on a GPU with ``sm_count`` SMs."""
    req = cfg.comm.num_sms
    if one_host:
        blocks = min(AUTO_BLOCKS if req == AUTO else int(req), sm_count)
        return RailPlan(blocks, None, f"one host: the rail runs over NVLink P2P with {blocks} blocks"
                                      f"{' (comm.num_sms: auto)' if req == AUTO else ''}; no NIC, no QP setting")
    from ...plan.cost_model import suggest  # pure Python; imported when a group spans hosts

    moe = cfg.moe
    s = suggest(num_nodes, ranks_per_node, max_tokens, hidden, moe.topk, num_experts, moe.num_groups,
                moe.group_topk, dispatch_dtype="fp8" if fp8 else "bf16", sm_count=sm_count, nic_ports=NIC_PORTS)
    blocks = min(int(s["num_sms"]) if req == AUTO else int(req), sm_count)
    qps = max(blocks, NIC_PORTS) if cfg.comm.rdma.qps_per_peer == AUTO else None
    why = (f"{s['why']}; rail blocks {blocks}" + (" (comm.num_sms: auto)" if req == AUTO else " (comm.num_sms)")
           + (f", qps_per_peer {qps} (auto: one per block)" if qps is not None else ", qps_per_peer as configured"))
    return RailPlan(blocks, qps, why)
