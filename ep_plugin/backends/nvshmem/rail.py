"""NvshmemRail: the internode hop ("rail") of the hierarchical backend on NVSHMEM kernels.

Same constructor, methods and results as the reference ``backends/torch_ref/rail.py`` (TorchRail,
whose docstring defines them) and equal to it bit for bit. The kernels (csrc/nvshmem/rail_*.cu,
protocol in rail.h) write each token's row once to each rail peer whose node it selects: st.global
over NVLink P2P where ``nvshmem_ptr`` maps the peer (virtual nodes on one host), NVSHMEM puts from a
staging copy where it does not (RDMA: compiled, not run on the GPU machines here; ``force_puts`` runs
that path over P2P). Each call launches its send half, then its receive half, on the current stream;
no host sync, fixed shapes, so the calls capture into a CUDA graph.

Dispatch returns views of the symmetric receive buffers, no copy: ``xf [N*M, H]``, ``sf [N*M, H/128]``,
``topk_f [N*M, K]``, ``wf [N*M, K]`` of the call's parity (calls alternate between two sets). They
are valid for work enqueued on this rank before its next dispatch; after that, until the peers'
dispatch after next, which in a MoE step (dispatch k, [dispatch k+1], combine k, ...) follows their
combine k, itself waiting for this rank's combine k. Copy what must live longer. They are never valid
after close(). All ranks must call with the same K.

Combine takes its rows from y_f (a row per slot), through an index (y_rows: a one-rank node's combine reads
its received rows in place instead of gathering them back to slots first), or already in place: where every
rail peer is mapped over P2P, ``combine_targets()`` names the rail peers' receive rows of the next combine
and a kernel of the caller's (the hierarchical backend's inner combine) stores each node's sums there
itself; ``combine_placed`` then only signals and receives (no copy of the rows, docs/INTERNODE.md, session 8).
The pulled form (``pull=True`` on combine, combine_targets and combine_placed, where ``can_pull``: every rail peer
over P2P) keeps each forwarder's rows in its own receive rows (local stores, by its send half or by the caller's
kernel at ``combine_targets(pull=True)``) and has the origin's receive half read them from its rail peers; every
rank of the group must pass the same ``pull`` to a call (csrc/nvshmem/rail.h, pulled combine).

A wait past comm.timeout_s records the missing rail peer in host-mapped memory; check() raises it as
EPTimeoutError naming its group rank (once), and set_mask() lets the others go on without it.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..._ext import get_c
from ...types import FP8_BLOCK
from . import runtime
from .faults import ReportsFaults
from .rail_plan import plan_rail
from .launch import MIN_TOPK_CAPACITY, RECV, SEND, require_kernels, current_stream as _current_stream, ptr as _ptr

MAX_NODES = 128   # rail_device.cuh kMaxNodes
MAX_TOPK = 32     # one lane per k


class _CudaBytes:
    """A device address range as __cuda_array_interface__ (the fallback of _device_bytes)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3}


def _device_bytes(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """uint8 [nbytes] over memory torch does not own (the NVSHMEM heap): valid while the Runtime lives."""
    make = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if make is not None:
        storage = make(ptr, device, nbytes)
        return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))
    return torch.as_tensor(_CudaBytes(ptr, nbytes), device=device)


