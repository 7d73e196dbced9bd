"""Dispatch/combine side by side in one run: ep_plugin nvlink, the torch backend (NCCL), a plain NCCL
all-to-all, and DeepEP V1 when `deep_ep` imports, under both protocols of DESIGN.md (cold call and
queued; protocols.py).

    python3 benchmarks/bench_dispatch.py --out /tmp/res --label after           # 2 GPUs, default cases
    PYTHONPATH=/path/to/old/checkout python3 benchmarks/bench_dispatch.py --label before
    python3 benchmarks/bench_dispatch.py --cases throughput sm_sweep --sms 8 16 24 32

Cases: throughput (4096 tokens/rank, hidden 7168, 256 experts, top-8, uniform routing),
group_limited (the same, experts in 4 contiguous groups, each token's top-8 inside its best 2 groups), group_limited8
(8 groups, best 4: DeepSeek-V3's),
latency (128 tokens/rank; adds the low-latency calls: ep_plugin's EPBuffer.low_latency_dispatch/combine
with comm.low_latency.max_tokens_per_rank 128, and DeepEP's), sm_sweep (optional: nvlink at --sms).
Low-latency rows: dispatch BF16, dispatch FP8, combine BF16 (weighted), and the two halves of each call
with return_recv_hook=True (send half = the call, recv half = hook()); the calls alternate dispatch,
combine, ... (DeepEP's rule: each timed call has its untimed partner). Their floor: one copy per (token,
expert) on another rank at 478 GB/s + one launch (bench_report.LAUNCH_US). When ep_plugin's engine is
the torch reference (no NVSHMEM build), its rows say "(torch reference engine)".
Times are the slowest rank's median. Logical GB/s (DeepEP's): BF16 bytes of the rows a rank receives,
one copy per rank, over the time, bottleneck rank. Floor: remote bytes of the busiest GPU at 478 GB/s.
Prints one table and writes bench_dispatch_<label>.json (+ .png with matplotlib) to --out.
The run goes in phases — ours, DeepEP normal, DeepEP low-latency, then ep_plugin's low-latency rows
(`--ep-ll first` puts them at the end of ours) — and the JSON is rewritten after each, so a failure or a
hang in one (killed at --timeout) keeps the rows measured before it.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import traceback
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
try:  # an ep_plugin on PYTHONPATH (e.g. an older checkout) wins over this tree
    import ep_plugin
except ImportError:
    sys.path.append(os.path.dirname(HERE))
    import ep_plugin

import bench_report as report  # noqa: E402
try:  # an older ep_plugin (the before/after baseline) has no expert-major layout: its rows are skipped
    from ep_plugin import expert_major  # noqa: E402
except ImportError:
    expert_major = None
from bench_inputs import (CASES, E, GROUP_TOPK, H, K, NUM_GROUPS, Inputs, ep_config, ll_engine,  # noqa: E402
                          make_inputs)
from bench_launch import init_rank, run_world  # noqa: E402
from deepep_rows import LL_OPS, NORMAL_OPS, DeepEP  # noqa: E402
from protocols import (LL_KINDS, _short, failed, kernel_breakdown, ll_op_names, measure, measure_low_latency,  # noqa: E402
                       Protocols)

NVLINK_OPS = ("nvlink.dispatch_bf16", "nvlink.dispatch_fp8", "nvlink.dispatch_cached", "nvlink.combine_bf16",
              "nvlink_sync.dispatch_bf16", "nvlink_sync.combine_bf16", "nvlink.dispatch_expert_bf16",
              "nvlink.combine_expert_bf16", "nvlink.combine_expert_send_sum_bf16", "nvlink.combine_expert_sum_first_bf16",
              "nvlink.dispatch_expert_fp8",
              "nvlink.dispatch_then_permute", "nvlink.unpermute_then_combine")
EP_LL_OPS = ll_op_names("ep_ll")
# the same calls with comm.low_latency.output_buffers: 2 (outputs from two sets used in turn): the
# full calls only (the rows the table shows)
EP_LL_RING = 2
EP_LL_RING_KINDS = ("dispatch_bf16", "dispatch_fp8", "combine_bf16")
EP_LL_RING_OPS = tuple(f"ep_ll_ring.{k}" for k in EP_LL_RING_KINDS)
EP_LL_ALL = EP_LL_OPS + EP_LL_RING_OPS


# ---------------------------------------------------------------------------------- ranks
def gather(v):
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, v)
    return every


def agreed_error(err: Optional[str]) -> Optional[str]:
    return next((f"rank {r}: {e}" for r, e in enumerate(gather(err)) if e), None)


def pending(ops, where: str) -> Dict:
    return {op: failed(f"did not finish: the run stopped in {where}") for op in ops}


def attempt(what: str, fn):
    """(fn(), None), or (None, the error of the first rank that failed): every rank takes the same branch."""
    out, err = None, None
    try:
        out = fn()
    except Exception as exc:
        err = f"{what} failed: {_short(exc)}"
    err = agreed_error(err)
    return (None, err) if err else (out, None)


class RankBench:
    def __init__(self, rank: int, world: int, args, q):
        self.rank, self.world, self.args, self.q = rank, world, args, q
        self.t0 = time.time()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.proto = Protocols(args.warmup, args.iters, ("cold", "queued", *(("hidden",) if args.host_hidden else ())))
        self.records: Dict[str, Dict] = {}
        self.deepep_info: Dict = {"ran": False, "low_latency_ran": False}

    def say(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[EP{self.world} +{time.time() - self.t0:5.1f}s] {msg}", flush=True)

    def put(self, kind: str) -> None:
        if self.rank == 0:
            self.q.put((kind, {"world": self.world, "records": list(self.records.values()),
                               "deepep": self.deepep_info}))

    def timed(self, rec: Dict, op: str, fn) -> None:
        rec["ops"][op] = measure(self.proto, fn)
        self.report_ops(rec["case"], {op: rec["ops"][op]})

    def new_record(self, inp: Inputs) -> Dict:
        rem_in = sum(inp.recv) - inp.recv[self.rank]
        rem_out = sum(inp.send) - inp.send[self.rank]
        copies_out = sum(inp.copies_send) - inp.copies_send[self.rank]  # (token, expert) copies to other ranks
        copies_in = sum(inp.copies_recv) - inp.copies_recv[self.rank]
        every = gather((sum(inp.recv), rem_in, rem_out, copies_out, copies_in))
        return {"case": inp.case, "world": self.world, "tokens_per_rank": inp.T, "routing": inp.routing, "hidden": H,
                "num_sms": self.args.num_sms, "ops": {}, "checks": {}, "breakdown": {},
                "traffic": {"recv_rows": [e[0] for e in every], "remote_in": [e[1] for e in every],
                            "remote_out": [e[2] for e in every], "copies_out": [e[3] for e in every],
                            "copies_in": [e[4] for e in every]}}

    # -------------------------------------------------------------- phase 1: ep_plugin and NCCL
    def make_buffers(self) -> Dict[str, object]:
        """{"nvlink": EPBuffer or the agreed error text, "nvlink_sync": the same with comm.host_sync: true,
        "torch": the same}. nvlink runs the default mode (no host sync)."""
        out: Dict[str, object] = {}
        for name in ("nvlink", "nvlink_sync", "torch"):
            cfg = ep_config("nvlink" if name == "nvlink_sync" else name, self.args.num_sms,
                            host_sync=name == "nvlink_sync")
            buf, err = attempt(f"EPBuffer(backend={name})", lambda cfg=cfg: ep_plugin.EPBuffer(None, cfg, hidden=H))
            if err:
                self.say(err)
            out[name] = err or buf
        return out

    def check_ours(self, nv, ref, inp: Inputs) -> Dict:
        """ep_plugin nvlink against the torch backend (valid rows only: a worst-case-sized dispatch pads)."""
        x, xf8, idx, w = inp.x, inp.xf8, inp.idx, inp.w
        a, b = nv.dispatch(x, idx, w), ref.dispatch(x, idx, w)
        na, nb = sum(a.handle.recv_counts), sum(b.handle.recv_counts)
        ok = na == nb and torch.equal(a.x[:na], b.x[:nb]) and torch.equal(a.topk_idx[:na], b.topk_idx[:nb])
        yb = ref.combine(b.x, b.handle).float()
        ok = ok and torch.allclose(nv.combine(a.x, a.handle).float(), yb, atol=3e-2, rtol=1e-2)
        be = getattr(nv, "_backend", None)
        mode0 = getattr(be, "combine_mode", None)
        if mode0 in ("split", "fused"):  # both combine kernels, where the backend has two
            try:
                for mode in ("split", "fused"):
                    be.combine_mode = mode
                    ok = ok and torch.allclose(nv.combine(a.x, a.handle).float(), yb, atol=3e-2, rtol=1e-2)
            finally:
                be.combine_mode = mode0
        af, bf = nv.dispatch(xf8, idx, w), ref.dispatch(xf8, idx, w)
        ok = ok and torch.equal(af.x[0][:na].view(torch.uint8), bf.x[0][:nb].view(torch.uint8)) \
            and torch.equal(af.x[1][:na], bf.x[1][:nb])
        if expert_major is not None:  # expert-major receive: same layout and combine as the reference
            ea, eb = nv.dispatch(x, idx, w, layout="expert"), ref.dispatch(x, idx, w, layout="expert")
            n = int(eb.expert_offsets[-1])
            ok = ok and ea.expert_offsets.tolist() == eb.expert_offsets.tolist() and torch.equal(ea.x[:n], eb.x[:n])
            ok = ok and torch.allclose(nv.combine(ea.x, ea.handle).float(), ref.combine(eb.x, eb.handle).float(),
                                       atol=3e-2, rtol=1e-2)
        inp.ours_x = a.x[:na].clone()  # the buffer behind a.x may be reused by the next dispatch
        return {"ok": bool(ok), "recv_rows": int(na), "recv_counts_ok": list(a.handle.recv_counts) == inp.recv}

    def ours_case(self, bufs: Dict[str, object], inp: Inputs, rec: Dict) -> None:
        x, idx, w = inp.x, inp.idx, inp.w
        nv, ref = bufs["nvlink"], bufs["torch"]
        if not isinstance(nv, str) and not isinstance(ref, str):
            mine, err = attempt("ep_plugin check", lambda: self.check_ours(nv, ref, inp))
            every = gather(mine)
            if err:
                self.say(f"{inp.case}: {err}")
                rec["checks"]["ours_error"] = err
            else:
                rec["checks"]["ours_vs_torch"] = [m["ok"] for m in every]
                rec["checks"]["ours_recv_rows"] = [m["recv_rows"] for m in every]
                rec["checks"]["ours_recv_counts_match_routing"] = [m["recv_counts_ok"] for m in every]
                self.say(f"{inp.case}: ep_plugin nvlink == torch backend: {rec['checks']['ours_vs_torch']}, "
                         f"rows received {rec['checks']['ours_recv_rows']}")
        if isinstance(nv, str):
            rec["ops"].update({op: failed(nv) for op in NVLINK_OPS})
        else:
            self.nvlink_ops(nv, bufs["nvlink_sync"], inp, rec)
        b, err = (None, ref) if isinstance(ref, str) else attempt("torch backend dispatch", lambda: ref.dispatch(x, idx, w))
        if err:
            rec["ops"].update({op: failed(err) for op in ("torch.dispatch_bf16", "torch.combine_bf16")})
        else:
            self.timed(rec, "torch.dispatch_bf16", lambda: ref.dispatch(x, idx, w))
            self.timed(rec, "torch.combine_bf16", lambda: ref.combine(b.x, b.handle))
        # a plain all-to-all moving the same rows, split sizes known in advance: only the exchange is timed
        order = torch.cat([inp.in_rank[:, r].nonzero().squeeze(1) for r in range(self.world)])
        send_buf = x[order].contiguous()
        recv_buf = torch.empty(sum(inp.recv), H, dtype=x.dtype, device=x.device)
        back_buf = torch.empty_like(send_buf)
        self.timed(rec, "nccl.dispatch_bf16", lambda: dist.all_to_all_single(recv_buf, send_buf, inp.recv, inp.send))
        self.timed(rec, "nccl.combine_bf16", lambda: dist.all_to_all_single(back_buf, recv_buf, inp.send, inp.recv))

    def nvlink_ops(self, nv, nv_sync, inp: Inputs, rec: Dict) -> None:
        x, xf8, idx, w = inp.x, inp.xf8, inp.idx, inp.w
        self.timed(rec, "nvlink.dispatch_bf16", lambda: nv.dispatch(x, idx, w))
        self.timed(rec, "nvlink.dispatch_fp8", lambda: nv.dispatch(xf8, idx, w))
        a, err = attempt("nvlink dispatch", lambda: nv.dispatch(x, idx, w))  # a fresh handle for what follows
        if err:
            rec["ops"]["nvlink.dispatch_cached"] = rec["ops"]["nvlink.combine_bf16"] = failed(err)
            return
        self.timed(rec, "nvlink.dispatch_cached", lambda: nv.dispatch(x, handle=a.handle))
        self.timed(rec, "nvlink.combine_bf16", lambda: nv.combine(a.x, a.handle))
        if not isinstance(nv_sync, str):  # the host-synced mode (exact output sizes), for comparison
            self.timed(rec, "nvlink_sync.dispatch_bf16", lambda: nv_sync.dispatch(x, idx, w))
            s = nv_sync.dispatch(x, idx, w)
            self.timed(rec, "nvlink_sync.combine_bf16", lambda: nv_sync.combine(s.x, s.handle))
        # expert-major receive against the rank-major receive followed by a torch permute (what an
        # integration did before): both deliver the same grouped-GEMM input
        if expert_major is None:
            return
        self.timed(rec, "nvlink.dispatch_expert_bf16", lambda: nv.dispatch(x, idx, w, layout="expert"))
        self.timed(rec, "nvlink.dispatch_expert_fp8", lambda: nv.dispatch(xf8, idx, w, layout="expert"))
        ea = nv.dispatch(x, idx, w, layout="expert")
        self.timed(rec, "nvlink.combine_expert_bf16", lambda: nv.combine(ea.x, ea.handle))
        be = nv._backend
        if getattr(be, "expert_sum_first", False):  # the split kernels' send-side sum, the way before it
            be.expert_sum_first = False
            try:
                self.timed(rec, "nvlink.combine_expert_send_sum_bf16", lambda: nv.combine(ea.x, ea.handle))
            finally:
                be.expert_sum_first = True
        if getattr(be, "expert_sum_beside", False):  # the sum as a pass of its own before the pull kernel (session 20)
            be.expert_sum_beside = False
            try:
                self.timed(rec, "nvlink.combine_expert_sum_first_bf16", lambda: nv.combine(ea.x, ea.handle))
            finally:
                be.expert_sum_beside = True
        EL = nv.num_local_experts

        def then_permute():
            r = nv.dispatch(x, idx, w)
            n = expert_major.capacity(r.handle.num_recv, idx.shape[1], EL, 1)
            lay = expert_major.plan(r.topk_idx, EL, 1, n)
            return expert_major.expand(r.x, lay), expert_major.expand_weights(r.topk_weights, lay)

        self.timed(rec, "nvlink.dispatch_then_permute", then_permute)
        r = nv.dispatch(x, idx, w)
        lay = expert_major.plan(r.topk_idx, EL, 1, expert_major.capacity(r.handle.num_recv, idx.shape[1], EL, 1))
        ex = expert_major.expand(r.x, lay)
        self.timed(rec, "nvlink.unpermute_then_combine",
                   lambda: nv.combine(expert_major.collapse(ex, lay), r.handle))
        if self.args.breakdown:  # every rank profiles; rank 0's numbers are kept
            rec["breakdown"] = {"dispatch_bf16": kernel_breakdown(lambda: nv.dispatch(x, idx, w)),
                                "dispatch_fp8": kernel_breakdown(lambda: nv.dispatch(xf8, idx, w)),
                                "combine_bf16": kernel_breakdown(lambda: nv.combine(a.x, a.handle))}

    # -------------------------------------------------------------- ep_plugin's low-latency calls
    def check_ll(self, buf, inp: Inputs) -> Dict:
        """ep_plugin's low-latency calls against docs/LOW_LATENCY.md, computed here from every rank's
        tokens: rows per local expert (source rank, then token ascending), counts, src_info, the FP8
        cast, the weighted combine, and the same results through receive hooks. Returns {"checks":
        {name: bool}, "info": {...}, "expert_out": the combine input the timed rows use, "engine"}: expert
        e's output is its rows times (1 + global expert / E), so a row combined under the wrong expert shows."""
        x, idx, w = inp.x, inp.idx, inp.w
        W, r, EL = self.world, self.rank, E // self.world
        xs, ids = [torch.empty_like(x) for _ in range(W)], [torch.empty_like(idx) for _ in range(W)]
        dist.all_gather(xs, x)
        dist.all_gather(ids, idx)
        mine = torch.arange(r * EL, (r + 1) * EL, device=x.device)
        hits = [(i.unsqueeze(-1) == mine).any(1) for i in ids]  # per source: [T_s, E_l]
        want_src = [torch.cat([h[:, e].nonzero().squeeze(1) for h in hits]) for e in range(EL)]
        want_rows = [torch.cat([xs[s][hits[s][:, e]] for s in range(W)]) for e in range(EL)]
        n = [int(t.numel()) for t in want_src]
        checks: Dict[str, bool] = {}

        dispatch, combine = ll_calls(buf, inp)

        def rows_ok(recv, count, handle):
            ok = count.tolist() == n and all(torch.equal(recv[e, :n[e]], want_rows[e]) for e in range(EL))
            src = getattr(handle, "src_info", None)
            if src is not None:
                ok = ok and all(torch.equal(src[e, :n[e]].long(), want_src[e]) for e in range(EL))
            return bool(ok)

        recv, count, handle, _, _ = dispatch()
        engine = ll_engine(buf, handle)
        checks["dispatch_bf16"] = rows_ok(recv, count, handle)
        scale = 1.0 + mine.float() / E
        expert_out = torch.empty_like(recv)
        for e in range(EL):  # one expert at a time: the whole [E_l, W*M, H] in float32 would be ~1 GB
            expert_out[e] = (recv[e].float() * scale[e]).to(torch.bfloat16)
        y = combine(expert_out, handle)[0].clone()
        valid = idx >= 0
        v = (x.float().unsqueeze(1) * (1.0 + idx.clamp(min=0).float() / E).unsqueeze(-1)).to(torch.bfloat16).float()
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for k in range(idx.shape[1]):  # the contract's order and arithmetic: acc = acc + w * v, k ascending
            acc = acc + torch.where(valid[:, k, None], w[:, k, None].float() * v[:, k], torch.zeros_like(acc))
        want_y = acc.to(torch.bfloat16)
        checks["combine_bf16"] = bool(torch.allclose(y.float(), want_y.float(), atol=2e-2, rtol=1e-2))
        info = {"combine_bitwise": bool(torch.equal(y, want_y)), "recv_copies": sum(n)}

        (data, scales), count, handle, _, _ = dispatch(fp8=True)
        ok = count.tolist() == n
        for e in range(EL):
            if not ok:
                break
            rows = want_rows[e].float().view(n[e], H // 128, 128)
            amax = rows.abs().amax(-1).clamp(min=1e-4)
            want_d = (rows * (448.0 / amax).unsqueeze(-1)).view(n[e], H).to(torch.float8_e4m3fn)
            ok = torch.equal(data[e, :n[e]].view(torch.uint8), want_d.view(torch.uint8)) and \
                torch.equal(scales[e, :n[e]], amax / 448.0)
        checks["dispatch_fp8"] = bool(ok)
        checks["combine_after_fp8"] = bool(torch.equal(combine(expert_out, handle)[0], y))
        # with output sets (the default, 2) the next dispatch takes the first one's set again: drop its outputs
        # (held, they raise OutputsStillHeldError, docs/LOW_LATENCY.md "Held outputs")
        del recv, data, scales, count, handle

        recv, count, handle, _, hook = dispatch(hook=True)
        hook()
        checks["dispatch_hook"] = rows_ok(recv, count, handle)
        yh, _, hook = combine(expert_out, handle, hook=True)
        hook()
        checks["combine_hook"] = bool(torch.equal(yh, y))
        return {"checks": checks, "info": info, "expert_out": expert_out, "engine": engine}

    def ours_ll(self, inp: Inputs, rec: Dict) -> None:
        """ep_plugin's low-latency rows on their own EPBuffer (the nvlink rows' config plus
        comm.low_latency.max_tokens_per_rank = the case's tokens), closed afterwards; then the same with
        comm.low_latency.output_buffers: EP_LL_RING (outputs from sets used in turn, no allocation per call)."""
        if not hasattr(ep_plugin.EPBuffer, "low_latency_dispatch"):
            rec["ops"].update({op: failed(f"n/a: this ep_plugin ({ep_plugin.__file__}) has no "
                                          "EPBuffer.low_latency_dispatch") for op in EP_LL_ALL})
            return
        self.ours_ll_rows(inp, rec, "ep_ll", EP_LL_OPS, 0, LL_KINDS)
        self.ours_ll_rows(inp, rec, "ep_ll_ring", EP_LL_RING_OPS, EP_LL_RING, EP_LL_RING_KINDS)

    def ours_ll_rows(self, inp: Inputs, rec: Dict, prefix: str, names, output_buffers: int, kinds) -> None:
        cfg = ep_config("nvlink", self.args.num_sms, ll_max_tokens=inp.T, ll_output_buffers=output_buffers)
        buf, err = attempt(f"EPBuffer(comm.low_latency: max_tokens_per_rank, output_buffers {output_buffers})",
                           lambda: ep_plugin.EPBuffer(None, cfg, hidden=H))
        if err:
            self.say(f"{inp.case}: {err}")
            rec["ops"].update({op: failed(err) for op in names})
            return
        try:
            mine, err = attempt("ep_plugin low-latency check", lambda: self.check_ll(buf, inp))
            engines = sorted(set(gather(mine["engine"] if mine else ll_engine(buf))))
            rec["ll_engine"] = engines[0] if len(engines) == 1 else " / ".join(engines)
            if err:
                self.say(f"{inp.case}: {err}")
                rec["checks"][f"{prefix}_error"] = err
                rec["ops"].update({op: failed(err) for op in names})
                return
            every = gather((mine["checks"], mine["info"]))
            rec["checks"][prefix] = [e[0] for e in every]
            rec["checks"][f"{prefix}_info"] = [e[1] for e in every]
            self.say(f"{inp.case}: ep_plugin low-latency engine {rec['ll_engine']} (output_buffers {output_buffers}); "
                     f"checks {[sorted(k for k, v in c.items() if not v) or 'all OK' for c in rec['checks'][prefix]]}")
            dispatch, combine = ll_calls(buf, inp)
            ops = measure_low_latency(self.proto, prefix, dispatch, combine, mine["expert_out"], kinds)
            rec["ops"].update(ops)
            self.report_ops(inp.case, ops)
        finally:
            if hasattr(buf, "close"):
                buf.close()

    def sm_sweep(self, nv, inp: Inputs, rec: Dict) -> None:
        be = getattr(nv, "_backend", None)
        if be is None or not hasattr(be, "num_sms"):
            self.say("sm_sweep: this backend has no num_sms to set; skipped")
            return
        a, err = attempt("nvlink dispatch", lambda: nv.dispatch(inp.x, inp.idx, inp.w))
        if err:
            self.say(f"sm_sweep: {err}")
            return
        sms0 = be.num_sms
        rec["sms"] = list(self.args.sms)
        try:
            for s in self.args.sms:
                be.num_sms = s
                self.timed(rec, f"nvlink@{s}.dispatch_bf16", lambda: nv.dispatch(inp.x, inp.idx, inp.w))
                self.timed(rec, f"nvlink@{s}.dispatch_fp8", lambda: nv.dispatch(inp.xf8, inp.idx, inp.w))
                self.timed(rec, f"nvlink@{s}.combine_bf16", lambda: nv.combine(a.x, a.handle))
        finally:
            be.num_sms = sms0

    # -------------------------------------------------------------- the run
    def report_ops(self, case: str, ops: Dict) -> None:
        for op, r in ops.items():
            if r["error"]:
                self.say(f"{case} {op}: {r['error']}")
                break  # the others share it
            self.say(f"{case} {op}: " + ", ".join(f"{p} {max(r[p + '_us']):.1f} us" for p in self.proto.kinds))

    def run(self) -> None:
        args = self.args
        cases = [c for c in args.cases if c in CASES]
        inputs = {c: make_inputs(c, self.rank, self.world, self.device) for c in cases}
        bufs = self.make_buffers()
        self.say(f"phase 1: ep_plugin ({ep_plugin.__file__}) and NCCL, cases {cases}")
        for c in cases:
            self.records[c] = self.new_record(inputs[c])
            self.ours_case(bufs, inputs[c], self.records[c])
        if "sm_sweep" in args.cases and not isinstance(bufs["nvlink"], str):
            inp = inputs.get("throughput") or make_inputs("sm_sweep", self.rank, self.world, self.device)
            rec = self.records["sm_sweep"] = self.new_record(inp)
            rec["case"] = "sm_sweep"
            self.sm_sweep(bufs["nvlink"], inp, rec)
        self.put("partial")
        ll_rec = self.records.get("latency")
        if ll_rec is not None and args.ep_ll == "off":
            ll_rec["ops"].update({op: failed("n/a: skipped (--ep-ll off)") for op in EP_LL_ALL})
        elif ll_rec is not None and args.ep_ll == "first":
            ll_rec["ops"].update(pending(EP_LL_ALL, "ep_plugin's low-latency calls"))
            self.put("partial")
            self.say("phase 1b: ep_plugin low-latency calls")
            self.ours_ll(inputs["latency"], ll_rec)
            self.put("partial")
        elif ll_rec is not None:  # last: after DeepEP's phases, their buffers closed
            ll_rec["ops"].update(pending(EP_LL_ALL, "DeepEP's kernels (ep_plugin's low-latency rows run last)"))

        # until a phase ends its ops read "did not finish", so a rank that dies in DeepEP leaves a reason
        run_ll = "latency" in cases and not args.no_deepep_ll
        for c in cases:
            self.records[c]["ops"].update(pending(NORMAL_OPS, "DeepEP's normal kernels"))
        if run_ll:
            self.records["latency"]["ops"].update(pending(LL_OPS, "DeepEP's normal kernels"))
        self.put("partial")
        dep = DeepEP(H, E, args.num_sms, enabled=not args.no_deepep and bool(cases))
        dep.setup_normal()
        self.say(f"phase 2: DeepEP normal kernels ({dep.error or 'ready'})")
        for c in cases:
            ops, facts = dep.normal_case(self.proto, inputs[c].x, inputs[c].xf8, inputs[c].idx, inputs[c].w)
            self.records[c]["ops"].update(ops)
            self.report_ops(c, ops)
            if not facts.get("error"):
                theirs, ours = facts.pop("recv_x"), inputs[c].ours_x
                same = ours is not None and torch.equal(theirs, ours)
                every = gather((facts["recv_rows"], facts["combine_ok"], same))
                chk = self.records[c]["checks"]
                chk["deepep_recv_rows"] = [e[0] for e in every]
                chk["deepep_combine_ok"] = [e[1] for e in every]
                chk["deepep_rows_equal_ours"] = [e[2] for e in every]
                self.deepep_info["ran"] = True
                self.say(f"{c}: DeepEP rows received {chk['deepep_recv_rows']}, ours {chk.get('ours_recv_rows')}")
            self.deepep_info.update(error=dep.error, **dep.info)
            self.put("partial")

        if not run_ll:
            self.deepep_info["ll_error"] = "skipped (no latency case, or --no-deepep-ll)"
        else:
            self.records["latency"]["ops"].update(pending(LL_OPS, "DeepEP's low-latency set-up or kernels"))
            self.put("partial")
            dep.setup_low_latency(CASES["latency"][0])
            self.say(f"phase 3: DeepEP low-latency kernels ({dep.ll_error or 'ready'})")
            inp = inputs["latency"]
            ops, facts = dep.low_latency_case(self.proto, inp.x, inp.idx, inp.w)
            self.records["latency"]["ops"].update(ops)
            self.report_ops("latency", ops)
            if not facts.get("error"):
                every = gather((facts["recv_copies"], facts["combine_ok"]))
                self.records["latency"]["checks"]["deepep_ll_recv_copies"] = [e[0] for e in every]
                self.records["latency"]["checks"]["deepep_ll_combine_ok"] = [e[1] for e in every]
                self.deepep_info["low_latency_ran"] = True
            self.deepep_info.update(ll_error=dep.ll_error, **dep.info)
        if ll_rec is not None and args.ep_ll == "last":
            dep.close()
            ll_rec["ops"].update(pending(EP_LL_ALL, "ep_plugin's low-latency calls"))
            self.put("partial")
            self.say("phase 4: ep_plugin low-latency calls")
            self.ours_ll(inputs["latency"], ll_rec)
        self.put("done")
        dep.close()
        for b in bufs.values():
            if not isinstance(b, str) and hasattr(b, "close"):
                b.close()


def ll_calls(buf, inp: Inputs):
    """The low-latency dispatch(fp8, hook) and combine(rows, handle, hook) of one buffer on the case's inputs."""
    x, idx, w = inp.x, inp.idx, inp.w

    def dispatch(fp8=False, hook=False):
        return buf.low_latency_dispatch(x, idx, use_fp8=fp8, return_recv_hook=hook)

    def combine(rows, handle, hook=False):
        return buf.low_latency_combine(rows, idx, w, handle, return_recv_hook=hook)

    return dispatch, combine


def rank_main(rank: int, world: int, port: int, args, q) -> None:
    try:
        init_rank(rank, world, port)
        RankBench(rank, world, args, q).run()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        q.put(("err", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


def run_meta(args) -> Dict:
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:
        nccl = None
    tree = os.path.dirname(os.path.dirname(os.path.abspath(ep_plugin.__file__)))
    return {"device": torch.cuda.get_device_name(0) if ngpu else "none", "num_gpus": ngpu, "worlds": list(args.worlds),
            "date": report.utc_now(), **report.git_commit(tree), "ep_plugin_file": ep_plugin.__file__,
            "ep_plugin_version": getattr(ep_plugin, "__version__", None), "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": nccl, "num_sms": args.num_sms, "hidden": H, "num_experts": E,
            "topk": K, "group_limited": {"num_groups": NUM_GROUPS, "group_topk": GROUP_TOPK}, "cases": list(args.cases),
            "iters": args.iters, "warmup": args.warmup, "nvlink_GBps": report.NVLINK_GBPS,
            "protocols": {"cold": "L2 flush (256 MB write), cuda synchronize, dist.barrier before each call; CUDA "
                                  "events around it; median per rank, slowest rank",
                          "queued": "calls enqueued back to back after one all-reduce on the stream; CUDA events "
                                    "around each; median per rank, slowest rank",
                          **({"hidden": "the cold call's start, the call enqueued behind a ~1.5 ms GPU sleep (host "
                                        "time hidden): the kernels' time from a cold L2"} if args.host_hidden else {})},
            "host": socket.gethostname(), "argv": sys.argv}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2], help="EP sizes, one run each (default 2)")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=[*CASES, "sm_sweep"])
    ap.add_argument("--sms", type=int, nargs="+", default=[8, 16, 24, 48], help="SM counts of the sm_sweep case")
    ap.add_argument("--num-sms", type=int, default=24, help="SMs for ep_plugin's kernels and DeepEP's (even)")
    ap.add_argument("--iters", type=int, default=30, help="timed calls per op and protocol")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls before each protocol")
    ap.add_argument("--breakdown", action="store_true", help="per-kernel times of our calls (torch profiler)")
    ap.add_argument("--host-hidden", action="store_true",
                    help="a third protocol: the cold call enqueued behind a GPU sleep, so cold - hidden is the "
                         "host's share of a cold call (hidden_us in the JSON and the log)")
    ap.add_argument("--no-deepep", action="store_true", help="leave DeepEP out (its rows say n/a)")
    ap.add_argument("--no-deepep-ll", action="store_true", help="leave DeepEP's low-latency kernels out")
    ap.add_argument("--ep-ll", choices=("first", "last", "off"), default="last",
                    help="ep_plugin's low-latency rows (latency case): after DeepEP's phases with DeepEP's buffers "
                         "closed (default: with ours first, DeepEP v1.2.1's low-latency kernels then assert on "
                         "num_rc_per_pe in the same process, 2x H200 2026-11-23), at the end of phase 1, or not "
                         "at all")
    ap.add_argument("--timeout", type=float, default=200.0, help="seconds per EP size before the ranks are killed")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for the JSON and the plot")
    ap.add_argument("--label", default="run", help="names the files: bench_dispatch_<label>.json")
    args = ap.parse_args(argv)
    if args.num_sms < 2 or args.num_sms % 2:
        ap.error(f"--num-sms must be even and >= 2 (DeepEP's kernels pair SMs), got {args.num_sms}")
    if args.iters < 1 or args.warmup < 0:
        ap.error(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    if not args.label or not all(ch.isalnum() or ch in "._-" for ch in args.label):
        ap.error(f"--label becomes part of a file name: letters, digits, '.', '_' and '-' only, got {args.label!r}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.iters < 30:
        print(f"note: --iters {args.iters} is below the protocol's 30", flush=True)
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)  # NVLink multicast stays off on the lent machines
    os.makedirs(args.out, exist_ok=True)
    meta = run_meta(args)
    path = os.path.join(args.out, f"bench_dispatch_{args.label}.json")
    t0 = time.time()
    dirty = " + local changes" if meta["commit_dirty"] else ""
    print(f"bench_dispatch: ep_plugin from {ep_plugin.__file__} (commit {meta['commit']}{dirty}), "
          f"{meta['num_gpus']}x {meta['device']}, torch {meta['torch']}, NCCL {meta['nccl']}", flush=True)
    reports: List[Dict] = []
    unfinished: List[int] = []

    def emit(extra: Optional[Dict] = None) -> List[Dict]:
        shown = reports + ([extra] if extra else [])
        summaries = [report.summarize(r) for rep in shown for r in rep["records"]]
        infos = {str(rep["world"]): rep["deepep"] for rep in shown}
        meta.update(wall_s=round(time.time() - t0, 1), complete=not unfinished and extra is None,
                    unfinished_worlds=list(unfinished),
                    deepep={"ran": any(i.get("ran") for i in infos.values()),
                            "low_latency_ran": any(i.get("low_latency_ran") for i in infos.values()),
                            "per_world": infos})
        report.write_json(path, report.document(args.label, meta, summaries))
        return summaries

    for world in args.worlds:
        if world > meta["num_gpus"]:
            print(f"skip EP{world}: only {meta['num_gpus']} GPUs", flush=True)
            continue
        rep, complete = run_world(rank_main, world, args, on_partial=emit)
        if not complete:
            unfinished.append(world)
        if rep is not None:
            reports.append(rep)
        emit()
    summaries = emit()
    if not reports:
        print(f"nothing ran: EP sizes {args.worlds}, {meta['num_gpus']} GPUs", flush=True)
        return 2
    print(report.format_table(summaries), flush=True)
    png = path[:-len(".json")] + ".png"
    why_not = report.plot(summaries, png)
    print(f"plot: {png}" if why_not is None else f"plot: none ({why_not})")
    print(f"json: {path} ({time.time() - t0:.0f} s)", flush=True)
    bad = [s["case"] for s in summaries if s["checks"].get("ours_vs_torch_ok") is False]
    if bad:
        print(f"FAILED: ep_plugin nvlink differs from the torch backend in {bad}", flush=True)
    bad_ll = [s["case"] for s in summaries if s["checks"].get("ep_ll_ok") is False]
    if bad_ll:
        print(f"FAILED: ep_plugin's low-latency calls differ from docs/LOW_LATENCY.md in {bad_ll}", flush=True)
    bad += bad_ll
    if unfinished:
        print(f"INCOMPLETE: EP sizes {unfinished} did not finish; the JSON holds what they measured", flush=True)
    return 1 if bad or unfinished else 0


if __name__ == "__main__":
    sys.exit(main())
