"""The internode backend (comm.backend: nvshmem) on one host split into virtual nodes, beside the flat
nvlink backend and the torch backend (NCCL) in the same run, with the rows each rank moves per domain.

    python benchmarks/bench_internode.py --world 2 --ranks-per-node 1 --out benchmarks/results --label 2x_h200
    python benchmarks/bench_internode.py --world 4 --ranks-per-node 2 --timeline 10 --profile   # 2x2, by stage

Cases: 4096 tokens/rank, hidden 7168, 256 experts, top-8; uniform routing, and group-limited with
num_groups = the node count and group_topk 1 (each token stays on one node: RDMA rows fall, the
point of DeepSeek-V3's node-limited gating). Both timing protocols of DESIGN.md (protocols.py),
slowest rank's median. On one host the "RDMA" hop runs over NVLink through NVSHMEM's P2P transport:
correct, not RDMA speed; the per-domain rows (ep_plugin/plan/traffic.py) are what a real fabric
would carry. DeepEP's internode kernels need 2+ real nodes of 8 GPUs (its NUM_MAX_NVL_PEERS layout),
so no DeepEP row here; ep_plugin/plan/cost_model.py compares with its published figures instead.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import ep_plugin  # noqa: E402
from bench_inputs import E, H, K, group_limited_topk, quantize_fp8  # noqa: E402
from bench_launch import init_rank, run_world  # noqa: E402
from ep_plugin.plan.traffic import hierarchical_rows  # noqa: E402
from protocols import Protocols, kernel_breakdown, measure  # noqa: E402

T = 4096


def routing(kind: str, nodes: int, rank: int, world: int):
    g = torch.Generator().manual_seed(100 * world + rank + (0 if kind == "uniform" else 7))
    scores = torch.rand(T, E, generator=g)
    if kind == "uniform":
        idx = scores.topk(K, dim=1).indices
    else:
        idx = group_limited_topk(scores, K, nodes, 1)
    return idx.long(), torch.rand(T, K, generator=g)


def buffer(backend: str, args, **comm):
    cfg = {"moe": {"num_experts": E, "topk": K},
           "comm": {"backend": backend, "max_tokens_per_rank": T, "timeout_s": 20.0, "num_sms": args.num_sms, **comm}}
    return ep_plugin.EPBuffer(None, cfg, hidden=H)


def _backend_of(buf):
    return getattr(buf._backend, "wrapped", buf._backend)


def stage_timeline(buf, x, idx, w, n: int, flush) -> dict:
    """The nvshmem backend's per-stage times (hierarchical/timeline.py) over n cold calls of each kind
    (L2 flushed, ranks aligned before each, as the cold-call protocol): this rank's medians."""
    from ep_plugin.backends.hierarchical.timeline import NO_TIMELINE, StageTimeline

    be = _backend_of(buf)
    a = buf.dispatch(x, idx, w)
    buf.combine(a.x, a.handle)
    tl = StageTimeline()
    be.timeline = tl
    try:
        for _ in range(n):
            for op in ("dispatch", "dispatch_cached", "combine"):
                flush.zero_()
                torch.cuda.synchronize()
                dist.barrier()
                if op == "dispatch":
                    a = buf.dispatch(x, idx, w)
                elif op == "dispatch_cached":
                    buf.dispatch(x, handle=a.handle)
                else:
                    buf.combine(a.x, a.handle)
        torch.cuda.synchronize()
        return tl.summary()
    finally:
        be.timeline = NO_TIMELINE


def use_host_path_before() -> None:
    """The hierarchical backend's host path as it was before session 7's cut (same values, more launches):
    the eight-op routing mask and the one-rank node's packing in torch ops (no local_pack kernel), for a
    same-machine A/B (--host-path before). The send counts' lazy sum and the single tpe.long() stay."""
    import ep_plugin.backends.hierarchical.backend as hb
    from ep_plugin.backends.hierarchical.local import LocalNode

    hb._in_rank = hb._in_rank_torch
    LocalNode.pack = lambda self, topk_f, nodes, max_tokens: LocalNode.pack_torch(self, topk_f, nodes, max_tokens,
                                                                                   before=True)


def use_combine_path_before() -> None:
    """The hierarchical combine as it was before session 8's cut (same values, two more passes at 2x2): the
    gather back to the inner order, the inner combine into y_f and the rail's copy of y_f's rows; at 2x1 the
    gather back to slots (--combine-path before)."""
    from ep_plugin.backends.hierarchical.backend import HierarchicalBackend

    HierarchicalBackend.fused_combine = False


