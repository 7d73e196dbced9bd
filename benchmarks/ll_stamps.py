"""Where the time goes inside the low-latency kernels: their phase stamps (csrc/nvshmem/ll_device.cuh,
"Phase stamps"), collected by bench_decode_pair.py --stamps N.

Thread 0 of every block writes %globaltimer at the phase boundaries of the output-set dispatch and of the
combine. A sample is the last of `pairs` eager pairs queued back to back (the stamps zeroed on the stream
before it, so that a stamp only one block writes -- the signal -- is that pair's); per sample and rank
each boundary becomes min / median / max over the blocks, in us after the rank's earliest dispatch
entry; the samples' medians of those are kept. %globaltimer counts in ns on each GPU: a rank's phases
compare exactly, ranks with each other only as far as the GPUs' timers agree (`t0_ns`).
"""
from __future__ import annotations

import statistics
from typing import Callable, Dict, List, Optional

DISPATCH_SLOTS = ("entry", "routing", "placed", "rows_out", "fenced", "signal", "signals_in", "done")
COMBINE_SLOTS = ("entry", "rows_out", "fenced", "signal", "signals_in", "done", "picked", "summed")
KERNELS = (("dispatch", DISPATCH_SLOTS), ("combine", COMBINE_SLOTS))


def summarize(stamps) -> Dict:
    """One launch pair's stamps (a [2, blocks, 8] int64 tensor, 0 = not written) -> {"t0_ns": the earliest
    dispatch entry, "dispatch.routing": [min, median, max] us after it over the blocks, ...}."""
    import torch
    st = stamps.to("cpu", torch.int64)
    entry = st[0, :, 0]
    entry = entry[entry > 0]
    if entry.numel() == 0:
        return {}
    t0 = int(entry.min())
    out: Dict = {"t0_ns": t0}
    for k, (kernel, slots) in enumerate(KERNELS):
        for i, name in enumerate(slots):
            v = st[k, :, i]
            v = v[v > 0]
            if v.numel() == 0:
                continue
            rel = ((v - t0).double() / 1e3).tolist()
            out[f"{kernel}.{name}"] = [round(min(rel), 2), round(statistics.median(rel), 2), round(max(rel), 2)]
    return out


def collect(engine, fn: Callable[[], object], samples: int, pairs: int, sync: Callable[[], None],
            barrier: Callable[[], None], capture: Optional[Callable] = None) -> Optional[Dict]:
    """`samples` samples of `pairs` queued calls of fn (an eager dispatch + combine) with the engine's
    stamps on -> the per-boundary medians over the samples (summarize's keys); None where the engine
    has no stamps (the torch engine, DeepEP). capture: fn -> a CUDA graph of it, taken with the stamps on
    (which the capture keeps); each call is then a replay."""
    if engine is None or not hasattr(engine, "phase_stamps") or samples < 1:
        return None
    st = engine.phase_stamps(True)
    rows: List[Dict] = []
    g = None
    try:
        call = fn
        if capture is not None:
            g = capture(fn)
            call = g.replay
        for _ in range(samples):
            barrier()
            for _ in range(max(pairs, 1) - 1):
                call()
            st.zero_()  # on the stream, between the queued pairs
            call()
            sync()
            rows.append(summarize(st))
    finally:
        del g
        engine.phase_stamps(False)
    rows = [r for r in rows if r]
    if not rows:
        return None
    out: Dict = {"samples": len(rows), "pairs_per_sample": pairs, "t0_ns": rows[-1]["t0_ns"]}
    for key in rows[0]:
        if key == "t0_ns":
            continue
        have = [r[key] for r in rows if key in r]
        out[key] = [round(statistics.median(x[j] for x in have), 2) for j in range(3)]
    return out


def lines(per_rank: List[Optional[Dict]]) -> List[str]:
    """A line per rank and kernel: each boundary's median over the blocks (max in brackets), us after the
    rank's first dispatch entry."""
    out = []
    base = next((r["t0_ns"] for r in per_rank if r), None)
    for rank, r in enumerate(per_rank):
        if not r:
            continue
        skew = (r["t0_ns"] - base) / 1e3 if base is not None else 0.0
        for kernel, slots in KERNELS:
            parts = [f"{name} {r[f'{kernel}.{name}'][1]:.1f} ({r[f'{kernel}.{name}'][2]:.1f})"
                     for name in slots if f"{kernel}.{name}" in r]
            head = f"stamps r{rank} {kernel:8s}"
            if kernel == "dispatch":
                head += f" [entry {skew:+.1f} us vs r0's timer]"
            out.append(f"    {head}: " + ", ".join(parts))
    return out
