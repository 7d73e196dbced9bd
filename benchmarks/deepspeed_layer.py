"""Time a DeepSpeed MoE layer (forward + backward) with DeepSpeed's all-to-all and with ep_plugin.

Launch one process per GPU (NCCL); results are merged into the JSON file under "ep<world>":

    torchrun --nproc-per-node 4 benchmarks/deepspeed_layer.py --ep-sizes 2,4
    torchrun --nproc-per-node 2 benchmarks/deepspeed_layer.py --cpu --tokens 64 --hidden 32   # smoke test (gloo)

An EP size smaller than the world runs as DeepSpeed does it: expert-parallel groups of that size
side by side (EP2 on 4 GPUs = 2 groups of 2, data parallel across them).

Both paths run the same deepspeed.moe.layer.MoE (same gate, same experts, same weights); only
the token exchange differs: DeepSpeed packs a zero-padded [experts, capacity, hidden] buffer and
exchanges it with two dense all-to-alls, ep_plugin sends each kept token once per destination rank
and runs every local expert on exactly its rows. Reported per case:
  layer_ms: forward+backward of the whole layer (gate, exchange, experts), median over iterations,
            slowest rank;
  comm_ms:  the two exchanges alone (DeepSpeed: 2 x all_to_all_single of the padded buffer;
            ep_plugin: dispatch + combine), forward only;
  rows_sent: rows this rank puts on the wire per direction (DeepSpeed: experts x capacity,
            padding included; ep_plugin: kept tokens, one per destination rank);
  max_abs_diff: largest output difference between the two paths (same inputs and gate RNG).
With --profile, also where a layer step's time goes: the top kernels of each path and the top host
ops by their own CPU time (torch profiler, rank 0, per step), printed and kept under
"profile_us_per_step" and "host_us_per_step" in the JSON.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from protocols import host_breakdown, kernel_breakdown  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=4096, help="expert FFN width")
    p.add_argument("--experts-per-rank", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--ep-sizes", default="", help="EP sizes to time, comma-separated (default: the world size)")
    p.add_argument("--backends", default="torch", help="ep_plugin backends to time, comma-separated")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=10, help="routing varies per step: warm the allocator and GEMM heuristics")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--cpu", action="store_true", help="gloo on CPU (smoke test)")
    p.add_argument("--drop-tokens", default="both", choices=["both", "true", "false"],
                   help="which drop_tokens settings to time (one per process takes the other's warm-up out: "
                        "GEMM heuristics and the allocator carry over from the first to the second)")
    p.add_argument("--profile", action="store_true", help="top GPU kernels per layer step of each path")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "deepspeed_layer.json"))
    return p.parse_args()


class Timer:
    def __init__(self, cuda):
        self.cuda = cuda

    def __call__(self, fn, iters, warmup):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            dist.barrier()
            if self.cuda:
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        med = torch.tensor([statistics.median(times)], dtype=torch.float64)
        if self.cuda:
            med = med.cuda()
        dist.all_reduce(med, op=dist.ReduceOp.MAX)  # bottleneck: the slowest rank
        return med.item()


def main():
    a = parse()
    cuda = not a.cpu and torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
    import deepspeed
    from ep_plugin.testing import deepspeed_without_shm_op

    deepspeed_without_shm_op()  # without CUDA: no CPU all-reduce op compiled (~2 minutes), none used
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    from deepspeed.moe.layer import MoE
    import ep_plugin.deepspeed as epds

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    H = a.hidden
    timer = Timer(cuda)
    data = {}
    if rank == 0 and os.path.exists(a.out):
        with open(a.out) as f:
            data = json.load(f)
    for ep in [int(e) for e in a.ep_sizes.split(",")] if a.ep_sizes else [world]:
        results = bench(a, ep, rank, world, device, dtype, timer, MoE, epds)
        if rank == 0:
            dev = torch.cuda.get_device_name(device) if cuda else "cpu"
            data[f"ep{ep}" + ("_cpu" if not cuda else "")] = {
                "device": dev, "world": world, "ep_size": ep, "tokens_per_rank": a.tokens, "hidden": H,
                "ffn": a.ffn, "num_experts": a.experts_per_rank * ep, "k": a.k, "capacity_factor": a.capacity_factor,
                "dtype": a.dtype, "iters": a.iters, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
                "results": results}
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(data, f, indent=1)
        print(f"wrote {a.out}")
    dist.barrier()


def bench(a, ep, rank, world, device, dtype, timer, MoE, epds):
    from ep_plugin.integrations.deepspeed.layer import wire_dtype
    E, H, world_ep = a.experts_per_rank * ep, a.hidden, ep
    results = []
    for drop in {"both": (True, False), "true": (True,), "false": (False,)}[a.drop_tokens]:
        torch.manual_seed(0)
        expert = torch.nn.Sequential(torch.nn.Linear(H, a.ffn), torch.nn.GELU(), torch.nn.Linear(a.ffn, H))
        ref = MoE(H, expert, num_experts=E, ep_size=ep, k=a.k, capacity_factor=a.capacity_factor,
                  eval_capacity_factor=a.capacity_factor, min_capacity=4, drop_tokens=drop)
        ref = ref.to(device=device, dtype=dtype)
        layers = {}
        for b in a.backends.split(","):
            m = copy.deepcopy(ref)
            flag = {"enabled": True, "config": {"comm": {"backend": b, "max_tokens_per_rank": max(a.tokens, 4096)}}}
            epds.convert_moe_layers(m, {"ep_plugin": flag})
            layers[f"ep_plugin[{b}]"] = m
        ref.set_deepspeed_parallelism()
        layers = {"deepspeed": ref, **layers}

        g = torch.Generator().manual_seed(1 + rank)
        x = torch.randn(a.tokens, H, generator=g).to(device=device, dtype=dtype)
        gy = torch.randn(a.tokens, H, generator=g).to(device=device, dtype=dtype)

        # correctness: same inputs, same gate RNG
        outs = {}
        for name, layer in layers.items():
            torch.manual_seed(123)
            with torch.no_grad():
                outs[name] = layer(x)[0].float()
        scale = outs["deepspeed"].abs().max().item()

        # what travels: DeepSpeed's padded buffer vs the kept tokens, per destination rank
        gate = ref.deepspeed_moe.gate
        torch.manual_seed(123)
        with torch.no_grad():
            _, C, _, idx, _, _, _ = gate(x, None, True, False)
        C = int(C)
        topk = idx.t().long().contiguous()
        dest = torch.where(topk >= 0, topk // a.experts_per_rank, -1)
        in_rank = torch.zeros(a.tokens, world_ep, dtype=torch.bool, device=device)
        valid = dest >= 0
        in_rank[torch.arange(a.tokens, device=device).unsqueeze(1).expand_as(dest)[valid], dest[valid]] = True
        rows_ours = int(in_rank.sum())
        rows_ds = E * C

        def layer_step(layer):
            def fn():
                xx = x.detach().requires_grad_(True)
                out = layer(xx)[0]
                out.backward(gy)
            return fn

        padded = torch.zeros(E, C, H, device=device, dtype=dtype)
        recv = torch.empty_like(padded)

        def ds_comm():
            dist.all_to_all_single(recv, padded, group=ref.deepspeed_moe.ep_group)
            dist.all_to_all_single(padded, recv, group=ref.deepspeed_moe.ep_group)

        for name, layer in layers.items():
            t_layer = timer(layer_step(layer), a.iters, a.warmup)
            if name == "deepspeed":
                t_comm = timer(ds_comm, a.iters, a.warmup)
                rows = rows_ds
            else:
                moe = layer.deepspeed_moe
                buf = moe.ep_buffer(H)
                w = torch.ones(topk.shape, dtype=torch.float32, device=device)
                # what the layer itself sends: kernel backends move fp32 models' rows as BF16
                xs = x.to(wire_dtype(x.dtype, buf.capabilities.row_dtypes))
                ys_dtype = wire_dtype(x.dtype, buf.capabilities.combine_dtypes)

                def ours_comm(buf=buf, xs=xs, ys_dtype=ys_dtype):
                    with torch.no_grad():
                        res = buf.dispatch(xs, topk, w, async_op=False)
                        buf.combine(res.x.to(ys_dtype), res.handle, async_op=False)
                t_comm = timer(ours_comm, a.iters, a.warmup)
                rows = rows_ours
            rows_t = torch.tensor([rows], dtype=torch.float64, device=device)
            dist.all_reduce(rows_t, op=dist.ReduceOp.MAX)
            diff = (outs[name] - outs["deepspeed"]).abs().max()
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            r = {"impl": name, "drop_tokens": drop, "layer_ms": round(t_layer, 3), "comm_ms": round(t_comm, 3),
                 "rows_sent_max_rank": int(rows_t.item()), "capacity": C,
                 "max_abs_diff": float(diff.item()), "output_scale": scale}
            if a.profile and not a.cpu:
                r["profile_us_per_step"] = prof = kernel_breakdown(layer_step(layer), n=5, top=12)
                r["host_us_per_step"] = host = host_breakdown(layer_step(layer), n=5, top=12)
                if rank == 0:
                    print(f"  profile {name} drop_tokens={drop} (us per step): {prof}", flush=True)
                    print(f"  host ops {name} drop_tokens={drop} (us per step): {host}", flush=True)
            results.append(r)
            if rank == 0:
                print(f"ep{ep} (world {world}) drop_tokens={drop!s:5} {name:18} layer fwd+bwd {t_layer:8.3f} ms   "
                      f"exchange {t_comm:8.3f} ms   rows/rank {int(rows_t.item()):7d}   "
                      f"max|diff| {diff.item():.2e}", flush=True)
        del layers, ref
    return results


if __name__ == "__main__":
    main()
