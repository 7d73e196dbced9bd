"""Stats across the ranks of an EP group: one line per interval, naming the slowest rank.

`collect(buffers)` is collective over the buffers' group: one all-gather of a few floats per rank,
at report time only. The framework integrations call it through an `IntervalReporter` every
`comm.stats_interval` steps and hand the `Report` to their framework's logging; the examples call
it themselves and print `Report.line()` (or `text()`, its part after the header):

    ep_plugin stats [nvlink, EP2] steps 11-20: 4,000 tokens/s, comm 25% (slowest rank 1: 30%),
    dispatch 812 us, combine 1.60 ms per call, max/mean rows per rank 1.50, per expert 1.50,
    timeouts 0, sent per step 210 MB remote + 216 MB local

"sent per step": the bytes all exchanges (dispatch, combine, weights; forward and backward) sent,
summed over the ranks, per step of the interval: remote = to the other ranks (the wire), local =
each rank to itself (a copy).
"""
from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .recorder import imbalance

# the floats each rank contributes, in this order
_FIELDS = ("comm_s", "rows_received", "tokens", "timeouts", "expert_imbalance", "dispatch_us",
           "combine_us", "calls", "sent_local", "sent_remote")


def merge(summaries: Sequence[dict]) -> dict:
    """One rank's summaries of several buffers (one per row width, say) as one: sums, and the
    worst expert imbalance."""
    if len(summaries) == 1:
        return summaries[0]
    ops: Dict[str, dict] = {}
    for s in summaries:
        for name, o in s["ops"].items():
            m = ops.setdefault(name, {"calls": 0, "time_s": 0.0})
            m["calls"] += o["calls"]
            m["time_s"] += o["time_s"]
    for m in ops.values():
        m["mean_us"] = 1e6 * m["time_s"] / m["calls"]
    worst = [s["expert_imbalance"] for s in summaries if s["expert_imbalance"] is not None]
    return {
        "backend": "+".join(sorted({s["backend"] for s in summaries})),
        "calls": sum(s["calls"] for s in summaries),
        "comm_time_s": sum(s["comm_time_s"] for s in summaries),
        "ops": ops,
        "rows_received": sum(s["rows_received"] for s in summaries),
        "bytes_sent": {d: sum(s["bytes_sent"][d] for s in summaries) for d in ("local", "remote")},
        "expert_imbalance": max(worst) if worst else None,
        "timeouts": sum(s["timeouts"] for s in summaries),
    }


