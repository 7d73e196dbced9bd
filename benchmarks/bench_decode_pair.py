"""Decode as inference engines run it: one low-latency dispatch + one low-latency combine (a "pair"),
captured in a CUDA graph and replayed, and the same pair called eagerly.

    python3 benchmarks/bench_decode_pair.py --lib ep_plugin --ranks 2 --out /tmp/res/pair_ep2.json
    python3 benchmarks/bench_decode_pair.py --lib deepep --ranks 2 --out /tmp/res/pair_ep2_deepep.json
    python3 benchmarks/bench_decode_pair.py --merge /tmp/res/pair_*.json --out all.json --plot all.png

One library per process (one NVSHMEM job per process): `--lib deepep` times DeepEP V1's Buffer,
`--lib ep_plugin` times ep_plugin's variants one after another in one process (each its own
EPBuffer, closed before the next), `--variants` picks them:
    default      the config a user gets (no comm.low_latency keys but max_tokens_per_rank)
    ob0, ob2     comm.low_latency.output_buffers 0 / 2
    shim         ep_plugin.deep_ep.Buffer with no ep_config, called through DeepEP's API
    shim_ob2     the same with ep_config output_buffers 2
    owner, source  comm.low_latency.combine_reduce owner / source (y's roundings differ between the two:
                 the checksums are compared within each)
    NAME:k=v,..  a variant of its own: `ob=N` (output_buffers), `shim=1`, `eng.ATTR=V` (an attribute
                 of the low-latency engine, set after its first call: the A/B knobs, e.g.
                 `eng.fused_launch=0`, `eng.kernel_flags=N` for the variant bits of
                 csrc/nvshmem/ll_device.cuh), `cfg.a.b=V` (any config key), `ht=NAME` (the EPBuffer's
                 high-throughput backend built as NAME whatever comm.backend says, e.g. `ht=torch`: the
                 low-latency engine without the nvlink side's IPC mappings beside it, an A/B knob).
Per variant and dtype (BF16, FP8 dispatch; combine BF16), four protocols, each --iters timed pairs
after --warmup, CUDA events around the pair, a rank's median, the slowest rank's (DESIGN.md):
    graph_cold    graph replay after an L2 flush (256 MB write), device sync and dist.barrier
    graph_queued  graph replays back to back
    eager_cold    the eager pair, cold as above (host work on the critical path counts)
    eager_queued  eager pairs back to back (the host enqueues ahead while it can)
With --profile N, each protocol's pairs run N more times under the torch profiler (CUDA activity
only), bracketed by marker kernels, and every rank's kernels are kept per pair: name, start relative
to the ranks' earliest start marker (host clock, one host: comparable across ranks), duration. From
those: where a pair's time goes (launch gap, send, the wait for peers inside a receive half, receive,
the gaps between kernels). Checks: the graph's output equals the eager one; each variant's y (BF16
and FP8) has a checksum, and ep_plugin variants must agree with each other (they compute the same
sums in the same order). With --stamps N, each ep_plugin variant and dtype then takes N samples of its
kernels' phase stamps (benchmarks/ll_stamps.py: inside the dispatch and the combine, per block, when the
routing was loaded, the rows placed, stored and acknowledged, the signals sent and seen), queued (the last
of 3 eager pairs), cold (one eager pair after the L2 flush and the barrier) and graph cold (the same with
the pair replayed from a CUDA graph captured with the stamps on). --cpu runs the eager protocols on gloo with the torch reference engine
(tiny sizes; for testing this script).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # this tree's ep_plugin, before any installed one (the spawned ranks inherit the path)
    sys.path.insert(0, ROOT)
SCHEMA = "ep_plugin.bench_decode_pair/1"
PROTOCOLS = ("graph_cold", "graph_queued", "eager_cold", "eager_queued")
DTYPES = ("bf16", "fp8")
LIBS = ("ep_plugin", "deepep")
FLUSH_BYTES = 256 * 1024 * 1024
BUILTIN_VARIANTS = {"default": {}, "ob0": {"ob": "0"}, "ob1": {"ob": "1"}, "ob2": {"ob": "2"},
                    "shim": {"shim": "1"}, "shim_ob2": {"shim": "1", "ob": "2"},
                    "owner": {"cfg.comm.low_latency.combine_reduce": "owner"},
                    "source": {"cfg.comm.low_latency.combine_reduce": "source"}}
REDUCE_KEY = "comm.low_latency.combine_reduce"  # variants agree on y only within one combine_reduce


# ---------------------------------------------------------------------------------------- arguments
def parse_variant(spec: str) -> Dict:
    """'ob2' or 'NAME:k=v,k=v' -> {"name", "ob" (int or None), "shim" (bool), "eng" {attr: value},
    "cfg" {dotted key: value}}. Values are ints, floats, true/false or strings."""
    name, _, rest = spec.partition(":")
    if not name:
        raise ValueError(f"variant {spec!r}: give a name first (NAME or NAME:k=v,...)")
    if rest:
        kv = {}
        for item in rest.split(","):
            k, eq, v = item.partition("=")
            if not eq or not k:
                raise ValueError(f"variant {spec!r}: {item!r} is not k=v")
            kv[k.strip()] = v.strip()
    elif name in BUILTIN_VARIANTS:
        kv = dict(BUILTIN_VARIANTS[name])
    else:
        raise ValueError(f"variant {name!r}: not one of {sorted(BUILTIN_VARIANTS)}; or write NAME:k=v,...")
    out = {"name": name, "ob": None, "shim": False, "eng": {}, "cfg": {}, "ht": None}
    for k, v in kv.items():
        val = _value(v)
        if k == "ob":
            if not isinstance(val, int) or val < 0:
                raise ValueError(f"variant {spec!r}: ob must be an int >= 0, got {v!r}")
            out["ob"] = val
        elif k == "shim":
            out["shim"] = bool(val)
        elif k == "ht":
            out["ht"] = str(val)
        elif k.startswith("eng."):
            out["eng"][k[4:]] = val
        elif k.startswith("cfg."):
            out["cfg"][k[4:]] = val
        else:
            raise ValueError(f"variant {spec!r}: unknown key {k!r} (ob, shim, ht, eng.ATTR, cfg.a.b)")
    return out


def _value(v: str):
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", choices=LIBS, default="ep_plugin")
    ap.add_argument("--ranks", type=int, default=2, help="EP size: one process per GPU 0..ranks-1")
    ap.add_argument("--variants", nargs="+", default=["default", "ob0", "ob2", "shim"],
                    help="ep_plugin variants (see above); ignored with --lib deepep")
    ap.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    ap.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS))
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank (= low-latency max_tokens_per_rank)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="pairs per protocol under the profiler (0: off)")
    ap.add_argument("--profile-variants", nargs="+", default=None, help="the variants to profile (default: all)")
    ap.add_argument("--stamps", type=int, default=0, metavar="N",
                    help="N samples of the kernels' phase stamps per variant and dtype (benchmarks/ll_stamps.py; 0: off)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before the ranks are killed")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_decode_pair.json"))
    ap.add_argument("--plot", default=None, help="with --merge: the PNG to write")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="merge these result files into --out, print the table and the A/B lines")
    ap.add_argument("--cpu", action="store_true", help="gloo + torch reference engine, eager only (a smoke test)")
    args = ap.parse_args(argv)
    if args.merge is None:
        if args.ranks < 1 or args.iters < 1 or args.warmup < 0 or args.tokens < 1 or args.profile < 0:
            ap.error("--ranks, --iters and --tokens must be >= 1, --warmup and --profile >= 0")
        if args.experts % args.ranks:
            ap.error(f"--experts {args.experts} does not split over --ranks {args.ranks}")
        try:
            args.variant_specs = [parse_variant(v) for v in args.variants] if args.lib == "ep_plugin" else \
                [{"name": "deepep", "ob": None, "shim": False, "eng": {}, "cfg": {}}]
        except ValueError as exc:
            ap.error(str(exc))
        if args.cpu:
            args.protocols = [p for p in args.protocols if p.startswith("eager")]
            args.profile = 0
    return args


# ---------------------------------------------------------------------------------------- the pair
class Timer:
    """The protocols' timing: CUDA events on GPU, perf_counter on CPU (where --cpu runs)."""

    def __init__(self, cuda: bool):
        import torch
        self.torch, self.cuda = torch, cuda
        self.flush = torch.empty(FLUSH_BYTES // 4 if cuda else 16, dtype=torch.int32,
                                 device="cuda" if cuda else "cpu")
        self.stamps: List = []  # the last cold run's (after the barrier, after the launch) host ns per pair

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def cold_prep(self):
        import torch.distributed as dist
        self.flush.zero_()
        self.sync()
        dist.barrier()

    def run(self, fn, iters: int, warmup: int, cold: bool) -> List[float]:
        """Per-pair times (us) of `iters` calls of fn after `warmup`."""
        torch = self.torch
        for _ in range(warmup):
            if cold:
                self.cold_prep()
            fn()
        self.sync()
        if not self.cuda:
            ts, stamps = [], []
            for _ in range(iters):
                if cold:
                    self.cold_prep()
                t0 = time.perf_counter_ns()
                fn()
                t1 = time.perf_counter_ns()
                ts.append((t1 - t0) / 1e3)
                if cold:
                    stamps.append((t0, t1))
            self.stamps = stamps
            return ts
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        if not cold:  # align the GPUs with a tiny all-reduce on the stream, then enqueue everything
            import torch.distributed as dist
            tok = torch.zeros(1, device="cuda")
            dist.all_reduce(tok)
        stamps = []
        for a, b in evs:
            if cold:
                self.cold_prep()
            t0 = time.perf_counter_ns()  # CLOCK_MONOTONIC: one clock for every rank on the host
            a.record()
            fn()
            b.record()
            if cold:
                stamps.append((t0, time.perf_counter_ns()))
                self.sync()
        self.sync()
        self.stamps = stamps
        return [a.elapsed_time(b) * 1e3 for a, b in evs]


