"""The one place that names the transports, and the rule that picks one for `comm.backend: auto`.

Each name maps to a backend package under ep_plugin/backends/, imported only when asked for (the
kernel backends need ep_plugin._C). A backend that cannot serve a group or row width says so in its
`check_group` (a ValueError or BackendUnavailableError with the reason); the chooser asks it once,
before the buffer is built, and never afterwards.

auto: nvshmem when the group spans nodes (counted from the hosts, or comm.ranks_per_node virtual
nodes) and it is built; nvlink when all ranks share a node with
peer access and nvlink takes the row width; torch otherwise (`auto_choice`, which `ep_plugin doctor`
asks too). The choice and its reason are logged once.

The low-latency calls have engines of their own (docs/LOW_LATENCY.md, "Engines"), chosen by
`low_latency_choice`: the NVSHMEM kernels when they can run here and `comm.backend` is not torch,
else the torch reference.
"""
from __future__ import annotations

import importlib
import logging
import socket
from typing import Callable, Optional, Tuple, Type

import torch
import torch.distributed as dist

from .._ext import HOW_TO_BUILD, get_c, has_c
from ..errors import BackendUnavailableError

BACKEND_NAMES = ("auto", "torch", "nvlink", "nvshmem")
_PACKAGES = {"torch": ("torch_ref", "TorchBackend"), "nvlink": ("nvlink", "NvlinkBackend"),
             "nvshmem": ("hierarchical", "NvshmemBackend")}
_KERNEL_BACKENDS = ("nvlink", "nvshmem")
# low-latency engines: name -> (module under backends/, class)
# the internode hop of the hierarchical backends: name -> (module under backends/, class)
_RAIL = {"torch": ("torch_ref.rail", "TorchRail"), "nvshmem": ("nvshmem.rail", "NvshmemRail")}
_LOW_LATENCY = {"torch": ("torch_ref.low_latency", "TorchLowLatency"),
                "nvshmem": ("nvshmem.low_latency", "NvshmemLowLatency")}

logger = logging.getLogger("ep_plugin")
_said = set()


