"""``comm.rdma`` -> NVSHMEM's environment: the RDMA knobs, set before NVSHMEM starts (docs/RDMA.md).

A pure function of the config section, this rank's local rank and the group size: nothing here
touches ``os.environ`` or a NIC. ``runtime.environment`` merges the result into the job's settings
when the group spans hosts (on one host NVSHMEM runs with ``NVSHMEM_REMOTE_TRANSPORT=none`` and no
NIC is opened, so none of these would be read).

Variables (NVSHMEM environment reference, https://docs.nvidia.com/nvshmem/api/gen/env.html; names
checked against the transports of the nvidia-nvshmem-cu13 3.8 wheel):

knob            variable                        what NVSHMEM does with it
--------------  ------------------------------  ----------------------------------------------------
qps_per_peer    NVSHMEM_IBGDA_NUM_RC_PER_PE     RC QPs per peer PE of the IBGDA transport (default 2);
                                                QPs are taken round-robin by CTA (IBGDA_RC_MAP_BY=cta)
                NVSHMEM_IB_NUM_RC_PER_DEVICE    default RC QPs to each peer of the CPU-proxy IB
                                                transports (ibrc, ibdevx; default 1)
traffic_class   NVSHMEM_IB_TRAFFIC_CLASS        traffic class of RoCE packets (default 0)
service_level   NVSHMEM_IB_SL                   service level over IB/RoCE (default 0)
ibgda           NVSHMEM_IB_ENABLE_IBGDA         GPU-initiated transport (default false)
nic             NVSHMEM_HCA_LIST                HCAs to use, ``dev[:port]`` entries, ``^`` excludes
                NVSHMEM_ENABLE_NIC_PE_MAPPING   1: use HCA_LIST / round-robin instead of the
                                                closest NIC (documented as needed for HCA_LIST)
gid_index       NVSHMEM_IB_GID_INDEX            source GID index for RoCE (default: picked)
roce_version    NVSHMEM_IB_ROCE_VERSION_NUM     RoCE version of the picked GID (default 2)

Rules:
- ``auto`` sets nothing: NVSHMEM's default (or the site's NVSHMEM settings) applies. Values that are
  derived rather than given: which QP variable ``qps_per_peer`` sets follows the transport that will
  carry device-initiated traffic (IBGDA when ``ibgda`` is true or the user's
  ``NVSHMEM_IB_ENABLE_IBGDA`` says so, else the CPU proxy: setting QPs of a transport that is not
  used would only cost NIC resources), and ``NVSHMEM_ENABLE_NIC_PE_MAPPING=1`` comes with any
  explicit ``nic`` (NVSHMEM documents HCA_LIST as effective only with it). ``auto_qps`` lets a
  backend that knows its channel count resolve ``qps_per_peer: auto`` (``ep_plugin.plan.cost_model``
  ``suggest()``'s ``qps_per_peer``); without it auto stays NVSHMEM's default.
- A variable already in the environment wins: it is never returned, so never overwritten. The NIC
  variables go as a group: if the user set any of them, the config's ``nic`` is left out entirely
  (NVSHMEM warns about, and ignores half of, a mixed HCA_LIST + HCA_PE_MAPPING).
- NVSHMEM also reads /etc/nvshmem.conf, ~/.nvshmem.conf and $NVSHMEM_CONF_FILE, whose values win over
  the environment; nothing here looks at them.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Tuple

AUTO = "auto"

QPS_IBGDA = "NVSHMEM_IBGDA_NUM_RC_PER_PE"
QPS_PROXY = "NVSHMEM_IB_NUM_RC_PER_DEVICE"
TRAFFIC_CLASS = "NVSHMEM_IB_TRAFFIC_CLASS"
SERVICE_LEVEL = "NVSHMEM_IB_SL"
ENABLE_IBGDA = "NVSHMEM_IB_ENABLE_IBGDA"
HCA_LIST = "NVSHMEM_HCA_LIST"
HCA_PE_MAPPING = "NVSHMEM_HCA_PE_MAPPING"
NIC_PE_MAPPING = "NVSHMEM_ENABLE_NIC_PE_MAPPING"
GID_INDEX = "NVSHMEM_IB_GID_INDEX"
ROCE_VERSION = "NVSHMEM_IB_ROCE_VERSION_NUM"

# Set by the user, any of these means the user chose the NICs: the config's nic is left out.
NIC_VARS: Tuple[str, ...] = (HCA_LIST, HCA_PE_MAPPING, NIC_PE_MAPPING)

# Every variable rdma_environment may return (docs and tests check the table against this).
VARIABLES: Tuple[str, ...] = (QPS_IBGDA, QPS_PROXY, TRAFFIC_CLASS, SERVICE_LEVEL, ENABLE_IBGDA,
                              HCA_LIST, NIC_PE_MAPPING, GID_INDEX, ROCE_VERSION)


def nvshmem_bool(text: str) -> bool:
    """How NVSHMEM reads a boolean variable: false iff it starts with 0, N, n, F or f."""
    return not (text[:1] in ("0", "N", "n", "F", "f"))


def ibgda_in_effect(rdma_cfg: Any, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether NVSHMEM will load the IBGDA transport: the user's NVSHMEM_IB_ENABLE_IBGDA if set,
    else ``ibgda`` if true/false, else NVSHMEM's default (off)."""
    environ = os.environ if environ is None else environ
    if ENABLE_IBGDA in environ:
        return nvshmem_bool(environ[ENABLE_IBGDA])
    return rdma_cfg is not None and rdma_cfg.ibgda is True


