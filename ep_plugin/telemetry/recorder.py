"""CommStats: what one EPBuffer's exchanges cost and moved, recorded per call with `comm.stats: true`.

Each call leaves a record: its time, the rows it moved per peer and the rows per local expert.
Times come from CUDA events on the GPU, read once the events have completed (`query()`, never a
wait: the hot path does not synchronise), and from host timers on CPU, where the torch backend's
calls return complete. Rows become bytes split by domain: `local` (a rank's rows to itself, a
copy) and `remote` (to the other ranks, the wire). Counts the backend already holds on the host are
read directly; a dispatch that did not wait on the host (nvlink with `comm.host_sync: false`) has
its counts reduced on a side stream after the call and copied to pinned memory without blocking.

A call only appends its record; records are folded into totals in batches, off the call's path,
and `summary()` folds the rest, waiting for the calls still in flight (report time only). Calls
made while a CUDA graph is being captured are counted, not timed (events cannot be read from
inside a graph).
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional

import torch

_LATEST = 512          # per op: the last call times kept for the median and maximum
_FOLD_EVERY = 256      # completed records folded into the totals at once
_MAX_IN_FLIGHT = 1024  # records not yet completed; past this the oldest is waited for
_EVENT_POOL = 64       # timing events kept for reuse


@dataclass(slots=True)
class _Record:
    op: str
    on_cuda: bool                      # timed with CUDA events (else host timers)
    start: Any                         # cuda Event, or perf_counter seconds
    end: Any
    row_bytes: int
    fresh: bool                        # a dispatch that routed (not a cached one): counts expert load
    sent: Optional[List[int]] = None   # rows per destination rank, in dispatch direction
    recv_total: int = 0                # rows received, in dispatch direction
    per_expert: Optional[List[int]] = None
    packed: Optional[torch.Tensor] = None  # pinned [W + E_local + 1]: sent, per expert, received
    ready: Any = None                  # event after which `packed` has landed
    seconds: float = 0.0               # the call's time, once known


class _OpTotals:
    """Running totals of one op (dispatch, combine, combine_weights)."""

    __slots__ = ("calls", "time_s", "latest", "sent_local", "sent_remote", "recv_local", "recv_remote")

    def __init__(self):
        self.calls, self.time_s = 0, 0.0
        self.latest: Deque[float] = collections.deque(maxlen=_LATEST)
        self.sent_local = self.sent_remote = self.recv_local = self.recv_remote = 0


def imbalance(values) -> Optional[float]:
    """max / mean (1.0 = perfectly even); None when there is nothing to compare."""
    values = list(values)
    total = sum(values)
    if not values or total <= 0:
        return None
    return max(values) * len(values) / total


class CommStats:
    """The records of one EPBuffer. rank/world: its place in the EP group; num_local_experts: E/W."""

    def __init__(self, rank: int, world: int, num_local_experts: int, backend: str):
        self.rank, self.world, self.num_local_experts, self.backend = rank, world, num_local_experts, backend
        self._in_flight: Deque[_Record] = collections.deque()   # CUDA records, oldest first
        self._done: List[_Record] = []                          # completed, not folded yet
        self._events: List[torch.cuda.Event] = []
        self._side = None                                       # stream for device-side counts
        self.reset()

    def reset(self) -> None:
        self._ops: Dict[str, _OpTotals] = {}
        self._sent_per_rank = [0] * self.world
        self._received = 0
        self._per_expert = [0] * self.num_local_experts
        self._timeouts = 0
        self._missing: set = set()
        self._captured = 0
        self._timer = None

    # ------------------------------------------------------------------ the call's path
    def begin(self, x: torch.Tensor):
        """Mark the start of a call on x's device; None while a CUDA graph is being captured."""
        if not x.is_cuda:
            return time.perf_counter()
        if torch.cuda.is_current_stream_capturing():
            self._captured += 1
            return None
        ev = self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def end(self, op: str, start, x: torch.Tensor, row_bytes: int, handle, event=None,
            fresh: bool = False) -> None:
        """Record a finished call. handle: the dispatch's Handle (counts); event: the EPEvent of an
        async call (its CUDA event marks the end), else the end is now on the current stream."""
        if start is None:
            return
        if not x.is_cuda:
            now = time.perf_counter()
            rec = _Record(op, False, start, now, row_bytes, fresh, handle.send_counts,
                          sum(handle.recv_counts), handle.tokens_per_expert if fresh else None, seconds=now - start)
            self._timer = "host"
            self._done.append(rec)
            if len(self._done) >= _FOLD_EVERY:
                self._fold()
            return
        rec = _Record(op, True, start, self._events.pop() if self._events else torch.cuda.Event(enable_timing=True),
                      row_bytes, fresh)
        done = getattr(event, "_cuda_event", None) if event is not None else None
        if done is None:
            rec.end.record()
        else:  # async: the call's own event is not a timing one; mark its completion on the side
            side = self._side_stream()
            side.wait_event(done)
            rec.end.record(side)
        if handle.exact:
            rec.sent, rec.recv_total = handle.send_counts, sum(handle.recv_counts)
            rec.per_expert = handle.tokens_per_expert if fresh else None
        else:
            self._counts_on_device(rec, handle)
        self._in_flight.append(rec)
        self._collect()

    def timeout(self, exc) -> None:
        """Count an EPTimeoutError once, however often the failed buffer raises it again."""
        if getattr(exc, "_ep_stats_counted", False):
            return
        exc._ep_stats_counted = True
        self._timeouts += 1
        self._missing.update(getattr(exc, "missing_ranks", ()))

    def _side_stream(self):
        if self._side is None:
            self._side = torch.cuda.Stream()
        return self._side

    def _counts_on_device(self, rec: _Record, handle) -> None:
        # The counts exist on the device only: reduce them on a side stream once the call is done,
        # so that neither the host nor the caller's streams wait for them.
        side = self._side_stream()
        side.wait_event(rec.end)
        parts = (handle.is_token_in_rank, handle.num_tokens_per_expert, handle.num_recv_device)
        with torch.cuda.stream(side):
            packed = torch.cat([parts[0].sum(0), parts[1].long().view(-1), parts[2].long().view(1)])
            rec.packed = torch.empty(packed.shape, dtype=torch.int64, pin_memory=True, device="cpu")
            rec.packed.copy_(packed, non_blocking=True)
            rec.ready = torch.cuda.Event()
            rec.ready.record(side)
        for t in parts:
            t.record_stream(side)

    def _collect(self, wait_all: bool = False) -> None:
        """Move completed CUDA records to the done list. Waits only at report time (wait_all), or
        for the oldest while more than _MAX_IN_FLIGHT are pending."""
        while self._in_flight:
            rec = self._in_flight[0]
            last = rec.ready if rec.ready is not None else rec.end
            if not last.query():
                if not (wait_all or len(self._in_flight) > _MAX_IN_FLIGHT):
                    break
                last.synchronize()
            self._in_flight.popleft()
            rec.seconds = rec.start.elapsed_time(rec.end) / 1e3
            self._timer = "cuda_events"
            if len(self._events) < _EVENT_POOL:
                self._events += [rec.start, rec.end]
            if rec.packed is not None:
                values = rec.packed.tolist()
                W, E = self.world, self.num_local_experts
                rec.sent, rec.recv_total = values[:W], values[W + E]
                rec.per_expert = values[W:W + E] if rec.fresh else None
            self._done.append(rec)
        if len(self._done) >= _FOLD_EVERY:
            self._fold()

    # ------------------------------------------------------------------ off the call's path
    def _fold(self) -> None:
        me, done, self._done = self.rank, self._done, []
        by_op: Dict[str, List[_Record]] = {}
        for rec in done:
            by_op.setdefault(rec.op, []).append(rec)
        for op, recs in by_op.items():
            t = self._ops.get(op)
            if t is None:
                t = self._ops[op] = _OpTotals()
            seconds = [r.seconds for r in recs]
            t.calls += len(recs)
            t.time_s += sum(seconds)
            t.latest.extend(seconds)
            mine = sum(r.sent[me] * r.row_bytes for r in recs)  # to itself = from itself
            out_b = sum(sum(r.sent) * r.row_bytes for r in recs)
            in_b = sum(r.recv_total * r.row_bytes for r in recs)
            if op != "dispatch":  # combine sends back what dispatch received
                out_b, in_b = in_b, out_b
            t.sent_local += mine
            t.recv_local += mine
            t.sent_remote += out_b - mine
            t.recv_remote += in_b - mine
            fresh = [r for r in recs if r.fresh] if op == "dispatch" else ()
            if fresh:
                self._sent_per_rank = [a + sum(c) for a, c in zip(self._sent_per_rank, zip(*(r.sent for r in fresh)))]
                self._received += sum(r.recv_total for r in fresh)
                loads = [r.per_expert for r in fresh if r.per_expert is not None]
                if loads:
                    self._per_expert = [a + sum(c) for a, c in zip(self._per_expert, zip(*loads))]

    def summary(self, reset: bool = False) -> Dict[str, Any]:
        """Everything recorded since the last reset, as a dict (waits for calls still in flight)."""
        self._collect(wait_all=True)
        self._fold()
        ops = {}
        for name, t in self._ops.items():
            latest = sorted(t.latest)
            got = t.recv_local + t.recv_remote
            ops[name] = {
                "calls": t.calls,
                "time_s": t.time_s,
                "mean_us": 1e6 * t.time_s / t.calls,
                "p50_us": 1e6 * latest[len(latest) // 2],
                "max_us": 1e6 * latest[-1],
                "bytes_sent": {"local": t.sent_local, "remote": t.sent_remote},
                "bytes_received": {"local": t.recv_local, "remote": t.recv_remote},
                "received_gb_per_s": got / t.time_s / 1e9 if t.time_s > 0 else None,
            }
        out = {
            "backend": self.backend, "rank": self.rank, "world": self.world,
            "timer": self._timer or "none",
            "calls": sum(t.calls for t in self._ops.values()),
            "comm_time_s": sum(t.time_s for t in self._ops.values()),
            "ops": ops,
            # all ops together (dispatch, combine, combine_weights; forward and backward), by domain:
            # local = this rank to itself, remote = to (from) the other ranks
            "bytes_sent": {d: sum(o["bytes_sent"][d] for o in ops.values()) for d in ("local", "remote")},
            "bytes_received": {d: sum(o["bytes_received"][d] for o in ops.values()) for d in ("local", "remote")},
            "rows_sent_per_rank": list(self._sent_per_rank),
            "rows_received": self._received,
            "rank_imbalance": imbalance(self._sent_per_rank),
            "tokens_per_expert": list(self._per_expert),
            "expert_imbalance": imbalance(self._per_expert),
            "timeouts": self._timeouts,
            "missing_ranks": sorted(self._missing),
            "captured_calls": self._captured,
        }
        if reset:
            self.reset()
        return out
