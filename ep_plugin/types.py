"""Types of the core contract, shared by EPBuffer and every backend: dtypes, events, handles, results.

A `Handle` is what combine (and a cached dispatch) needs. Its counts live on the device first;
the host lists (`send_counts`, `recv_counts`, `tokens_per_expert`) come from a non-blocking copy into
pinned memory and are read lazily: reading one waits for that copy only, not for the stream. Types
never change with the mode: `tokens_per_expert` is always a list, `num_tokens_per_expert` always an
int device tensor. `Handle.state` is a dataclass private to the backend that made the handle.
`LowLatencyHandle` is the low-latency calls' counterpart (fixed expert-major layout, docs/LOW_LATENCY.md).
"""
from __future__ import annotations

import contextlib

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

FP8_BLOCK = 128  # channels per FP8 scale
ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))

XInput = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def padded(counts: List[int], alignment: int) -> List[int]:
    """Each count rounded up to a multiple of `alignment` (the expert-major segment sizes)."""
    return [(n + alignment - 1) // alignment * alignment for n in counts]


class EPEvent:
    """Completion of an asynchronous dispatch/combine.

    Wraps torch.distributed work objects and/or a CUDA event of the communication stream.
    `current_stream_wait()` makes the caller's stream (or the host, on CPU) wait for completion;
    `synchronize()` also waits on the host and raises a pending kernel error (e.g. EPTimeoutError).
    """

    def __init__(self, works=(), cuda_event: Optional[torch.cuda.Event] = None, on_complete=None,
                 check=None):
        self._works = list(works)
        self._cuda_event = cuda_event
        self._on_complete = on_complete
        self._check = check  # raises what the kernels reported, once they have finished

    @property
    def cuda_event(self) -> Optional[torch.cuda.Event]:
        """The CUDA event of the communication stream, if the call ran on one."""
        return self._cuda_event

    def current_stream_wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []
        if self._cuda_event is not None:
            torch.cuda.current_stream().wait_event(self._cuda_event)
        if self._on_complete is not None:
            fn, self._on_complete = self._on_complete, None
            fn()

    wait = current_stream_wait

    def synchronize(self) -> None:
        self.current_stream_wait()
        if self._cuda_event is not None:
            self._cuda_event.synchronize()
        if self._check is not None:
            self._check()


class HostCounts:
    """Integer device tensors copied to pinned host memory without blocking, read as lists on demand.
    The pinned buffers come from a PinnedRing (`ring`, required with `device`).

    `get(name)` waits for the copy (an event recorded right after it on `stream`), never for later
    work. `derived` entries are computed from the others (or, at the cost of a sync, from the device)
    the first time they are read. Inside CUDA-graph capture nothing is copied: the device tensors
    are the only form, and reading a host list raises.
    """

    def __init__(self, lists: Optional[Dict[str, List[int]]] = None,
                 device: Optional[Dict[str, torch.Tensor]] = None, stream=None,
                 derived: Optional[Dict[str, Callable[["HostCounts"], List[int]]]] = None,
                 ring: Optional["PinnedRing"] = None):
        self._lists: Dict[str, List[int]] = dict(lists or {})
        self._derived = dict(derived or {})
        self._pinned: Dict[str, torch.Tensor] = {}
        self._event = None
        self._capturing = False
        if device:
            self._capturing = torch.cuda.is_current_stream_capturing()
            if not self._capturing:
                self._pinned, self._event = ring.take(self)  # reused pinned buffers: no allocation per call
                # on the current stream without a stream object or a context switch (host time of every fresh
                # dispatch, docs/INTERNODE.md session 7); Event.record(None) records on the current stream
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    for name, t in device.items():
                        self._pinned[name].copy_(t, non_blocking=True)
                self._event.record(stream)

    def materialize(self) -> None:
        """Turn the pinned copies into lists (waits for their copy only)."""
        if self._pinned:
            self._event.synchronize()
            for k, t in self._pinned.items():
                self._lists[k] = t.tolist()
            self._pinned = {}

    def peek(self, name: str) -> Optional[List[int]]:
        """`get(name)` if that waits for nothing (the copy, or the kernel writing the pinned buffers, is done);
        else None. Never a derived entry that reads the device."""
        if name in self._lists:
            return self._lists[name]
        if self._capturing or not self._pinned or name not in self._pinned or not self._event.query():
            return None
        self.materialize()
        return self._lists.get(name)

    def get(self, name: str) -> List[int]:
        if name in self._lists:
            return self._lists[name]
        if self._capturing:
            raise RuntimeError(f"{name} is not available on the host for a dispatch captured in a CUDA "
                               "graph; use the device tensors (res.num_tokens_per_expert, res.num_recv)")
        self.materialize()
        if name not in self._lists and name in self._derived:
            self._lists[name] = self._derived.pop(name)(self)
        return self._lists[name]


class PinnedRing:
    """Pinned host buffers and events for HostCounts, reused round-robin: a dispatch that does not
    wait on the host copies its counts without allocating pinned memory (which costs tens of us).
    When a slot comes round again, the counts it held are first turned into lists (their copy
    finished long ago), so a handle's counts stay readable however late they are read."""

    def __init__(self, shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]], size: int = 32):
        self._slots = [({n: torch.empty(shape, dtype=dt, pin_memory=True, device="cpu") for n, (shape, dt) in shapes.items()},
                        torch.cuda.Event()) for _ in range(size)]
        self._owners: List[Optional["weakref.ref"]] = [None] * size
        self._next = 0

    def take(self, owner: "HostCounts"):
        return self.own(self.claim(), owner)

    def claim(self) -> int:
        """The next slot's index, the counts it held first turned into lists (it is written next); `own` gives
        it its new owner (apart, so that a kernel may be queued to write the slot before its owner exists)."""
        i = self._next
        self._next = (i + 1) % len(self._slots)
        prev = self._owners[i]() if self._owners[i] is not None else None
        if prev is not None:
            prev.materialize()
        return i

    def own(self, i: int, owner: "HostCounts"):
        """Slot i (claimed) now holds owner's counts -> its (buffers, event)."""
        self._owners[i] = weakref.ref(owner)
        return self._slots[i]  # shared, not copied: a HostCounts rebinds its dict, never changes it

    def pointers(self, *names) -> list:
        """Per slot, the addresses of its buffers `names` (for a kernel that writes a slot itself)."""
        return [tuple(bufs[n].data_ptr() for n in names) for bufs, _ in self._slots]


