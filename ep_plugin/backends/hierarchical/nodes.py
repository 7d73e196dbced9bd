"""Which ranks of a group form a node: comm.ranks_per_node, or counted from the hosts.

Nodes are contiguous runs of P ranks (rank g is on node g // P, local index g % P), as torchrun and
Slurm number them; a group whose hosts do not follow that pattern is refused with the reason, since
the kernels' forwarding assumes it.
"""
from __future__ import annotations

import socket
from typing import List, Optional, Tuple

import torch.distributed as dist

from ...config.schema import AUTO


def hosts_of(group) -> List[str]:
    """Every rank's host name (a collective over the group)."""
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return hosts


def ranks_per_node_of(hosts: List[str]) -> int:
    """P such that ranks [n*P, (n+1)*P) share host n, or ValueError saying why there is none."""
    W = len(hosts)
    P = hosts.count(hosts[0])
    if W % P or any(hosts[g] != hosts[(g // P) * P] for g in range(W)) or len(set(hosts)) != W // P:
        raise ValueError(
            f"the group's ranks are not laid out as contiguous, equal nodes (hosts by rank: {hosts}); the internode "
            "backend forwards within runs of comm.ranks_per_node ranks: launch ranks node by node, or set "
            "comm.ranks_per_node")
    return P


def resolve_ranks_per_node(group, setting, hosts: Optional[List[str]] = None) -> Tuple[int, str]:
    """(P, why) from comm.ranks_per_node: a number as given (it must divide the group), auto from the
    hosts (asked for when `hosts` is None: a collective)."""
    W = dist.get_world_size(group)
    if setting != AUTO:
        P = int(setting)
        if W % P:
            raise ValueError(f"comm.ranks_per_node={P} does not divide the group's {W} ranks")
        return P, f"comm.ranks_per_node: {P}"
    P = ranks_per_node_of(hosts if hosts is not None else hosts_of(group))
    return P, f"{P} ranks per host"


def node_groups(group, P: int):
    """(this rank's node group, its global ranks). Collective: every rank creates every node's group,
    in the same order, as torch.distributed.new_group requires."""
    W = dist.get_world_size(group)
    me = dist.get_rank(group)
    mine = None
    for n in range(W // P):
        ranks = [dist.get_global_rank(group, g) for g in range(n * P, (n + 1) * P)]
        pg = dist.new_group(ranks)
        if n == me // P:
            mine = (pg, ranks)
    return mine
