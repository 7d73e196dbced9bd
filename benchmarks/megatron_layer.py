#!/usr/bin/env python3
"""megatron-core MoELayer with ep_plugin's dispatcher vs megatron's `alltoall`: equality and timing.

    torchrun --nproc-per-node 4 benchmarks/megatron_layer.py            # GPUs, NCCL
    torchrun --nproc-per-node 2 benchmarks/megatron_layer.py --device cpu --tiny   # dry run

1. equality: small fp32 layers (plain top-k; group-limited sigmoid + expert bias; shared expert
   with overlap through the flex backend; EPGroupedMLP experts against TEGroupedMLP's): max
   |difference| of output, input gradient and parameter gradients, ours vs alltoall, same weights
   and inputs.
2. timing: a DeepSeek-like MoE layer forward+backward (hidden 7168, 64 experts per rank, top-8,
   sigmoid routing with 4 groups / top-2, scaling 2.5, expert bias, moe_ffn 2048 SwiGLU, 4096
   tokens per rank, BF16). Rows (fc1/fc2 weights [G, out, in], torch grouped_mm, in all of them):
     alltoall                     megatron's alltoall + TEGroupedMLP (non-TE path) with
                                  ep_plugin.megatron.GroupedMMLinear: host counts (tolist) per forward
     deepep                       megatron's flex dispatcher, moe_flex_dispatcher_backend="deepep", same
                                  experts: only where DeepEP itself (`deep_ep`, not ep_plugin.deep_ep)
                                  imports, else the row says n/a and why
     ep_plugin[B]                 ep_plugin's dispatcher (comm.backend B) + ep_plugin.megatron.EPGroupedMLP:
                                  counts on the device, rows sized for the worst case (comm.host_sync
                                  false), no host read in the layer: what ep_plugin runs by default
     ep_plugin[B]+torch_act       the same with EPGroupedMLP.bounded_activation off (--torch-activation):
                                  megatron's weighted SwiGLU over every worst-case row, where the default's
                                  kernels stop at the last expert's end
     ep_plugin[B]+host_counts     ep_plugin's dispatcher + TEGroupedMLP (host counts, exact rows): the
                                  host-synced path, for comparison (--host-counts-backends)
   Median over iterations (CUDA events), plus a forward breakdown: communication
   (token_dispatch + token_combine) and local permutation (pre/post-processing).
   megatron's torch.compile'd router helper runs eagerly for both (no compile time on the clock).
   Memory per dispatcher (GPU): the previous variant freed and its EPBuffers closed, the peak
   counter reset, then build + forward + timed forward/backward: peak_mem_gib is
   torch.cuda.max_memory_allocated (the largest over ranks), peak_mem_added_gib the part above what
   was allocated before the variant started, ep_buffer_gib the kernel backend's communication buffer.

Results are merged into benchmarks/results/megatron_layer.json under "ep<world>".
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from protocols import kernel_breakdown  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--tiny", action="store_true", help="small sizes (CPU dry run)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts-per-rank", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--backends", default="torch,auto", help="ep_plugin comm.backend values to time")
    p.add_argument("--host-counts-backends", default="auto",
                   help="comm.backend values to also time with megatron's TEGroupedMLP (host counts)")
    p.add_argument("--torch-activation", action="store_true",
                   help="also time EPGroupedMLP with bounded_activation off (megatron's SwiGLU over every worst-case row)")
    p.add_argument("--skip-equality", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--profile", action="store_true", help="top GPU kernels per forward+backward step (torch profiler)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "megatron_layer.json"))
    a = p.parse_args()
    if a.tiny:
        a.tokens, a.hidden, a.experts_per_rank, a.topk, a.ffn = 64, 128, 4, 4, 64
        a.warmup, a.iters = 1, 3
    return a


# ------------------------------------------------------------------------------------ building

def make_config(world, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, num_attention_heads=4, expert_model_parallel_size=world,
                add_bias_linear=False, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                bias_activation_fusion=False, moe_router_load_balancing_type="none")
    base.update(kw)
    return TransformerConfig(**base)


EXPERTS = {
    "sequential": "SequentialMLP (megatron)",
    "grouped": "TEGroupedMLP(non-TE) + GroupedMMLinear (torch grouped_mm), host counts",
    "ep": "EPGroupedMLP (GroupedMMLinear, torch grouped_mm), device counts, bounded_activation (default)",
    "ep_torch_act": "EPGroupedMLP with bounded_activation off (megatron's SwiGLU over every worst-case row)",
}


def moe_layer(cfg, experts: str):
    """experts: "sequential" (megatron's spec), "grouped" (TEGroupedMLP + GroupedMMLinear) or "ep"
    (EPGroupedMLP); router and shared experts from megatron's spec."""
    import dataclasses

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    import ep_plugin.megatron as epm

    torch.manual_seed(0)
    spec = get_moe_module_spec(use_te=False, num_experts=cfg.num_moe_experts)
    if experts == "sequential":
        return spec(config=cfg)
    builder = epm.EPGroupedMLP if experts in ("ep", "ep_torch_act") else epm.grouped_mm_experts()
    layer = MoELayer(config=cfg, submodules=dataclasses.replace(spec.keywords["submodules"], experts=builder))
    if experts == "ep_torch_act":
        layer.experts.bounded_activation = False
    return layer


def dispatcher_kw(kind, backend=None):
    if kind == "alltoall":
        return dict(moe_token_dispatcher_type="alltoall")
    if kind == "deepep":
        return dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
    if kind == "flex":
        return dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="ep_plugin")
    return dict(moe_token_dispatcher_type="ep_plugin")