def capture_graph(fn, warm: int):
    """fn warmed `warm` times on a side stream, then captured in a CUDA graph: (graph, fn's output)."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warm):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def make_inputs(rank: int, a, device):
    import torch
    T, H, E, K, R = a.tokens, a.hidden, a.experts, a.topk, a.ranks
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    x = torch.randn((T, H), generator=g, device=device).to(torch.bfloat16)
    scores = torch.rand((T, E), generator=g, device=device) + 0.1
    w, idx = scores.topk(K, dim=-1)
    idx, w = idx.to(torch.int64), (w / w.sum(-1, keepdim=True)).float()
    y_in = torch.randn((E // R, R * T, H), generator=g, device=device).to(torch.bfloat16)
    return x, idx, w, y_in


class Pair:
    """One library's dispatch + combine over one buffer: `pair(fp8)` returns y."""

    def __init__(self, lib: str, variant: Dict, group, a, inputs, cuda: bool):
        self.lib, self.variant, self.a = lib, variant, a
        self.x, self.idx, self.w, self.y_in = inputs
        self.engine_info: Dict = {}
        T, H, E, K, R = a.tokens, a.hidden, a.experts, a.topk, a.ranks
        if lib == "deepep" or variant["shim"]:
            if lib == "deepep":
                import deep_ep
            else:
                import ep_plugin.deep_ep as deep_ep
            nbytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
            kw = {}
            if lib != "deepep" and (variant["ob"] is not None or variant["cfg"]):
                kw["ep_config"] = self._config_dict(variant, backend=False)
            self.buf = deep_ep.Buffer(group, 0, nbytes, low_latency_mode=True, num_qps_per_rank=E // R,
                                      explicitly_destroy=True, **kw)
            self.api = "deep_ep"
        else:
            import ep_plugin
            import ep_plugin.buffer as epb
            from ep_plugin.backends.registry import backend_class
            made = epb.make_backend
            if variant.get("ht"):  # the high-throughput side as named (the low-latency engine follows comm.backend)
                epb.make_backend = lambda g, cfg, hidden, e: backend_class(variant["ht"])(g, cfg, hidden, e)
            try:
                self.buf = ep_plugin.EPBuffer(group, self._config_dict(variant, backend=True, cpu=not cuda), hidden=H)
            finally:
                epb.make_backend = made
            self.api = "ep_plugin"
        self._eng_set = False

    def _config_dict(self, v: Dict, backend: bool, cpu: bool = False) -> Dict:
        a = self.a
        ll = {"max_tokens_per_rank": a.tokens}
        if v["ob"] is not None:
            ll["output_buffers"] = v["ob"]
        cfg = {"moe": {"num_experts": a.experts, "topk": a.topk}, "comm": {"low_latency": ll}}
        if backend:  # a user's default backend; the normal kernels sized small (this runs low-latency calls only)
            cfg["comm"].update(backend="torch" if cpu else "auto", max_tokens_per_rank=max(a.tokens, 128))
        for key, val in v["cfg"].items():
            node = cfg
            *path, last = key.split(".")
            for p in path:
                node = node.setdefault(p, {})
            node[last] = val
        return cfg

    def engine(self):
        buf = self.buf
        if self.api == "deep_ep":  # ep_plugin.deep_ep keeps one EPBuffer per (H, E, M) shape
            inner = getattr(buf, "_ll_buffers", None) or getattr(buf, "_ll_bufs", None)
            if isinstance(inner, dict) and inner:
                buf = next(iter(inner.values()))
            else:
                return None
        return getattr(buf, "_low_latency", None)

    def _apply_engine_knobs(self):
        if self._eng_set:
            return
        self._eng_set = True
        eng = self.engine()
        if eng is not None:
            self.engine_info = {"engine": getattr(eng, "name", "?"),
                                "output_sets": getattr(eng, "output_sets", None),
                                "output_buffers": getattr(eng, "output_buffers", None)}
        for k, v in self.variant["eng"].items():
            if eng is None or not hasattr(eng, k):
                raise ValueError(f"variant {self.variant['name']}: the engine has no attribute {k!r}")
            setattr(eng, k, v)
            self.engine_info[k] = v

    def pair(self, fp8: bool):
        a = self.a
        if self.api == "deep_ep" or self.lib == "deepep":
            _, _, h, _, _ = self.buf.low_latency_dispatch(self.x, self.idx, a.tokens, a.experts, use_fp8=fp8)
            y = self.buf.low_latency_combine(self.y_in, self.idx, self.w, h)[0]
        else:
            _, _, h, _, _ = self.buf.low_latency_dispatch(self.x, self.idx, use_fp8=fp8)
            y = self.buf.low_latency_combine(self.y_in, self.idx, self.w, h)[0]
        if not self._eng_set:
            self._apply_engine_knobs()
        return y

    def close(self):
        for name in ("close", "destroy"):
            fn = getattr(self.buf, name, None)
            if fn is not None:
                try:
                    fn()
                except Exception:  # noqa: BLE001  (explicitly_destroy off: DeepEP's destroy may refuse)
                    pass
                return