class BackendState:
    """Base of the per-backend handle state (a dataclass in each backend)."""


@dataclass
class ExpertLayout:
    """Where an expert-major dispatch put each received (row, top-k slot) (`layout="expert"`).

    Expert e's rows are ``x[offsets[e] : offsets[e] + num_tokens_per_expert[e]]``; a segment is padded
    with zero rows up to a multiple of `alignment` (grouped GEMMs want aligned segments), so
    ``offsets[e + 1] - offsets[e]`` is the padded count. Inside a segment the rows keep the received
    order (source rank, then position on the source): the same layout on every backend, so a run is
    reproducible. Rows past ``offsets[-1]`` (the worst-case capacity of a dispatch that did not wait on
    the host) are not written.
    """

    positions: torch.Tensor   # [R, K] int32: expert-major row of received row i's slot k, -1 if not here
    offsets: torch.Tensor     # [E_local + 1] int64 on the device: aligned segment starts, offsets[-1] = rows used
    num_rows: int             # rows of the expert-major tensors (exact, or the worst-case capacity)
    alignment: int = 1


@dataclass
class Handle:
    """What combine (and a cached dispatch) needs to reuse a dispatch's layout.

    num_recv is the number of rows of the dispatch output (the worst-case capacity when the
    dispatch did not wait on the host); num_recv_device holds the valid count on the device.
    """

    backend: str                    # name of the backend that made it
    num_tokens: int                 # T: tokens this rank dispatched
    num_recv: int                   # rows of the dispatch output (valid rows first)
    num_experts: int                # E: global expert count
    is_token_in_rank: torch.Tensor  # [T, W] bool
    topk_idx: torch.Tensor          # [T, K] global expert ids given to dispatch
    recv_topk_idx: Optional[torch.Tensor]  # [R, K] local expert ids, -1 where not on this rank
    num_recv_device: torch.Tensor   # [] int32/int64 on the rows' device: valid received rows
    num_tokens_per_expert: torch.Tensor  # [E_local] int64 on the rows' device
    counts: HostCounts = field(repr=False)  # host lists, read lazily
    state: BackendState = field(default_factory=BackendState, repr=False)
    exact: bool = True              # num_recv is the exact row count (the dispatch synced the host)
    expert: Optional[ExpertLayout] = None  # set by an expert-major dispatch (layout="expert")
    # Set by EPBuffer after the dispatch: combine and a cached dispatch refuse a handle of another buffer.
    buffer_id: Optional[int] = field(default=None, repr=False)
    # The caller's topk_idx when EPBuffer dispatched another tensor (repeated experts merged): a cached
    # dispatch accepts either.
    given_topk_idx: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def send_counts(self) -> List[int]:
        return self.counts.get("send_counts")

    @property
    def recv_counts(self) -> List[int]:
        return self.counts.get("recv_counts")

    @property
    def tokens_per_expert(self) -> List[int]:
        return self.counts.get("tokens_per_expert")


@dataclass
class DispatchOutput:
    """What a backend's dispatch returns to EPBuffer."""

    x: torch.Tensor                       # [R, H]
    scales: Optional[torch.Tensor]        # [R, H/128] for FP8 input, else None
    topk_idx: torch.Tensor                # [R, K] int64, local ids, -1 = not here
    topk_weights: Optional[torch.Tensor]  # [R, K] float32 (0 where topk_idx is -1)
    handle: Handle
    event: Optional[EPEvent] = None