def deepep_unavailable(cuda):
    """Why the DeepEP row cannot run here, or None. It needs DeepEP itself: ep_plugin.deep_ep (DeepEP's
    API over EPBuffer) can stand in as `deep_ep`, and megatron must have found the real one when it
    imported its flex dispatcher."""
    if not cuda:
        return "DeepEP needs CUDA GPUs"
    try:
        import deep_ep
    except Exception as exc:  # ImportError, or a build that does not load
        return f"deep_ep does not import ({type(exc).__name__}: {str(exc)[:200]})"
    where = getattr(deep_ep, "__file__", "") or ""
    if deep_ep.__name__.startswith("ep_plugin") or os.sep + "ep_plugin" + os.sep in where:
        return "`deep_ep` is ep_plugin.deep_ep (ep_plugin's compatibility API), not DeepEP"
    from megatron.core.transformer.moe import fused_a2a

    if not getattr(fused_a2a, "HAVE_DEEP_EP", False):
        return "megatron-core's fused_a2a did not find deep_ep when it was imported"
    return None


def attach_backend(cfg, backend, max_tokens):
    import ep_plugin.megatron as epm

    if backend is not None:
        epm.attach_config(cfg, {"moe": {"num_experts": cfg.num_moe_experts, "topk": cfg.moe_router_topk},
                                "comm": {"backend": backend, "max_tokens_per_rank": max_tokens,
                                         "timeout_s": 60}})


# ------------------------------------------------------------------------------------ equality

EQ_CASES = {
    "topk_softmax": dict(),
    "group_limited_sigmoid_expert_bias": dict(
        moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.5, moe_router_dtype="fp32"),
    "shared_expert_overlap_flex": dict(moe_shared_expert_intermediate_size=96, moe_shared_expert_overlap=True),
    # ours: EPGroupedMLP (device counts); reference: TEGroupedMLP + GroupedMMLinear (same weight layout)
    "ep_experts_vs_te_grouped": dict(moe_router_topk=3),
}
EQ_EXPERTS = {"ep_experts_vs_te_grouped": ("grouped", "ep")}  # (reference, ours); else SequentialMLP both


