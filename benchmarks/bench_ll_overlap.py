"""Receive hooks free the SMs: a BF16 GEMM placed between a low-latency call's send half and its hook()
runs at full speed while the data moves, so the exchange hides under the compute.

    python3 benchmarks/bench_ll_overlap.py --out /tmp/res/bench_ll_overlap.json     # 2 GPUs
    python3 benchmarks/bench_ll_overlap.py --gemm 8192 4096 4096 --fp8 --iters 50

Per iteration, on every rank of an EP2 (or --ranks 4) run (one process per GPU, spawned like bench_dispatch), each
variant cold-call style (L2 flush, cuda synchronize and dist.barrier before it, CUDA events inside):
  (a) alone:      the GEMM;
  (b) hooks:      low_latency_dispatch(return_recv_hook=True), GEMM, hook(),
                  low_latency_combine(return_recv_hook=True), GEMM, hook();
  (c) sequential: low_latency_dispatch, GEMM, low_latency_combine, GEMM (no hooks).
Everything runs on the current stream. Reported (slowest rank's median over --iters): the GEMM alone,
the GEMM inside (b) (the same as alone when the hook leaves every SM to it), the totals of (b) and (c),
the sequential sum (dispatch + combine of (c) + 2 GEMMs alone) and the overlap fraction
= (sequential sum - total with hooks) / (dispatch + combine of (c)): the share of the exchange hidden.
The inputs are bench_dispatch's latency case (128 tokens per rank, hidden 7168, 256 experts, top-8,
uniform routing); the EPBuffer the nvlink rows' config plus comm.low_latency.max_tokens_per_rank =
--tokens. The results with hooks must equal those without (checked before timing, and y and
recv_count of every iteration); a mismatch fails the run. Writes JSON to --out, prints a table.
Needs --ranks CUDA GPUs (2 by default).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
import traceback
from typing import Dict, List

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
try:  # an ep_plugin on PYTHONPATH wins over this tree
    import ep_plugin
except ImportError:
    sys.path.append(os.path.dirname(HERE))
    import ep_plugin

import bench_report as report  # noqa: E402
from bench_inputs import E, H, K, ep_config, ll_engine, make_routing  # noqa: E402
from bench_launch import init_rank, run_world  # noqa: E402
from protocols import FLUSH_BYTES, _short  # noqa: E402

SCHEMA = "ep_plugin.bench_ll_overlap/1"
WORLD = 2  # the default EP size (--ranks)
# per-iteration times (us) of each variant, in the order they are derived from the events
ALONE = ("gemm",)
HOOKS = ("dispatch_send", "gemm_dispatch", "dispatch_recv", "combine_send", "gemm_combine", "combine_recv", "total")
SEQ = ("dispatch", "gemm_dispatch", "combine", "gemm_combine", "total")


def events(n: int) -> List[torch.cuda.Event]:
    return [torch.cuda.Event(enable_timing=True) for _ in range(n)]


def spans(evs: List[torch.cuda.Event]) -> List[float]:
    """us between consecutive events, then first to last."""
    return [a.elapsed_time(b) * 1e3 for a, b in zip(evs, evs[1:])] + [evs[0].elapsed_time(evs[-1]) * 1e3]


class OverlapBench:
    def __init__(self, rank: int, args):
        self.rank, self.args = rank, args
        self.dev = torch.device("cuda", torch.cuda.current_device())
        T = args.tokens
        idx, w = make_routing(T, "uniform", seed=1000 * args.ranks + 10 * rank + 2)  # bench_dispatch's latency seeds
        self.idx, self.w = idx.to(self.dev), w.to(self.dev)
        gen = torch.Generator(device=self.dev).manual_seed(1000 * args.ranks + 10 * rank + 2)
        self.x = torch.randn(T, H, generator=gen, device=self.dev, dtype=torch.bfloat16)
        m, n, k = args.gemm
        self.a = torch.randn(m, k, device=self.dev, dtype=torch.bfloat16)
        self.b = torch.randn(k, n, device=self.dev, dtype=torch.bfloat16)
        self.c = torch.empty(m, n, device=self.dev, dtype=torch.bfloat16)
        self.flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=self.dev)
        self.buf = ep_plugin.EPBuffer(None, ep_config("nvlink", args.num_sms, ll_max_tokens=T), hidden=H)

    # the calls
    def gemm(self) -> None:
        torch.matmul(self.a, self.b, out=self.c)

    def dispatch(self, hook: bool):
        return self.buf.low_latency_dispatch(self.x, self.idx, use_fp8=self.args.fp8, return_recv_hook=hook)

    def combine(self, handle, hook: bool):
        return self.buf.low_latency_combine(self.expert_out, self.idx, self.w, handle, return_recv_hook=hook)

    def aligned(self) -> None:
        """The cold-call start: L2 flushed, device drained, ranks aligned on the host."""
        self.flush.zero_()
        torch.cuda.synchronize()
        dist.barrier()

    # the variants (events recorded on the current stream)
    def alone(self, ev) -> None:
        ev[0].record()
        self.gemm()
        ev[1].record()

    def hooks(self, ev):
        ev[0].record()
        recv, count, handle, _, hook = self.dispatch(True)
        ev[1].record()
        self.gemm()  # every SM free: the receive half has not been launched
        ev[2].record()
        hook()
        ev[3].record()
        y, _, hook = self.combine(handle, True)
        ev[4].record()
        self.gemm()
        ev[5].record()
        hook()
        ev[6].record()
        return recv, count, y

    def sequential(self, ev):
        ev[0].record()
        recv, count, handle, _, _ = self.dispatch(False)
        ev[1].record()
        self.gemm()
        ev[2].record()
        y, _, _ = self.combine(handle, False)
        ev[3].record()
        self.gemm()
        ev[4].record()
        return recv, count, y

    # results
    def rows(self, recv, count) -> List:
        """The valid received rows per local expert (copies), as bytes: BF16, or FP8 data and scales."""
        n = count.tolist()
        if isinstance(recv, (tuple, list)):
            data, scales = recv
            return [(data[e, :n[e]].view(torch.uint8).clone(), scales[e, :n[e]].clone()) for e in range(len(n))]
        return [recv[e, :n[e]].clone() for e in range(len(n))]

    def first_checks(self) -> Dict:
        """The reference run without hooks, then one with: received rows, counts and y must be equal."""
        recv, count, handle, _, _ = self.buf.low_latency_dispatch(self.x, self.idx, use_fp8=False)
        self.expert_out = recv.clone()  # the combine's input: the dispatch's own tensor is reused by later calls
        self.buf.low_latency_combine(self.expert_out, self.idx, self.w, handle)
        self.engine = ll_engine(self.buf, handle)
        recv, count, handle, _, _ = self.dispatch(False)
        ref_rows, self.count_ref = self.rows(recv, count), count.clone()
        self.y_ref = self.combine(handle, False)[0].clone()
        recv, count, handle, _, hook = self.dispatch(True)
        hook()
        rows = self.rows(recv, count)
        y, _, hook = self.combine(handle, True)
        hook()

        def same(p, q):
            return all(torch.equal(u, v) for u, v in zip(p, q)) if isinstance(p, tuple) else torch.equal(p, q)

        return {"recv_count_equal": bool(torch.equal(count, self.count_ref)),
                "recv_rows_equal": len(rows) == len(ref_rows) and all(same(p, q) for p, q in zip(rows, ref_rows)),
                "y_equal": bool(torch.equal(y, self.y_ref)),
                "recv_copies": int(self.count_ref.sum())}

    def run(self) -> Dict:
        args = self.args
        checks = self.first_checks()
        bad = torch.zeros((), dtype=torch.int64, device=self.dev)  # iterations whose results differ
        samples: Dict[str, List[List[float]]] = {"alone": [], "hooks": [], "sequential": []}
        for i in range(args.warmup + args.iters):
            timed = i >= args.warmup
            ev_a, ev_h, ev_s = events(2), events(7), events(5)
            self.aligned()
            self.alone(ev_a)
            self.aligned()
            _, count, y = self.hooks(ev_h)
            bad += (count != self.count_ref).any().long() + (y != self.y_ref).any().long()
            self.aligned()
            _, count, y = self.sequential(ev_s)
            bad += (count != self.count_ref).any().long() + (y != self.y_ref).any().long()
            if timed:
                samples["alone"].append(ev_a)
                samples["hooks"].append(ev_h)
                samples["sequential"].append(ev_s)
        torch.cuda.synchronize()
        med = {}
        for variant, names in (("alone", ALONE), ("hooks", HOOKS), ("sequential", SEQ)):
            per_iter = [spans(ev) for ev in samples[variant]]
            if variant == "alone":
                per_iter = [p[:1] for p in per_iter]  # one span: the GEMM (its "total" is the same)
            for j, name in enumerate(names):
                med[f"{variant}.{name}"] = statistics.median(p[j] for p in per_iter)
        checks["iterations_differing"] = int(bad)  # (iteration, variant, tensor) mismatches, warm-up included
        return {"median_us": med, "checks": checks, "engine": self.engine}


def summarize(per_rank: List[Dict], args) -> Dict:
    """The slowest rank's median of each time, and what they say about the overlap."""
    keys = list(per_rank[0]["median_us"])
    slow = {k: round(max(r["median_us"][k] for r in per_rank), 2) for k in keys}
    alone = slow["alone.gemm"]
    comm = slow["sequential.dispatch"] + slow["sequential.combine"]
    seq_sum = comm + 2 * alone
    hooks_total = slow["hooks.total"]
    m, n, k = args.gemm
    return {"gemm_alone_us": alone,
            "gemm_TFLOPs": round(2 * m * n * k / alone / 1e6, 1) if alone > 0 else None,
            "gemm_between_dispatch_send_and_hook_us": slow["hooks.gemm_dispatch"],
            "gemm_between_combine_send_and_hook_us": slow["hooks.gemm_combine"],
            "gemm_speed_between_send_and_hook":
                round(2 * alone / (slow["hooks.gemm_dispatch"] + slow["hooks.gemm_combine"]), 3),
            "hooks_total_us": hooks_total,
            "sequential_total_us": slow["sequential.total"],
            "sequential_sum_us": round(seq_sum, 2),
            "comm_sequential_us": round(comm, 2),
            "hidden_us": round(seq_sum - hooks_total, 2),
            "overlap_fraction": round((seq_sum - hooks_total) / comm, 3) if comm > 0 else None,
            "slowest_rank_median_us": slow}