def use_combine_path_pull() -> None:
    """The pulled combine of session 11 (same values): each forwarder keeps the sums it owes an origin in its own rail
    rows and the origin's receive + sum reads them over P2P, instead of the inner combine storing them at the origin
    (--combine-path pull; HierarchicalBackend.pull_combine)."""
    from ep_plugin.backends.hierarchical.backend import HierarchicalBackend

    HierarchicalBackend.pull_combine = True


def _pulls(path: str) -> bool:
    """Whether the run's combine was the pulled one where the rail peers are P2P (stage_model.local_combine_terms
    takes only such runs' 2x1 timelines)."""
    from ep_plugin.backends.hierarchical.backend import HierarchicalBackend

    return path == "pull" or (path == "now" and bool(HierarchicalBackend.pull_combine))


def use_combine_path_push() -> None:
    """The pushed combine of sessions 8-10 (same values): the inner combine (P > 1) or the rail's send (P = 1) stores
    each sum at its origin's rail rows (--combine-path push; the default pulls where every rail peer is P2P)."""
    from ep_plugin.backends.hierarchical.backend import HierarchicalBackend

    HierarchicalBackend.pull_combine = False


def use_cached_path_before() -> None:
    """The hierarchical cached dispatch as it was before session 10 (same values, one more pass at 2x2): the inner
    dispatch in its own order, then scatter_rows into the contract's (--cached-path before)."""
    from ep_plugin.backends.hierarchical.backend import HierarchicalBackend

    HierarchicalBackend.direct_cached_dispatch = False


def use_fresh_path_before() -> None:
    """The hierarchical fresh dispatch as it was before session 10 (same values, two more passes at 2x2): the inner
    dispatch in its own order, contract_order, then scatter_rows into the contract's (--fresh-path before)."""
    from ep_plugin.backends.hierarchical.backend import HierarchicalBackend

    HierarchicalBackend.direct_fresh_dispatch = False


# --NAME-path before: that part of the hierarchical backend as it was before a session's cut (same values), for an
# A/B on the same machine; NAME -> (what "before" means, the switch)
PATHS_BEFORE = {
    "host": ("the hierarchical backend's host path before session 7 (torch routing mask and packing, no local_pack "
             "kernel)", use_host_path_before),
    "combine": ("the hierarchical combine before session 8 (gather back to the inner order or to slots, inner combine "
                "into y_f, the rail copies its rows)", use_combine_path_before),
    "cached": ("the hierarchical cached dispatch before session 10 (the inner dispatch in its own order, then the "
               "reorder pass)", use_cached_path_before),
    "fresh": ("the hierarchical fresh dispatch before session 10 (the inner dispatch in its own order, contract_order, "
              "then the reorder pass)", use_fresh_path_before),
}
def use_fresh_path_notify_first() -> None:
    """The 2x2 fresh dispatch's inner exchange with notify launched before the contract-order stage_pull, as it was
    before session 18 turned notify inside it on (--fresh-path notify_first)."""
    from ep_plugin.backends.nvlink.backend import NvlinkBackend

    NvlinkBackend.notify_inside_contract = False


# --NAME-path VALUE beyond now/before: another path behind its switch, for an A/B; NAME -> {VALUE: (what, the switch)}
PATHS_NEW = {
    "fresh": {"notify_first": ("the fresh dispatch with notify launched before the inner contract-order stage_pull "
                               "(before session 18; now notify runs inside it)", use_fresh_path_notify_first)},
    "combine": {"pull": ("the pulled combine (session 11: sums kept in the forwarder's own rail rows, the origin reads "
                         "them over P2P; the default)", use_combine_path_pull),
                "push": ("the pushed combine (sessions 8-10: the sums stored at the origin's rail rows)",
                         use_combine_path_push)},
}