class NvshmemRail(ReportsFaults):
    name = "nvshmem"
    what = "rail"
    kernels = {20: "rail dispatch", 21: "rail combine"}
    mask_hint = "set_mask(ranks)"

    @staticmethod
    def check_available(group, hidden: int) -> None:
        require_kernels("rail", hidden)

    def __init__(self, group, cfg, hidden: int, num_experts: int, ranks_per_node: int, max_tokens: int,
                 fp8: bool, *, force_puts: bool = False):
        """force_puts (tests): NVSHMEM puts from staging buffers to every peer, as across nodes."""
        C = get_c()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        P = int(ranks_per_node)
        if P < 1 or self.world % P:
            raise ValueError(f"comm.ranks_per_node={ranks_per_node} does not divide the group's {self.world} ranks")
        self.P, self.N = P, self.world // P
        if self.N > MAX_NODES:
            raise ValueError(f"the NVSHMEM rail supports at most {MAX_NODES} nodes, got {self.N}")
        if num_experts % self.N:
            raise ValueError(f"{num_experts} experts do not split evenly over {self.N} nodes")
        self.node, self.local = divmod(self.rank, P)
        self.peers = [m * P + self.local for m in range(self.N)]
        self.hidden = hidden
        self.num_experts = num_experts
        self.M = int(max_tokens)
        self.fp8 = bool(fp8)
        if hidden % (FP8_BLOCK if self.fp8 else 8):
            raise ValueError(f"the NVSHMEM rail needs hidden % {FP8_BLOCK if self.fp8 else 8} == 0 for "
                             f"{'FP8' if self.fp8 else 'BF16'} rows, got {hidden}")
        self.max_topk = min(max(int(cfg.moe.topk), MIN_TOPK_CAPACITY), MAX_TOPK)
        self.timeout_s = float(cfg.comm.timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device())
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        one_host = runtime._host_layout(group)[0]  # collective; across hosts the puts need staging areas
        self.plan = plan_rail(cfg, self.N, P, self.M, hidden, num_experts, self.fp8, sms, one_host)
        self.num_blocks = self.plan.num_blocks
        runtime.logger.info("ep_plugin.nvshmem rail: %s", self.plan.why)
        stage = int(force_puts or not one_host)
        heap = C.RailRuntime.heap_bytes(self.world, P, num_experts, self.M, self.max_topk, hidden, int(self.fp8), stage)
        if hidden % FP8_BLOCK == 0:  # room for the other row form's rail too (the backend makes it at its first call)
            heap += C.RailRuntime.heap_bytes(self.world, P, num_experts, self.M, self.max_topk, hidden,
                                             int(not self.fp8), stage)
        runtime.join(group, heap, cfg.comm.rdma, auto_qps=self.plan.auto_qps)  # sizes the heap if NVSHMEM starts here
        self._rt = C.RailRuntime(self.rank, self.world, P, num_experts, self.M, self.max_topk, hidden,
                                 int(self.fp8), self.timeout_s, self.num_blocks, int(force_puts))
        self._views = [self._parity_views(p) for p in (0, 1)]
        # combine_targets() per parity, made now: a copy to the GPU is not allowed while a CUDA graph is captured
        self._targets = self._per_parity(self._rt.combine_targets)
        self._own_targets = self._per_parity(self._rt.combine_own_targets)
        self._masked = False          # a set_mask() left a rank out: combine sends through its own half
        self._reported = False
        # called with "rail_send" between the send and the receive launch of each call (the backend's
        # stage timeline, hierarchical/timeline.py); None: nothing between them
        self.on_phase = None

    def _parity_views(self, parity: int):
        """(xf, sf or None, topk_f flat, wf flat) over one parity's symmetric buffers."""
        xf_ptr, sf_ptr, ids_ptr, w_ptr = self._rt.buffers(parity)
        NM, H, cap = self.N * self.M, self.hidden, self.max_topk
        dev = self.device
        row = torch.float8_e4m3fn if self.fp8 else torch.bfloat16
        xf = _device_bytes(xf_ptr, NM * H * row.itemsize, dev).view(row).view(NM, H)
        sf = (_device_bytes(sf_ptr, NM * (H // FP8_BLOCK) * 4, dev).view(torch.float32).view(NM, H // FP8_BLOCK)
              if self.fp8 else None)
        ids = _device_bytes(ids_ptr, NM * cap * 8, dev).view(torch.int64)
        w = _device_bytes(w_ptr, NM * cap * 4, dev).view(torch.float32)
        return xf, sf, ids, w

    def _check_rows(self, x, scales, topk_idx, topk_weights):
        T, K = topk_idx.shape
        if T > self.M:
            raise ValueError(f"{T} tokens exceed the rail's max_tokens={self.M}")
        if not 1 <= K <= self.max_topk:
            raise ValueError(f"topk_idx has {K} columns; the NVSHMEM rail was sized for 1..{self.max_topk}")
        if topk_idx.dtype != torch.int64 or not topk_idx.is_contiguous():
            raise TypeError(f"topk_idx must be contiguous int64, got {topk_idx.dtype}")
        want = torch.float8_e4m3fn if self.fp8 else torch.bfloat16
        if x.dtype != want or tuple(x.shape) != (T, self.hidden) or not x.is_contiguous():
            raise TypeError(f"x must be contiguous {want} [{T}, {self.hidden}] for this rail "
                            f"(fp8={self.fp8}), got {x.dtype} {list(x.shape)}")
        if self.fp8 != (scales is not None):
            raise TypeError(f"this rail moves {'FP8 rows: scales are required' if self.fp8 else 'BF16 rows: no scales'}")
        if scales is not None and (scales.dtype != torch.float32 or not scales.is_contiguous()
                                   or tuple(scales.shape) != (T, self.hidden // FP8_BLOCK)):
            raise TypeError(f"scales must be contiguous float32 [{T}, {self.hidden // FP8_BLOCK}], got "
                            f"{scales.dtype} {list(scales.shape)}")
        if topk_weights is not None and (topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous()
                                         or tuple(topk_weights.shape) != (T, K)):
            raise TypeError(f"topk_weights must be contiguous float32 [{T}, {K}], got "
                            f"{topk_weights.dtype} {list(topk_weights.shape)}")

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                 topk_weights: Optional[torch.Tensor]):
        """-> (xf, sf, topk_f, wf): views of this call's receive buffers (see the module docstring)."""
        self._check_rows(x, scales, topk_idx, topk_weights)
        T, K = topk_idx.shape
        rt = self._rt
        parity = rt.next_dispatch_parity()
        stream = _current_stream()
        rt.dispatch(x.data_ptr(), _ptr(scales), topk_idx.data_ptr(), _ptr(topk_weights), T, K, SEND, stream)
        if self.on_phase is not None:
            self.on_phase("rail_send")
        rt.dispatch(0, 0, 0, 0, T, K, RECV, stream)
        xf, sf, ids, w = self._views[parity]
        n = self.N * self.M * K
        return xf, sf, ids[:n].view(-1, K), (w[:n].view(-1, K) if topk_weights is not None else None)

    def _per_parity(self, addresses):
        """[addresses(parity) as an int64 tensor on this GPU for parity 0, 1], or [None, None] without P2P everywhere."""
        if not self._rt.all_p2p:
            return [None, None]
        return [torch.tensor(addresses(p), dtype=torch.int64, device=self.device) for p in (0, 1)]

    # ------------------------------------------------------------------ combine
    @property
    def can_pull(self) -> bool:
        """Whether combine can take pull=True: every rail peer is mapped over P2P (the same on every rank)."""
        return self._rt is not None and bool(self._rt.all_p2p)

    def _check_pull(self, pull: bool) -> int:
        if pull and not self.can_pull:
            raise ValueError("the pulled rail combine (pull=True) reads the rail peers' rows over P2P: this rail has a "
                             "peer without P2P (across hosts, or force_puts); check can_pull first")
        return int(bool(pull))

    def combine(self, y_f: torch.Tensor, slot_valid: torch.Tensor, topk_idx: torch.Tensor,
                num_tokens: int, y_rows: Optional[torch.Tensor] = None, pull: bool = False) -> torch.Tensor:
        """y_f [N*M, H] bf16 (a row per slot this rank forwarded; with y_rows int64 [N*M], slot i's row is
        y_f[y_rows[i]] and y_f has any number of rows, y_rows' values in range where slot_valid), slot_valid
        [N*M] bool/uint8, topk_idx [T, K] this rank's dispatch ids -> y [T, H] bf16 (a new tensor). pull: the
        pulled form (module docstring; the same on every rank)."""
        NM, H = self.N * self.M, self.hidden
        T, K = self._check_combine(topk_idx, num_tokens)
        pull = self._check_pull(pull)
        rows_ok = (y_f.shape[1:] == (H,) and y_f.shape[0] > 0) if y_rows is not None else tuple(y_f.shape) == (NM, H)
        if y_f.dtype != torch.bfloat16 or y_f.dim() != 2 or not rows_ok or not y_f.is_contiguous():
            raise TypeError(f"y_f must be contiguous bfloat16 [{'R > 0' if y_rows is not None else NM}, {H}], got "
                            f"{y_f.dtype} {list(y_f.shape)}")
        if y_rows is not None and (y_rows.dtype != torch.int64 or y_rows.numel() != NM or not y_rows.is_contiguous()
                                   or y_rows.device != y_f.device):
            raise TypeError(f"y_rows must be contiguous int64 with {NM} entries on {y_f.device}, got {y_rows.dtype} "
                            f"{list(y_rows.shape)} on {y_rows.device}")
        if slot_valid.dtype not in (torch.bool, torch.uint8) or slot_valid.numel() != NM \
                or not slot_valid.is_contiguous():
            raise TypeError(f"slot_valid must be contiguous bool or uint8 with {NM} entries, got "
                            f"{slot_valid.dtype} {list(slot_valid.shape)}")
        y = torch.empty((T, H), dtype=torch.bfloat16, device=topk_idx.device)
        rt = self._rt
        stream = _current_stream()
        rt.combine(y_f.data_ptr(), slot_valid.data_ptr(), 0, T, K, SEND, 0, stream,
                   0 if y_rows is None else y_rows.data_ptr(), 0, pull)
        if self.on_phase is not None:
            self.on_phase("rail_send")
        rt.combine(0, 0, topk_idx.data_ptr(), T, K, RECV, y.data_ptr(), stream, 0, 0, pull)
        return y

    def combine_targets(self, pull: bool = False) -> Optional[torch.Tensor]:
        """[N] int64 on this GPU: where the next combine puts this node's rows at each rail peer (the row of slot
        s*M + t goes to address [s] + t * 2H), for a kernel that stores them there itself before combine_placed;
        None where they must go through combine's send half (NVSHMEM puts across hosts, a rank left out by
        set_mask). Valid for the next combine on this rail only (the two parities alternate). pull: the addresses
        in this rank's own rows where the pulled combine keeps them (combine_placed(pull=True) after the stores);
        a mask does not matter there (nothing is stored at a peer; its rows are simply not read)."""
        if pull:
            return self._own_targets[self._rt.next_combine_parity()] if self.can_pull else None
        if self._masked or not self._rt.all_p2p:
            return None
        return self._targets[self._rt.next_combine_parity()]

    def combine_placed(self, topk_idx: torch.Tensor, num_tokens: int, pull: bool = False) -> torch.Tensor:
        """combine whose rows are in place: work enqueued before it on the current stream has stored every valid
        slot's row at combine_targets(pull) (taken just before) and fenced it. The send half only signals the rail
        peers; the receive half waits and sums as combine's (pull: reading the rows from the rail peers).
        -> y [T, H] bf16."""
        T, K = self._check_combine(topk_idx, num_tokens)
        pull = self._check_pull(pull)
        y = torch.empty((T, self.hidden), dtype=torch.bfloat16, device=topk_idx.device)
        rt = self._rt
        stream = _current_stream()
        rt.combine(0, 0, 0, T, K, SEND, 0, stream, 0, 1, pull)
        if self.on_phase is not None:
            self.on_phase("rail_send")
        rt.combine(0, 0, topk_idx.data_ptr(), T, K, RECV, y.data_ptr(), stream, 0, 0, pull)
        return y

    def _check_combine(self, topk_idx: torch.Tensor, num_tokens: int):
        T, K = topk_idx.shape
        if T != num_tokens:
            raise ValueError(f"num_tokens={num_tokens} but topk_idx has {T} rows")
        if topk_idx.dtype != torch.int64 or not topk_idx.is_contiguous():
            raise TypeError(f"topk_idx must be contiguous int64, got {topk_idx.dtype}")
        if T > self.M or not 1 <= K <= self.max_topk:
            raise ValueError(f"topk_idx [{T}, {K}] exceeds the rail's max_tokens={self.M} or topk 1..{self.max_topk}")
        return T, K

    # ------------------------------------------------------------------ faults
    def take_bad_expert_ids(self) -> bool:
        return self._rt is not None and bool(self._rt.take_bad_expert_ids())

    def set_mask(self, ranks: Sequence[int]) -> None:
        """Group ranks to leave out (an empty list clears it); only this rank's rail peers matter."""
        self._rt.set_mask(list(ranks))
        self._masked = bool(list(ranks))
        self._reported = False

    def _release(self) -> None:
        self._views = None  # views of the heap: freed with it
        self._targets = [None, None]
        self._own_targets = [None, None]
