"""Where a call's host time goes ON THE GPU HOST: EPBuffer.dispatch, the cached dispatch and combine on the
nvlink backend with its real kernels, each kernel launch stamped on the host (bench_nvlink_host.py is the
same path on a CPU box, with fakes).

    python3 benchmarks/bench_nvlink_host_gpu.py --world 4 --sms 24
    CUDA_VISIBLE_DEVICES=0,1 python3 benchmarks/bench_nvlink_host_gpu.py --world 2
    PYTHONPATH=/tmp/base python3 benchmarks/bench_nvlink_host_gpu.py ...   # another ep_plugin tree (with its _C)

The runtime (_C.NvlinkRuntime) is wrapped so that each launch records time.perf_counter_ns when it returns
(a Python call and an append per launch added to what is measured). bench_inputs' throughput case: 4096
tokens per rank, hidden 7168, top-8 of 256, BF16, comm.*_kernel auto. Protocols:
- cold: protocols.py's cold call (L2 flush, device drained, dist.barrier, CUDA events around the call);
- hidden: the same with the call queued behind a GPU sleep (its host time is then off the GPU's clock);
- warm: calls back to back, the host never waiting for the GPU (what the host costs in a queued run).
Per op and protocol: the slowest rank's median host us from entering the call to the entry and the return
of each launch ("notify>" / "notify@", "stage>" / "stage@", ...: ">" - previous "@" is Python, "@" - ">" the
pybind call and the kernel launch; the first "@" is what an idle GPU waits for), to the call's return
("return@"), and the GPU us between the events ("gpu"). cold - hidden in "gpu" is the host's share of a
cold call; a cold "notify@" well above the warm one is what an idle host pays on top (caches, clocks).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
try:  # an ep_plugin on PYTHONPATH wins over this tree
    import ep_plugin
except ImportError:
    sys.path.append(os.path.dirname(HERE))
    import ep_plugin

from bench_inputs import H, ep_config, make_inputs  # noqa: E402
from bench_launch import init_rank, run_world  # noqa: E402
from protocols import FLUSH_BYTES, SLEEP_CYCLES  # noqa: E402

LAUNCHES = ("notify", "stage", "pull", "stage_pull", "notify_stage_pull", "stage_begin", "stage_end", "expert_pull",
            "combine", "combine_expert")
MODES = ("cold", "hidden", "warm")
clock = time.perf_counter_ns


def _stamping(fn, name, stamps):
    def call(*args):
        stamps.append((name + ">", clock()))  # entering the launch: Python before it, the launch after
        out = fn(*args)
        stamps.append((name + "@", clock()))
        return out
    return call


class Stamped:
    """The real runtime, its launch methods stamping `stamps` as they return; everything else passes through."""

    def __init__(self, rt, stamps):
        self.__dict__["_rt"] = rt
        for name in dir(type(rt)):  # bound once: a lookup through __getattr__ per call would add time
            attr = getattr(type(rt), name)
            if not name.startswith("_") and callable(attr) and not isinstance(attr, property):
                fn = getattr(rt, name)
                self.__dict__[name] = _stamping(fn, name, stamps) if name in LAUNCHES else fn

    def __getattr__(self, name):
        return getattr(self.__dict__["_rt"], name)

    def __setattr__(self, name, value):
        setattr(self.__dict__["_rt"], name, value)


def timeline(fn, stamps, mode, warmup, iters, flush):
    """Median host us per launch position (as "<name>@"), to the return, and GPU us, over `iters` calls."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(warmup + iters)]
    host = []
    for i, (a, b) in enumerate(events):
        if mode != "warm":
            flush.zero_()
            torch.cuda.synchronize()
            dist.barrier()
            if mode == "hidden":
                torch.cuda._sleep(SLEEP_CYCLES)
        a.record()
        del stamps[:]
        t0 = clock()
        fn()  # its result is dropped here, as in protocols.py
        t1 = clock()
        b.record()
        if i >= warmup:
            host.append([(n, (t - t0) / 1e3) for n, t in stamps] + [("return@", (t1 - t0) / 1e3)])
    torch.cuda.synchronize()
    out = {}
    for pos in range(min(len(h) for h in host)):
        name = host[0][pos][0]
        out[name] = round(statistics.median(h[pos][1] for h in host), 2)
    out["gpu"] = round(statistics.median(a.elapsed_time(b) * 1e3 for a, b in events[warmup:]), 2)
    return out


