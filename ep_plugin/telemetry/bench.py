"""What recording costs per call (comm.stats: true against false).

    python -m ep_plugin.telemetry.bench                       # one process: gloo on CPU, NCCL on a GPU
    torchrun --nproc-per-node 2 -m ep_plugin.telemetry.bench  # an EP group of 2 (rank 0 prints)
    torchrun --nproc-per-node 2 -m ep_plugin.telemetry.bench --tokens 4096 --hidden 7168 --topk 8 \\
        --iters 50 --rounds 3 --out /tmp/ep_out/telemetry_bench.json     # DeepSeek-sized rows on GPUs

  recorder  CommStats.begin + end alone, on a call whose counts are host lists: the host work added
            to each call (on a GPU: two event records and the lazy completion queries)
  call      EPBuffer.dispatch + combine pairs, stats off and on (a fresh buffer each, rounds
            alternated): the wall time per pair once the device has finished (synchronised after
            --iters pairs), medians over --rounds; the difference per call and relative to a pair
            (what recording adds to the exchanges of an MoE layer). On GPUs the per-pair device
            time (CUDA events around each pair) is reported beside it.

--out writes the numbers as JSON (rank 0) with the device, date, commit (EP_COMMIT or git) and torch.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
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


def make_inputs(group, device, args):
    """The same tokens and routing for every round: x [T, H], topk_idx [T, K], topk_weights [T, K]."""
    E = args.experts
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(dist.get_rank(group))
    x = torch.randn(args.tokens, args.hidden, generator=g).to(device, dtype)
    idx = torch.rand(args.tokens, E, generator=g).argsort(dim=1)[:, :args.topk].contiguous().to(device)
    w = torch.rand(args.tokens, args.topk, generator=g).to(device)
    return x, idx, w


def call_cost(group, device, args, inputs, stats: bool) -> dict:
    """Per dispatch + combine pair: wall seconds (device finished), and on GPUs the median device
    seconds of one pair (CUDA events)."""
    import ep_plugin

    cfg = {"moe": {"num_experts": args.experts, "topk": args.topk},
           "comm": {"backend": args.backend, "stats": stats, "host_sync": not args.worst_case,
                    "max_tokens_per_rank": args.tokens}}
    x, idx, w = inputs
    cuda = device.type == "cuda"
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
        device_s = None
        if cuda:  # the device's view: each pair between two events (a host wait in between shows up)
            times = []
            for _ in range(min(args.iters, 20)):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                res = buf.dispatch(x, idx, w)
                buf.combine(res.x, res.handle)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            device_s = statistics.median(times)
        backend = buf.backend_name
        if stats:
            buf.stats()
        dist.barrier(group)
    return {"wall_s": spent / args.iters, "device_s": device_s, "backend": backend}


def _commit() -> str:
    if os.environ.get("EP_COMMIT"):
        return os.environ["EP_COMMIT"]
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _slowest(values, device) -> list:
    t = torch.tensor(values, dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20000, help="recorder calls to time")
    p.add_argument("--iters", type=int, default=200, help="dispatch + combine pairs per round")
    p.add_argument("--rounds", type=int, default=5, help="off/on rounds (medians are reported)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--experts", type=int, default=0, help="routed experts (default: 8 per rank)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--worst-case", action="store_true", help="comm.host_sync: false (device-side counts)")
    p.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
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
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    args.experts = args.experts or 8 * world
    say = print if rank == 0 else (lambda *a, **k: None)
    dev_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    rec = recorder_cost(device, args.calls)
    say(f"recorder, counts on the host, {device.type} tensors: {1e6 * rec:.2f} us per call", flush=True)
    inputs = make_inputs(group, device, args)
    off, on, backend = [], [], None
    for _ in range(args.rounds):
        off.append(call_cost(group, device, args, inputs, stats=False))
        on.append(call_cost(group, device, args, inputs, stats=True))
        backend = on[-1]["backend"]
    # the slowest rank's number per round (each rank timed the same pairs)
    off_wall = _slowest([r["wall_s"] for r in off], device)
    on_wall = _slowest([r["wall_s"] for r in on], device)
    a, b = statistics.median(off_wall), statistics.median(on_wall)
    per_call = (b - a) / 2
    dev_a = dev_b = None
    if cuda:
        dev_a = statistics.median(_slowest([r["device_s"] for r in off], device))
        dev_b = statistics.median(_slowest([r["device_s"] for r in on], device))
    shape = (f"EP{world}, {args.tokens} tokens x {args.hidden}, {args.experts} experts top-{args.topk}, "
             f"backend {backend}{' (host_sync false)' if args.worst_case else ''}")
    say(f"dispatch + combine, {shape}: stats off {1e6 * a:.1f} us, on {1e6 * b:.1f} us per pair "
        f"({1e6 * per_call:+.2f} us per call, {100 * (b - a) / a:+.2f}% of a pair; wall, medians of {args.rounds} "
        f"rounds x {args.iters} pairs, slowest rank)", flush=True)
    if cuda:
        say(f"device time per pair (CUDA events): stats off {1e6 * dev_a:.1f} us, on {1e6 * dev_b:.1f} us "
            f"({100 * (dev_b - dev_a) / dev_a:+.2f}%)", flush=True)
    result = {
        "device": dev_name, "world": world, "backend": backend,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(), "torch": torch.__version__,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "recorder_us_per_call": 1e6 * rec,
        "pair_us_off": [1e6 * v for v in off_wall], "pair_us_on": [1e6 * v for v in on_wall],
        "pair_us_off_median": 1e6 * a, "pair_us_on_median": 1e6 * b,
        "added_us_per_call": 1e6 * per_call, "relative_cost": (b - a) / a,
        "device_pair_us_off": None if dev_a is None else 1e6 * dev_a,
        "device_pair_us_on": None if dev_b is None else 1e6 * dev_b,
    }
    if rank == 0 and args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        say(f"wrote {args.out}", flush=True)
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