def format_table(doc: Dict) -> str:
    s, slow, g = doc["summary"], doc["summary"]["slowest_rank_median_us"], doc["gemm"]
    rows = [("GEMM alone", s["gemm_alone_us"], f"{s['gemm_TFLOPs']} TFLOP/s"),
            ("GEMM between dispatch send and hook()", s["gemm_between_dispatch_send_and_hook_us"], ""),
            ("GEMM between combine send and hook()", s["gemm_between_combine_send_and_hook_us"],
             f"speed vs alone {s['gemm_speed_between_send_and_hook']:.3f}"),
            ("hooks: dispatch send half", slow["hooks.dispatch_send"], ""),
            ("hooks: dispatch recv half (hook())", slow["hooks.dispatch_recv"], ""),
            ("hooks: combine send half", slow["hooks.combine_send"], ""),
            ("hooks: combine recv half (hook())", slow["hooks.combine_recv"], ""),
            ("sequential: dispatch", slow["sequential.dispatch"], ""),
            ("sequential: combine", slow["sequential.combine"], ""),
            ("total with hooks", s["hooks_total_us"], ""),
            ("total sequential (measured)", s["sequential_total_us"], ""),
            ("sequential sum (dispatch + combine + 2 GEMMs)", s["sequential_sum_us"],
             f"hidden {s['hidden_us']:.1f} us"),
            ("overlap fraction (hidden / dispatch + combine)", None,
             "-" if s["overlap_fraction"] is None else f"{s['overlap_fraction']:.1%}")]
    head = (f"== low-latency receive hooks vs a BF16 GEMM {g['m']}x{g['n']}x{g['k']} ({g['gflop']:.1f} GFLOP), EP{doc['world']}, "
            f"{doc['tokens_per_rank']} tok/rank, {'FP8' if doc['fp8'] else 'BF16'} dispatch, engine "
            f"{doc['engine']}, cold call, slowest rank's median of {doc['iters']}")
    lines = [head] + [f"   {name:<48}{'' if v is None else f'{v:10.1f} us':>13}   {note}" for name, v, note in rows]
    c = doc["checks"]
    lines.append(f"   check: hooks == no hooks (recv rows, recv_count, y) on every rank: "
                 f"{'OK' if c['ok'] else 'FAIL'}; iterations differing "
                 f"{[r['iterations_differing'] for r in c['per_rank']]}")
    if doc["engine"] != "nvshmem":
        lines.append("   note: not the NVSHMEM kernels: the torch reference engine's hook() does the whole exchange "
                     "(host syncs), so these figures say nothing about the kernels")
    a = s["gemm_alone_us"]
    if not 100 <= a <= 300:
        lines.append(f"   note: the GEMM takes {a:.0f} us; pick --gemm so that it takes 100-300 us")
    return "\n".join(lines)


