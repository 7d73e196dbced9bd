"""Where a hierarchical call's time goes: stage boundaries marked on the stream and on the host.

Off by default (the backend's ``timeline`` is None and a call marks nothing). A benchmark turns it
on with ``backend.timeline = StageTimeline()``; every dispatch and combine then records, at each
stage boundary, a CUDA event on the current stream and the host clock. After the calls,
``summary()`` (it synchronizes) gives per call kind (``dispatch``, ``dispatch_cached``, ``combine``)
and stage the median GPU time between consecutive marks (what the stream spent from the previous
boundary to this one: the stage's kernels, and any gap while the stream waited for the host to
launch them) and the median host time (what the host spent issuing the stage).

Stages (docs/INTERNODE.md, "Where the time goes"), in call order:
  dispatch:  layout (routing masks, counts all-to-all) | rail_send | rail_recv | forward (the inner
             NVLink dispatch, or the one-rank node's packing) | reorder (to the contract's order)
  combine:   reorder (back to the inner order) | reduce_in_node (inner combine, or the one-rank
             node's gather) | rail_send | rail_recv_sum (the origin's wait and sum)
A stage a call does not have (reorder with one rank per node) is not marked. The combine of session 8
(HierarchicalBackend.fused_combine) has no reorder (the inner combine reads x through its index); with
every rail peer over P2P its reduce_in_node also stores the rows at the rail peers and rail_send only
signals; with one rank per node reduce_in_node is empty (the rail's send reads x in place). The cached
dispatch of session 10 (HierarchicalBackend.direct_cached_dispatch) has no reorder either: where the
inner backend writes through an index, its pull stores the rows in the contract's order. Nor does the
fresh dispatch with HierarchicalBackend.direct_fresh_dispatch on (off by default), where the inner pull
computes the contract positions itself: its forward ends in the contract's order.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch


@dataclass
class _Call:
    kind: str
    marks: List[Tuple[str, Optional[torch.cuda.Event], float]] = field(default_factory=list)


class StageTimeline:
    """Collects stage marks of the calls made while it is attached (see the module docstring)."""

    def __init__(self, max_calls: int = 1000):
        self.max_calls = max_calls
        self.calls: List[_Call] = []
        self._open: Optional[_Call] = None
        self.enabled = True

    def begin(self, kind: str) -> None:
        if not self.enabled or len(self.calls) >= self.max_calls:
            self._open = None
            return
        self._open = _Call(kind)
        self.mark("start")

    def mark(self, stage: str) -> None:
        c = self._open
        if c is None:
            return
        ev = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        c.marks.append((stage, ev, time.perf_counter()))

    def end(self, stage: str) -> None:
        """Marks the call's last stage and files the call."""
        c = self._open
        if c is None:
            return
        self.mark(stage)
        self.calls.append(c)
        self._open = None

    def clear(self) -> None:
        self.calls = []
        self._open = None

    def per_call(self) -> List[Dict[str, object]]:
        """[{kind, stages: {stage: (gpu_us or None, host_us)}}] per recorded call (synchronizes)."""
        if any(ev is not None for c in self.calls for _, ev, _ in c.marks):
            torch.cuda.synchronize()
        out = []
        for c in self.calls:
            stages = {}
            for (_, ev0, h0), (name, ev1, h1) in zip(c.marks, c.marks[1:]):
                gpu = ev0.elapsed_time(ev1) * 1e3 if ev0 is not None and ev1 is not None else None
                stages[name] = (gpu, (h1 - h0) * 1e6)
            out.append({"kind": c.kind, "stages": stages})
        return out

    def summary(self) -> Dict[str, Dict[str, Dict[str, Optional[float]]]]:
        """{kind: {stage: {"gpu_us", "host_us"}}}: medians over the recorded calls of each kind, stages
        in call order, plus "total" (the sum of the stages' medians)."""
        by_kind: Dict[str, Dict[str, List[Tuple[Optional[float], float]]]] = {}
        for call in self.per_call():
            stages = by_kind.setdefault(call["kind"], {})
            for name, v in call["stages"].items():
                stages.setdefault(name, []).append(v)
        out = {}
        for kind, stages in by_kind.items():
            row = {}
            for name, vals in stages.items():
                gpus = [g for g, _ in vals if g is not None]
                row[name] = {"gpu_us": round(statistics.median(gpus), 1) if gpus else None,
                             "host_us": round(statistics.median([h for _, h in vals]), 1)}
            gpu_total = [v["gpu_us"] for v in row.values() if v["gpu_us"] is not None]
            row["total"] = {"gpu_us": round(sum(gpu_total), 1) if gpu_total else None,
                            "host_us": round(sum(v["host_us"] for v in row.values()), 1)}
            out[kind] = row
        return out


class NoTimeline:
    """What a backend holds while no timeline is attached: every mark is a no-op."""

    enabled = False

    def begin(self, kind: str) -> None:
        pass

    def mark(self, stage: str) -> None:
        pass

    def end(self, stage: str) -> None:
        pass


NO_TIMELINE = NoTimeline()