def equality(world, rank, device, backend):
    out = {}
    H = 64
    for name, kw in EQ_CASES.items():
        try:
            common = dict(hidden_size=H, num_moe_experts=4 * world, moe_router_topk=2, moe_ffn_hidden_size=32,
                          use_cpu_initialization=True)
            common.update(kw)
            ref_experts, our_experts = EQ_EXPERTS.get(name, ("sequential", "sequential"))
            ref = moe_layer(make_config(world, **common, **dispatcher_kw("alltoall")), ref_experts).to(device)
            kind = "flex" if "flex" in name else "ep_plugin"
            cfg = make_config(world, **common, **dispatcher_kw(kind))
            attach_backend(cfg, backend, 4096)
            ours = moe_layer(cfg, our_experts).to(device)
            with torch.no_grad():
                g = torch.Generator().manual_seed(100 + rank)
                for n, p in ref.named_parameters():
                    if ".experts." in n and "shared" not in n:
                        p.add_(torch.randn(p.shape, generator=g).to(device) * 0.1)
                eb = getattr(ref.router, "expert_bias", None)
                if eb is not None:
                    eb.copy_(torch.randn(eb.shape, generator=torch.Generator().manual_seed(7)).to(device) * 0.1)
            ours.load_state_dict(ref.state_dict(), strict=False)
            S = 48 + 16 * rank
            g = torch.Generator().manual_seed(1000 + rank)
            x0 = torch.randn(S, 2, H, generator=g).to(device)
            w = torch.randn(S, 2, H, generator=g).to(device)
            res = []
            for layer in (ref, ours):
                x = x0.clone().requires_grad_()
                y, _ = layer(x)
                (y * w).sum().backward()
                res.append((y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}))
            (y0, gx0, gp0), (y1, gx1, gp1) = res
            out[name] = {
                "dispatcher": type(ours.token_dispatcher).__name__,
                "experts": type(ours.experts).__name__,
                "max_abs_diff_out": (y0 - y1).abs().max().item(),
                "max_abs_diff_grad_x": (gx0 - gx1).abs().max().item(),
                "max_abs_diff_grad_params": max((gp0[n] - gp1[n]).abs().max().item() for n in gp0),
                "max_abs_out": y0.abs().max().item(),
                "same_param_set": sorted(gp0) == sorted(gp1),
            }
            del ref, ours
        except Exception:
            out[name] = {"error": traceback.format_exc()[-2000:]}
    return out


# -------------------------------------------------------------------------------------- timing

class PhaseTimer:
    """Forward breakdown: wraps the dispatcher's six hooks with events (or host clocks on CPU)."""

    COMM = ("token_dispatch", "token_combine")
    LOCAL = ("dispatch_preprocess", "dispatch_postprocess", "combine_preprocess", "combine_postprocess")

    def __init__(self, disp, cuda):
        self.cuda, self.marks, self.on = cuda, [], False
        for name in self.COMM + self.LOCAL:
            fn = getattr(disp, name)
            setattr(disp, name, self._wrap(name, fn))

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _wrap(self, name, fn):
        def inner(*a, **k):
            if not self.on:
                return fn(*a, **k)
            t0 = self._now()
            r = fn(*a, **k)
            self.marks.append((name, t0, self._now()))
            return r
        return inner

    def collect(self):
        if self.cuda:
            torch.cuda.synchronize()
        tot = {"comm": 0.0, "local": 0.0}
        for name, a, b in self.marks:
            ms = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
            tot["comm" if name in self.COMM else "local"] += ms
        self.marks = []
        return tot


