"""Time dispatch/combine of the nvlink and torch (NCCL) backends side by side (DESIGN.md protocol).

    python3 benchmarks/bench_dispatch.py                 # EP2 and EP4, all cases, results in benchmarks/results
    python3 benchmarks/bench_dispatch.py --worlds 4 --iters 50 --out /tmp/res

Cases: throughput (4096 tokens/rank, hidden 7168, 256 experts, top-8; BF16 and FP8 dispatch, BF16
combine), latency (128 tokens/rank, same model), SM sweep (8/16/24/32 SMs, throughput shape).
Each timing: L2 flushed (a 256 MB write), GPUs aligned by a tiny all-reduce, CUDA events around the
call, warm-up first, median over iterations; the reported time is the slowest rank's median.
Logical bandwidth (DeepEP): bytes of rows received by a rank (BF16, one copy per rank) / time,
bottleneck rank. Floor: the bytes that must cross NVLink into (dispatch) or out of (combine) the busiest
GPU at the 478 GB/s line rate.
Writes nvlink_<case>.json (+ nvlink_bench.png with matplotlib) and prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ep_plugin  # noqa: E402

NVLINK_GBPS = 478.0
NCCL_GBPS = 330.0
E, K, H = 256, 8, 7168


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_routing(T, seed, device):
    g = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(torch.int64)
    w = torch.rand(T, K, generator=g)
    return idx.to(device), w.to(device)


def quantize_fp8(x):
    T = x.shape[0]
    s = x.float().abs().view(T, -1, 128).amax(-1).clamp(min=1e-4) / 448.0
    d = (x.float().view(T, -1, 128) / s.unsqueeze(-1)).view(T, -1).to(torch.float8_e4m3fn)
    return d, s.contiguous()


class Timer:
    def __init__(self, warmup, iters):
        self.warmup, self.iters = warmup, iters
        self.flush = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device="cuda")  # 256 MB > L2
        self.tok = torch.zeros(1, device="cuda")

    def __call__(self, fn):
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
               for _ in range(self.warmup + self.iters)]
        for a, b in evs:
            self.flush.zero_()
            dist.all_reduce(self.tok)  # GPUs start the timed region together
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize()
        t = [a.elapsed_time(b) * 1e3 for a, b in evs[self.warmup:]]
        return statistics.median(t)


def kernel_breakdown(fn, n=10):
    """Average device time per kernel name (us) over n calls, via the torch profiler (CUPTI)."""
    try:
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
        out = {}
        for ev in prof.key_averages():
            dt = getattr(ev, "device_time_total", None)
            if dt is None:
                dt = getattr(ev, "cuda_time_total", 0)
            if dt:
                name = ev.key.replace("(anonymous namespace)::", "").replace("void ", "")
                name = name.split("(")[0].split("<")[0].split("::")[-1][:60] or ev.key[:60]
                out[name] = out.get(name, 0.0) + dt / n
        return dict(sorted(out.items(), key=lambda kv: -kv[1])[:8])
    except Exception as exc:  # profiler unavailable: not fatal
        return {"error": str(exc)[:200]}


def rank_main(rank, world, port, args, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world)
        res = run_cases(rank, world, args)
        if rank == 0:
            q.put(("ok", res))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        q.put(("err", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


def gather_max(v):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, v)
    return out


def run_cases(rank, world, args):
    timer = Timer(args.warmup, args.iters)
    comm = {"max_tokens_per_rank": 4096, "timeout_s": 15.0, "num_sms": 24}

    def say(msg):
        if rank == 0:
            print(f"[EP{world}] {msg}", flush=True)

    nv = ep_plugin.EPBuffer(None, {"moe": {"num_experts": E, "topk": K}, "comm": {"backend": "nvlink", **comm}},
                            hidden=H)
    ref = ep_plugin.EPBuffer(None, {"moe": {"num_experts": E, "topk": K}, "comm": {"backend": "torch", **comm}},
                             hidden=H)
    be = nv._backend
    results = {}
    for case, T in (("throughput", 4096), ("latency", 128)):
        if case not in args.cases and not (case == "throughput" and "sm_sweep" in args.cases):
            continue
        x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        idx, w = make_routing(T, 1000 * world + rank, "cuda")
        xf8 = quantize_fp8(x)
        a = nv.dispatch(x, idx, w)
        b = ref.dispatch(x, idx, w)
        ok = torch.equal(a.x, b.x) and torch.equal(a.topk_idx, b.topk_idx)
        rows = a.x
        ya, yb = nv.combine(rows, a.handle), ref.combine(rows, b.handle)
        ok = ok and torch.allclose(ya.float(), yb.float(), atol=3e-2, rtol=1e-2)
        modes = ("split", "fused") if hasattr(be, "combine_mode") else ()
        mode0 = getattr(be, "combine_mode", None)
        for mode in modes:  # both combine kernels against the reference
            be.combine_mode = mode
            ok = ok and torch.allclose(nv.combine(rows, a.handle).float(), yb.float(), atol=3e-2, rtol=1e-2)
        if modes:
            be.combine_mode = mode0
        af, bf = nv.dispatch(xf8, idx, w), ref.dispatch(xf8, idx, w)
        ok = ok and torch.equal(af.x[0].view(torch.uint8), bf.x[0].view(torch.uint8)) and torch.equal(af.x[1], bf.x[1])
        h = a.handle
        self_rows = h.recv_counts[rank]
        info = {"rank": rank, "num_recv": h.num_recv, "remote_recv": h.num_recv - self_rows,
                "remote_sent": sum(h.send_counts) - h.send_counts[rank], "check_ok": bool(ok)}
        rec = {"info": info, "nvlink": {}, "torch": {}, "breakdown": {}}
        say(f"EP{world} {case}: {json.dumps(info)}")

        def t(fn, label=""):
            v = timer(fn)
            say(f"{case} {label}: {v:.1f} us (rank {rank})")
            return v

        if case in args.cases:
            be.num_sms = 24
            rec["nvlink"]["dispatch_bf16"] = t(lambda: nv.dispatch(x, idx, w), "nvlink dispatch_bf16")
            rec["nvlink"]["dispatch_fp8"] = t(lambda: nv.dispatch(xf8, idx, w), "nvlink dispatch_fp8")
            rec["nvlink"]["dispatch_bf16_cached"] = t(lambda: nv.dispatch(x, handle=h), "nvlink dispatch_bf16_cached")
            rec["nvlink"]["combine_bf16"] = t(lambda: nv.combine(rows, h), "nvlink combine_bf16")
            # the backend alone (no EPBuffer input validation, which syncs the host twice per dispatch)
            rec["nvlink_backend"] = {
                "dispatch_bf16": t(lambda: be.dispatch(x, None, idx, w), "nvlink backend dispatch_bf16"),
                "dispatch_fp8": t(lambda: be.dispatch(xf8[0], xf8[1], idx, w), "nvlink backend dispatch_fp8"),
                "dispatch_bf16_cached": t(lambda: be.dispatch(x, None, idx, None, h), "nvlink backend cached"),
                "combine_bf16": t(lambda: be.combine(rows, h), "nvlink backend combine_bf16")}
            for mode in modes:
                be.combine_mode = mode
                rec["nvlink_backend"][f"combine_bf16_{mode}"] = t(lambda: be.combine(rows, h), f"backend combine {mode}")
            if modes:
                be.combine_mode = mode0
            rec["torch"]["dispatch_bf16"] = t(lambda: ref.dispatch(x, idx, w), "torch dispatch_bf16")
            rec["torch"]["dispatch_fp8"] = t(lambda: ref.dispatch(xf8, idx, w), "torch dispatch_fp8")
            rec["torch"]["combine_bf16"] = t(lambda: ref.combine(b.x, b.handle), "torch combine_bf16")
            if args.breakdown:  # collective: every rank profiles, rank 0's numbers are kept
                rec["breakdown"]["dispatch_bf16"] = kernel_breakdown(lambda: nv.dispatch(x, idx, w))
                rec["breakdown"]["combine_bf16"] = kernel_breakdown(lambda: nv.combine(rows, h))
                rec["breakdown"]["dispatch_fp8"] = kernel_breakdown(lambda: nv.dispatch(xf8, idx, w))
                say(f"breakdown {json.dumps(rec['breakdown'])}")
            results[case] = rec
        if case == "throughput" and "sm_sweep" in args.cases:
            sweep = {}
            for sms in args.sms:
                be.num_sms = sms
                sweep[sms] = {"dispatch_bf16": t(lambda: nv.dispatch(x, idx, w), f"{sms} SMs dispatch_bf16"),
                              "dispatch_fp8": t(lambda: nv.dispatch(xf8, idx, w), f"{sms} SMs dispatch_fp8"),
                              "combine_bf16": t(lambda: nv.combine(rows, h), f"{sms} SMs combine_bf16")}
            be.num_sms = 24
            results["sm_sweep"] = {"info": info, "nvlink": sweep}
    # all ranks' numbers to rank 0
    merged = {}
    allres = gather_max(results)
    for case in results:
        merged[case] = [r[case] for r in allres]
    nv.close()
    ref.close()
    return merged


def summarize(world, case, per_rank):
    infos = [r["info"] for r in per_rank]
    recv_rows = max(i["num_recv"] for i in infos)
    remote_in = max(i["remote_recv"] for i in infos)
    remote_out = max(i["remote_sent"] for i in infos)
    bf16_row = H * 2
    fp8_row = H + (H // 128) * 4
    out = {"world": world, "case": case, "tokens_per_rank": 4096 if case != "latency" else 128,
           "check_ok": all(i["check_ok"] for i in infos),
           "rows_received_max": recv_rows, "remote_rows_in_max": remote_in, "remote_rows_out_max": remote_out,
           "bytes_logical_bf16": recv_rows * bf16_row,
           "floor_us": {
               "dispatch_bf16": max(remote_in, remote_out) * bf16_row / NVLINK_GBPS / 1e3,
               "dispatch_fp8": max(remote_in, remote_out) * fp8_row / NVLINK_GBPS / 1e3,
               "combine_bf16": max(remote_in, remote_out) * bf16_row / NVLINK_GBPS / 1e3},
           "per_rank": per_rank}

    def agg(backend, op, sweep_key=None):
        vals = [(r[backend][sweep_key][op] if sweep_key is not None else r[backend].get(op)) for r in per_rank]
        if any(v is None for v in vals):
            return None
        tmax = max(vals)
        return {"us": round(tmax, 1), "per_rank_us": [round(v, 1) for v in vals],
                "logical_GBps": round(recv_rows * bf16_row / tmax / 1e3, 1)}

    if case == "sm_sweep":
        out["nvlink"] = {str(s): {op: agg("nvlink", op, s) for op in ("dispatch_bf16", "dispatch_fp8", "combine_bf16")}
                         for s in per_rank[0]["nvlink"]}
    else:
        for be in ("nvlink", "nvlink_backend", "torch"):
            if be in per_rank[0]:
                out[be] = {op: agg(be, op) for op in per_rank[0][be]}
        out["breakdown_rank0_us"] = per_rank[0].get("breakdown", {})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--cases", nargs="+", default=["throughput", "latency", "sm_sweep"])
    ap.add_argument("--sms", type=int, nargs="+", default=[8, 16, 24, 32])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--breakdown", action="store_true", help="per-kernel times via the torch profiler")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ngpu = torch.cuda.device_count()
    dev_name = torch.cuda.get_device_name(0) if ngpu else "none"
    commit = os.environ.get("EP_COMMIT")
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                             cwd=os.path.dirname(os.path.abspath(__file__))).strip()
        except Exception:
            commit = "unknown"
    meta = {"device": f"{ngpu}x {dev_name}", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "torch": torch.__version__, "num_sms": 24, "hidden": H, "num_experts": E, "topk": K,
            "iters": args.iters, "warmup": args.warmup, "nvlink_line_rate_GBps": NVLINK_GBPS,
            "timing": "median over iters of CUDA events per rank, slowest rank reported; L2 flushed; GPUs aligned by all-reduce"}
    summary = {c: [] for c in args.cases}
    for world in args.worlds:
        if world > ngpu:
            print(f"skip EP{world}: only {ngpu} GPUs")
            continue
        ctx = mp.get_context("spawn")
        q = ctx.SimpleQueue()
        port = _port()
        procs = [ctx.Process(target=rank_main, args=(r, world, port, args, q)) for r in range(world)]
        for p in procs:
            p.start()
        status, res = q.get()
        for p in procs:
            p.join(300)
            if p.is_alive():
                p.kill()
        if status != "ok":
            print(res)
            raise SystemExit(f"EP{world} failed")
        for case, per_rank in res.items():
            summary[case].append(summarize(world, case, per_rank))
        for case, lst in summary.items():  # written after each EP size, so a later failure keeps these
            if lst:
                with open(os.path.join(args.out, f"nvlink_{case}.json"), "w") as f:
                    json.dump({"meta": meta, "results": lst}, f, indent=1)
    report(summary, args, meta)


def report(summary, args, meta):
    lines = []
    for case in ("throughput", "latency"):
        for s in summary.get(case, []):
            lines.append(f"== {case} EP{s['world']} ({s['tokens_per_rank']} tok/rank, check_ok={s['check_ok']}, "
                         f"rows recv max {s['rows_received_max']}, logical {s['bytes_logical_bf16'] / 1e6:.1f} MB)")
            lines.append(f"   {'op':<22}{'nvlink us':>10}{'GB/s':>8}{'backend us':>11}{'GB/s':>8}{'torch us':>10}"
                         f"{'GB/s':>8}{'floor us':>10}")
            nan = {"us": float("nan"), "logical_GBps": float("nan")}
            for op, v in s["nvlink"].items():
                tv = s["torch"].get(op) or nan
                bv = s.get("nvlink_backend", {}).get(op) or nan
                fl = s["floor_us"].get(op.replace("_cached", ""), 0)
                lines.append(f"   {op:<22}{v['us']:>10.1f}{v['logical_GBps']:>8.1f}{bv['us']:>11.1f}"
                             f"{bv['logical_GBps']:>8.1f}{tv['us']:>10.1f}{tv['logical_GBps']:>8.1f}{fl:>10.1f}")
            for op, bv in s.get("nvlink_backend", {}).items():
                if op not in s["nvlink"] and bv:
                    fl = s["floor_us"].get("combine_bf16" if op.startswith("combine") else op, 0)
                    lines.append(f"   {op:<22}{'':>10}{'':>8}{bv['us']:>11.1f}{bv['logical_GBps']:>8.1f}"
                                 f"{'':>10}{'':>8}{fl:>10.1f}")
            if s.get("breakdown_rank0_us"):
                lines.append(f"   kernels (rank 0, us/call): {json.dumps(s['breakdown_rank0_us'])}")
    for s in summary.get("sm_sweep", []):
        lines.append(f"== SM sweep EP{s['world']} (throughput shape, nvlink)")
        for sms, ops in s["nvlink"].items():
            lines.append(f"   {sms:>3} SMs: " + "  ".join(f"{op} {v['us']:.1f} us ({v['logical_GBps']:.0f} GB/s)"
                                                      for op, v in ops.items()))
    print("\n".join(lines))
    for case, lst in summary.items():
        if lst:
            with open(os.path.join(args.out, f"nvlink_{case}.json"), "w") as f:
                json.dump({"meta": meta, "results": lst}, f, indent=1)
    try:
        plot(summary, os.path.join(args.out, "nvlink_bench.png"))
    except ImportError:
        print("matplotlib not available: no plot")


def plot(summary, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, case in zip(axes[:2], ("throughput", "latency")):
        labels, nvv, tv = [], [], []
        for s in summary.get(case, []):
            for op in ("dispatch_bf16", "dispatch_fp8", "combine_bf16"):
                labels.append(f"EP{s['world']}\n{op.replace('_', ' ')}")
                nvv.append(s["nvlink"][op]["us"])
                tv.append(s["torch"][op]["us"] if s["torch"].get(op) else 0)
        xs = range(len(labels))
        ax.bar([i - 0.2 for i in xs], nvv, 0.4, label="nvlink (24 SMs)")
        ax.bar([i + 0.2 for i in xs], tv, 0.4, label="torch / NCCL")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("us (slowest rank, median)")
        ax.set_title(case)
        ax.legend()
    ax = axes[2]
    for s in summary.get("sm_sweep", []):
        sms = list(s["nvlink"].keys())
        for op in ("dispatch_bf16", "dispatch_fp8", "combine_bf16"):
            ax.plot([int(v) for v in sms], [s["nvlink"][k][op]["us"] for k in sms], marker="o",
                    label=f"EP{s['world']} {op}")
    ax.set_xlabel("SMs")
    ax.set_ylabel("us")
    ax.set_title("SM sweep (throughput shape)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
