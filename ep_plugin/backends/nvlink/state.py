"""The nvlink backend's handle state and the host counts of a dispatch that did not wait on the host
(written into a pinned ring slot by the notify kernel itself); see backend.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...types import BackendState, HostCounts, PinnedRing


@dataclass
class NvlinkState(BackendState):
    send_pos: torch.Tensor   # [T, W] int32: slot of each token in each destination's receive order
    recv_off: torch.Tensor   # [W + 1] int32: receive offsets per source (recv_off[W] = rows received)
    recv_src: torch.Tensor   # [R] int32: source token of each received row
    worst_case: bool         # outputs sized for the worst case (no host sync)


def _diff(offsets):
    return [b - a for a, b in zip(offsets[:-1], offsets[1:])]


def _send_counts(c: "_DispatchCounts"):  # read only by the generic weight reduction: a sync, if asked
    return c._is_in.sum(0).tolist()


def _recv_counts(c: "_DispatchCounts"):
    return _diff(c.get("recv_off"))


class _DispatchCounts(HostCounts):
    """The host counts of a dispatch that did not wait on the host: tokens_per_expert and recv_off in
    a pinned ring slot, written there by the notify kernel itself (no copy after it), with an event
    recorded right behind notify (`written`); send_counts and recv_counts derived on first read. What
    HostCounts(device=...) gives, without its stream lookup and two copies (several us between notify
    and the next kernel at 128 tokens)."""

    def __init__(self, is_in: torch.Tensor, capturing: bool, ring: PinnedRing, slot: int):
        """slot: the ring slot notify was given (ring.claim(); its addresses: ring.pointers), ignored under capture."""
        # the state HostCounts.get/materialize read, as HostCounts.__init__ leaves it
        self._lists = {}
        self._derived = {"send_counts": _send_counts, "recv_counts": _recv_counts}
        self._is_in = is_in
        self._capturing = capturing
        self._pinned, self._event = {}, None
        if not capturing:  # captured: the device tensors are the only form; reading a host list raises
            self._pinned, self._event = ring.own(slot, self)

    def written(self, stream) -> None:
        """notify, which writes the pinned buffers, has been queued on `stream`."""
        if self._event is not None:
            self._event.record(stream)