@dataclass
class ContractDispatch:
    """What Backend.dispatch_contract returns: the dispatch, its rows already in the hierarchical contract's
    order (out.x, out.scales, out.topk_idx, out.topk_weights; out.handle is the backend's own, for its
    combine and cached dispatches), and that order's index and counts, as contract_order gives them."""

    out: DispatchOutput
    to_contract: torch.Tensor             # [R] int64: the output row of each received row (padding: itself)
    recv_counts: torch.Tensor             # [nodes * P] int64: rows from each source rank of the whole job


@dataclass
class DispatchResult:
    """What EPBuffer.dispatch returns (DESIGN.md, "The core contract")."""

    x: XInput                             # [R, H], or (data [R, H], scales [R, H/128]) for FP8 input
    topk_idx: torch.Tensor                # [R, K] int64 local expert ids, -1 where not on this rank
    topk_weights: Optional[torch.Tensor]  # [R, K] float32, 0 where topk_idx is -1
    handle: Handle                        # what combine and a cached dispatch need
    event: Optional[EPEvent] = None       # set for async calls: wait before using the outputs

    @property
    def tokens_per_expert(self) -> List[int]:
        """Rows per local expert (host values; waits for the pinned copy of the counts only)."""
        return self.handle.tokens_per_expert

    @property
    def num_tokens_per_expert(self) -> torch.Tensor:
        """Rows per local expert as an int64 device tensor (grouped-GEMM offsets)."""
        return self.handle.num_tokens_per_expert

    @property
    def num_recv(self) -> torch.Tensor:
        """Valid received rows, a device scalar (rows past it have topk_idx -1)."""
        return self.handle.num_recv_device


@dataclass
class ExpertDispatchResult:
    """What ``EPBuffer.dispatch(..., layout="expert")`` returns: one row per (token, local expert),
    grouped by local expert (see ExpertLayout), ready for a grouped GEMM."""

    x: XInput                             # [N, H], or (data [N, H], scales [N, H/128]) for FP8 input
    topk_weights: Optional[torch.Tensor]  # [N] float32: the routing weight of each row (0 on padding)
    handle: Handle                        # what combine and a cached dispatch need (handle.expert is set)
    event: Optional[EPEvent] = None       # set for async calls: wait before using the outputs

    @property
    def expert_offsets(self) -> torch.Tensor:
        """[E_local + 1] int64 device tensor: aligned start of each expert's rows."""
        return self.handle.expert.offsets

    @property
    def num_tokens_per_expert(self) -> torch.Tensor:
        """Rows per local expert, before padding, as an int64 device tensor."""
        return self.handle.num_tokens_per_expert

    @property
    def tokens_per_expert(self) -> List[int]:
        """Rows per local expert, before padding (host values; waits for the pinned copy only)."""
        return self.handle.tokens_per_expert

    @property
    def padded_tokens_per_expert(self) -> List[int]:
        """Rows per local expert after padding to the alignment (host values, what m_splits want)."""
        return padded(self.handle.tokens_per_expert, self.handle.expert.alignment)


@dataclass(eq=False)
class LowLatencyHandle:
    """What `EPBuffer.low_latency_combine` needs from its `low_latency_dispatch` (docs/LOW_LATENCY.md).

    W ranks, E_l local experts, M = `comm.low_latency.max_tokens_per_rank`. Local expert e holds the
    rows from source rank s in its slots [begin, begin + count), where begin = `layout_range[e, s] >> 32`
    and count = `layout_range[e, s] & 0xFFFFFFFF`: sources in rank order from slot 0 (in arrival order
    with `comm.low_latency.source_order: arrival`), each source's rows by token index ascending. A row's `src_info` entry is that token's index on its source rank;
    entries at and past the expert's total count are garbage. With a receive hook, the tensors are
    valid once the hook has run on the stream.

    Equality is identity: a handle stands for one dispatch.
    """

    src_info: torch.Tensor      # [E_l, W*M] int32: token index on the source rank of each received row
    layout_range: torch.Tensor  # [E_l, W] int64: (begin << 32) | count of each source rank's rows
    num_tokens: int             # T of the dispatching rank (combine's topk_idx/weights are [T, K])
    max_tokens: int             # M: rows per source rank in each expert's [W*M] slots
    hidden: int                 # H
    num_experts: int            # E, global
    topk: int                   # K
    use_fp8: bool               # whether the dispatch cast the rows to FP8
    backend: str                # name of the low-latency engine that made it
    state: Any = field(default=None, repr=False)  # private to that engine
    # Set by EPBuffer after the dispatch: combine refuses a handle from another buffer.
    buffer_id: Optional[int] = field(default=None, repr=False)


def counts_from_lists(send_counts: Sequence[int], recv_counts: Sequence[int],
                      tokens_per_expert: Sequence[int]) -> HostCounts:
    return HostCounts({"send_counts": list(send_counts), "recv_counts": list(recv_counts),
                       "tokens_per_expert": list(tokens_per_expert)})