def profile(fn, op, n, rank):
    """cProfile over n calls, each alone (the GPU drained between them, outside the profile), on every rank
    (the kernels meet); rank 0 prints the functions by their own time: which Python a call pays for."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    for _ in range(n):
        torch.cuda.synchronize()
        prof.enable()
        fn()
        prof.disable()
    torch.cuda.synchronize()
    if rank == 0:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
        body = text.getvalue()
        print(f"--- profile {op}, {n} calls (us = s * {1e6 / n:.0f}) ---\n" + body[body.find("ncalls"):], flush=True)


def rank_main(rank, world, port, args, q):
    init_rank(rank, world, port)
    inp = make_inputs("throughput", rank, world)
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    report = {"world": world, "sms": args.sms, "ep_plugin": os.path.dirname(ep_plugin.__file__), "rows": []}
    stamps: list = []
    buf = ep_plugin.EPBuffer(None, ep_config("nvlink", args.sms), hidden=H)
    be = buf._backend
    be._rt = Stamped(be._rt, stamps)
    first = buf.dispatch(inp.x, inp.idx, inp.w)
    # expert-major (what the Megatron and DeepSpeed integrations ask for): the nvlink kernels merge repeated
    # experts (notify and stage, Capabilities.merges_repeats), so its first launch is notify too
    ex = buf.dispatch(inp.x, inp.idx, inp.w, layout="expert", expert_alignment=128)
    ops = {"dispatch": lambda: buf.dispatch(inp.x, inp.idx, inp.w),
           "cached": lambda: buf.dispatch(inp.x, handle=first.handle),
           "combine": lambda: buf.combine(first.x, first.handle),
           "expert": lambda: buf.dispatch(inp.x, inp.idx, inp.w, layout="expert", expert_alignment=128),
           "combine_e": lambda: buf.combine(ex.x, ex.handle)}
    if args.ops:
        ops = {k: v for k, v in ops.items() if k in args.ops}
    for op, fn in ops.items():
        for mode in MODES:
            mine = timeline(fn, stamps, mode, args.warmup, args.iters, flush)
            every = [None] * world
            dist.all_gather_object(every, mine)
            row = {"op": op, "mode": mode, "slowest": {k: max(r[k] for r in every) for k in mine},
                   "per_rank": every}
            report["rows"].append(row)
            if rank == 0:
                cells = "  ".join(f"{k} {v:7.1f}" for k, v in row["slowest"].items())
                print(f"EP{world} {args.sms} SMs {op:9s} {mode:6s} {cells}", flush=True)
        if args.profile:
            profile(fn, op, args.profile, rank)
    del first, ex
    buf.close()
    if rank == 0:
        q.put(("done", report))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sms", type=int, default=24)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--ops", nargs="+", choices=["dispatch", "cached", "combine", "expert", "combine_e"],
                    help="a subset of the ops (default: all)")
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after each op's timelines, cProfile N lone calls and print rank 0's costliest functions")
    ap.add_argument("--out", default=None, help="folder for bench_nvlink_host_gpu_ep<W>.json")
    args = ap.parse_args(argv)
    report, done = run_world(rank_main, args.world, args, on_partial=lambda body: None)
    if args.out and report:
        os.makedirs(args.out, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "torch": torch.__version__, "complete": done}
        path = os.path.join(args.out, f"bench_nvlink_host_gpu_ep{args.world}.json")
        with open(path, "w") as f:
            json.dump({"meta": meta, **report}, f, indent=1)
        print(f"wrote {path}")
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
