"""EPBuffer: the one dispatch/combine contract (DESIGN.md, "The core contract") over every backend.

The path of a token: EPBuffer.dispatch checks the call (ep_plugin.checks: types, shapes, devices,
capacity, the backend's capabilities, the handle's buffer; expert ids on the device) -> the backend
chosen once at construction moves the row to every rank owning one of its experts -> the experts run
-> EPBuffer.combine -> the backend sends the rows back and sums them per token. Both directions are
differentiable (autograd.py).

This class is a façade: the high-throughput calls live in buffer_ht.py, the low-latency calls
(`low_latency_dispatch`/`low_latency_combine`, docs/LOW_LATENCY.md) in buffer_ll.py, and every argument
check in ep_plugin/checks/, once per call form.

No host synchronisation in the checks: `topk_idx` outside [-1, E) is found on the device (by the
backend's own kernel when it declares `checks_expert_ids`, else by a few checks queued here), the
layouts treat bad ids as "routed nowhere" so no kernel indexes out of bounds, and the error is raised
as a ValueError at the next synchronising point -- a host-synced dispatch (`comm.host_sync: true`),
the next call once the flag's copy has landed, `EPEvent.synchronize()` or `EPBuffer.check()`.
`comm.validate: full` checks on the host before any kernel instead (one sync per dispatch).
"""
from __future__ import annotations

import itertools
from typing import Optional

import torch
import torch.distributed as dist

from .backends import make_backend
from .backends.registry import make_low_latency
from .buffer_ht import HighThroughputCalls
from .buffer_ll import LowLatencyCalls
from .checks import CallChecks, need
from .telemetry import CommStats, RecordingBackend

_buffer_ids = itertools.count(1)  # tells the handles of one buffer from another's


class EPBuffer(HighThroughputCalls, LowLatencyCalls):
    """Dispatch tokens to the ranks owning their top-k experts, and combine the results back.

    group: the expert-parallel ProcessGroup (None = WORLD). cfg: EPConfig, dict, YAML path or preset
    name. hidden: row width H. Rank r owns experts [r*E/W, (r+1)*E/W). The buffer owns the backend's
    communication memory: call close() (or use it as a context manager) before destroying the group;
    handles must not be used after close(), nor with another buffer.
    """

    # The calls, each defined with its checks' caller in its own file, named here as the façade's API.
    dispatch = HighThroughputCalls.dispatch
    combine = HighThroughputCalls.combine
    low_latency_dispatch = LowLatencyCalls.low_latency_dispatch
    low_latency_combine = LowLatencyCalls.low_latency_combine

    def __init__(self, group=None, cfg=None, hidden: int = None, *, num_experts: Optional[int] = None):
        from .config import load_config

        need(dist.is_available() and dist.is_initialized(), RuntimeError,
             "torch.distributed must be initialized before creating an EPBuffer")
        need(isinstance(hidden, int) and hidden > 0, ValueError, f"hidden must be a positive int, got {hidden!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.cfg = load_config(cfg, {"moe.num_experts": num_experts} if num_experts is not None else None)
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.num_experts = self.cfg.moe.num_experts
        self.cfg.check_ep_size(self.world)
        self.hidden = hidden
        self.num_local_experts = self.num_experts // self.world
        self._backend = make_backend(self.group, self.cfg, hidden, self.num_experts)
        self._stats = None
        if self.cfg.comm.stats:  # off: the backend itself, nothing added to a call
            self._stats = CommStats(self.rank, self.world, self.num_local_experts, self._backend.name)
            self._backend = RecordingBackend(self._backend, self._stats)
        self._id = next(_buffer_ids)
        self._checks = CallChecks(hidden=hidden, num_experts=self.num_experts, world=self.world,
                                  max_tokens=self.cfg.comm.max_tokens_per_rank, backend=self._backend.name,
                                  caps=self._backend.capabilities, device_problem=self._backend.device_problem,
                                  full_validation=self.cfg.comm.validate == "full", buffer_id=self._id)
        self._low_latency = None          # the engine, built at the first low-latency call
        self._low_latency_mask: tuple = ()
        self._closed = False

    def _low_latency_engine(self):
        """The low-latency engine, built at the first low-latency call (a collective over the group)."""
        if self._low_latency is None:
            self._low_latency = make_low_latency(self.group, self.cfg, self.hidden, self.num_experts)
            if self._low_latency_mask:
                self._low_latency.set_mask(list(self._low_latency_mask))
        return self._low_latency

    @property
    def backend_name(self) -> str:
        return self._backend.name

    @property
    def capabilities(self):
        """What the chosen backend takes (backends.base.Capabilities): row and combine dtypes, FP8, top-k."""
        return self._checks.caps

    @property
    def _caps(self):
        return self._checks.caps

    @_caps.setter
    def _caps(self, caps) -> None:  # tests narrow a backend's capabilities: the checked forms no longer hold
        self._checks.caps = caps
        self._checks.forms.clear()

    def stats(self, reset: bool = False) -> dict:
        """What this buffer's exchanges cost and moved since the last reset (comm.stats: true): per op
        calls and times (device times from CUDA events, host times on CPU), bytes sent and received
        per domain (local = to itself, remote = to other ranks), rows per destination rank and per
        local expert with their max/mean imbalance, and timeouts. Waits for the exchanges still in
        flight, so call it at report time, not per step. See ep_plugin.telemetry."""
        need(self._stats is not None, RuntimeError,
              "stats are off for this buffer: set comm.stats: true in its config")
        return self._stats.summary(reset=reset)

    # ---------------------------------------------------------------- errors
    def _raise_pending(self) -> None:
        self._backend.check()
        self._checks.expert_ids_flag.raise_if_seen()

    def check_finished(self) -> None:
        """Raise what finished work reported (EPTimeoutError naming the missing ranks, or ValueError for
        expert ids out of range), without waiting. Covers the low-latency engine too."""
        self._backend.check()
        if self._low_latency is not None:
            self._low_latency.check()
        self._checks.expert_ids_flag.raise_if_seen()

    def check(self) -> None:
        """Wait for this rank's queued work on the current stream, then raise what it reported."""
        self._backend.wait_pending()
        if self._low_latency is not None:
            self._low_latency.wait_pending()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()
        self.check_finished()

    synchronize = check

    def close(self) -> None:
        """Release the backend's and the low-latency engine's communication resources; safe to repeat."""
        self._closed = True
        self._backend.close()
        if self._low_latency is not None:
            self._low_latency.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

