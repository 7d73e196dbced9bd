"""deep_ep.utils names that frameworks import (Megatron's fused_a2a: EventHandle, EventOverlap)."""
from __future__ import annotations

import torch

from .events import EventOverlap


class EventHandle:
    """An event recorded on the current stream when made (DeepEP's C++ EventHandle); `event` is None
    without CUDA, so waiting on it is a no-op there."""

    def __init__(self) -> None:
        self.event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


__all__ = ["EventHandle", "EventOverlap"]
