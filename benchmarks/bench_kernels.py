"""The nvlink kernel choices side by side, with DeepEP V1 in the same run: which `comm.dispatch_kernel` /
`comm.combine_kernel` wins at this EP size and SM count (what `auto` in backends/nvlink/plan.py rests on).

    python3 benchmarks/bench_kernels.py --world 4 --sms 16 24 48 --out /tmp/res
    CUDA_VISIBLE_DEVICES=0,1 python3 benchmarks/bench_kernels.py --world 2 --sms 8 16 24 48

Throughput case of DESIGN.md (4096 tokens per rank, hidden 7168, 256 experts, top-8, uniform or --case
group-limited routing, BF16), all three
protocols (protocols.py: cold is the headline, queued the kernels' view), slowest rank's median. Every
kernel pair is first checked against the torch backend on the same inputs (received rows equal, combine
equal within BF16 rounding); a pair that differs is reported and not timed. DeepEP's rows come from
deepep_rows.py when `deep_ep` imports (its SM count set per row). Writes bench_kernels_ep<W>.json.

A/B of the pull combine's variants (Runtime.pull_variant, csrc/nvlink/combine_pull_tma.cu; V or V/S with S
stager slots, else the planned count): every pair whose combine kernel is pull (or auto) runs once per
variant, checked like the others; --combine-only times the combine alone.

    python3 benchmarks/bench_kernels.py --world 4 --sms 24 48 --pairs fused/pull --combine-variant 0 0/3 1/3 4 5/3 --combine-only

Rows print each protocol's time (cold / queued / hidden [/ aligned]) and, for the stamped protocols, the ranks'
host-clock spread after the barrier and at the call's return and the slowest host time in the call (protocols.py).
With `--protocols ... traced` each op also prints the median cold call's kernels per rank under the profiler (the
launch gap after a marker kernel, each kernel's start and length): where a cold call's time goes, ours and DeepEP's.

    python3 benchmarks/bench_kernels.py --world 4 --sms 24 --pairs auto/auto --combine-only --protocols cold queued traced

A cold row moves by 30-60 us from one set of processes to the next (the ranks' spread after the barrier is drawn
per process: benchmarks/NOTES_nvlink.md, session 12), so --processes N runs the whole bench N times, each in fresh
processes, and the JSON's rows hold the median over them of each row's value ("<protocol>_us"), the values
themselves beside it ("<protocol>_us_runs"); an A/B is two such runs, or alternating runs of one process each.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
try:
    import ep_plugin
except ImportError:
    sys.path.append(os.path.dirname(HERE))
    import ep_plugin

from bench_inputs import E, H, K, ep_config, make_inputs  # noqa: E402
from bench_launch import init_rank, run_world  # noqa: E402
from deepep_rows import DeepEP  # noqa: E402
from protocols import PROTOCOLS, Protocols, measure  # noqa: E402

# (dispatch_kernel, combine_kernel) pairs; "auto" is what a user gets by default
PAIRS = (("split", "split"), ("split", "fused"), ("split", "pipelined"), ("fused", "pipelined"), ("split", "pull"),
         ("fused", "pull"), ("auto", "auto"))


def slowest(op):
    return {k: (max(v) if isinstance(v, list) and v and None not in v else v) for k, v in op.items()}


def check_pair(buf, inp, ref_out, ref_y, rows_out):
    """None when buf's dispatch and combine equal the torch backend's on these inputs, else what differs."""
    res = buf.dispatch(inp.x, inp.idx, inp.w)
    n = ref_out.x.size(0)
    if not torch.equal(res.x[:n], ref_out.x):
        return "dispatch rows differ from the torch backend's"
    y = buf.combine(rows_out(res.x), res.handle)
    # both sum in float and round once to BF16: they may differ by an ulp of the result, not more
    bad = ((y.float() - ref_y.float()).abs() > 1e-2 * ref_y.float().abs() + 1e-3).sum().item()
    if bad:
        return f"combine differs from the torch backend's in {bad} elements"
    return None


def rank_main(rank, world, port, args, q):
    init_rank(rank, world, port)
    inp = make_inputs(args.case, rank, world)
    # hidden: a cold call whose host work is hidden behind a GPU sleep (cold - hidden = the host's share)
    proto = Protocols(args.warmup, args.iters, tuple(args.protocols))
    ref = ep_plugin.EPBuffer(None, ep_config("torch", 24), hidden=H)
    ref_out = ref.dispatch(inp.x, inp.idx, inp.w)
    scale = 0.5 + rank  # expert outputs: the received rows scaled per rank, so combine sums distinct values
    rows_out = lambda rows: (rows.float() * scale).to(torch.bfloat16)  # noqa: E731
    ref_y = ref.combine(rows_out(ref_out.x), ref_out.handle)
    ref.close()
    out = {"world": world, "sms": args.sms, "case": args.case, "rows": []}

    def row(name, sms, ops, note=None):
        r = {"name": name, "sms": sms, "ops": {k: slowest(v) for k, v in ops.items()}, "note": note}
        out["rows"].append(r)
        if rank == 0:
            cells = "  ".join(f"{k} " + "/".join(f"{v.get(p + '_us') or float('nan'):6.1f}" for p in proto.kinds)
                              + _skews(v, proto.kinds) for k, v in r["ops"].items())
            print(f"EP{world} {sms:2d} SMs {name:24s} {cells}{'  ' + note if note else ''}", flush=True)
            for k, v in r["ops"].items():  # --protocols traced: the median cold call's kernels per rank
                if v.get("traced_timeline"):
                    from bench_decode_pair import timeline_line
                    print(f"    {k} traced (us after the ranks' first marker): {timeline_line(v['traced_timeline'])}",
                          flush=True)

    runs = []  # (dispatch kernel, combine kernel, pull variant or None, its stage slots or None, pair's attrs)
    for spec in args.pairs:
        pair, _, own = spec.partition(":")  # DK/CK[:NAME=V,...]: attributes of this pair's backend only
        dk, ck = pair.split("/")
        own = [a for a in own.split(",") if a]
        if args.combine_variant and ck in ("pull", "auto"):
            runs += [(dk, ck, *_variant(v), own) for v in args.combine_variant]
        else:
            runs.append((dk, ck, None, None, own))
    for dk, ck, variant, stage_slots, own in runs:
        cfg = ep_config("nvlink", args.sms[0])
        cfg["comm"].update(dispatch_kernel=dk, combine_kernel=ck)
        buf = ep_plugin.EPBuffer(None, cfg, hidden=H)
        be = buf._backend
        attrs = dict(a.split("=", 1) for a in [*args.backend_attr, *own])
        for k, v in attrs.items():  # NAME (the backend's) or _rt.NAME (its runtime's)
            *path, leaf = k.split(".")
            obj = be
            for part in path:
                obj = getattr(obj, part)
            if not hasattr(obj, leaf):
                raise SystemExit(f"--backend-attr {k}: the nvlink backend has no attribute {k!r}")
            setattr(obj, leaf, type(getattr(obj, leaf))(int(v)))
        if variant is not None:
            be._rt.pull_variant = variant
            if stage_slots is not None:
                be._rt.pull_stage_slots = stage_slots
        err = None
        try:
            err = check_pair(buf, inp, ref_out, ref_y, rows_out)
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"[:300]
        errs = [None] * world
        dist.all_gather_object(errs, err)
        err = next((f"rank {r}: {e}" for r, e in enumerate(errs) if e), None)
        name = f"ep_plugin {dk}/{ck}" + ("" if variant is None else
                                          f" v{variant}/{be._rt.pull_stage_slots}") + "".join(
                                              f" {k}={v}" for k, v in attrs.items())
        if err:
            row(name, args.sms[0], {}, note=f"FAILED CHECK: {err}")
            buf.close()
            continue
        first = buf.dispatch(inp.x, inp.idx, inp.w)
        for sms in args.sms:
            be.num_sms = sms  # (and the dispatch kernel `auto` plans for it, as a buffer built for sms would)
            ops = {} if args.combine_only else {
                "dispatch": measure(proto, lambda: buf.dispatch(inp.x, inp.idx, inp.w)),
                "cached": measure(proto, lambda: buf.dispatch(inp.x, handle=first.handle))}
            ops["combine"] = measure(proto, lambda: buf.combine(first.x, first.handle))
            if args.combine_barrier:  # the start aligned by a device-side barrier, its own latency on the clock
                tok = torch.zeros(1, device="cuda")
                ops["combine_barrier"] = measure(proto, lambda: (dist.all_reduce(tok), buf.combine(first.x, first.handle)))
                ops["barrier_only"] = measure(proto, lambda: dist.all_reduce(tok))
            if (dk, ck) == ("auto", "auto") and not args.combine_only:
                ops["dispatch_fp8"] = measure(proto, lambda: buf.dispatch(inp.xf8, inp.idx, inp.w))
            copies = getattr(be._rt, "combine_copy_calls", 0)  # which combine path ran (the copy-engine stage's A/B)
            row(name, sms, ops, note=f"{copies} combines by the copy-engine stage so far" if copies else None)
        del first
        buf.close()
    if not args.no_deepep:
        for sms in args.sms:
            dep = DeepEP(H, E, sms)
            dep.setup_normal()
            ops, facts = dep.normal_case(proto, inp.x, inp.xf8, inp.idx, inp.w)
            keep = {"dispatch": ops.get("deepep.dispatch_bf16"), "cached": ops.get("deepep.dispatch_cached"),
                    "combine": ops.get("deepep.combine_bf16"), "dispatch_fp8": ops.get("deepep.dispatch_fp8")}
            if args.combine_only:
                keep = {"combine": keep["combine"]}
            row("deepep v1", sms, {k: v for k, v in keep.items() if v}, note=facts.get("error"))
            dep.close()
    if rank == 0:
        q.put(("done", out))
    dist.barrier()
    dist.destroy_process_group()


def merge_processes(reports):
    """One report from several runs' (rank 0's `out` of each): rows matched by (name, SMs) in the first run's
    order, each op's "<protocol>_us" the median over the runs that have it, the values kept as "..._us_runs"; other
    keys (the skews, notes) from the first run."""
    import statistics
    first = reports[0]
    merged = {**first, "rows": [], "processes": len(reports)}
    for r in first["rows"]:
        same = [x for rep in reports for x in rep["rows"] if (x["name"], x["sms"]) == (r["name"], r["sms"])]
        ops = {}
        for op, vals in r["ops"].items():
            cell = dict(vals)
            for key, v in vals.items():
                if not key.endswith("_us"):
                    continue
                runs = [x["ops"][op][key] for x in same if isinstance(x["ops"].get(op, {}).get(key), (int, float))]
                if runs:
                    cell[key] = round(statistics.median(runs), 2)
                    cell[key + "_runs"] = runs
            ops[op] = cell
        merged["rows"].append({**r, "ops": ops})
    return merged


def _skews(op, kinds):
    """A row's suffix: protocols.stamp_summary's medians per stamped protocol, where measured."""
    got = [f"{p} {op[p + '_skew_us']:.0f}/{op[p + '_ret_skew_us']:.0f}/{op[p + '_host_us']:.0f}"
           for p in kinds if op.get(p + "_skew_us") is not None]
    late = f" [late rank's delay {op['skewed_delay_us']:.1f} us]" if op.get("skewed_delay_us") is not None else ""
    return (f" [skew after barrier/at return/host us: {', '.join(got)}]" if got else "") + late


def _variant(text):
    """--combine-variant's "V" or "V/S" -> (V, S or None)."""
    v, _, s = str(text).partition("/")
    return int(v), (int(s) if s else None)


