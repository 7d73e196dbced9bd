"""One NVSHMEM job per process, bootstrapped over torch.distributed (no MPI, no launcher changes).

Rank 0 of the group makes an NVSHMEM unique id, the group broadcasts it, every rank joins with its
GPU current. NVSHMEM allows one job per process, so every buffer that uses it must share the first
group's ranks. The job lives until the interpreter exits; `finalize` there is collective (NVSHMEM's
own barrier), so after a fault (a timeout a kernel recorded) it is skipped rather than risk hanging
on a dead peer.

Environment set before NVSHMEM starts, unless the user set it (docs/LOW_LATENCY.md lists them):
NVSHMEM_DISABLE_NVLS=1 always (NVLink multicast stays off), NVSHMEM_SYMMETRIC_SIZE to what the
first engine needs plus headroom, NVSHMEM_REMOTE_TRANSPORT=none when the whole group is one host
(no NIC is probed), NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY left to NVSHMEM. When the group spans hosts,
the RDMA knobs of `comm.rdma` (QPs per peer, traffic class, service level, IBGDA, NIC per GPU, GID)
are added by `rdma_env.rdma_environment` (docs/RDMA.md); on one host they are not, as no NIC is used
(virtual nodes from `comm.ranks_per_node` included: their "RDMA" half runs over NVSHMEM's P2P transport).
"""
from __future__ import annotations

import atexit
import logging
import os
import socket
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..._ext import get_c
from ...errors import BackendUnavailableError
from .rdma_env import check_local_ranks, rdma_environment, shadowed

logger = logging.getLogger("ep_plugin.nvshmem")

HEADROOM = 256 << 20  # symmetric heap beyond the first engine's need (NVSHMEM's own allocations, a second engine)

_job = {"ranks": None, "faulted": False}


def _group_ranks(group) -> List[int]:
    return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]


def _host_layout(group) -> Tuple[bool, int, int]:
    """(whether the group is one host, this rank's local rank: its position among the group's ranks
    on its host in group-rank order, the most ranks any host has). Collective over the group."""
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    rank = dist.get_rank(group)
    return len(set(hosts)) == 1, hosts[:rank].count(hosts[rank]), max(hosts.count(h) for h in hosts)


def environment(heap_bytes: int, one_host: bool, rdma_cfg: Any = None, local_rank: int = 0,
                world: int = 1, auto_qps: Optional[int] = None) -> dict:
    """The NVSHMEM settings this job starts with (user-set variables win, NVLS is always off).

    ``rdma_cfg`` (a ``comm.rdma`` section), ``local_rank`` and ``world``: across hosts, the RDMA
    knobs' variables for this rank (``rdma_env.rdma_environment``; ``auto_qps``: what
    ``qps_per_peer: auto`` resolves to, from the backend's plan). On one host no NIC is used
    (``NVSHMEM_REMOTE_TRANSPORT=none``), so they are not set."""
    env = {"NVSHMEM_DISABLE_NVLS": "1"}
    if "NVSHMEM_SYMMETRIC_SIZE" not in os.environ:
        env["NVSHMEM_SYMMETRIC_SIZE"] = str(int(heap_bytes) + HEADROOM)
    if one_host and "NVSHMEM_REMOTE_TRANSPORT" not in os.environ:
        env["NVSHMEM_REMOTE_TRANSPORT"] = "none"
    if not one_host and rdma_cfg is not None:
        env.update(rdma_environment(rdma_cfg, local_rank, world, auto_qps=auto_qps))
    return env


def join(group, heap_bytes: int, rdma_cfg: Any = None, *, auto_qps: Optional[int] = None) -> None:
    """Start NVSHMEM over `group` if this process has not yet (collective over the group).

    ``rdma_cfg``: the config's ``comm.rdma`` section (None: NVSHMEM's RDMA defaults), applied when the
    group spans hosts; ``auto_qps``: what its ``qps_per_peer: auto`` resolves to (the first buffer to
    start NVSHMEM decides: QPs are set once per process)."""
    C = get_c()
    if not getattr(C, "HAS_NVSHMEM", False):
        raise BackendUnavailableError("ep_plugin._C is built without NVSHMEM (pip install nvidia-nvshmem-cu13 "
                                      "or -cu12 matching torch's CUDA, then reinstall ep_plugin)")
    ranks = _group_ranks(group)
    if C.nvshmem_initialized():
        if ranks != _job["ranks"]:
            raise ValueError(f"NVSHMEM already runs over global ranks {_job['ranks']}; one NVSHMEM job per process, "
                             f"so a low-latency buffer on ranks {ranks} cannot join it")
        return
    one_host, local_rank, local_world = _host_layout(group)
    if not one_host:
        check_local_ranks(rdma_cfg, local_world)  # every rank raises alike: none waits on the others
    env = environment(heap_bytes, one_host, rdma_cfg, local_rank, len(ranks), auto_qps)
    if not one_host and rdma_cfg is not None:
        for var, (mine, user) in shadowed(rdma_cfg, local_rank, len(ranks), auto_qps=auto_qps).items():
            logger.info("ep_plugin.nvshmem: %s=%s from the environment wins over comm.rdma's %s", var, user, mine)
    os.environ.update(env)  # NVSHMEM_DISABLE_NVLS=1 included, whatever was set before
    torch.cuda.init()
    torch.cuda.current_device()  # the rank's GPU current, with a context, before NVSHMEM starts
    rank = dist.get_rank(group)
    uid = [C.nvshmem_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(uid, src=ranks[0], group=group)
    C.nvshmem_init(rank, len(ranks), uid[0])
    _job["ranks"] = ranks
    atexit.register(_finalize_at_exit)


def mark_fault() -> None:
    """A peer may be dead: leave NVSHMEM's collective teardown out."""
    _job["faulted"] = True


def faulted() -> bool:
    return _job["faulted"]


def _finalize_at_exit() -> None:
    C = get_c()
    if C.nvshmem_initialized() and not _job["faulted"]:
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - a broken context: skip the collective part
            return
        C.nvshmem_finalize()