def time_layer(layer, x0, gy, args, cuda):
    def step():
        for p in layer.parameters():
            p.grad = None
        x = x0.detach().requires_grad_()
        y, _ = layer(x)
        y.backward(gy)

    def fwd():
        with torch.no_grad():
            layer(x0)

    for _ in range(args.warmup):
        step()
    times, ftimes = [], []
    for _ in range(args.iters):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
    timer = PhaseTimer(layer.token_dispatcher, cuda)
    comm, local = [], []
    for _ in range(max(2, args.iters // 2)):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        timer.on = True
        fwd()
        timer.on = False
        if cuda:
            torch.cuda.synchronize()
        ftimes.append((time.perf_counter() - t) * 1e3)
        c = timer.collect()
        comm.append(c["comm"])
        local.append(c["local"])
    # slowest rank is the layer's time
    vals = torch.tensor([statistics.median(times), statistics.median(ftimes), statistics.median(comm),
                         statistics.median(local)], dtype=torch.float64, device=x0.device)
    dist.all_reduce(vals, op=dist.ReduceOp.MAX)
    v = vals.tolist()
    out = {"fwd_bwd_ms": v[0], "fwd_ms": v[1], "fwd_comm_ms": v[2], "fwd_local_permute_ms": v[3],
           "fwd_bwd_ms_all_iters_rank0": [round(t, 3) for t in times]}
    if args.profile and cuda:  # where a step's GPU time goes (rank 0 prints it)
        out["profile_us_per_step"] = kernel_breakdown(step, n=3, top=14)
    return out


def _release(cuda):
    """Free what the previous variant left (layers may sit in reference cycles) and restart the
    peak counter; returns the bytes still allocated."""
    gc.collect()
    if not cuda:
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _ep_buffer_bytes():
    import ep_plugin.megatron as epm

    sizes = [getattr(getattr(b, "_backend", None), "buffer_bytes", 0) for b in epm.cached_buffers()]
    return sum(int(n or 0) for n in sizes)


def memory_stats(start, device):
    """Peak memory of this variant, the largest over ranks (GiB)."""
    if start is None:
        return {}
    vals = torch.tensor([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_allocated() - start,
                         _ep_buffer_bytes()], dtype=torch.float64, device=device)
    dist.all_reduce(vals, op=dist.ReduceOp.MAX)
    peak, added, bufs = (v / 2**30 for v in vals.tolist())
    return {"peak_mem_gib": round(peak, 3), "peak_mem_added_gib": round(added, 3), "ep_buffer_gib": round(bufs, 3)}


def timing(world, rank, device, args):
    cuda = device.type == "cuda"
    dt = torch.bfloat16 if cuda else torch.float32
    common = dict(hidden_size=args.hidden, num_moe_experts=args.experts_per_rank * world,
                  moe_router_topk=args.topk, moe_ffn_hidden_size=args.ffn,
                  moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2,
                  moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True,
                  moe_router_dtype="fp32", bf16=cuda, params_dtype=dt,
                  use_cpu_initialization=not cuda)
    g = torch.Generator().manual_seed(42 + rank)
    x0 = torch.randn(args.tokens, 1, args.hidden, generator=g).to(device, dt)
    gy = torch.randn(args.tokens, 1, args.hidden, generator=g).to(device, dt) * 1e-2
    # (label, dispatcher, ep_plugin comm.backend, experts)
    variants = [("alltoall", "alltoall", None, "grouped"), ("deepep", "deepep", None, "grouped")]
    variants += [(f"ep_plugin[{b}]", "ep_plugin", b, "ep") for b in args.backends.split(",") if b]
    if args.torch_activation:
        variants += [(f"ep_plugin[{b}]+torch_act", "ep_plugin", b, "ep_torch_act") for b in args.backends.split(",") if b]
    variants += [(f"ep_plugin[{b}]+host_counts", "ep_plugin", b, "grouped")
                 for b in args.host_counts_backends.split(",") if b]
    import ep_plugin.megatron as epm

    out, ref_state, ref_y = {}, None, None
    seen = set()  # (comm backend, experts) already timed
    for label, kind, backend, experts in variants:
        if kind == "deepep":
            why = deepep_unavailable(cuda)
            if why is not None:  # every rank decides alike (same machine kind, same install)
                out[label] = {"n/a": why, "experts": EXPERTS[experts]}
                if rank == 0:
                    print(f"[ep{world}] {label:26s} n/a: {why}", flush=True)
                continue
        layer = y = None
        epm.clear_buffers()  # collective: every rank runs the same variants in the same order
        start = _release(cuda)
        try:
            cfg = make_config(world, **common, **dispatcher_kw(kind))
            attach_backend(cfg, backend, args.tokens)
            layer = moe_layer(cfg, experts).to(device)
            if ref_state is None:  # kept on the host: not part of any variant's peak
                ref_state = {k: v.detach().to("cpu", copy=True) for k, v in layer.state_dict().items()}
            else:
                layer.load_state_dict(ref_state, strict=False)
            with torch.no_grad():
                y, _ = layer(x0)
            buf = getattr(layer.token_dispatcher, "buffer", None)
            actual = getattr(buf, "backend_name", None)
            if actual is not None and (actual, experts) in seen:
                out[label] = {"skipped": f"resolves to backend {actual!r}, already timed"}
                del layer
                continue
            if actual is not None:
                seen.add((actual, experts))
            r = {"comm_backend": actual, "experts": EXPERTS[experts],
                 "host_sync": None if buf is None else buf.cfg.comm.host_sync}
            if ref_y is None:
                ref_y = y.float()
            else:
                r["max_abs_diff_out_vs_alltoall"] = (y.float() - ref_y).abs().max().item()
                r["max_abs_out"] = ref_y.abs().max().item()
            r.update(time_layer(layer, x0, gy, args, cuda))
            r.update(memory_stats(start, device))
            r["experts_gemm"] = epm.GroupedMMLinear.impl
            if experts == "ep":  # whether the kernels ran (BF16 rows, float32 probs), or the torch form
                r["bounded_runs"] = layer.experts.bounded_runs
            out[label] = r
            if rank == 0:
                mem = f"  peak {r['peak_mem_gib']:.2f} GiB (+{r['peak_mem_added_gib']:.2f})" if "peak_mem_gib" in r else ""
                runs = f"  bounded SwiGLU runs {r['bounded_runs']}" if "bounded_runs" in r else ""
                print(f"[ep{world}] {label:26s} fwd+bwd {r['fwd_bwd_ms']:8.2f} ms  fwd {r['fwd_ms']:7.2f} ms  "
                      f"(comm {r['fwd_comm_ms']:.2f}, permute {r['fwd_local_permute_ms']:.2f}){mem}{runs}", flush=True)
                if "profile_us_per_step" in r:
                    print(f"[ep{world}] {label} GPU kernels per step (us): {r['profile_us_per_step']}", flush=True)
            del layer
        except Exception:
            out[label] = {"error": traceback.format_exc()[-3000:]}
            if rank == 0:
                print(f"[ep{world}] {label} failed:\n{out[label]['error']}", flush=True)
    layer = y = None  # noqa: F841  (the last variant goes before its buffers are closed)
    epm.clear_buffers()
    return out


# ---------------------------------------------------------------------------------------- main

def main():
    args = parse_args()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        device = torch.device("cuda", local)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()

    import torch._dynamo as dynamo

    dynamo.config.disable = True  # megatron's torch.compile'd router helper: eager for everyone
    import ep_plugin.megatron as epm

    if not cuda:
        from ep_plugin.testing import cpu_stand_ins

        cpu_stand_ins()
        torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(expert_model_parallel_size=world)
    if cuda:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(123)

    result = {"world": world, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "grouped_mm": getattr(epm.torch_grouped_mm(), "__name__", None),
              "config": {"tokens_per_rank": args.tokens, "hidden": args.hidden,
                         "experts_per_rank": args.experts_per_rank, "num_experts": args.experts_per_rank * world,
                         "topk": args.topk, "moe_ffn": args.ffn, "score": "sigmoid", "groups": 4,
                         "group_topk": 2, "dtype": "bf16" if cuda else "fp32",
                         "experts_impl": "per row ('experts'); fc1/fc2 GroupedMMLinear in all",
                         "iters": args.iters, "warmup": args.warmup}}
    t0 = time.time()
    if not args.skip_equality:
        result["equality"] = equality(world, rank, device, "torch")
        if rank == 0:
            print(f"[ep{world}] equality ({time.time() - t0:.1f}s):", json.dumps(result["equality"], indent=1)[:3000],
                  flush=True)
    if not args.skip_timing:
        result["layer"] = timing(world, rank, device, args)
    result["wall_s"] = time.time() - t0
    from bench_report import git_commit, utc_now  # (benchmarks/ on the path: the script runs from there)
    result["date"] = utc_now()
    result.update(git_commit(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if rank == 0:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        data = {}
        if os.path.exists(args.out):
            try:
                with open(args.out) as f:
                    data = json.load(f)
            except (OSError, ValueError):
                data = {}
        data[f"ep{world}" + ("_tiny" if args.tiny else "")] = result
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
        print(f"wrote {args.out}", flush=True)
    ps.destroy_model_parallel()
    epm.clear_buffers()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
