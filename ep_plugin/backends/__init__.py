"""Backend selection: `comm.backend` auto|torch|nvlink|nvshmem -> a Backend instance."""
from __future__ import annotations

import logging
import socket

import torch as _torch  # not `torch`: the submodule .torch would shadow it
import torch.distributed as dist

from .._ext import HOW_TO_BUILD, has_c
from ..errors import BackendUnavailableError
from .base import Backend, DispatchOutput, EPEvent, Handle

logger = logging.getLogger("ep_plugin")
BACKENDS = ("auto", "torch", "nvlink", "nvshmem")
_said = set()


def _say_once(msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        if not logger.handlers and not logging.getLogger().handlers:
            logger.addHandler(logging.StreamHandler())
            logger.setLevel(logging.INFO)
        logger.info(msg)


def _nvlink_module():
    try:
        from . import nvlink
    except ImportError as exc:
        raise BackendUnavailableError(f"the nvlink backend could not be imported ({exc}). {HOW_TO_BUILD}") from exc
    return nvlink


def _nvshmem_module():
    try:
        from . import nvshmem
    except ImportError as exc:
        raise BackendUnavailableError(
            "the nvshmem backend is not available in this build: it needs ep_plugin._C built with NVSHMEM "
            "(pip install nvidia-nvshmem-cu13, or -cu12 matching torch's CUDA) "
            f"({exc}). Use comm.backend: nvlink within a node or torch.") from exc
    return nvshmem


def choose_backend(group, requested: str, hidden: int):
    """Returns (name, reason). Raises BackendUnavailableError for a backend that cannot run here."""
    if requested not in BACKENDS:
        raise ValueError(f"comm.backend must be one of {BACKENDS}, got {requested!r}")
    pg_backend = dist.get_backend(group)
    if requested == "torch":
        return "torch", "comm.backend: torch"
    if requested in ("nvlink", "nvshmem"):
        if pg_backend != "nccl" or not _torch.cuda.is_available():
            raise BackendUnavailableError(
                f"comm.backend: {requested} needs CUDA GPUs and an NCCL process group (this group uses "
                f"{pg_backend!r}); use comm.backend: torch or auto")
        if not has_c():
            raise BackendUnavailableError(f"comm.backend: {requested} needs the compiled module. {HOW_TO_BUILD}")
        return requested, f"comm.backend: {requested}"
    # auto
    if pg_backend != "nccl" or not _torch.cuda.is_available():
        return "torch", f"process group backend is {pg_backend!r} (no NCCL/CUDA)"
    if not has_c():
        return "torch", "ep_plugin._C is not built"
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) > 1:
        try:
            _nvshmem_module()
            return "nvshmem", f"group spans {len(set(hosts))} nodes and the nvshmem backend is built"
        except BackendUnavailableError:
            return "torch", f"group spans {len(set(hosts))} nodes and the nvshmem backend is not built"
    n = _torch.cuda.device_count()
    if not all(_torch.cuda.can_device_access_peer(a, b) for a in range(n) for b in range(n) if a != b):
        return "torch", "GPUs of this node lack peer access"
    try:
        nvlink = _nvlink_module()
        nvlink.check_hidden(hidden)
    except (BackendUnavailableError, ValueError) as exc:
        return "torch", str(exc)
    if len(hosts) > nvlink.MAX_RANKS:
        return "torch", f"the nvlink backend supports at most {nvlink.MAX_RANKS} ranks, the group has {len(hosts)}"
    return "nvlink", f"all {len(hosts)} ranks share one node with peer access"


def make_backend(group, cfg, hidden: int, num_experts: int) -> Backend:
    name, reason = choose_backend(group, cfg.comm.backend, hidden)
    if dist.get_rank(group) == 0:
        _say_once(f"ep_plugin: using the {name} backend ({reason})")
    if name == "torch":
        from .torch import TorchBackend
        return TorchBackend(group, cfg, hidden, num_experts)
    if name == "nvlink":
        return _nvlink_module().NvlinkBackend(group, cfg, hidden, num_experts)
    return _nvshmem_module().NvshmemBackend(group, cfg, hidden, num_experts)


__all__ = ["Backend", "DispatchOutput", "EPEvent", "Handle", "BACKENDS", "choose_backend", "make_backend"]