@dataclass
class Report:
    """An interval's stats over the group. Lists are per rank of the group."""

    rank: int
    backend: str
    comm_s: List[float]
    rows_received: List[float]
    tokens: int                         # all ranks (0 = not counted)
    timeouts: int                       # all ranks
    expert_imbalance: Optional[float]   # the worst rank's max/mean over its local experts
    dispatch_us: float                  # mean per call, the slowest rank's
    combine_us: float
    wall_s: Optional[float]             # the interval's wall time, when the caller knows it
    steps: Optional[tuple] = None       # (first, last) step of the interval
    local: Optional[dict] = None        # this rank's own summary
    sent_local: Optional[List[float]] = None   # bytes each rank sent to itself in the interval
    sent_remote: Optional[List[float]] = None  # bytes each rank sent to the other ranks
    num_steps: Optional[int] = None     # steps the exchanges counted belong to (default: the span of `steps`)

    @property
    def world(self) -> int:
        return len(self.comm_s)

    @property
    def slowest_rank(self) -> int:
        return max(range(self.world), key=self.comm_s.__getitem__)

    @property
    def rank_imbalance(self) -> Optional[float]:
        return imbalance(self.rows_received)

    @property
    def comm_share(self) -> Optional[float]:
        """Mean over ranks of the time in exchanges, as a share of the wall time."""
        if not self.wall_s:
            return None
        return sum(self.comm_s) / self.world / self.wall_s

    @property
    def tokens_per_s(self) -> Optional[float]:
        return self.tokens / self.wall_s if self.wall_s and self.tokens else None

    @property
    def bytes_sent(self) -> Optional[Dict[str, float]]:
        """{"remote", "local"}: bytes the exchanges sent in the interval, summed over the ranks
        (None without exchange stats)."""
        if self.local is None or self.sent_local is None or self.sent_remote is None:
            return None
        return {"remote": float(sum(self.sent_remote)), "local": float(sum(self.sent_local))}

    @property
    def step_count(self) -> Optional[int]:
        """The steps the interval's exchanges belong to: `num_steps`, else the span of `steps`."""
        if self.num_steps is not None:
            return self.num_steps
        return self.steps[1] - self.steps[0] + 1 if self.steps else None

    @property
    def bytes_sent_per_step(self) -> Optional[Dict[str, float]]:
        """`bytes_sent` per step (None when the steps are not known, or none)."""
        sent, n = self.bytes_sent, self.step_count
        if sent is None or not n:
            return None
        return {k: v / n for k, v in sent.items()}

    def text(self) -> str:
        """tokens/s (when counted), communication share (of the wall time, when known) with the
        slowest rank, time per call, max/mean imbalance over ranks and experts, timeouts, bytes sent
        per domain (per step when the steps are known, else in the interval)."""
        parts = []
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:,.0f} tokens/s")
        if self.local is None:
            return ", ".join(parts + ["no exchange stats (comm.stats off)"])
        slow = self.slowest_rank
        if self.comm_share is not None:
            parts.append(f"comm {100 * self.comm_share:.0f}% (slowest rank {slow}: "
                         f"{100 * self.comm_s[slow] / self.wall_s:.0f}%)")
        else:
            parts.append(f"comm {sum(self.comm_s) / self.world:.3f} s (slowest rank {slow}: {self.comm_s[slow]:.3f} s)")
        parts.append(f"dispatch {_us(self.dispatch_us)}, combine {_us(self.combine_us)} per call")
        parts.append(f"max/mean rows per rank {_ratio(self.rank_imbalance)}, per expert {_ratio(self.expert_imbalance)}")
        parts.append(f"timeouts {self.timeouts}")
        sent, per_step = self.bytes_sent, self.bytes_sent_per_step
        if per_step is not None:
            parts.append(f"sent per step {_size(per_step['remote'])} remote + {_size(per_step['local'])} local")
        elif sent is not None:
            parts.append(f"sent {_size(sent['remote'])} remote + {_size(sent['local'])} local")
        return ", ".join(parts)

    def line(self) -> str:
        head = f"ep_plugin stats [{self.backend}, EP{self.world}]"
        if self.steps:
            head += f" steps {self.steps[0]}-{self.steps[1]}"
        return f"{head}: {self.text()}"

    def events(self, step: int) -> list:
        """(tag, value, step) triples, the form DeepSpeed's monitors write."""
        values = {"comm_share": self.comm_share, "tokens_per_s": self.tokens_per_s,
                  "slowest_rank": self.slowest_rank, "rank_imbalance": self.rank_imbalance,
                  "expert_imbalance": self.expert_imbalance, "dispatch_us": self.dispatch_us,
                  "combine_us": self.combine_us, "timeouts": self.timeouts}
        per_step = self.bytes_sent_per_step
        if per_step is not None:
            values.update({f"sent_{d}_bytes_per_step": per_step[d] for d in ("remote", "local")})
        return [(f"ep_plugin/{k}", float(v), step) for k, v in values.items() if v is not None]


def _us(v: float) -> str:
    return f"{v / 1e3:.2f} ms" if v >= 1e3 else f"{v:.0f} us"


