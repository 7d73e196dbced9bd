"""The contract every transport implements; EPBuffer validates inputs and adds autograd on top.

A backend receives inputs that EPBuffer has already checked (dtype, device, shape, contiguity,
index range, capacity), so it only moves bytes. Semantics (DESIGN.md, "The core contract"):
rank r owns experts [r*E/W, (r+1)*E/W); a token goes to a rank once; received rows are ordered by
source rank, then by position on the source; combine sums the rows sent back for each token.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch


class EPEvent:
    """Completion of an asynchronous dispatch/combine.

    Wraps the torch.distributed work objects and/or a CUDA event of the communication stream.
    `current_stream_wait()` makes the caller's stream (or the host, on CPU) wait for completion.
    """

    def __init__(self, works=(), cuda_event: Optional[torch.cuda.Event] = None, on_complete=None):
        self._works = list(works)
        self._cuda_event = cuda_event
        self._on_complete = on_complete

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


@dataclass
class Handle:
    """What combine (and a cached dispatch) needs to reuse a dispatch's layout."""

    num_tokens: int                 # T: tokens this rank dispatched
    num_recv: int                   # R: rows this rank received
    num_experts: int                # E: global expert count
    is_token_in_rank: torch.Tensor  # [T, W] bool
    send_counts: List[int]          # rows sent to each rank
    recv_counts: List[int]          # rows received from each rank
    tokens_per_expert: List[int]    # per local expert, host values
    topk_idx: torch.Tensor          # [T, K] global expert ids given to dispatch
    recv_topk_idx: torch.Tensor     # [R, K] local expert ids, -1 where not on this rank
    backend_state: Any = field(default=None, repr=False)  # private to the backend that made it


@dataclass
class DispatchOutput:
    x: torch.Tensor                       # [R, H]
    scales: Optional[torch.Tensor]        # [R, H/128] for FP8 input, else None
    topk_idx: torch.Tensor                # [R, K] int64, local ids, -1 = not here
    topk_weights: Optional[torch.Tensor]  # [R, K] float32 (0 where topk_idx is -1)
    tokens_per_expert: List[int]
    handle: Handle
    event: Optional[EPEvent] = None


class Backend(abc.ABC):
    name = "base"

    def __init__(self, group, cfg, hidden: int, num_experts: int):
        self.group = group
        self.cfg = cfg
        self.hidden = hidden
        self.num_experts = num_experts
        self.rank = torch.distributed.get_rank(group)
        self.world = torch.distributed.get_world_size(group)
        self.experts_per_rank = num_experts // self.world

    @abc.abstractmethod
    def dispatch(self, x: torch.Tensor, scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                 topk_weights: Optional[torch.Tensor], handle: Optional[Handle] = None,
                 async_op: bool = False) -> DispatchOutput:
        """Send rows to the ranks owning their experts. With `handle`, reuse its layout (cached mode);
        `topk_idx` is then the handle's. With `async_op`, return before completion with `event` set."""

    @abc.abstractmethod
    def combine(self, x: torch.Tensor, handle: Handle, async_op: bool = False):
        """Send received rows back and sum them per original token: returns (y [T, H], event or None)."""

    def close(self) -> None:
        """Release transport resources; safe to call more than once."""