def _say_once(msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        if not logger.handlers and not logging.getLogger().handlers:
            logger.addHandler(logging.StreamHandler())
            logger.setLevel(logging.INFO)
        logger.info(msg)


def backend_class(name: str) -> Type:
    """The Backend class registered under `name`; BackendUnavailableError if it cannot be imported."""
    if name not in _PACKAGES:
        raise ValueError(f"comm.backend must be one of {BACKEND_NAMES}, got {name!r}")
    module, cls = _PACKAGES[name]
    if name in _KERNEL_BACKENDS and not has_c():
        raise BackendUnavailableError(f"comm.backend: {name} needs the compiled module. {HOW_TO_BUILD}")
    try:
        return getattr(importlib.import_module(f"{__package__}.{module}"), cls)
    except BackendUnavailableError:
        raise
    except ImportError as exc:
        hint = (" It needs ep_plugin._C built with NVSHMEM (pip install nvidia-nvshmem-cu13, or -cu12 "
                "matching torch's CUDA); use comm.backend: nvlink within a node, or torch.") if name == "nvshmem" else ""
        raise BackendUnavailableError(f"the {name} backend could not be imported ({exc}).{hint}") from exc


def backend_unavailable(name: str, world: int) -> Optional[str]:
    """Why `name` cannot serve `world` ranks on this machine, from its import and declared limits, or
    None. For callers without a group (doctor); with a group, check_group also checks the row width."""
    try:
        cls = backend_class(name)
    except BackendUnavailableError as exc:
        return str(exc)
    limit = cls.capabilities.max_ranks
    if limit is not None and world > limit:
        return f"the {name} backend supports at most {limit} ranks, got {world}"
    return None


def node_peer_access() -> bool:
    """Whether every pair of this node's visible GPUs has peer access (what nvlink needs)."""
    n = torch.cuda.device_count()
    return all(torch.cuda.can_device_access_peer(a, b) for a in range(n) for b in range(n) if a != b)


def auto_choice(pg_backend: str, cuda: bool, built: bool, world: int, num_nodes: Callable[[], int],
                peer_access: Callable[[], bool], unavailable: Callable[[str], Optional[str]]) -> Tuple[str, str]:
    """The `auto` rule on facts, without a group: (name, reason). Shared by choose_backend (a live
    group) and `ep_plugin doctor --world N` (this machine, no group).

    num_nodes() and peer_access() are asked only when the rule gets that far (counting a live group's
    hosts is a collective); unavailable(name) says why that backend cannot serve, or None."""
    if not (pg_backend == "nccl" and cuda):
        return "torch", f"process group backend is {pg_backend!r} (no NCCL/CUDA)"
    if not built:
        return "torch", "ep_plugin._C is not built"
    nodes = num_nodes()
    if nodes > 1:
        if unavailable("nvshmem") is None:
            return "nvshmem", f"group spans {nodes} nodes and the nvshmem backend is built"
        return "torch", f"group spans {nodes} nodes and the nvshmem backend is not built"
    if not peer_access():
        return "torch", "GPUs of this node lack peer access"
    why = unavailable("nvlink")
    if why is not None:
        return "torch", why
    return "nvlink", f"all {world} ranks share one node with peer access"


def choose_backend(group, requested: str, hidden: int, ranks_per_node="auto") -> Tuple[str, str]:
    """Returns (name, reason). Raises BackendUnavailableError for a backend that cannot run here.
    `ranks_per_node` (comm.ranks_per_node) other than auto makes the group W / ranks_per_node nodes."""
    if requested not in BACKEND_NAMES:
        raise ValueError(f"comm.backend must be one of {BACKEND_NAMES}, got {requested!r}")
    pg_backend = dist.get_backend(group)
    on_gpus = pg_backend == "nccl" and torch.cuda.is_available()
    if requested != "auto":
        if requested in _KERNEL_BACKENDS and not on_gpus:
            raise BackendUnavailableError(
                f"comm.backend: {requested} needs CUDA GPUs and an NCCL process group (this group uses "
                f"{pg_backend!r}); use comm.backend: torch or auto")
        backend_class(requested).check_group(group, hidden)
        return requested, f"comm.backend: {requested}"

    def num_nodes() -> int:
        if ranks_per_node != "auto":
            return max(1, dist.get_world_size(group) // int(ranks_per_node))
        hosts = [None] * dist.get_world_size(group)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        return len(set(hosts))

    def unavailable(name: str) -> Optional[str]:
        try:
            backend_class(name).check_group(group, hidden)
        except (BackendUnavailableError, ValueError) as exc:
            return str(exc)
        return None

    return auto_choice(pg_backend, torch.cuda.is_available(), has_c(), dist.get_world_size(group),
                       num_nodes, node_peer_access, unavailable)


def make_backend(group, cfg, hidden: int, num_experts: int):
    name, reason = choose_backend(group, cfg.comm.backend, hidden, cfg.comm.ranks_per_node)
    if dist.get_rank(group) == 0:
        _say_once(f"ep_plugin: using the {name} backend ({reason})")
    return backend_class(name)(group, cfg, hidden, num_experts)


def rail_class(name: str) -> Type:
    """The rail engine (the internode hop of a hierarchical backend) registered under `name`."""
    module, cls = _RAIL[name]
    try:
        return getattr(importlib.import_module(f"{__package__}.{module}"), cls)
    except ImportError as exc:
        raise BackendUnavailableError(f"the {name} rail could not be imported ({exc})") from exc


def make_rail(name: str, group, cfg, hidden: int, num_experts: int, ranks_per_node: int, max_tokens: int,
              fp8: bool):
    """Build a rail engine: collective over the group (the NVSHMEM one allocates symmetric memory)."""
    return rail_class(name)(group, cfg, hidden, num_experts, ranks_per_node, max_tokens, fp8)


def _low_latency_class(name: str) -> Type:
    module, cls = _LOW_LATENCY[name]
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)


def nvshmem_low_latency_unavailable(group, hidden: int) -> Optional[str]:
    """Why the NVSHMEM low-latency engine cannot serve `group` and row width `hidden`, or None.
    Asks the engine's check_available (no collectives)."""
    pg_backend = dist.get_backend(group)
    if "nccl" not in pg_backend or not torch.cuda.is_available():
        return f"process group backend is {pg_backend!r} (the NVSHMEM kernels need NCCL and CUDA GPUs)"
    if not has_c():
        return "ep_plugin._C is not built"
    if not getattr(get_c(), "HAS_NVSHMEM", False):
        return "ep_plugin._C is built without NVSHMEM (pip install nvidia-nvshmem-cu13, or -cu12, then rebuild)"
    try:
        _low_latency_class("nvshmem").check_available(group, hidden)
    except ImportError as exc:
        return f"the NVSHMEM low-latency engine could not be imported ({exc})"
    except (BackendUnavailableError, ValueError) as exc:
        return str(exc)
    return None


def low_latency_choice(group, requested: str, hidden: int) -> Tuple[str, str]:
    """The low-latency engine for `comm.backend` = `requested`: (name, reason). The NVSHMEM kernels
    unless `requested` is torch or they cannot run here (then the torch reference); an explicit
    `comm.backend: nvshmem` raises BackendUnavailableError instead of falling back."""
    if requested not in BACKEND_NAMES:
        raise ValueError(f"comm.backend must be one of {BACKEND_NAMES}, got {requested!r}")
    if requested == "torch":
        return "torch", "comm.backend: torch"
    why = nvshmem_low_latency_unavailable(group, hidden)
    if why is None:
        return "nvshmem", "the NVSHMEM kernels are built and the group is NCCL on GPUs"
    if requested == "nvshmem":
        raise BackendUnavailableError(f"comm.backend: nvshmem: the NVSHMEM low-latency engine cannot run here: {why}")
    return "torch", why


def make_low_latency(group, cfg, hidden: int, num_experts: int):
    """Build the low-latency engine of an EPBuffer: collective over the group's members (each engine
    builds its communication state)."""
    name, reason = low_latency_choice(group, cfg.comm.backend, hidden)
    if dist.get_rank(group) == 0:
        _say_once(f"ep_plugin: low-latency calls use the {name} engine ({reason})")
    return _low_latency_class(name)(group, cfg, hidden, num_experts)