def rank_main(rank: int, world: int, port: int, args, q) -> None:
    try:
        init_rank(rank, world, port)
        out, err = None, None
        try:
            bench = OverlapBench(rank, args)
            out = bench.run()
        except Exception as exc:  # said at once: a rank still in a collective is stopped by run_world
            err = f"rank {rank}: {_short(exc)}"
            q.put(("err", f"rank {rank}:\n{traceback.format_exc()}"))
        every = [None] * world
        dist.all_gather_object(every, (out, err))
        if rank == 0:
            q.put(("done", {"per_rank": [o for o, _ in every], "errors": [e for _, e in every if e]}))
        if err is None:
            bench.buf.close()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        q.put(("err", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_ll_overlap.json"), help="the JSON file")
    ap.add_argument("--gemm", type=int, nargs=3, default=[4096, 4096, 4096], metavar=("M", "N", "K"),
                    help="the BF16 GEMM [M, K] x [K, N]; 4096^3 (137 GFLOP) takes ~150-250 us on an H100/H200")
    ap.add_argument("--ranks", type=int, default=WORLD, help="EP size: one rank per GPU 0..ranks-1 (2 or 4)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank (= comm.low_latency.max_tokens_per_rank)")
    ap.add_argument("--fp8", action="store_true", help="FP8 dispatch (default BF16); the combine is BF16 either way")
    ap.add_argument("--num-sms", type=int, default=24, help="comm.num_sms of the buffer (as bench_dispatch)")
    ap.add_argument("--iters", type=int, default=50, help="timed iterations (the protocol asks for >= 30)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds before the ranks are killed")
    args = ap.parse_args(argv)
    if args.iters < 1 or args.warmup < 0 or args.tokens < 1 or min(args.gemm) < 1:
        ap.error("--iters, --tokens and the --gemm sizes must be >= 1, --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if ngpu < args.ranks:
        print(f"bench_ll_overlap: needs {args.ranks} CUDA GPUs (one rank each); this machine has {ngpu}. Nothing ran.",
              file=sys.stderr, flush=True)
        return 2
    if not hasattr(ep_plugin.EPBuffer, "low_latency_dispatch"):
        print(f"bench_ll_overlap: this ep_plugin ({ep_plugin.__file__}) has no EPBuffer.low_latency_dispatch. "
              "Nothing ran.", file=sys.stderr, flush=True)
        return 2
    if args.iters < 30:
        print(f"note: --iters {args.iters} is below the protocol's 30", flush=True)
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)  # NVLink multicast stays off on the lent machines
    t0 = time.time()
    tree = os.path.dirname(os.path.dirname(os.path.abspath(ep_plugin.__file__)))
    m, n, k = args.gemm
    doc = {"schema": SCHEMA, "date": report.utc_now(), **report.git_commit(tree), "ep_plugin_file": ep_plugin.__file__,
           "device": torch.cuda.get_device_name(0), "num_gpus": ngpu, "host": socket.gethostname(),
           "torch": torch.__version__, "cuda": torch.version.cuda, "argv": sys.argv, "world": args.ranks,
           "tokens_per_rank": args.tokens, "hidden": H, "num_experts": E, "topk": K, "fp8": args.fp8,
           "num_sms": args.num_sms, "iters": args.iters, "warmup": args.warmup,
           "gemm": {"m": m, "n": n, "k": k, "dtype": "bf16", "gflop": 2 * m * n * k / 1e9},
           "protocol": "per iteration: each variant after an L2 flush, cuda synchronize and dist.barrier; CUDA events "
                       "on the current stream; median per rank, slowest rank"}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rep, complete = run_world(rank_main, args.ranks, args, on_partial=lambda body: None)
    doc["wall_s"] = round(time.time() - t0, 1)
    if not complete or rep is None or rep["errors"]:
        why = ("did not finish (see the ranks' output above)" if rep is None
               else "; ".join(rep["errors"]) or "incomplete")
        doc.update(complete=False, error=why)
        report.write_json(args.out, doc)
        print(f"FAILED: {why}\njson: {args.out}", flush=True)
        return 1
    per_rank = rep["per_rank"]
    engines = sorted({r["engine"] for r in per_rank})
    checks = {"per_rank": [r["checks"] for r in per_rank]}
    checks["ok"] = all(c["recv_count_equal"] and c["recv_rows_equal"] and c["y_equal"]
                       and c["iterations_differing"] == 0 for c in checks["per_rank"])
    doc.update(complete=True, engine=engines[0] if len(engines) == 1 else " / ".join(engines), checks=checks,
               per_rank_median_us=[r["median_us"] for r in per_rank], summary=summarize(per_rank, args))
    report.write_json(args.out, doc)
    print(format_table(doc), flush=True)
    print(f"json: {args.out} ({doc['wall_s']:.0f} s)", flush=True)
    if not checks["ok"]:
        print("FAILED: the results with receive hooks differ from those without", flush=True)
        raise AssertionError(f"hooks != no hooks: {checks['per_rank']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
