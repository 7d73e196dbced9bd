"""EventOverlap and Config as DeepEP V1 (v1.2.1) callers use them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch


class EventOverlap:
    """A completion a caller may wait on: an ep_plugin EPEvent, a CUDA event, or nothing (done).

    `current_stream_wait()` makes the current stream wait; `with event:` runs the block and then waits
    (DeepEP's overlap idiom). `extra_tensors` are kept alive until then, as in DeepEP."""

    def __init__(self, event=None, extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        ev = self.event
        if ev is None:
            return
        if isinstance(ev, torch.cuda.Event):
            torch.cuda.current_stream().wait_event(ev)
        else:  # an ep_plugin EPEvent or a deep_ep.utils.EventHandle
            ev.current_stream_wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait()


class _Done(EventOverlap):
    """The EventOverlap of a call that needs no waiting (no async_finish): one shared instance, read-only,
    instead of a new object per call."""

    def __init__(self) -> None:
        object.__setattr__(self, "event", None)
        object.__setattr__(self, "extra_tensors", None)

    def __setattr__(self, name, value) -> None:
        raise AttributeError("this EventOverlap (of a call without async_finish) is shared: make your own")


DONE = _Done()


@dataclass
class Config:
    """DeepEP's kernel tuning knobs. ep_plugin reads `num_sms` (the SMs its kernels use); the chunk
    and buffer sizes belong to DeepEP's ring buffers, which ep_plugin does not have."""

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 128

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes DeepEP would reserve; ep_plugin sizes its buffers from comm.max_tokens_per_rank."""
        return self.num_max_nvl_chunked_recv_tokens * num_ranks * hidden_bytes * 2

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


def capture() -> EventOverlap:
    """An event on the current stream (DeepEP's Buffer.capture())."""
    if not torch.cuda.is_available():
        return EventOverlap(None)
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream())
    return EventOverlap(ev)