def nic_for_rank(nic: Any, local_rank: int) -> Optional[str]:
    """The NVSHMEM_HCA_LIST value for ``local_rank`` (None for auto); ValueError naming
    ``comm.rdma.nic`` when a list or mapping has no entry for this rank."""
    if nic == AUTO or nic is None:
        return None
    if isinstance(nic, str):
        return nic
    if isinstance(nic, (list, tuple)):
        if local_rank >= len(nic):
            raise ValueError(f"comm.rdma.nic: a list of {len(nic)} NICs has no entry for local rank "
                             f"{local_rank}; allowed: one entry per local rank (repeat a NIC that GPUs "
                             f"share), a single 'device[:port]' for all, or auto")
        return nic[local_rank]
    if isinstance(nic, Mapping):
        if local_rank not in nic:
            raise ValueError(f"comm.rdma.nic: the mapping has no entry for local rank {local_rank} "
                             f"(it names local ranks {sorted(nic)}); allowed: every local rank of the "
                             f"host as a key, a single 'device[:port]' for all, or auto")
        return nic[local_rank]
    raise TypeError(f"comm.rdma.nic: expected auto, a string, a list or a mapping, got {type(nic).__name__}")


def check_local_ranks(rdma_cfg: Any, local_world: int) -> None:
    """Raise (ValueError naming comm.rdma.nic) unless ``nic`` has an entry for every local rank
    ``0..local_world-1``. Every rank can run this with the largest host's rank count and fail alike,
    rather than only the ranks past the end of a list failing in the middle of a collective."""
    if rdma_cfg is not None:
        for local_rank in range(local_world):
            nic_for_rank(rdma_cfg.nic, local_rank)


def rdma_settings(rdma_cfg: Any, local_rank: int, world: int, *, auto_qps: Optional[int] = None,
                  environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Everything ``rdma_cfg`` asks NVSHMEM for on this rank, before the user's environment is
    consulted (``environ`` only decides which transport's QP variable applies)."""
    if isinstance(local_rank, bool) or not isinstance(local_rank, int) or not isinstance(world, int) \
            or world < 1 or not 0 <= local_rank < world:
        raise ValueError(f"rdma_environment: local_rank must be an int in [0, world), got local_rank="
                         f"{local_rank!r}, world={world!r}")
    if rdma_cfg is None:
        return {}
    env: Dict[str, str] = {}

    # rdma_cfg is a validated comm.rdma section (config.schema.RdmaConfig): its values are in range
    qps = rdma_cfg.qps_per_peer
    if qps == AUTO and auto_qps is not None:
        qps = int(auto_qps)  # derived: resolved by the backend from its channel count
    if qps != AUTO:
        env[QPS_IBGDA if ibgda_in_effect(rdma_cfg, environ) else QPS_PROXY] = str(qps)
    env[TRAFFIC_CLASS] = str(rdma_cfg.traffic_class)
    env[SERVICE_LEVEL] = str(rdma_cfg.service_level)
    if rdma_cfg.ibgda is True or rdma_cfg.ibgda is False:
        env[ENABLE_IBGDA] = "1" if rdma_cfg.ibgda else "0"
    hca = nic_for_rank(rdma_cfg.nic, local_rank)
    if hca is not None:
        env[HCA_LIST] = hca
        env[NIC_PE_MAPPING] = "1"  # derived: NVSHMEM documents HCA_LIST as effective only with it
    if rdma_cfg.gid_index != AUTO:
        env[GID_INDEX] = str(rdma_cfg.gid_index)
    if rdma_cfg.roce_version != AUTO:
        env[ROCE_VERSION] = str(rdma_cfg.roce_version)
    return env


def rdma_environment(rdma_cfg: Any, local_rank: int, world: int, *, auto_qps: Optional[int] = None,
                     environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The NVSHMEM variables to set for ``rdma_cfg`` (a ``comm.rdma`` section: ``RdmaConfig`` or a
    dict) on the rank with ``local_rank`` (its position among the group's ranks on its host) in a
    group of ``world`` ranks. Returns only what should be set: variables present in ``environ``
    (default ``os.environ``) are left out, the NIC group as a whole. ``auto_qps``: what
    ``qps_per_peer: auto`` resolves to (None: NVSHMEM's default). See the module docstring."""
    environ = os.environ if environ is None else environ
    wanted = rdma_settings(rdma_cfg, local_rank, world, auto_qps=auto_qps, environ=environ)
    if any(var in environ for var in NIC_VARS):
        for var in NIC_VARS:
            wanted.pop(var, None)
    return {var: value for var, value in wanted.items() if var not in environ}


def shadowed(rdma_cfg: Any, local_rank: int, world: int, *, auto_qps: Optional[int] = None,
             environ: Optional[Mapping[str, str]] = None) -> Dict[str, Tuple[str, str]]:
    """``{variable: (config's value, environment's value)}`` where the user's environment overrides
    a differing config setting (for a log line; NIC variables count as one group)."""
    environ = os.environ if environ is None else environ
    wanted = rdma_settings(rdma_cfg, local_rank, world, auto_qps=auto_qps, environ=environ)
    user_nics = any(var in environ for var in NIC_VARS)
    out = {}
    for var, value in wanted.items():
        if var in NIC_VARS and user_nics:
            out[var] = (value, environ.get(var, "(unset: the user's NIC variables apply)"))
        elif var in environ and environ[var] != value:
            out[var] = (value, environ[var])
    return out
