"""`ep_plugin doctor --config FILE`: what a config's comm.rdma becomes -- the NVSHMEM variables the
internode backend sets before NVSHMEM starts (backends/nvshmem/rdma_env.py, docs/RDMA.md), per local
rank, and which of them this shell's environment would override.

Across hosts only: on one host (virtual nodes included) NVSHMEM runs with
NVSHMEM_REMOTE_TRANSPORT=none and none of these is read. `qps_per_peer: auto` is resolved by the
internode backend when it starts (one QP per rail block, backends/nvshmem/rail_plan.py); here it shows
as NVSHMEM's default.
"""
from __future__ import annotations

import os
from typing import List, Mapping, Optional

from .report import ERROR, OK, WARNING, Check


def rdma_config_check(path: str, local_ranks: int = 1, environ: Optional[Mapping[str, str]] = None) -> Check:
    """One Check: comm.rdma of the config at `path` as NVSHMEM variables for local ranks
    0..local_ranks-1 (the NIC can differ per rank), with the environment's overrides."""
    from ..backends.nvshmem.rdma_env import nic_for_rank, rdma_environment, rdma_settings, shadowed
    from ..config import load_config
    from ..errors import ConfigError

    environ = os.environ if environ is None else environ
    name = "comm.rdma"
    try:
        cfg = load_config(path)
    except (ConfigError, OSError) as e:
        return Check(name, ERROR, f"{path}: {str(e).splitlines()[0]}", fix="fix the config file")
    rdma = cfg.comm.rdma
    world = max(local_ranks, 1)
    details: List[str] = [f"config: {', '.join(f'{k}={v}' for k, v in _fields(rdma).items())}"]
    overridden = False
    try:
        for local_rank in range(world):
            wanted = rdma_settings(rdma, local_rank, world, environ=environ)
            applied = rdma_environment(rdma, local_rank, world, environ=environ)
            wins = shadowed(rdma, local_rank, world, environ=environ)
            overridden |= bool(wins)
            if local_rank > 0 and nic_for_rank(rdma.nic, local_rank) == nic_for_rank(rdma.nic, 0):
                continue  # same variables as local rank 0
            cells = []
            for var, value in wanted.items():
                if var in applied:
                    cells.append(f"{var}={value}")
                elif var in wins:
                    cells.append(f"{var}={wins[var][1]} (environment; config: {value})")
                else:
                    cells.append(f"{var}={environ.get(var, value)} (environment)")
            details.append(f"local rank {local_rank}: " + (" ".join(cells) if cells else "(nothing: NVSHMEM defaults)"))
    except (ValueError, TypeError) as e:
        return Check(name, ERROR, f"{path}: {e}", details=details, fix="give comm.rdma.nic an entry per local rank")
    summary = (f"{path}: {len(wanted)} NVSHMEM variable(s) across hosts"
               f"{'' if rdma.qps_per_peer != 'auto' else '; qps_per_peer auto: one QP per rail block, set at start'}")
    details.append("on one host (virtual nodes) NVSHMEM_REMOTE_TRANSPORT=none: none of these is read")
    if overridden:
        return Check(name, WARNING, summary + "; this environment overrides some of them", details=details,
                     fix="unset the NVSHMEM variables marked (environment) to let comm.rdma decide")
    return Check(name, OK, summary, details=details)


def _fields(rdma) -> dict:
    keys = ("qps_per_peer", "traffic_class", "service_level", "ibgda", "nic", "gid_index", "roce_version")
    return {k: getattr(rdma, k) for k in keys if hasattr(rdma, k)}