def rank_main(rank: int, world: int, port: int, args, q) -> None:
    try:
        init_rank(rank, world, port)
        for name, (_, use_before) in PATHS_BEFORE.items():
            if getattr(args, f"{name}_path", "now") == "before":
                use_before()
        for name, paths in PATHS_NEW.items():
            new = paths.get(getattr(args, f"{name}_path", "now"))
            if new is not None:
                new[1]()
        P = args.ranks_per_node
        nodes = world // P
        proto = Protocols(args.warmup, args.iters)
        makers = {"nvshmem": lambda: buffer("nvshmem", args, ranks_per_node=P),
                  "nvlink": lambda: buffer("nvlink", args), "torch": lambda: buffer("torch", args)}
        bufs = {name: makers[name]() for name in args.backends}
        ref_name = "torch" if "torch" in bufs else None
        rows = []
        for kind in args.cases:
            idx, w = routing(kind, nodes, rank, world)
            every = [None] * world
            dist.all_gather_object(every, idx)
            traffic = hierarchical_rows(every, E, P)
            idx, w = idx.cuda(), w.cuda()
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            xf8 = quantize_fp8(x)
            ok = {}
            if ref_name is not None:
                ref = bufs[ref_name].dispatch(x, idx, w)
                yr = bufs[ref_name].combine(ref.x, ref.handle)
                n = ref.x.shape[0]
                for name in bufs:
                    if name == ref_name:
                        continue
                    got = bufs[name].dispatch(x, idx, w)
                    ok[name] = bool(torch.equal(got.x[:n], ref.x) and torch.equal(got.topk_idx[:n], ref.topk_idx))
                    yg = bufs[name].combine(got.x, got.handle)
                    ok[name] &= bool(torch.allclose(yg.float(), yr.float(), atol=3e-2, rtol=1e-2))
            ops = {}
            for name, buf in bufs.items():
                a = buf.dispatch(x, idx, w)
                ops[f"{name}.dispatch_bf16"] = measure(proto, lambda: buf.dispatch(x, idx, w))
                if name != "torch" and args.fp8:
                    ops[f"{name}.dispatch_fp8"] = measure(proto, lambda: buf.dispatch(xf8, idx, w))
                ops[f"{name}.dispatch_cached"] = measure(proto, lambda: buf.dispatch(x, handle=a.handle))
                ops[f"{name}.combine_bf16"] = measure(proto, lambda: buf.combine(a.x, a.handle))
            row = {"case": kind, "checks": ok, "rows_per_rank": traffic, "row_bytes_bf16": H * 2, "ops": ops}
            if args.timeline and "nvshmem" in bufs:
                mine = stage_timeline(bufs["nvshmem"], x, idx, w, args.timeline, proto._flush)
                every = [None] * world
                dist.all_gather_object(every, mine)
                row["timeline"] = every  # [rank] {kind: {stage: {gpu_us, host_us}}}
            if args.profile and "nvshmem" in bufs:  # every rank makes the calls; rank 0 keeps its table
                row["kernels"] = kernel_profile(bufs["nvshmem"], x, idx, w)
            rows.append(row)
            if rank == 0:
                q.put(("partial", {"rows": rows}))
        for b in bufs.values():
            b.close()
        if rank == 0:
            q.put(("done", {"rows": rows}))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        q.put(("err", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


def kernel_profile(buf, x, idx, w) -> dict:
    """GPU time per kernel (torch profiler, us per call) of a fresh dispatch, a cached one and a combine
    of the nvshmem backend: which kernels the stages are made of."""
    a = buf.dispatch(x, idx, w)
    buf.combine(a.x, a.handle)
    # the first profiler of a process starts CUPTI (~100 ms, not the same on every rank): a kernel that waits
    # for its peers (the rail's receive, the nvlink notify) then absorbs their late start -- the 98 ms
    # "dispatch" and 9.5 ms notify_kernel rank 0 showed for the 2x2 fresh dispatch on 2026-11-26 (session 7).
    # A throwaway profile first, then the ranks aligned, so the profiled calls start together.
    kernel_breakdown(torch.cuda.synchronize, n=1, top=1)
    torch.cuda.synchronize()
    dist.barrier()
    last = {}

    def fresh():
        last["a"] = buf.dispatch(x, idx, w)

    fresh()
    return {"dispatch": kernel_breakdown(fresh, n=3, top=12),
            "dispatch_cached": kernel_breakdown(lambda: buf.dispatch(x, handle=last["a"].handle), n=3, top=12),
            "combine": kernel_breakdown(lambda: buf.combine(last["a"].x, last["a"].handle), n=3, top=12)}


def timeline_table(rows) -> str:
    """Slowest rank's median per stage (GPU us, host us in brackets) for each row that has a timeline."""
    out = []
    for r in rows:
        if not r.get("timeline"):
            continue
        out.append(f"[{r['case']}] nvshmem stage timeline, slowest rank's median per stage: GPU us (host us)")
        kinds = r["timeline"][0].keys()
        for kind in kinds:
            stages = r["timeline"][0][kind].keys()
            cells = []
            for st in stages:
                g = [t[kind][st]["gpu_us"] for t in r["timeline"] if t.get(kind, {}).get(st)]
                h = [t[kind][st]["host_us"] for t in r["timeline"] if t.get(kind, {}).get(st)]
                gpu = max(v for v in g if v is not None) if any(v is not None for v in g) else float("nan")
                cells.append(f"{st} {gpu:.0f} ({max(h):.0f})")
            out.append(f"  {kind:16s} " + " | ".join(cells))
    return "\n".join(out)


def table(rows, world, P) -> str:
    out = [f"EP{world} as {world // P} virtual nodes x {P}: slowest rank's median, us (cold / queued)"]
    for r in rows:
        t = r["rows_per_rank"]
        mb = r["row_bytes_bf16"] / 1e6
        out.append(f"[{r['case']}] checks vs torch backend: {r['checks']}; per rank MB over RDMA (hierarchical "
                   f"{[round(v * mb, 1) for v in t['rdma_sent']]}, flat {[round(v * mb, 1) for v in t['flat_rdma_sent']]}),"
                   f" NVLink forwarding {[round(v * mb, 1) for v in t['nvlink_sent']]}")
        for op, m in r["ops"].items():
            if m.get("error"):
                out.append(f"  {op:28s} failed: {m['error']}")
            else:
                out.append(f"  {op:28s} {max(m['cold_us']):9.1f} / {max(m['queued_us']):9.1f}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--num-sms", type=int, default=24)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--label", default="run")
    ap.add_argument("--dry-run", action="store_true", help="check the arguments and imports, run nothing")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel GPU time of the nvshmem backend's fresh dispatch, cached dispatch and combine")
    ap.add_argument("--timeline", type=int, default=0, metavar="N",
                    help="the nvshmem backend's per-stage timeline over N cold calls of each kind (0: off)")
    ap.add_argument("--backends", default="nvshmem,nvlink,torch",
                    help="comma-separated, of nvshmem, nvlink, torch (torch: the reference the others are checked "
                         "against)")
    ap.add_argument("--cases", default="uniform,node_limited", help="comma-separated, of uniform, node_limited")
    ap.add_argument("--no-fp8", dest="fp8", action="store_false", help="skip the FP8 dispatch rows")
    for name, (what, _) in PATHS_BEFORE.items():
        new = PATHS_NEW.get(name, {})
        ap.add_argument(f"--{name}-path", choices=("now", "before") + tuple(new), default="now",
                        help=f"before: {what}, for an A/B on the same machine"
                             + "".join(f"; {v}: {w}" for v, (w, _) in new.items()))
    args = ap.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    args.cases = [c for c in args.cases.split(",") if c]
    bad = sorted(set(args.backends) - {"nvshmem", "nvlink", "torch"}) + sorted(set(args.cases) - {"uniform", "node_limited"})
    if bad or args.world % args.ranks_per_node:
        ap.error(f"unknown backends/cases {bad}" if bad else "--ranks-per-node must divide --world")
    if args.dry_run:
        print(f"bench_internode: world {args.world}, ranks_per_node {args.ranks_per_node}, backends {args.backends}, "
              f"cases {args.cases}, timeline {args.timeline}, profile {args.profile}, combine path {args.combine_path}, "
              f"cached path {args.cached_path}, fresh path {args.fresh_path}, out {args.out}/"
              f"bench_internode_{args.label}.json")
        return 0
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    t0 = time.time()
    rep, complete = run_world(rank_main, args.world, args, on_partial=lambda body: None)
    if rep is None:
        print("nothing measured", flush=True)
        return 2
    meta = {"device": torch.cuda.get_device_name(0), "world": args.world, "ranks_per_node": args.ranks_per_node,
            "tokens": T, "hidden": H, "num_experts": E, "topk": K, "num_sms": args.num_sms, "iters": args.iters,
            "backends": args.backends, "timeline_calls": args.timeline, "host_path": args.host_path,
            "combine_path": args.combine_path, "cached_path": args.cached_path,
            "fresh_path": args.fresh_path, "pull_combine": _pulls(args.combine_path),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "complete": complete, "wall_s": round(time.time() - t0, 1),
            "note": "virtual nodes on one host: the rail hop runs over NVLink (NVSHMEM P2P), not RDMA"}
    try:
        import subprocess
        meta["commit"] = subprocess.run(["git", "-C", os.path.dirname(HERE), "rev-parse", "--short", "HEAD"],
                                        capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bench_internode_{args.label}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rep["rows"]}, f, indent=1)
    print(table(rep["rows"], args.world, args.ranks_per_node), flush=True)
    print(timeline_table(rep["rows"]), flush=True)
    for r in rep["rows"]:
        if r.get("kernels"):
            print(f"[{r['case']}] nvshmem kernels, rank 0, us per call: {json.dumps(r['kernels'])}", flush=True)
    print(f"json: {path}", flush=True)
    bad = [r["case"] for r in rep["rows"] if not all(r["checks"].values())]
    if bad:
        print(f"FAILED: differs from the torch backend in {bad}", flush=True)
    return 1 if bad or not complete else 0


if __name__ == "__main__":
    sys.exit(main())
