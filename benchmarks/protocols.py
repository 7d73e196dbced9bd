"""The two timing protocols of DESIGN.md ("Performance protocol"), and a per-kernel breakdown.

cold call: before every timed call the L2 is flushed (a 256 MB write), the device is drained and a
    `dist.barrier()` leaves host and GPUs idle and aligned; CUDA events around the call. Host work on
    the critical path (launch overhead, host syncs inside the call) is part of the time, as in a
    training step.
queued: the host enqueues all iterations back to back after one tiny all-reduce on the stream has
    aligned the GPUs; CUDA events around each call. Host latency hides behind the previous call, so
    this is the kernels' view (unless the call itself waits on the host).
host hidden (optional, "hidden"): the cold call's start (L2 flushed, device drained, ranks aligned),
    but the call is enqueued behind a GPU sleep (SLEEP_CYCLES, ~1.5 ms) long enough for the host to
    queue all of it, so the time is the kernels' own from a cold L2 and GPUs aligned as well as the hosts
    leave the barrier together (the sleeps start then; see aligned). cold - hidden is
    the host's share of a cold call (a call that waits on the host inside keeps that wait).
aligned (optional, diagnostic): hidden's start, and then one tiny all-reduce on the stream after the sleep,
    so every GPU starts the call within NCCL's latency of the others (the queued protocol's alignment) from a
    flushed L2 with the host hidden. hidden - aligned is what the ranks' start skew costs the call; aligned -
    queued what a cold L2 (and cold translations) cost it.
traced (optional, diagnostic): cold's start, the call between two marker kernels under the torch profiler
    (CUDA activity; bench_decode_pair.kernel_trace): `measure` adds `traced_timeline`, the median call's kernels
    per rank after the ranks' earliest marker -- the launch gap (the host's way from the marker to the call's
    first kernel), each kernel's start and length, the end. Where a cold call's time goes, ours and DeepEP's
    alike; its own times carry the profiler's overhead (read the timeline, not `traced_us`).
skewed (optional, diagnostic): aligned's start, then the last rank alone sleeps SKEW_CYCLES more (~50 us)
    before its call, the others start at once: (skewed - aligned) / the delay is how much of one late rank's
    delay the slowest rank pays (1: the others wait it out and lose nothing more; above 1: the late start
    also slows the work after it). The delay, timed on the late rank, is reported as `skewed_delay_us`.

cold, hidden and aligned stamp the host clock (CLOCK_MONOTONIC, one clock for every process on the host)
after the barrier and when the call returns; `measure` reports per protocol the median over iterations of
the ranks' spread after the barrier (`<p>_skew_us`), of the slowest rank's host time in the call
(`<p>_host_us`) and of the spread of the calls' returns (`<p>_ret_skew_us`): in a cold call the kernels
start about when the calls return, so that spread is about the start skew the slowest rank waits out.

Each protocol runs `warmup` untimed calls, then `iters` timed ones; a rank keeps its median. Every
rank then shares its numbers (`measure`), so all ranks hold the same per-rank lists and the slowest
rank's median is `max(list)`. Optional `before` / `after` callables run untimed around every call
(warm-up included; `before` ahead of the cold call's flush and barrier): the low-latency calls must
alternate dispatch, combine, dispatch, ... (DeepEP's rule), so a timed dispatch is followed by an
untimed combine and the other way round (`measure_low_latency`).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

FLUSH_BYTES = 256 * 1024 * 1024  # larger than H100/H200 L2 (50-60 MB)
SLEEP_CYCLES = 3_000_000  # ~1.5 ms at H100/H200 clocks: more than any call's host time
SKEW_CYCLES = 100_000  # the skewed protocol's late start: ~50 us at 1.98 GHz (timed, see skewed_delay_us)
Hook = Optional[Callable[[], object]]  # an untimed call around the timed one
PROTOCOLS = ("cold", "queued", "hidden", "aligned", "skewed", "traced")
STAMPED = ("cold", "hidden", "aligned", "skewed")  # protocols whose host stamps measure() summarises


def _call(fn: Hook) -> None:
    if fn is not None:
        fn()


class Protocols:
    def __init__(self, warmup: int, iters: int, kinds=("cold", "queued")):
        unknown = set(kinds) - set(PROTOCOLS)
        if unknown:
            raise ValueError(f"unknown protocols {sorted(unknown)}; known: {PROTOCOLS}")
        self.warmup, self.iters, self.kinds = warmup, iters, tuple(kinds)
        self._flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
        self._tok = torch.zeros(1, device="cuda")
        self.stamps: Dict[str, List[tuple]] = {}  # protocol -> [(ns after the barrier, ns at return)] per call
        self.delays: List[float] = []  # skewed: the late rank's extra sleep per call (us; empty elsewhere)
        self.traces: List = []  # traced: per call the kernels between the markers (bench_decode_pair.kernel_trace)

    def _events(self):
        return [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(self.iters)]

    def _warm(self, fn, before=None, after=None):
        for _ in range(self.warmup):
            _call(before)
            fn()
            _call(after)

    def cold(self, fn: Callable[[], object], before: Hook = None, after: Hook = None) -> List[float]:
        """Per-call times (us) under the cold-call protocol."""
        return self._cold(fn, before, after, "cold", hide_host=False)

    def hidden(self, fn: Callable[[], object], before: Hook = None, after: Hook = None) -> List[float]:
        """Per-call times (us) of a cold call whose host work is hidden behind a GPU sleep."""
        return self._cold(fn, before, after, "hidden", hide_host=True)

    def aligned(self, fn: Callable[[], object], before: Hook = None, after: Hook = None) -> List[float]:
        """Per-call times (us) of a cold call started together on every GPU, host hidden (see the module)."""
        return self._cold(fn, before, after, "aligned", hide_host=True, align=True)

    def skewed(self, fn: Callable[[], object], before: Hook = None, after: Hook = None) -> List[float]:
        """Per-call times (us) of an aligned call whose last rank starts SKEW_CYCLES late (see the module)."""
        late = dist.get_rank() == dist.get_world_size() - 1
        return self._cold(fn, before, after, "skewed", hide_host=True, align=True, late=late)

    def _cold(self, fn, before, after, name: str, hide_host: bool, align: bool = False, late: bool = False
              ) -> List[float]:
        self._warm(fn, before, after)
        evs = self._events()
        delays = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in evs] if late else []
        stamps = []
        for i, (a, b) in enumerate(evs):
            _call(before)
            self._flush.zero_()
            torch.cuda.synchronize()
            dist.barrier()  # NCCL's barrier also waits on the host for its all-reduce
            t0 = time.perf_counter_ns()
            if hide_host:
                torch.cuda._sleep(SLEEP_CYCLES)
            if align:
                dist.all_reduce(self._tok)  # on the stream: the GPUs leave it together, behind every sleep
            a.record()
            if late:  # inside the timed span on the late rank too: its own row shows the delay it caused
                delays[i][0].record()
                torch.cuda._sleep(SKEW_CYCLES)
                delays[i][1].record()
            fn()
            stamps.append((t0, time.perf_counter_ns()))
            b.record()
            _call(after)
        torch.cuda.synchronize()
        self.stamps[name] = stamps
        if name == "skewed":
            self.delays = [x.elapsed_time(y) * 1e3 for x, y in delays]
        return [a.elapsed_time(b) * 1e3 for a, b in evs]

    def traced(self, fn: Callable[[], object], before: Hook = None, after: Hook = None) -> List[float]:
        """Per-call times (us) of cold calls run between two marker kernels under the profiler; the kernels
        between the markers land in self.traces (see the module)."""
        from bench_decode_pair import kernel_trace  # (benchmarks/ on the path: the scripts run from there)

        self._warm(fn, before, after)
        evs = self._events()
        calls = iter(evs)

        def one(marker):
            a, b = next(calls)
            _call(before)
            self._flush.zero_()
            torch.cuda.synchronize()
            dist.barrier()
            marker()
            a.record()
            fn()
            b.record()
            marker()
            _call(after)

        self.traces = kernel_trace(one, self.iters)
        return [a.elapsed_time(b) * 1e3 for a, b in evs]

    def queued(self, fn: Callable[[], object], before: Hook = None, after: Hook = None) -> List[float]:
        """Per-call times (us) with the iterations enqueued back to back."""
        self._warm(fn, before, after)
        evs = self._events()
        self._flush.zero_()  # the first call sees a cold L2, the rest whatever the previous call left
        torch.cuda.synchronize()
        dist.barrier()
        dist.all_reduce(self._tok)  # on the stream: both GPUs start the first call together
        for a, b in evs:
            _call(before)
            a.record()
            fn()
            b.record()
            _call(after)
        torch.cuda.synchronize()
        return [a.elapsed_time(b) * 1e3 for a, b in evs]


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def measure(proto: Protocols, fn: Callable[[], object], protocols=None, *,
            before: Hook = None, after: Hook = None) -> Dict:
    """Time fn under proto.kinds (cold and queued by default) on every rank; returns the same dict on every rank:
    {"cold_us": [median per rank], "cold_min_us": [...], "queued_us": [...], "queued_min_us": [...],
     "error": None or the first rank's error}. A failure on any rank marks the op failed everywhere.
    before / after: untimed calls around every call of fn (see the module's docstring)."""
    protocols = proto.kinds if protocols is None else protocols
    mine: Dict[str, Optional[float]] = {}
    err = None
    try:
        for p in protocols:
            t = getattr(proto, p)(fn, before, after)
            mine[f"{p}_us"] = statistics.median(t)
            mine[f"{p}_min_us"] = min(t)
            if p == "skewed" and proto.delays:
                mine["skewed_delay_us"] = statistics.median(proto.delays)
    except Exception as exc:  # a broken op must not take the other rows with it
        err = _short(exc)
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
    stamps = {p: proto.stamps.get(p) for p in protocols if p in STAMPED and not err}
    traces = proto.traces if "traced" in protocols and not err else None
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (mine, err, stamps, traces))
    out: Dict = {"error": next((f"rank {r}: {e}" for r, (_, e, _, _) in enumerate(every) if e), None)}
    for p in protocols:
        for key in (f"{p}_us", f"{p}_min_us"):
            vals = [m.get(key) for m, _, _, _ in every]
            out[key] = None if out["error"] or any(v is None for v in vals) else [round(v, 2) for v in vals]
        if p in STAMPED and not out["error"]:
            out.update(stamp_summary(p, [s.get(p) for _, _, s, _ in every]))
        if p == "skewed" and not out["error"]:
            late = [m["skewed_delay_us"] for m, _, _, _ in every if m.get("skewed_delay_us") is not None]
            out["skewed_delay_us"] = round(late[0], 2) if late else None
        if p == "traced" and not out["error"] and all(t for _, _, _, t in every):
            from bench_decode_pair import timeline
            out["traced_timeline"] = timeline([t for _, _, _, t in every])
    return out


def stamp_summary(p: str, per_rank) -> Dict:
    """From each rank's [(after barrier, at return)] ns stamps of protocol p: the medians over iterations of
    the ranks' spread after the barrier, of the slowest rank's time in the call and of the returns' spread (us)."""
    if not per_rank or any(not s for s in per_rank) or len({len(s) for s in per_rank}) != 1:
        return {}
    its = list(zip(*per_rank))  # per iteration: one (t0, t1) per rank

    def med(f):
        return round(statistics.median(f(it) for it in its) / 1e3, 2)

    return {f"{p}_skew_us": med(lambda it: max(t0 for t0, _ in it) - min(t0 for t0, _ in it)),
            f"{p}_host_us": med(lambda it: max(t1 - t0 for t0, t1 in it)),
            f"{p}_ret_skew_us": med(lambda it: max(t1 for _, t1 in it) - min(t1 for _, t1 in it))}


# the low-latency ops, under a prefix per library ("ep_ll.", "deepep_ll."): the full calls, then the two
# halves of each call with return_recv_hook=True (the send half is the call, the receive half is hook())
LL_KINDS = ("dispatch_bf16", "dispatch_fp8", "combine_bf16", "dispatch_send_bf16", "dispatch_recv_bf16",
            "combine_send_bf16", "combine_recv_bf16")


def ll_op_names(prefix: str):
    return tuple(f"{prefix}.{k}" for k in LL_KINDS)


def measure_low_latency(proto: Protocols, prefix: str, dispatch: Callable, combine: Callable, expert_out,
                        kinds=LL_KINDS) -> Dict:
    """Every op of ll_op_names(prefix), each as `measure` records it, the calls alternating dispatch,
    combine, dispatch, ... on every rank (untimed partners in before/after) and every receive hook run
    before the next call of its kind.

    dispatch(use_fp8, hook) -> (recv_x, recv_count, handle, event, recv_hook);
    combine(x, handle, hook) -> (y, event, recv_hook); expert_out: the combine's input [E_l, W*M, H] BF16,
    in the layout of a dispatch of the same routing."""
    last: Dict = {}

    def d(fp8=False, hook=False):
        last["d"] = dispatch(fp8, hook)
        return last["d"]

    def c(hook=False):
        last["c"] = combine(expert_out, last["d"][2], hook)
        return last["c"]

    def d_hook():
        return d(False, True)

    def c_hook():
        return c(True)

    def recv_d():  # the receive half of the last dispatch
        return last["d"][4]()

    def recv_c():
        return last["c"][2]()

    def recv_d_then_c():
        recv_d()
        c()

    def d_then_c_hook():
        d()
        c(True)

    timed = {"dispatch_bf16": lambda: measure(proto, d, after=c),
             "dispatch_fp8": lambda: measure(proto, lambda: d(True), after=c),
             "combine_bf16": lambda: measure(proto, c, before=d),
             "dispatch_send_bf16": lambda: measure(proto, d_hook, after=recv_d_then_c),
             "dispatch_recv_bf16": lambda: measure(proto, recv_d, before=d_hook, after=c),
             "combine_send_bf16": lambda: measure(proto, c_hook, before=d, after=recv_c),
             "combine_recv_bf16": lambda: measure(proto, recv_c, before=d_then_c_hook)}
    return {f"{prefix}.{k}": timed[k]() for k in kinds}


def failed(error: str, protocols=PROTOCOLS) -> Dict:
    """The record of an op that could not run at all (e.g. its library did not import)."""
    out: Dict = {"error": error}
    for p in protocols:
        out[f"{p}_us"] = out[f"{p}_min_us"] = None
    return out


def _profiled_averages(fn: Callable[[], object], n: int, activity: str, per_event, top: int) -> Dict[str, float]:
    """Runs fn n times under the torch profiler (activity "CPU" or "CUDA"); per_event(event) gives
    (name, us over the n calls) or None; returns the `top` largest per-call averages and "total"."""
    try:
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        with profile(activities=[getattr(ProfilerActivity, activity)]) as prof:
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
        out: Dict[str, float] = {}
        for ev in prof.key_averages():
            got = per_event(ev)
            if got:
                out[got[0]] = round(out.get(got[0], 0.0) + got[1] / n, 2)
        total = round(sum(out.values()), 1)
        return {**dict(sorted(out.items(), key=lambda kv: -kv[1])[:top]), "total": total}
    except Exception as exc:  # profiler unavailable: not fatal
        return {"error": _short(exc)}


def host_breakdown(fn: Callable[[], object], n: int = 10, top: int = 8) -> Dict[str, float]:
    """Average host time per op (us per call, the op's own CPU time, children excluded) over n calls,
    via the torch profiler: the `top` largest, and "total". Where a step's time goes when its kernels
    add up to less than the step (the GPU waiting for the host)."""
    return _profiled_averages(fn, n, "CPU", lambda ev: (ev.key[:60], ev.self_cpu_time_total)
                              if ev.self_cpu_time_total else None, top)


def _kernel_time(ev):
    dt = getattr(ev, "self_device_time_total", None)  # kernels only: an op's own device time is 0
    if dt is None:
        dt = getattr(ev, "self_cuda_time_total", 0)
    if not dt:
        return None
    name = ev.key.replace("(anonymous namespace)::", "").replace("void ", "")
    return name.split("(")[0].split("<")[0].split("::")[-1][:60] or ev.key[:60], dt


def kernel_breakdown(fn: Callable[[], object], n: int = 10, top: int = 8) -> Dict[str, float]:
    """Average device time per kernel name (us per call) over n calls, via the torch profiler: the
    `top` largest, and "total" (every kernel)."""
    return _profiled_averages(fn, n, "CUDA", _kernel_time, top)