def checksum(y) -> float:
    return float(y.float().abs().sum().item()) if y is not None else float("nan")


# ---------------------------------------------------------------------------------------- profiling
def _short_name(n: str) -> str:
    n = n.replace("(anonymous namespace)::", "").replace("void ", "")
    base = n.split("(")[0]
    head, lt, rest = base.partition("<")
    head = head.split("::")[-1]
    return (head + (lt + rest if lt else ""))[:48]


def kernel_trace(fn, n: int) -> List[List[Dict]]:
    """Runs fn n times under the profiler, each between two marker kernels; returns per pair the kernels
    between them: {"name", "ts" (us, host clock), "dur"}, plus the start marker's end as the pair's "t0"."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn(lambda: torch.cuda._sleep(1))
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            doc = json.load(f)
        events = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
    finally:
        os.unlink(path)
    # ts are us after baseTimeNanoseconds where the trace has it (host clock): kept below 10^6 s so that
    # floats keep sub-microsecond steps; ranks of one host share the clock
    base_us = (int(doc.get("baseTimeNanoseconds", 0)) % 10**15) / 1e3
    ks = sorted((e for e in events if e.get("cat") == "kernel" and "dur" in e), key=lambda e: float(e["ts"]))
    pairs, cur, inside, t0 = [], None, False, 0.0
    for e in ks:
        name, ts, dur = e.get("name", ""), float(e["ts"]) + base_us, float(e["dur"])
        if "spin" in name.lower() or "sleep" in name.lower():
            if not inside:
                cur, inside, t0 = [], True, ts + dur
            else:
                pairs.append({"t0": t0, "kernels": cur})
                inside = False
            continue
        if inside and not name.startswith("nccl"):
            cur.append({"name": _short_name(name), "ts": ts, "dur": dur})
    return pairs


def timeline(per_rank: List[List[Dict]]) -> Dict:
    """Every rank's pairs (kernel_trace) -> the median pair: per rank its kernels in order, each with
    start and end relative to the earliest start marker of the ranks (us), and the summary: host launch
    gap (first kernel's start after the marker), busy (sum of kernel times), idle gaps between kernels,
    the end of the pair (last kernel's end)."""
    n = min(len(p) for p in per_rank) if per_rank else 0
    rows = []
    for rank, pairs in enumerate(per_rank):
        pairs = pairs[:n]
        counts = [len(p["kernels"]) for p in pairs]
        if not counts:
            rows.append({"rank": rank, "kernels": [], "note": "no pairs traced"})
            continue
        mode = max(set(counts), key=counts.count)
        keep = [i for i in range(n) if counts[i] == mode]
        base = {i: min(per_rank[r][i]["t0"] for r in range(len(per_rank))) for i in keep}
        ks = []
        for j in range(mode):
            start = statistics.median(pairs[i]["kernels"][j]["ts"] - base[i] for i in keep)
            dur = statistics.median(pairs[i]["kernels"][j]["dur"] for i in keep)
            ks.append({"name": pairs[keep[0]]["kernels"][j]["name"], "start": round(start, 2), "dur": round(dur, 2),
                       "end": round(start + dur, 2)})
        own_t0 = statistics.median(pairs[i]["t0"] - base[i] for i in keep)
        gaps = [round(ks[j + 1]["start"] - ks[j]["end"], 2) for j in range(len(ks) - 1)]
        rows.append({"rank": rank, "pairs": len(keep), "marker_end": round(own_t0, 2), "kernels": ks,
                     "launch_gap": round(ks[0]["start"] - own_t0, 2) if ks else None,
                     "busy": round(sum(k["dur"] for k in ks), 2), "gaps": gaps,
                     "end": ks[-1]["end"] if ks else None})
    return {"ranks": rows}


# ---------------------------------------------------------------------------------------- one rank
def run_variant(rank: int, group, a, variant: Dict, timer: Timer, inputs, cuda: bool, profile: bool = False) -> Dict:
    """One variant on a buffer of its own: the timed protocols, or (profile) only the profiler's traces, so
    that no timed run follows a profiled one (CUPTI left initialised costs launches time)."""
    import torch
    lib = a.lib
    rec = {"variant": variant["name"], "spec": {k: variant.get(k) for k in ("ob", "shim", "eng", "cfg", "ht")},
           "dtypes": {}}
    pair = Pair(lib, variant, group, a, inputs, cuda)
    try:
        for dt in a.dtypes:
            fp8 = dt == "fp8"
            fn = lambda fp8=fp8: pair.pair(fp8)  # noqa: E731
            d: Dict = {"us": {}, "errors": {}}
            y_eager = fn()
            timer.sync()
            d["checksum"] = checksum(y_eager)
            del y_eager  # a held output would send every other combine to a fresh tensor (output sets)
            for p in a.protocols:
                if p.startswith("eager") and not profile:
                    d["us"][p] = timer.run(fn, a.iters, a.warmup, cold=p == "eager_cold")
                    if timer.stamps:
                        d.setdefault("host_ns", {})[p] = timer.stamps
            graph = None
            if cuda and any(p.startswith("graph") for p in a.protocols):
                try:
                    graph, y_g = capture_graph(fn, 3)
                    graph.replay()
                    torch.cuda.synchronize()
                    d["graph_equal"] = bool(torch.equal(y_g, fn()))
                    torch.cuda.synchronize()
                    del y_g
                    for p in a.protocols:
                        if p.startswith("graph") and not profile:
                            d["us"][p] = timer.run(graph.replay, a.iters, a.warmup, cold=p == "graph_cold")
                            if timer.stamps:
                                d.setdefault("host_ns", {})[p] = timer.stamps
                except Exception as exc:  # noqa: BLE001
                    d["errors"]["graph"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    graph = None
            if profile and cuda:
                traces = {}
                for p in a.protocols:
                    run = graph.replay if p.startswith("graph") else fn
                    if run is None or (p.startswith("graph") and graph is None):
                        continue
                    cold = p.endswith("cold")

                    def one(mark, run=run, cold=cold):
                        if cold:
                            timer.cold_prep()
                        mark()
                        run()
                        mark()
                        if cold:
                            timer.sync()
                    try:
                        traces[p] = kernel_trace(one, a.profile)
                    except Exception as exc:  # noqa: BLE001
                        d["errors"][f"profile_{p}"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                d["traces"] = traces
            del graph
            if a.stamps and cuda and not profile:
                import torch.distributed as dist
                import ll_stamps
                d["stamps"] = ll_stamps.collect(pair.engine(), fn, a.stamps, 3, timer.sync, dist.barrier)
                # cold: L2 flushed, the ranks released by a barrier, one pair (the launch skew shows)
                d["stamps_cold"] = ll_stamps.collect(pair.engine(), fn, a.stamps, 1, timer.sync, timer.cold_prep)
                d["stamps_graph_cold"] = ll_stamps.collect(pair.engine(), fn, a.stamps, 1, timer.sync, timer.cold_prep,
                                                           capture=lambda f: capture_graph(f, 2)[0])
            rec["dtypes"][dt] = d
        rec["engine"] = pair.engine_info
    finally:
        pair.close()
        timer.sync()
    return rec


def rank_main(rank: int, world: int, port: int, a, q) -> None:
    import torch
    import torch.distributed as dist
    err = None
    try:
        cuda = not a.cpu
        if cuda:
            from bench_launch import init_rank
            if a.lib == "ep_plugin":  # every variant's engine in one NVSHMEM job (DeepEP: as it sets itself up)
                os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(a.symmetric_bytes))
            init_rank(rank, world, port)
        else:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=rank, world_size=world)
        group = dist.new_group(list(range(world)))
        timer = Timer(cuda)
        inputs = make_inputs(rank, a, "cuda" if cuda else "cpu")
        results = []
        for v in a.variant_specs:
            t0 = time.time()
            try:
                rec = run_variant(rank, group, a, v, timer, inputs, cuda)
            except Exception as exc:  # noqa: BLE001  one variant failing keeps the others
                rec = {"variant": v["name"], "error": f"{type(exc).__name__}: {str(exc)[:400]}",
                       "trace": traceback.format_exc()[-1500:]}
            rec["wall_s"] = round(time.time() - t0, 1)
            every = [None] * world
            dist.all_gather_object(every, rec)
            if rank == 0:
                merged = merge_ranks(every)
                results.append(merged)
                print(variant_lines(a.lib, world, merged), flush=True)
                q.put(("partial", results))
            if any("error" in r for r in every) and cuda:
                break  # a failed NVSHMEM buffer may leave the job unusable: stop here, keep the rows
        # then the traces (after every timed run), into the records of their variants
        wanted = set(a.profile_variants or [v["name"] for v in a.variant_specs])
        for v in (a.variant_specs if a.profile and cuda else []):
            if v["name"] not in wanted:
                continue
            try:
                rec = run_variant(rank, group, a, v, timer, inputs, cuda, profile=True)
            except Exception as exc:  # noqa: BLE001
                rec = {"variant": v["name"], "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            every = [None] * world
            dist.all_gather_object(every, rec)
            if rank == 0:
                prof = merge_ranks(every)
                target = next((r for r in results if r.get("variant") == v["name"] and "dtypes" in r), None)
                if target is None or "error" in prof:
                    continue
                for dt, row in prof["dtypes"].items():
                    if dt in target["dtypes"]:
                        target["dtypes"][dt]["timelines"] = row.get("timelines", {})
                        target["dtypes"][dt]["errors"].update(row.get("errors", {}))
                print(variant_lines(a.lib, world, target, timelines_only=True), flush=True)
                q.put(("partial", results))
            if any("error" in r for r in every):
                break
        if rank == 0:
            q.put(("done", results))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        err = traceback.format_exc()
        q.put(("err", f"rank {rank}:\n{err}"))
        raise


def merge_ranks(every: List[Dict]) -> Dict:
    """The ranks' records of one variant -> one: per dtype and protocol the slowest rank's median (and
    every rank's), the timelines, the checks."""
    first = every[0]
    out = {k: first[k] for k in ("variant", "spec", "engine", "wall_s") if k in first}
    errors = [f"rank {r}: {e['error']}" for r, e in enumerate(every) if "error" in e]
    if errors:
        out["error"] = "; ".join(errors)
        out["trace"] = next(e.get("trace") for e in every if "error" in e)
        return out
    out["dtypes"] = {}
    for dt, d0 in first["dtypes"].items():
        ds = [e["dtypes"][dt] for e in every]
        row = {"slowest_median_us": {}, "per_rank_median_us": {}, "errors": {}}
        for p in d0["us"]:
            meds = [statistics.median(d["us"][p]) for d in ds if d["us"].get(p)]
            row["per_rank_median_us"][p] = [round(m, 2) for m in meds]
            row["slowest_median_us"][p] = round(max(meds), 2) if meds else None
            mins = [min(d["us"][p]) for d in ds if d["us"].get(p)]
            row.setdefault("slowest_min_us", {})[p] = round(max(mins), 2) if mins else None
        for d in ds:
            row["errors"].update(d.get("errors", {}))
        for p in d0.get("host_ns", {}):  # the ranks' spread after the barrier: what a cold pair waits out
            row.setdefault("host", {}).update(host_spread(p, [d.get("host_ns", {}).get(p) for d in ds]))
        row["checksums"] = [d.get("checksum") for d in ds]
        if any("graph_equal" in d for d in ds):
            row["graph_equal"] = all(d.get("graph_equal", False) for d in ds)
        for key in ("stamps", "stamps_cold", "stamps_graph_cold"):
            if any(d.get(key) for d in ds):
                row[key] = [d.get(key) for d in ds]
        if any(d.get("traces") for d in ds):
            row["timelines"] = {p: timeline([d["traces"].get(p, []) for d in ds]) for p in d0.get("traces", {})}
        out["dtypes"][dt] = row
    return out


def host_spread(p: str, per_rank) -> Dict:
    """protocols.stamp_summary of protocol p's host stamps, and which rank left the barrier last in most pairs."""
    from protocols import stamp_summary
    out = stamp_summary(p, per_rank)
    if out:
        lates = [max(range(len(it)), key=lambda r: it[r][0]) for it in zip(*per_rank)]
        out[f"{p}_late_rank"] = statistics.mode(lates)
    return out


def variant_lines(lib: str, world: int, rec: Dict, timelines_only: bool = False) -> str:
    head = f"EP{world} {lib:9s} {rec['variant']:14s}"
    if "error" in rec:
        return f"{head} FAILED: {rec['error']}"
    lines = []
    for dt, row in rec["dtypes"].items():
        if timelines_only:
            lines.append(f"{head} {dt:4s} kernels (start@us+dur, from the ranks' earliest start marker):")
            for p, tl in row.get("timelines", {}).items():
                lines.append(f"    {p}: " + timeline_line(tl))
            continue
        us = row["slowest_median_us"]
        cells = " | ".join(f"{p} {us[p]:7.1f}" if us.get(p) is not None else f"{p}    n/a" for p in PROTOCOLS if p in us)
        extra = "" if row.get("graph_equal", True) else "  (graph output differs from eager!)"
        if row["errors"]:
            extra += "  errors: " + "; ".join(f"{k}: {v}" for k, v in row["errors"].items())
        lines.append(f"{head} {dt:4s} {cells}{extra}")
        host = row.get("host", {})
        if host:
            lines.append("    host, median over pairs (us): " + " | ".join(
                f"{p} spread {host[p + '_skew_us']:.1f} (late r{host[p + '_late_rank']}), in call "
                f"{host[p + '_host_us']:.1f}, returns {host[p + '_ret_skew_us']:.1f}"
                for p in PROTOCOLS if p + "_skew_us" in host))
        for key, what in (("stamps", "queued"), ("stamps_cold", "cold"), ("stamps_graph_cold", "graph cold")):
            if row.get(key):
                import ll_stamps
                lines.append(f"    phase stamps, {what} (us after the rank's first dispatch entry; max over blocks in brackets):")
                lines.extend(ll_stamps.lines(row[key]))
    return "\n".join(lines)


def timeline_line(tl: Dict) -> str:
    parts = []
    for r in tl["ranks"]:
        if not r.get("kernels"):
            parts.append(f"r{r['rank']}: -")
            continue
        ks = " ".join(f"{k['name'].split('<')[0]}@{k['start']:.1f}+{k['dur']:.1f}" for k in r["kernels"])
        parts.append(f"r{r['rank']}: launch {r['launch_gap']:.1f} | {ks} | end {r['end']:.1f}")
    return "  ||  ".join(parts)


# ---------------------------------------------------------------------------------------- merge, plot
def load_docs(paths: List[str]) -> List[Dict]:
    docs = []
    for p in paths:
        try:
            with open(p) as f:
                docs.append(json.load(f))
        except (OSError, ValueError) as exc:
            print(f"skipped {p}: {exc}", flush=True)
    return docs


def rows_of(docs: List[Dict]) -> List[Dict]:
    """Flat rows: world, lib, variant, dtype, the four protocols' slowest medians."""
    rows = []
    for doc in docs:
        for rec in doc.get("results", []):
            if "error" in rec:
                rows.append({"world": doc["world"], "lib": doc["lib"], "variant": rec["variant"], "dtype": "-",
                             "error": rec["error"]})
                continue
            for dt, row in rec["dtypes"].items():
                rows.append({"world": doc["world"], "lib": doc["lib"], "variant": rec["variant"], "dtype": dt,
                             **{p: row["slowest_median_us"].get(p) for p in PROTOCOLS},
                             "graph_equal": row.get("graph_equal"), "checksums": row.get("checksums"),
                             "spec": rec.get("spec")})
    return rows


def table(rows: List[Dict]) -> str:
    out = [f"{'EP':>3} {'lib':9s} {'variant':16s} {'dtype':5s} " + " ".join(f"{p:>12s}" for p in PROTOCOLS)]
    for r in sorted(rows, key=lambda r: (r["world"], r["dtype"], r["lib"] != "deepep", r["variant"])):
        if "error" in r:
            out.append(f"{r['world']:>3} {r['lib']:9s} {r['variant']:16s} FAILED: {r['error'][:120]}")
            continue
        cells = " ".join(f"{r[p]:12.1f}" if r.get(p) is not None else f"{'n/a':>12s}" for p in PROTOCOLS)
        out.append(f"{r['world']:>3} {r['lib']:9s} {r['variant']:16s} {r['dtype']:5s} {cells}")
    return "\n".join(out)


def ab_lines(rows: List[Dict]) -> str:
    """Each ep_plugin variant against DeepEP / default / ob0 of the same EP size and dtype, per protocol
    (ratio < 1: faster), and whether the ep_plugin variants' outputs agree (checksums)."""
    out = []
    by = {(r["world"], r["lib"], r["variant"], r["dtype"]): r for r in rows if "error" not in r}
    for (w, lib, v, dt), r in sorted(by.items()):
        if lib != "ep_plugin":
            continue
        refs = [("deepep", by.get((w, "deepep", "deepep", dt))), ("default", by.get((w, "ep_plugin", "default", dt))),
                ("ob0", by.get((w, "ep_plugin", "ob0", dt)))]
        parts = []
        for name, ref in refs:
            if ref is None or ref is r:
                continue
            rat = [f"{p.replace('_', ' ')} {r[p] / ref[p]:.2f}" for p in PROTOCOLS
                   if r.get(p) and ref.get(p)]
            if rat:
                parts.append(f"vs {name}: " + ", ".join(rat))
        if parts:
            out.append(f"EP{w} {dt} {v:16s} " + " | ".join(parts))
    def reduce_of(r):  # the variant's combine_reduce (None: the config's default)
        return str((r.get("spec") or {}).get("cfg", {}).get(REDUCE_KEY, "default"))

    for (w, dt) in sorted({(k[0], k[3]) for k in by}):
        groups = sorted({reduce_of(by[k]) for k in by if k[1] == "ep_plugin"})
        for red in groups:
            sums = {k[2]: by[k]["checksums"] for k in by if k[0] == w and k[3] == dt and k[1] == "ep_plugin"
                    and by[k].get("checksums") and reduce_of(by[k]) == red}
            if len(sums) > 1:
                ref = next(iter(sums.values()))
                bad = [v for v, s in sums.items() if s != ref]
                which = f" (combine_reduce {red})" if len(groups) > 1 else ""
                out.append(f"EP{w} {dt} outputs of the ep_plugin variants{which}: "
                           + ("equal" if not bad else f"DIFFER ({', '.join(bad)} vs {next(iter(sums))})"))
    return "\n".join(out)


def plot(rows: List[Dict], path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    good = [r for r in rows if "error" not in r]
    groups = sorted({(r["world"], r["dtype"]) for r in good})
    if not groups:
        return "nothing to plot"
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.2), squeeze=False)
    for ax, (w, dt) in zip(axes[0], groups):
        rs = sorted((r for r in good if r["world"] == w and r["dtype"] == dt),
                    key=lambda r: (r["lib"] != "deepep", r["variant"]))
        width = 0.8 / max(1, len(rs))
        for i, r in enumerate(rs):
            xs = [j + i * width for j in range(len(PROTOCOLS))]
            ax.bar(xs, [r.get(p) or 0 for p in PROTOCOLS], width,
                   label="DeepEP V1" if r["lib"] == "deepep" else r["variant"])
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(PROTOCOLS))])
        ax.set_xticklabels([p.replace("_", "\n") for p in PROTOCOLS])
        ax.set_title(f"decode pair, EP{w}, {dt} dispatch")
        ax.set_ylabel("us (slowest rank's median)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


# ---------------------------------------------------------------------------------------- main
def symmetric_bytes(a) -> int:
    """NVSHMEM's heap for every variant of this process at once (+ 1 GiB): each EPBuffer has its own engine."""
    per = 0
    try:
        from ep_plugin._ext import get_c
        C = get_c()
        for v in a.variant_specs:
            sets = v["ob"] if v["ob"] is not None else 2
            per = max(per, C.LowLatencyRuntime.heap_bytes(a.ranks, a.experts, a.tokens, max(a.topk, 16), a.hidden,
                                                          min(sets, 8)))
    except Exception:  # noqa: BLE001
        per = 2 * a.experts * a.tokens * (a.hidden * 2 + 64) + 2 * a.tokens * 32 * a.hidden * 2
    return int(per * 2 + (1 << 30))  # one engine open at a time; twice for what a failed close leaves


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.merge is not None:
        docs = load_docs(a.merge)
        rows = rows_of(docs)
        print(table(rows), flush=True)
        print(ab_lines(rows), flush=True)
        doc = {"schema": SCHEMA, "merged": a.merge, "rows": rows, "docs": docs}
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
        if a.plot:
            why = plot(rows, a.plot)
            print(why or f"plot: {a.plot}", flush=True)
        return 0
    import torch
    sys.path.insert(0, HERE)
    if not a.cpu:
        n = torch.cuda.device_count()
        if n < a.ranks:
            print(f"bench_decode_pair: needs {a.ranks} GPUs, this machine has {n}. Nothing ran.", file=sys.stderr)
            return 2
        for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
            os.environ.setdefault(k, v)
    a.symmetric_bytes = symmetric_bytes(a) if not a.cpu else 0
    from bench_launch import run_world
    t0 = time.time()
    results, complete = run_world(rank_main, a.ranks, a, on_partial=lambda body: None)
    import ep_plugin
    doc = {"schema": SCHEMA, "label": a.label, "lib": a.lib, "world": a.ranks, "argv": sys.argv,
           "ep_plugin_file": ep_plugin.__file__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": socket.gethostname(),
           "device": torch.cuda.get_device_name(0) if not a.cpu else "cpu", "torch": torch.__version__,
           "tokens_per_rank": a.tokens, "hidden": a.hidden, "num_experts": a.experts, "topk": a.topk,
           "iters": a.iters, "warmup": a.warmup, "protocols": a.protocols, "complete": complete,
           "results": results or [], "wall_s": round(time.time() - t0, 1)}
    try:
        import subprocess
        doc["commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                       capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"json: {a.out} ({doc['wall_s']:.0f} s{'' if complete else ', INCOMPLETE'})", flush=True)
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
