"""The configuration schema: the sections as dataclasses, and the one definition of every choice.

Each list of allowed values exists once, here (backends: ``backends/registry.py``); the validator,
``routing.py`` and the backends import it rather than spell it again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from ..backends.registry import BACKEND_NAMES
from .ep_size import check_ep_size

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
DISPATCH_DTYPES = ("bf16", "fp8")
COMBINE_DTYPES = ("bf16",)
COMBINE_KERNELS = ("auto", "split", "fused", "pipelined", "pull")
DISPATCH_KERNELS = ("auto", "split", "fused")
HELD_OUTPUTS = ("raise", "copy")
SOURCE_ORDERS = ("rank", "arrival")
COMBINE_REDUCES = ("source", "owner")
VALIDATE_MODES = ("device", "full")
AUTO = "auto"


@dataclass
class MoEConfig:
    """Routing: how many experts, how many per token, and how they are scored."""

    num_experts: int = 8
    topk: int = 2
    num_groups: Optional[int] = None  # group-limited routing: experts form num_groups groups
    group_topk: Optional[int] = None  # ... and each token keeps its best group_topk groups
    score_function: str = "softmax"  # one of SCORE_FUNCTIONS
    topk_scaling_factor: Optional[float] = None  # multiply the top-k weights by this
    expert_bias: bool = False  # aux-loss-free balancing: select on score + bias (not softmax)
    use_pre_softmax: bool = False  # softmax over all experts before top-k (no renormalisation)


@dataclass
class LowLatencyConfig:
    """The low-latency calls (EPBuffer.low_latency_dispatch/combine, docs/LOW_LATENCY.md): section
    ``comm.low_latency``."""

    # M: most tokens one rank passes to a low-latency dispatch (more raises an error). Sizes its fixed
    # output [E_local, W * M, H] and the engine's buffers, so keep it at the decode batch.
    max_tokens_per_rank: int = 128
    # N > 0: outputs from N sets allocated once and used in turn (on one host in the NVSHMEM heap, where the
    # senders write rows in place: no receive copy), overwritten N calls later -- a set still held then
    # raises (docs/LOW_LATENCY.md); 0: fresh output tensors every call, as DeepEP V1 returns them.
    output_buffers: int = 2
    # true: on one host the sets live in the NVSHMEM heap (rows written in place; a held set raises);
    # false: torch-tensor sets plus a receive copy, where a held set gives way to a free one or to fresh
    # tensors on that rank alone (ep_plugin.deep_ep with no ep_config: DeepEP's callers may hold outputs).
    heap_outputs: bool = True
    # What a heap set still held by a caller becomes (docs/LOW_LATENCY.md, "Held outputs"): raise, after the
    # call that overwrote it; copy: one dispatch before its turn the held tensors are moved to memory of their
    # own (their values kept, one device copy), so nothing is overwritten and nothing raised -- needs
    # output_buffers >= 3 (with 2 the previous dispatch's outputs, still bound by the caller, would move
    # every call). Torch-tensor sets give way to a free set either way.
    held_outputs: str = "raise"
    # The order of the source ranks' row blocks within each local expert's output (layout_range says where
    # each starts): rank (0, 1, ...: the same every call) or arrival (the order their reservations reached
    # the owner, as DeepEP's: no rank waits for a lower rank's launch before placing its rows -- a cold call
    # no longer pays the ranks' launch skew; heap output sets only, docs/LOW_LATENCY.md).
    source_order: str = "rank"
    # Where a token's picks are summed in low_latency_combine: owner (the default: each rank holding picks of
    # the token sums its own, weighted, float32, into a BF16 row -- as a high-throughput combine's per-rank
    # expert outputs are -- and the token's rank adds those rows, float32, in the order of each rank's first
    # pick; with heap output sets the owner sums before sending, so one row per (token, rank) crosses NVLink
    # instead of one per pick: docs/LOW_LATENCY.md, "Owner sums") or source (the token's rank sums every
    # pick's row, float32, k ascending, rounded to BF16 once: DeepEP's numbers, bit for bit).
    combine_reduce: str = "owner"


@dataclass
class RdmaConfig:
    """The RDMA settings of the nvshmem backend across hosts (docs/RDMA.md): section ``comm.rdma``.

    Mapped to NVSHMEM's environment before it starts (``backends/nvshmem/rdma_env.py``); variables the
    user set win. Unused when the whole group is one host (no NIC is used). ``auto`` = NVSHMEM's default.
    """

    # RC queue pairs to each peer PE: channels spread their RDMA writes over them; with >= 2 a bonded
    # dual-port NIC (and ECMP) hashes them onto both ports/paths. NVSHMEM_IBGDA_NUM_RC_PER_PE (IBGDA)
    # or NVSHMEM_IB_NUM_RC_PER_DEVICE (CPU-proxy transport).
    qps_per_peer: Union[int, str] = AUTO
    traffic_class: int = 0  # IP traffic class byte (DSCP << 2) of RoCE packets: NVSHMEM_IB_TRAFFIC_CLASS
    service_level: int = 0  # IB service level / RoCE 802.1p priority: NVSHMEM_IB_SL
    ibgda: Union[bool, str] = AUTO  # GPU-initiated RDMA (no CPU proxy): NVSHMEM_IB_ENABLE_IBGDA
    # Which HCA each GPU uses: auto (NVSHMEM: the closest by PCIe), "mlx5_0:1" (every rank; an
    # NVSHMEM_HCA_LIST string), a list indexed by local rank, or a mapping {local rank: "dev[:port]"}.
    nic: Union[str, List[str], Dict[int, str]] = AUTO
    gid_index: Union[int, str] = AUTO  # RoCE source GID index (e.g. 3 = RoCEv2/IPv4): NVSHMEM_IB_GID_INDEX
    # RoCE version of the GID NVSHMEM picks when gid_index is auto: NVSHMEM_IB_ROCE_VERSION_NUM
    roce_version: Union[int, str] = AUTO


@dataclass
class CommConfig:
    """Communication: which transport, how many SMs, dtypes, buffer sizing, timeouts."""

    backend: str = "auto"  # one of BACKEND_NAMES
    num_sms: Union[int, str] = 24  # or AUTO: each backend's planner picks a count for the case
    # Read by the kernel backends: bf16 = dispatch takes BF16/FP16 rows and FP8 pairs, fp8 = FP8
    # pairs only (their buffers hold a BF16 row per slot either way). The torch backend moves any dtype.
    dispatch_dtype: str = "bf16"  # one of DISPATCH_DTYPES
    # bf16 only; the kernel backends' combine takes BF16 rows.
    combine_dtype: str = "bf16"  # one of COMBINE_DTYPES
    max_tokens_per_rank: int = 4096
    # GPUs per node, for the internode backend (nvshmem): auto = counted from the group's hosts; a
    # number splits the group into nodes of that many ranks (on one host: virtual nodes, whose
    # "RDMA" half then runs over NVLink through NVSHMEM's P2P transport).
    ranks_per_node: Union[int, str] = AUTO
    timeout_s: float = 60.0
    # False (default): dispatch never waits on the host; its outputs are sized for the worst case that
    # max_tokens_per_rank allows and the counts come back as device tensors plus a lazy pinned copy.
    # True: the host waits for the counts so that outputs have their exact size (one sync per dispatch).
    host_sync: bool = False
    # nvlink: make each call's output tensors at the end of the previous call of the same form, after its
    # launches, so that a call's kernels do not wait for the CUDA allocator (backends/nvlink/spares.py).
    # Holds one call's outputs per kind of call (worst-case dispatch rows, a combine's sums); false frees it.
    spare_outputs: bool = True
    # nvlink combine (one of COMBINE_KERNELS): send + reduce kernels ("split"), one kernel whose warps
    # send and then reduce each chunk once it has arrived ("fused"), the same with bulk-copy sends while
    # the other warps reduce ("pipelined"), or every rank stages its rows in its own buffer and the owners
    # read and sum them ("pull": remote reads instead of writes); "auto" picks by the token count and EP
    # size (backends/nvlink/plan.py).
    combine_kernel: str = "auto"
    # nvlink, rank-major dispatch without a host sync (and cached dispatches): stage, then pull
    # ("split"), or one kernel that pulls each sub-chunk as soon as its source has staged it ("fused");
    # "auto": backends/nvlink/plan.py.
    dispatch_kernel: str = "auto"  # one of DISPATCH_KERNELS
    # device: expert ids outside [-1, E) are found on the device and raised at the next synchronising
    # call; full: checked on the host before any kernel (one host sync per dispatch).
    validate: str = "device"  # one of VALIDATE_MODES
    # Per-call telemetry (EPBuffer.stats(): device times, bytes per domain, imbalance, timeouts);
    # off costs nothing.
    stats: bool = False
    # Steps between the framework integrations' stats reports (their own logging); None = never,
    # read EPBuffer.stats() yourself.
    stats_interval: Optional[int] = 100
    low_latency: LowLatencyConfig = field(default_factory=LowLatencyConfig)
    rdma: RdmaConfig = field(default_factory=RdmaConfig)


@dataclass
class OverlapConfig:
    """Overlap of communication with compute."""

    async_dispatch: bool = False
    shared_expert_overlap: bool = False
    # The default of return_recv_hook of the low-latency calls: True = they return a hook that
    # launches the receive half later, leaving every SM to the caller's compute in between.
    recv_hook: bool = False


@dataclass
class EPConfig:
    """A whole, validated ep_plugin configuration (build it with :func:`load_config`)."""

    moe: MoEConfig = field(default_factory=MoEConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    # Provenance for error messages, not a setting: a preset loaded by name and through a path
    # (configs/<name>.yaml links to the packaged file) compare equal.
    source: Optional[str] = field(default=None, compare=False)

    def to_dict(self) -> Dict[str, Dict[str, Any]]:
        """Plain nested dict of the schema keys (no ``source``); ``load_config`` accepts it back."""
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def check_ep_size(self, ep_size: int) -> None:
        """Raise ConfigError unless the experts split evenly and contiguously over ``ep_size`` ranks."""
        check_ep_size(self, ep_size)

    def num_local_experts(self, ep_size: int) -> int:
        """Experts held by each rank of an EP group of ``ep_size`` (validated)."""
        self.check_ep_size(ep_size)
        return self.moe.num_experts // ep_size


SECTIONS: Dict[str, type] = {"moe": MoEConfig, "comm": CommConfig, "overlap": OverlapConfig}

__all__ = [
    "MoEConfig", "CommConfig", "LowLatencyConfig", "RdmaConfig", "OverlapConfig", "EPConfig", "SECTIONS", "AUTO",
    "SCORE_FUNCTIONS", "BACKEND_NAMES", "DISPATCH_DTYPES", "COMBINE_DTYPES", "COMBINE_KERNELS", "DISPATCH_KERNELS",
    "VALIDATE_MODES",
]
