"""What recording costs per call (comm.stats: true against false).

    python -m ep_plugin.telemetry.bench                       # one process: gloo on CPU, NCCL on a GPU
    torchrun --nproc-per-node 2 -m ep_plugin.telemetry.bench  # an EP group of 2 (rank 0 prints)

  recorder  CommStats.begin + end alone, on a call whose counts are host lists: the host work added
            to each call (on a GPU: two event records and the lazy completion queries)
  call      EPBuffer.dispatch + combine, stats off and on, alternated; the difference per call
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from .recorder import CommStats


def recorder_cost(device, calls: int, world: int = 8, local_experts: int = 4) -> float:
    """Seconds of host time per recorded call, counts already on the host."""
    stats = CommStats(0, world, local_experts, "bench")
    handle = SimpleNamespace(exact=True, send_counts=[16] * world, recv_counts=[16] * world,
                             tokens_per_expert=[32] * local_experts)
    x = torch.empty(16, 1024, device=device)
    for _ in range(100):
        stats.end("dispatch", stats.begin(x), x, 2048, handle, fresh=True)
    stats.summary(reset=True)
    t0 = time.perf_counter()
    for _ in range(calls):
        stats.end("dispatch", stats.begin(x), x, 2048, handle, fresh=True)
    spent = time.perf_counter() - t0
    stats.summary()
    return spent / calls


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def call_cost(group, device, args, stats: bool) -> float:
    """Seconds per dispatch + combine pair."""
    import ep_plugin

    cfg = {"moe": {"num_experts": 8 * dist.get_world_size(group), "topk": args.topk},
           "comm": {"backend": args.backend, "stats": stats, "host_sync": not args.worst_case,
                    "max_tokens_per_rank": args.tokens}}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(dist.get_rank(group))
    x = torch.randn(args.tokens, args.hidden, generator=g).to(device, dtype)
    E = cfg["moe"]["num_experts"]
    idx = torch.stack([torch.randperm(E, generator=g)[:args.topk] for _ in range(args.tokens)]).to(device)
    w = torch.rand(args.tokens, args.topk, generator=g).to(device)
    with ep_plugin.EPBuffer(group, cfg, hidden=args.hidden) as buf:
        for _ in range(5):
            res = buf.dispatch(x, idx, w)
            buf.combine(res.x, res.handle)
        _sync(device)
        dist.barrier(group)
        t0 = time.perf_counter()
        for _ in range(args.iters):
            res = buf.dispatch(x, idx, w)
            buf.combine(res.x, res.handle)
        _sync(device)
        spent = time.perf_counter() - t0
        if stats:
            buf.stats()
        dist.barrier(group)
    return spent / args.iters


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20000, help="recorder calls to time")
    p.add_argument("--iters", type=int, default=200, help="dispatch + combine pairs per round")
    p.add_argument("--rounds", type=int, default=5, help="off/on rounds (medians are reported)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--backend", default="auto")
    p.add_argument("--worst-case", action="store_true", help="comm.host_sync: false (device-side counts)")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo")
    else:
        dist.init_process_group("nccl" if cuda else "gloo", init_method="tcp://127.0.0.1:0", rank=0,
                                world_size=1)
    group, rank = dist.group.WORLD, dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"recorder, counts on the host, {device.type} tensors: "
        f"{1e6 * recorder_cost(device, args.calls):.2f} us per call")
    off, on = [], []
    for _ in range(args.rounds):
        off.append(call_cost(group, device, args, stats=False))
        on.append(call_cost(group, device, args, stats=True))
    a, b = statistics.median(off), statistics.median(on)
    say(f"dispatch + combine, EP{dist.get_world_size()}, {args.tokens} tokens x {args.hidden}, top-{args.topk}, "
        f"backend {args.backend}{' (host_sync false)' if args.worst_case else ''}: stats off {1e6 * a:.1f} us, "
        f"on {1e6 * b:.1f} us per pair ({1e6 * (b - a) / 2:+.2f} us per call; medians of {args.rounds} rounds)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