def _ratio(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def _size(n: float) -> str:
    """Bytes, three significant digits: 812 B, 4.21 KB, 21.0 MB, 210 MB, 1.12 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            v = n / scale
            return f"{v:.{2 if v < 10 else 1 if v < 100 else 0}f} {unit}"
    return f"{n:.0f} B"


def collect(buffers, group=None, *, reset: bool = True, tokens: int = 0, wall_s: Optional[float] = None,
            steps: Optional[tuple] = None, num_steps: Optional[int] = None) -> Report:
    """Gather the stats of `buffers` (EPBuffers of this rank with comm.stats on; others are skipped)
    over `group` (default: the first buffer's). Collective: every rank of the group calls it, at the
    same point. tokens: this rank's tokens in the interval; wall_s: the interval's length; steps:
    (first, last) step of the interval; num_steps: how many steps the recorded exchanges belong to
    when that is not the span of `steps` (the bytes per step divide by it)."""
    mine = [b.stats(reset=reset) for b in buffers if b.cfg.comm.stats]
    if group is None:
        group = buffers[0].group if buffers else dist.group.WORLD
    s = merge(mine) if mine else None
    row = [0.0] * len(_FIELDS)
    if s is not None:
        ops = s["ops"]
        row = [s["comm_time_s"], s["rows_received"], tokens, s["timeouts"],
               s["expert_imbalance"] or 0.0, ops.get("dispatch", {}).get("mean_us", 0.0),
               ops.get("combine", {}).get("mean_us", 0.0), s["calls"], s["bytes_sent"]["local"],
               s["bytes_sent"]["remote"]]
    else:
        row[2] = tokens
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    mine_t = torch.tensor(row, dtype=torch.float64, device=device)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine_t) for _ in range(world)]
    dist.all_gather(gathered, mine_t, group=group)
    table = torch.stack(gathered).cpu().tolist()
    col = {name: [r[i] for r in table] for i, name in enumerate(_FIELDS)}
    worst = [v for v in col["expert_imbalance"] if v > 0]
    return Report(rank=dist.get_rank(group), backend=s["backend"] if s else "off", comm_s=col["comm_s"],
                  rows_received=col["rows_received"], tokens=int(sum(col["tokens"])),
                  timeouts=int(sum(col["timeouts"])), expert_imbalance=max(worst) if worst else None,
                  dispatch_us=max(col["dispatch_us"]), combine_us=max(col["combine_us"]), wall_s=wall_s,
                  steps=steps, local=s, sent_local=col["sent_local"], sent_remote=col["sent_remote"],
                  num_steps=num_steps)


class IntervalReporter:
    """Counts the steps of one EPBuffer and reports every `interval` of them through `emit` (rank 0
    of the buffer's group only; the collection itself is collective).

    A step is a forward pass, with gradients on, of the first layer that reports to this buffer:
    every layer of a model shares the buffer, so the first one's forwards count the steps (with
    gradient accumulation, micro-steps).

    The layer calls `step` before its exchanges, so a report made at step s holds the exchanges,
    tokens and time of the steps before s (back to the previous report's step): the report of
    steps 1-N covers steps 1..N-1, each later one N steps. The bytes per step divide by those."""

    def __init__(self, buf, interval: int, emit: Callable[[Report], None]):
        self.buf, self.interval, self.emit = buf, interval, emit
        self._owner = None
        self.steps = 0
        self._tokens = 0
        self._first = 1  # the first step whose exchanges and tokens the next report holds
        self._since = time.perf_counter()

    def step(self, layer, tokens: int) -> Optional[Report]:
        owner = self._owner() if self._owner is not None else None
        if owner is None:
            self._owner, owner = weakref.ref(layer), layer
        if owner is not layer:
            return None
        self.steps += 1
        report = None
        if self.steps % self.interval == 0:
            report = collect([self.buf], tokens=self._tokens, wall_s=time.perf_counter() - self._since,
                             steps=(self.steps - self.interval + 1, self.steps), num_steps=self.steps - self._first)
            self._since = time.perf_counter()
            self._tokens = 0
            self._first = self.steps
            if report.rank == 0:
                self.emit(report)
        self._tokens += tokens  # this step's exchanges come after the call: so do its tokens
        return report


_REPORTERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _in_backward() -> bool:
    """Whether this thread runs inside an autograd backward pass (a checkpoint's recompute)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def training_step(layer, buf, tokens: int, emit: Callable[[Report], None]) -> Optional[Report]:
    """What a framework layer calls at each forward: counts a step of `buf` when gradients are on
    and `comm.stats` is, and reports every `comm.stats_interval` steps. Returns the report made, if
    any. A forward run inside a backward pass (an activation-checkpoint recompute) is no step. Costs
    a dict lookup when stats are off."""
    comm = buf.cfg.comm
    if not comm.stats or comm.stats_interval is None or not torch.is_grad_enabled() or _in_backward():
        return None
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None  # a report is a collective and a host read: never inside a CUDA graph
    rep = _REPORTERS.get(buf)
    if rep is None:
        rep = _REPORTERS[buf] = IntervalReporter(buf, comm.stats_interval, emit)
    return rep.step(layer, tokens)


def log_to(logger: logging.Logger) -> Callable[[Report], None]:
    """An emitter writing `Report.line()` at INFO to `logger`. Where logging is not configured at
    all, the lines still show (the user asked for them): a handler goes on the "ep_plugin" logger."""

    def emit(report: Report) -> None:
        if not logger.hasHandlers():
            top = logging.getLogger("ep_plugin")
            top.addHandler(logging.StreamHandler())
            if top.level == logging.NOTSET:
                top.setLevel(logging.INFO)
        logger.info(report.line())

    return emit
