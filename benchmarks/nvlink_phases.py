"""Where an nvlink dispatch spends its time: the GPU time of each kernel launch (notify, stage, pull,
combine), from CUDA events recorded between the runtime's launches while the host is kept ahead of
the GPU (the calls queued behind a GPU sleep), plus notify on its own at --tokens and at 128 tokens.
Rows marked "fused" run stage and pull as one stage_pull kernel (comm.dispatch_kernel: fused).
The torch profiler's per-kernel view (bench_dispatch --breakdown) cannot give these: there the ranks
drift apart and each wait on a peer swallows the drift.

    python3 benchmarks/nvlink_phases.py                 # 2 GPUs, 4096 tokens, hidden 7168, top-8 of 256
    python3 benchmarks/nvlink_phases.py --world 4 --only "combine pull" --pull-variants 0 1 4 5 --pull-slots 3 4

Each line: a case, a rank, the time per call over --iters calls, and the median GPU time of each launch.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAUNCHES = ("notify", "stage", "pull", "stage_pull", "notify_stage_pull", "expert_pull", "combine", "combine_expert")


class TimedRuntime:
    """The nvlink runtime with a CUDA event pair around each kernel launch, on the current stream."""

    def __init__(self, rt, log: list):
        self._rt, self._log = rt, log

    def __getattr__(self, name):
        fn = getattr(self._rt, name)
        if name not in LAUNCHES:
            return fn

        def timed(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self._log.append((name, start, end))
            return out
        return timed


def _worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import ep_plugin

    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    buf = ep_plugin.EPBuffer(None, {"moe": {"num_experts": E, "topk": K},
                                    "comm": {"backend": "nvlink", "max_tokens_per_rank": T, "num_sms": args.num_sms}},
                             hidden=H)
    backend = buf._backend
    rt = backend._rt
    g = torch.Generator().manual_seed(rank)
    idx = torch.rand(T, E, generator=g).topk(K, 1).indices.cuda()
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    w = torch.rand(T, K, device="cuda")
    scales = torch.rand(T, H // 128, device="cuda") + 0.5
    x_fp8 = (x.float().view(T, -1, 128) / scales.unsqueeze(-1)).view(T, H).to(torch.float8_e4m3fn)
    first = buf.dispatch(x, idx, w)
    # notify's own outputs, for notify alone
    send_pos = torch.empty(T, world, dtype=torch.int32, device="cuda")
    is_in = torch.empty(T, world, dtype=torch.bool, device="cuda")
    recv_off = torch.empty(world + 1, dtype=torch.int32, device="cuda")
    tpe = torch.empty(E // world, dtype=torch.int64, device="cuda")
    log: list = []  # (launch, start event, end event) of the calls being timed

    def notify(n):
        return lambda: log.append(("notify", *_around(lambda: rt.notify(
            idx.data_ptr(), n, K, send_pos.data_ptr(), is_in.data_ptr(), recv_off.data_ptr(), tpe.data_ptr(),
            torch.cuda.current_stream().cuda_stream))))

    def with_attr(obj, attr, value, fn):  # the call with obj.<attr> set to value
        def call():
            old, _ = getattr(obj, attr), setattr(obj, attr, value)
            try:
                fn()
            finally:
                setattr(obj, attr, old)
        return call

    def mode(attr, value, fn):  # the call with backend.<attr> (dispatch_mode, combine_mode, notify_inside) set
        return with_attr(backend, attr, value, fn)

    def rt_mode(attr, value, fn):  # the call with the runtime's <attr> (stage_copy_engine, tma) set
        return with_attr(rt, attr, value, fn)

    def fused(fn):  # comm.dispatch_kernel fused: stage and pull as one stage_pull kernel
        return mode("dispatch_mode", "fused", fn)

    def pull_variant(slots, diag, variant=0):  # comm.combine_kernel pull with Runtime.pull_stage_slots /
        def call():                            # pull_diag / pull_variant set
            old, old_variant = rt.pull_stage_slots, rt.pull_variant
            rt.pull_stage_slots, rt.pull_diag, rt.pull_variant = slots, diag, variant
            try:
                mode("combine_mode", "pull", lambda: buf.combine(first.x, first.handle))()
            finally:
                rt.pull_stage_slots, rt.pull_diag, rt.pull_variant = old, 0, old_variant
        return call

    cases = {
        "dispatch BF16": lambda: buf.dispatch(x, idx, w),
        "dispatch BF16, fused": fused(lambda: buf.dispatch(x, idx, w)),
        "dispatch BF16, split": mode("dispatch_mode", "split", lambda: buf.dispatch(x, idx, w)),
        "dispatch BF16, fused, notify first": fused(mode("notify_inside", False, lambda: buf.dispatch(x, idx, w))),
        "dispatch BF16, split, stage after notify": mode("dispatch_mode", "split", mode(
            "stage_beside_notify", False, lambda: buf.dispatch(x, idx, w))),
        "dispatch BF16, split, stage kernel": mode("dispatch_mode", "split", rt_mode(
            "stage_copy_engine", False, lambda: buf.dispatch(x, idx, w))),
        "dispatch cached BF16, split, stage kernel": mode("dispatch_mode", "split", rt_mode(
            "stage_copy_engine", False, lambda: buf.dispatch(x, handle=first.handle))),
        "dispatch cached BF16, split": mode("dispatch_mode", "split", lambda: buf.dispatch(x, handle=first.handle)),
        "dispatch FP8": lambda: buf.dispatch((x_fp8, scales), idx, w),
        "dispatch FP8, fused": fused(lambda: buf.dispatch((x_fp8, scales), idx, w)),
        "dispatch cached BF16": lambda: buf.dispatch(x, handle=first.handle),
        "dispatch cached BF16, fused": fused(lambda: buf.dispatch(x, handle=first.handle)),
        **{f"combine BF16, {k}": mode("combine_mode", k, lambda: buf.combine(first.x, first.handle))
           for k in ("split", "fused", "pipelined", "pull")},
        "combine BF16, pull, copy-engine stage": mode("combine_mode", "pull", mode(
            "combine_stage_copy_engine", True, lambda: buf.combine(first.x, first.handle))),
        # the pull combine's halves alone (y is wrong in these rows) and its shared-memory split
        **{f"combine pull, {name}": pull_variant(slots, diag)
           for name, slots, diag in (("stage only", 5, 1), ("loads only", 5, 2), ("loads only, 3 stage slots", 3, 2),
                                     ("3 stage slots", 3, 0), ("4 stage slots", 4, 0),
                                     ("6 stage slots", 6, 0))},
        # Runtime.pull_variant (combine_pull_tma.cu): whole kernel, and its loads / stage alone, per stage slots
        **{f"combine pull v{v}, {s} stage slots{name}": pull_variant(s, diag, v)
           for v in args.pull_variants for s in args.pull_slots
           for name, diag in (("", 0), (", loads only", 2), (", stage only", 1))},
        f"notify alone, {T} tokens": notify(T),
        "notify alone, 128 tokens": notify(min(128, T)),
    }
    if args.pull_profile:  # one pull combine per variant and slot count, its blocks' wait cycles printed
        for v in args.pull_variants or [0]:
            for s in args.pull_slots:
                for _ in range(args.warmup):
                    pull_variant(s, 0, v)()
                torch.cuda.synchronize()
                dist.barrier()
                for late in (0, args.pull_profile_late) if args.pull_profile_late else (0,):
                    if rank == 0:
                        print(f"pull profile: variant {v}, {s} stage slots, last rank late by {late} cycles",
                              flush=True)
                    # queued behind a sleep, so the host's launch skew is hidden; the last rank then sleeps
                    # `late` cycles more (the skewed protocol's late rank, seen from inside the kernel)
                    torch.cuda._sleep(20_000_000)
                    if late and rank == world - 1:
                        torch.cuda._sleep(late)
                    pull_variant(s, 4, v)()
                    torch.cuda.synchronize()  # device printf flushes here
                    dist.barrier()
    backend._rt = TimedRuntime(rt, log)
    try:
        for name, fn in cases.items():
            if args.only not in name:
                continue
            for _ in range(args.warmup):
                fn()
            torch.cuda.synchronize()
            dist.barrier()
            log.clear()
            torch.cuda._sleep(20_000_000)  # the host queues every call before the first one starts
            t0, t1 = _around(lambda: [fn() for _ in range(args.iters)])
            torch.cuda.synchronize()
            per_launch: dict = {}
            for launch, start, end in log:
                per_launch.setdefault(launch, []).append(start.elapsed_time(end) * 1e3)
            row = (t0.elapsed_time(t1) * 1e3 / args.iters, {k: statistics.median(v) for k, v in per_launch.items()})
            rows = [None] * world
            dist.all_gather_object(rows, row)
            if rank == 0:
                for r, (per_call, launches) in enumerate(rows):
                    parts = ", ".join(f"{k} {v:.1f}" for k, v in launches.items())
                    print(f"{name:40s} rank {r}: {per_call:7.1f} us per call; {parts}", flush=True)
    finally:
        backend._rt = rt
        buf.close()
        dist.destroy_process_group()


def _around(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    return start, end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--num-sms", type=int, default=24)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--pull-variants", type=int, nargs="*", default=[],
                    help="Runtime.pull_variant values to time (0: as measured so far; +1 / +2 half / quarter "
                         "stager rows, +4 free load slots, +8 contiguous spans per block, +16 x read L2 evict_first)")
    ap.add_argument("--pull-slots", type=int, nargs="+", default=[3, 4], help="stage slots for --pull-variants")
    ap.add_argument("--pull-profile", action="store_true",
                    help="first, one pull combine per --pull-variants / --pull-slots with Runtime.pull_diag 4: blocks 0 "
                         "and last print their loader's and stager's cycles and the loader's waits (ready flags, "
                         "free slots, descriptors)")
    ap.add_argument("--pull-profile-late", type=int, default=0, metavar="CYCLES",
                    help="with --pull-profile: each profile twice, the second with the last rank CYCLES late "
                         "(protocols.SKEW_CYCLES = 100000, ~50 us: the skewed protocol's delay)")
    args = ap.parse_args()
    if torch.cuda.device_count() < args.world:
        raise SystemExit(f"nvlink_phases needs {args.world} GPUs, this machine has {torch.cuda.device_count()}")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.spawn(_worker, args=(args.world, port, args), nprocs=args.world)


if __name__ == "__main__":
    main()
