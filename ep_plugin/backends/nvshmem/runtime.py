"""One NVSHMEM job per process, bootstrapped over torch.distributed (no MPI, no launcher changes).

Rank 0 of the group makes an NVSHMEM unique id, the group broadcasts it, every rank joins with its
GPU current. NVSHMEM allows one job per process, so every buffer that uses it must share the first
group's ranks. The job lives until the interpreter exits; `finalize` there is collective (NVSHMEM's
own barrier), so after a fault (a timeout a kernel recorded) it is skipped rather than risk hanging
on a dead peer.

Environment set before NVSHMEM starts, unless the user set it (docs/LOW_LATENCY.md lists them):
NVSHMEM_DISABLE_NVLS=1 always (NVLink multicast stays off), NVSHMEM_SYMMETRIC_SIZE to what the
first engine needs plus headroom, NVSHMEM_REMOTE_TRANSPORT=none when the whole group is one host
(no NIC is probed), NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY left to NVSHMEM.
"""
from __future__ import annotations

import atexit
import os
import socket
from typing import List, Optional

import torch
import torch.distributed as dist

from ..._ext import get_c
from ...errors import BackendUnavailableError

HEADROOM = 256 << 20  # symmetric heap beyond the first engine's need (NVSHMEM's own allocations, a second engine)

_job = {"ranks": None, "faulted": False, "env": {}}


def _group_ranks(group) -> List[int]:
    return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))] if group is not None \
        else list(range(dist.get_world_size()))


def _one_host(group) -> bool:
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return len(set(hosts)) == 1


def environment(heap_bytes: int, one_host: bool) -> dict:
    """The NVSHMEM settings this job starts with (user-set variables win, NVLS is always off)."""
    env = {"NVSHMEM_DISABLE_NVLS": "1"}
    if "NVSHMEM_SYMMETRIC_SIZE" not in os.environ:
        env["NVSHMEM_SYMMETRIC_SIZE"] = str(int(heap_bytes) + HEADROOM)
    if one_host and "NVSHMEM_REMOTE_TRANSPORT" not in os.environ:
        env["NVSHMEM_REMOTE_TRANSPORT"] = "none"
    return env


def join(group, heap_bytes: int) -> None:
    """Start NVSHMEM over `group` if this process has not yet (collective over the group)."""
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
    one_host = _one_host(group)
    env = environment(heap_bytes, one_host)
    os.environ.update(env)
    if os.environ.get("NVSHMEM_DISABLE_NVLS") != "1":
        os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    torch.cuda.init()
    torch.cuda.current_device()  # the rank's GPU current, with a context, before NVSHMEM starts
    rank = dist.get_rank(group)
    uid = [C.nvshmem_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(uid, src=ranks[0], group=group)
    C.nvshmem_init(rank, len(ranks), uid[0])
    _job["ranks"] = ranks
    _job["env"] = env
    atexit.register(_finalize_at_exit)


def mark_fault() -> None:
    """A peer may be dead: leave NVSHMEM's collective teardown out."""
    _job["faulted"] = True


def faulted() -> bool:
    return _job["faulted"]


def job_ranks() -> Optional[List[int]]:
    return _job["ranks"]


def _finalize_at_exit() -> None:
    C = get_c()
    if C.nvshmem_initialized() and not _job["faulted"]:
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - a broken context: skip the collective part
            return
        C.nvshmem_finalize()