def plot(report, path):
    """Cold-call dispatch and combine time against SMs: ep_plugin (auto kernels) and DeepEP V1."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, op in zip(axes, ("dispatch", "combine")):
        for name, style in (("ep_plugin auto/auto", "o-"), ("deepep v1", "s--")):
            pts = sorted((r["sms"], r["ops"][op]["cold_us"]) for r in report.get("rows", [])
                         if r["name"] == name and op in r["ops"] and r["ops"][op].get("cold_us"))
            if pts:
                ax.plot(*zip(*pts), style, label=name)
        ax.set(title=f"EP{report.get('world')} {op} ({report.get('case', 'throughput')}, cold)", xlabel="SMs",
               ylabel="us, slowest rank")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sms", type=int, nargs="+", default=[24])
    ap.add_argument("--case", default="throughput", choices=["throughput", "group_limited", "group_limited8"],
                    help="bench_inputs.CASES: uniform, 4 groups / top-2, or 8 groups / top-4 routing")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--pairs", nargs="+", default=[f"{d}/{c}" for d, c in PAIRS],
                    help="dispatch/combine kernel pairs, each optionally with its own backend attributes "
                         "(split/auto:stage_beside_notify=1; see --backend-attr)")
    ap.add_argument("--combine-variant", "--pull-variant", nargs="+", default=[], metavar="V[/S]",
                    help="run each pull (or auto) combine pair once per Runtime.pull_variant V (16: the default since "
                         "session 5, 0: the kernel before it; +1 / +2 half / quarter stager rows, +4 free load slots, +8 contiguous spans per block, +16 x "
                         "read L2 evict_first, +64 every rank's combine starts together; 80 the default since session 16), "
                         "with S stager slots if given")
    ap.add_argument("--combine-only", action="store_true", help="time the combine alone (DeepEP's too)")
    ap.add_argument("--combine-barrier", action="store_true",
                    help="also time each pair's combine behind a one-float NCCL all-reduce on the stream (op "
                         "combine_barrier, the all-reduce on the clock): what aligning the ranks' start costs or saves "
                         "a cold combine (DeepEP's combine starts with a notify kernel that waits for every rank)")
    ap.add_argument("--backend-attr", nargs="+", default=[], metavar="NAME=V",
                    help="set attributes of the nvlink backend (NAME) or its runtime (_rt.NAME) on every pair (ints; the A/B "
                         "knobs, e.g. notify_inside=0, _rt.stage_copy_engine=0)")
    ap.add_argument("--protocols", nargs="+", default=["cold", "queued", "hidden"], choices=list(PROTOCOLS),
                    help="protocols.py's; `aligned` (diagnostic) separates the start skew from a cold L2")
    ap.add_argument("--no-deepep", action="store_true")
    ap.add_argument("--processes", type=int, default=1, metavar="N",
                    help="run the bench N times in fresh processes; rows hold the median over them")
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    t0 = time.time()
    reports, done = [], True
    for _ in range(max(1, args.processes)):
        report, complete = run_world(rank_main, args.world, args, on_partial=lambda body: None)
        done = done and complete
        if report:
            reports.append(report)
    report = merge_processes(reports) if len(reports) > 1 else (reports[0] if reports else None)
    if len(reports) > 1:
        print(f"median over {len(reports)} processes:", flush=True)
        for r in report["rows"]:
            cells = "  ".join(f"{k} " + "/".join(f"{v.get(p + '_us') or float('nan'):6.1f}" for p in args.protocols)
                              for k, v in r["ops"].items())
            print(f"EP{report['world']} {r['sms']:2d} SMs {r['name']:24s} {cells}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "commit": os.popen(f"git -C {HERE} rev-parse --short HEAD 2>/dev/null").read().strip() or None,
            "seconds": round(time.time() - t0, 1), "complete": done, "processes": len(reports)}
    suffix = "" if args.case == "throughput" else f"_{args.case}"
    path = os.path.join(args.out, f"bench_kernels_ep{args.world}{suffix}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, **(report or {})}, f, indent=1)
    png = plot(report or {}, path[:-len(".json")] + ".png")
    print(f"wrote {path}{' and ' + png if png else ''} ({meta['seconds']} s, complete={done})", flush=True)
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
