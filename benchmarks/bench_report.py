"""Turn bench_dispatch's per-case records into rows, one table, one JSON document and a plot.

Pure Python over plain dicts (no GPU, no torch.distributed), so it is tested on CPU with made-up
numbers. A record (one case, one EP size) as the ranks hand it over:
    {"case", "world", "tokens_per_rank", "routing", "hidden",
     "traffic": {"recv_rows": [per rank], "remote_in": [...], "remote_out": [...]},
     "ops": {op: protocols.measure(...) dict}, "checks": {...}, "breakdown": {...}}
A row pairs a dispatch op with a combine op (either may be absent); its time under a protocol is the
slowest rank's median. The latency case's record may also hold "ll_engine" (which engine served
ep_plugin's low-latency rows) and traffic "copies_out" / "copies_in" (per rank: (token, expert)
copies sent to / received from other ranks), which the low-latency floors need.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
from dataclasses import dataclass
from typing import Dict, List, Optional

NVLINK_GBPS = 478.0  # 18 NVLink 4 links x 26.6 GB/s per direction (H100/H200)
# One kernel launch, added to the low-latency floors: an estimate (not measured by this benchmark) of
# what a launch and the grid's start cost on an H100/H200 seen from CUDA events, ~2 us; a low-latency
# call is one kernel (one per half with a receive hook), so it cannot beat bytes / NVLINK_GBPS + this.
LAUNCH_US = 2.0
SCHEMA = "ep_plugin.bench_dispatch/2"  # fields only added since (floor_kind, ll floors, ll_engine, ll checks)


@dataclass(frozen=True)
class Row:
    path: str
    dispatch: Optional[str]  # op key, or None
    combine: Optional[str]
    row_dtype: str = "bf16"  # what the dispatch moves, for its floor: bf16 | fp8 | none
    # rank: remote rows deduplicated per rank (the normal kernels); ll: one copy per (token, expert) on
    # another rank + LAUNCH_US (the low-latency kernels); ll_recv: a receive half (no NVLink bytes: LAUNCH_US)
    floor: str = "rank"
    engine: bool = False     # ep_plugin's low-latency engine: the path names it unless it is the kernels


ROWS = (
    Row("ep_plugin nvlink BF16", "nvlink.dispatch_bf16", "nvlink.combine_bf16"),
    Row("ep_plugin nvlink FP8", "nvlink.dispatch_fp8", None, "fp8"),
    Row("ep_plugin nvlink cached BF16", "nvlink.dispatch_cached", None),
    Row("ep_plugin nvlink BF16, host_sync: true", "nvlink_sync.dispatch_bf16", "nvlink_sync.combine_bf16"),
    Row("ep_plugin nvlink expert-major BF16", "nvlink.dispatch_expert_bf16", "nvlink.combine_expert_bf16"),
    Row("ep_plugin nvlink expert-major FP8", "nvlink.dispatch_expert_fp8", None, "fp8"),
    Row("ep_plugin nvlink rank-major + torch permute", "nvlink.dispatch_then_permute", "nvlink.unpermute_then_combine"),
    Row("torch backend (NCCL) BF16", "torch.dispatch_bf16", "torch.combine_bf16"),
    Row("NCCL all_to_all_single, a copy per rank", "nccl.dispatch_bf16", "nccl.combine_bf16"),
    Row("DeepEP V1 BF16 (layout + dispatch)", "deepep.dispatch_bf16", "deepep.combine_bf16"),
    Row("DeepEP V1 BF16, layout precomputed", "deepep.dispatch_bf16_prelayout", None),
    Row("DeepEP V1 get_dispatch_layout", "deepep.layout", None, "none"),
    Row("DeepEP V1 FP8 (layout + dispatch)", "deepep.dispatch_fp8", None, "fp8"),
    Row("DeepEP V1 cached BF16", "deepep.dispatch_cached", None),
    Row("DeepEP V1 low-latency BF16", "deepep_ll.dispatch_bf16", "deepep_ll.combine_bf16", floor="ll"),
    Row("DeepEP V1 low-latency FP8", "deepep_ll.dispatch_fp8", None, "fp8", floor="ll"),
    Row("DeepEP V1 low-latency BF16, send half (hook)", "deepep_ll.dispatch_send_bf16", "deepep_ll.combine_send_bf16",
        floor="ll"),
    Row("DeepEP V1 low-latency BF16, recv half: hook()", "deepep_ll.dispatch_recv_bf16",
        "deepep_ll.combine_recv_bf16", floor="ll_recv"),
    Row("ep_plugin low-latency BF16", "ep_ll.dispatch_bf16", "ep_ll.combine_bf16", floor="ll", engine=True),
    Row("ep_plugin low-latency FP8", "ep_ll.dispatch_fp8", None, "fp8", floor="ll", engine=True),
    Row("ep_plugin low-latency BF16, send half (hook)", "ep_ll.dispatch_send_bf16", "ep_ll.combine_send_bf16",
        floor="ll", engine=True),
    Row("ep_plugin low-latency BF16, recv half: hook()", "ep_ll.dispatch_recv_bf16", "ep_ll.combine_recv_bf16",
        floor="ll_recv", engine=True),
    Row("ep_plugin low-latency BF16, output_buffers 2", "ep_ll_ring.dispatch_bf16", "ep_ll_ring.combine_bf16",
        floor="ll", engine=True),
    Row("ep_plugin low-latency FP8, output_buffers 2", "ep_ll_ring.dispatch_fp8", None, "fp8", floor="ll", engine=True),
)


def sweep_rows(sms_list) -> List[Row]:
    out = []
    for s in sms_list:
        out.append(Row(f"ep_plugin nvlink BF16, {s} SMs", f"nvlink@{s}.dispatch_bf16", f"nvlink@{s}.combine_bf16"))
        out.append(Row(f"ep_plugin nvlink FP8, {s} SMs", f"nvlink@{s}.dispatch_fp8", None, "fp8"))
    return out


def row_bytes(hidden: int, dtype: str) -> int:
    return hidden * 2 if dtype == "bf16" else hidden + (hidden // 128) * 4


def _num(v, nd=1):
    return None if v is None else round(float(v), nd)


def ll_floors(hidden: int, traffic: Dict) -> Dict[str, Optional[float]]:
    """The low-latency floors (us): the busiest rank's bytes to other ranks, one copy per (token, expert)
    (dispatch: copies it sends; combine: the copies it received, sent back), at NVLINK_GBPS, + LAUNCH_US.
    None where the record has no copy counts (an older record)."""
    out, cin = traffic.get("copies_out"), traffic.get("copies_in")
    f: Dict[str, Optional[float]] = {"dispatch_bf16": None, "dispatch_fp8": None, "combine_bf16": None,
                                     "recv_half": LAUNCH_US}
    if out:
        for d in ("bf16", "fp8"):
            f[f"dispatch_{d}"] = max(out) * row_bytes(hidden, d) / NVLINK_GBPS / 1e3 + LAUNCH_US
    if cin:
        f["combine_bf16"] = max(cin) * row_bytes(hidden, "bf16") / NVLINK_GBPS / 1e3 + LAUNCH_US
    return f


def engine_note(engine: Optional[str]) -> str:
    """What the path of an ep_plugin low-latency row adds about the engine that served it."""
    if engine is None or engine == "nvshmem":
        return ""
    return " (torch reference engine)" if engine == "torch reference" else f" (engine: {engine})"


def _side(op: Dict, logical_bytes: Optional[int], floor_us: Optional[float]) -> Dict:
    out = {"cold_us": None, "queued_us": None, "cold_per_rank_us": op.get("cold_us"),
           "queued_per_rank_us": op.get("queued_us"), "cold_min_us": None, "queued_min_us": None,
           "logical_GBps_cold": None, "logical_GBps_queued": None, "floor_us": _num(floor_us),
           "gap_us": None, "error": op.get("error")}
    for p in ("cold", "queued"):
        per_rank = op.get(f"{p}_us")
        if per_rank:
            t = max(per_rank)  # the slowest rank's median
            out[f"{p}_us"] = _num(t)
            out[f"{p}_min_us"] = _num(min(op.get(f"{p}_min_us") or [t]))
            out[f"logical_GBps_{p}"] = _num(logical_bytes / t / 1e3) if logical_bytes and t > 0 else None
    if out["cold_us"] is not None and floor_us is not None:  # what the cold call spends above the wire time
        out["gap_us"] = _num(out["cold_us"] - floor_us)
    return out


def summarize(rec: Dict) -> Dict:
    """One case record -> its JSON summary (traffic, checks, rows)."""
    H, tr = rec["hidden"], rec["traffic"]
    recv_max, rin, rout = max(tr["recv_rows"]), max(tr["remote_in"]), max(tr["remote_out"])
    logical = recv_max * row_bytes(H, "bf16")
    remote = max(rin, rout)
    floors = {d: remote * row_bytes(H, d) / NVLINK_GBPS / 1e3 for d in ("bf16", "fp8")}
    floors["none"] = None
    ll = ll_floors(H, tr)
    ops = rec.get("ops", {})
    specs = sweep_rows(rec.get("sms", [])) if rec["case"] == "sm_sweep" else ROWS
    rows = []
    for spec in specs:
        if spec.dispatch not in ops and spec.combine not in ops:
            continue
        path = spec.path + (engine_note(rec.get("ll_engine")) if spec.engine else "")
        row = {"path": path, "dispatch_op": spec.dispatch, "combine_op": spec.combine,
               "dispatch": None, "combine": None, "floor_kind": spec.floor}
        if spec.floor == "rank":
            d_floor, c_floor = floors[spec.row_dtype], floors["bf16"]
        elif spec.floor == "ll":
            d_floor, c_floor = ll.get(f"dispatch_{spec.row_dtype}"), ll["combine_bf16"]
        else:  # a receive half: its bytes crossed NVLink in the send half
            d_floor = c_floor = ll["recv_half"]
        moves = spec.row_dtype != "none" and spec.floor != "ll_recv"  # no bandwidth for a layout or a hook
        if spec.dispatch in ops:  # a layout-only op moves no rows: no bandwidth, no floor
            row["dispatch"] = _side(ops[spec.dispatch], logical if moves else None, d_floor)
        if spec.combine in ops:
            row["combine"] = _side(ops[spec.combine], logical if spec.floor != "ll_recv" else None, c_floor)
        errs = [s["error"] for s in (row["dispatch"], row["combine"]) if s and s["error"]]
        row["error"] = errs[0] if errs else None
        row["status"] = "n/a" if row["error"] and row["error"].startswith("n/a") else ("error" if errs else "ok")
        rows.append(row)
    traffic = {"rows_received_per_rank": tr["recv_rows"], "rows_received_max": recv_max,
               "remote_rows_in_max": rin, "remote_rows_out_max": rout,
               "bytes_logical_bf16": logical,
               "floor_us": {"dispatch_bf16": _num(floors["bf16"]), "dispatch_fp8": _num(floors["fp8"]),
                            "combine_bf16": _num(floors["bf16"])}}
    if tr.get("copies_out"):
        traffic.update(remote_copies_out_per_rank=tr["copies_out"], remote_copies_in_per_rank=tr.get("copies_in"))
        traffic["floor_us"].update({f"ll_{k}": _num(v) for k, v in ll.items()}, launch_us=LAUNCH_US)
    return {"case": rec["case"], "world": rec["world"], "tokens_per_rank": rec["tokens_per_rank"],
            "routing": rec.get("routing"), "num_sms": rec.get("num_sms"),
            "traffic": traffic, "checks": check_summary(rec.get("checks", {})),
            "rows": rows, "ops": ops, "breakdown_rank0_us": rec.get("breakdown", {}),
            **({"ll_engine": rec["ll_engine"]} if "ll_engine" in rec else {}),
            **({"sms": rec["sms"]} if "sms" in rec else {})}


def check_summary(c: Dict) -> Dict:
    """ok: ours == torch backend on every rank, (when DeepEP ran) DeepEP's received rows == ours, and (when
    ep_plugin's low-latency calls ran) they match the contract of docs/LOW_LATENCY.md on every rank."""
    if not c:
        return {}
    out = dict(c)
    ours = c.get("ours_vs_torch")
    dep, mine = c.get("deepep_recv_rows"), c.get("ours_recv_rows")
    out["ours_vs_torch_ok"] = False if c.get("ours_error") else (None if ours is None else all(ours))
    out["deepep_rows_match"] = None if dep is None or mine is None else list(dep) == list(mine)
    ll = (c.get("ep_ll") or []) + (c.get("ep_ll_ring") or [])  # per rank: {check: bool}, both buffers
    out["ep_ll_ok"] = False if c.get("ep_ll_error") or c.get("ep_ll_ring_error") else (
        None if not ll else all(all(v for v in r.values()) for r in ll))
    verdicts = [v for v in (out["ours_vs_torch_ok"], out["deepep_rows_match"], out["ep_ll_ok"]) if v is not None]
    out["ok"] = all(verdicts) if verdicts else None
    return out


# ---------------------------------------------------------------------------------- table
def _us(side: Optional[Dict], key: str) -> str:
    if side is None:
        return "-"
    if side.get("error"):
        return "n/a" if side["error"].startswith("n/a") else "error"
    v = side.get(key)
    return "-" if v is None else f"{v:.1f}"


def _pair(a: Optional[float], b: Optional[float], nd=0) -> str:
    def f(v):  # a decimal below 100 us: the low-latency floors and gaps are tens of us
        return "-" if v is None else f"{v:.{nd if abs(v) >= 100 else max(nd, 1)}f}"
    return f"{f(a)}/{f(b)}" if b is not None else f(a)


def check_line(s: Dict) -> str:
    c = s["checks"]

    def verdict(v):
        return "n/a" if v is None else ("OK" if v else "FAIL")

    parts = [f"ep_plugin nvlink == torch backend: {verdict(c.get('ours_vs_torch_ok'))}"]
    if c.get("deepep_recv_rows") is not None:
        parts.append(f"DeepEP received rows == ours: {verdict(c.get('deepep_rows_match'))} "
                     f"(DeepEP {c['deepep_recv_rows']}, ours {c.get('ours_recv_rows')})")
    else:
        parts.append("DeepEP received rows == ours: n/a")
    for key, label in (("deepep_combine_ok", "DeepEP combine"), ("deepep_ll_combine_ok", "DeepEP low-latency combine"),
                       ("deepep_rows_equal_ours", "DeepEP rows bitwise == ours")):
        if c.get(key) is not None:
            v = c[key]
            parts.append(f"{label}: {verdict(all(v) if isinstance(v, list) else v)}")
    if c.get("ep_ll_ok") is not None:
        rows = (c.get("ep_ll") or []) + (c.get("ep_ll_ring") or [])
        bad = sorted({k for r in rows for k, v in r.items() if not v})
        errors = [c[k] for k in ("ep_ll_error", "ep_ll_ring_error") if c.get(k)]
        parts.append(f"ep_plugin low-latency == contract: {verdict(c['ep_ll_ok'])}"
                     + (f" (failed: {', '.join(bad)})" if bad else "")
                     + (f" ({'; '.join(errors)})" if errors else ""))
    return "   check: " + "; ".join(parts)


def format_table(summaries: List[Dict]) -> str:
    lines = []
    for s in summaries:
        w = max([44] + [len(r["path"]) + 2 for r in s["rows"]])
        tr = s["traffic"]
        lines.append(f"== {s['case']} EP{s['world']}: {s['tokens_per_rank']} tok/rank, {s.get('routing')} routing, "
                     f"{s.get('num_sms')} SMs; rows received max {tr['rows_received_max']} "
                     f"({tr['bytes_logical_bf16'] / 1e6:.1f} MB BF16), remote in/out max "
                     f"{tr['remote_rows_in_max']}/{tr['remote_rows_out_max']} rows")
        lines.append(f"   {'path':<{w}}{'cold disp':>10}{'cold comb':>10}{'queued disp':>12}{'queued comb':>12}"
                     f"{'GB/s d/c':>11}{'floor d/c':>13}{'gap d/c':>13}")
        notes = []
        for r in s["rows"]:
            d, c = r["dispatch"], r["combine"]
            gb = _pair(d and d["logical_GBps_cold"], c and c["logical_GBps_cold"]) if not r["error"] else "-"
            fl = _pair(d and d["floor_us"], c and c["floor_us"])
            gap = _pair(d and d.get("gap_us"), c and c.get("gap_us")) if not r["error"] else "-"
            lines.append(f"   {r['path']:<{w}}{_us(d, 'cold_us'):>10}{_us(c, 'cold_us'):>10}{_us(d, 'queued_us'):>12}"
                         f"{_us(c, 'queued_us'):>12}{gb:>11}{fl:>13}{gap:>13}")
            if r["error"] and r["error"] not in notes:
                notes.append(r["error"])
        if s["case"] != "sm_sweep":
            lines.append(check_line(s))
        if tr.get("remote_copies_out_per_rank") and any(r["floor_kind"] != "rank" for r in s["rows"]):
            ll = tr["floor_us"]
            cout, cin = max(tr["remote_copies_out_per_rank"]), max(tr.get("remote_copies_in_per_rank") or [0])
            lines.append(f"   low-latency floors: remote copies out/in max {cout}/{cin} (one per token and expert) "
                         f"at {NVLINK_GBPS:.0f} GB/s + {LAUNCH_US:.0f} us launch: dispatch BF16 "
                         f"{_pair(ll.get('ll_dispatch_bf16'), None)}, FP8 {_pair(ll.get('ll_dispatch_fp8'), None)}, "
                         f"combine {_pair(ll.get('ll_combine_bf16'), None)} us; a recv half: {LAUNCH_US:.0f} us"
                         + (f"; ep_plugin engine: {s['ll_engine']}" if s.get("ll_engine") else ""))
        for n in notes:
            lines.append(f"   note: {n[:220]}")
        if s.get("breakdown_rank0_us"):
            lines.append(f"   kernels (rank 0, us/call): {json.dumps(s['breakdown_rank0_us'])}")
    lines.append("us: slowest rank's median (cold call / queued protocols, DESIGN.md); GB/s: DeepEP's logical "
                 "bandwidth, cold; floor: remote bytes of the busiest GPU at 478 GB/s (low-latency rows: one copy per "
                 "token and expert, + one launch); gap: cold - floor")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- JSON, meta
def git_commit(tree: str) -> Dict:
    """HEAD of the git checkout that `tree` is the top of (not of a repository it merely sits inside),
    else $EP_COMMIT, else "unknown"."""
    def git(*a):
        return subprocess.check_output(["git", "-C", tree, *a], text=True, stderr=subprocess.DEVNULL,
                                       timeout=10).strip()
    try:
        top = git("rev-parse", "--show-toplevel")
        if os.path.realpath(top) == os.path.realpath(tree):
            dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
            return {"commit": git("rev-parse", "HEAD"), "commit_source": "git", "commit_dirty": dirty}
    except Exception:
        pass
    env = os.environ.get("EP_COMMIT")
    if env:
        return {"commit": env, "commit_source": "env EP_COMMIT", "commit_dirty": None}
    return {"commit": "unknown", "commit_source": None, "commit_dirty": None}


def cpu_name() -> str:
    """The host CPU's model name (host-overhead benchmarks report where their Python ran)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "this CPU"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def document(label: str, meta: Dict, summaries: List[Dict]) -> Dict:
    return {"schema": SCHEMA, "label": label, "meta": meta, "cases": summaries}


def write_json(path: str, doc: Dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)  # a reader (or a kill) never sees half a file


# ---------------------------------------------------------------------------------- plot
def plot(summaries: List[Dict], path: str) -> Optional[str]:
    """Bars per row: cold/queued x dispatch/combine. Returns why there is no plot, or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not available"
    shown = [s for s in summaries if s["rows"]]
    if not shown:
        return "no rows"
    fig, axes = plt.subplots(len(shown), 1, figsize=(11, 1.2 + 0.55 * sum(len(s["rows"]) for s in shown)),
                             squeeze=False)
    series = (("dispatch", "cold_us", "dispatch, cold"), ("combine", "cold_us", "combine, cold"),
              ("dispatch", "queued_us", "dispatch, queued"), ("combine", "queued_us", "combine, queued"))
    for ax, s in zip(axes[:, 0], shown):
        rows = s["rows"][::-1]
        ys = range(len(rows))
        h = 0.2
        for i, (side, key, label) in enumerate(series):
            vals = [((r[side] or {}).get(key) or 0) for r in rows]
            ax.barh([y + (1.5 - i) * h for y in ys], vals, h, label=label)
        ax.set_yticks(list(ys))
        ax.set_yticklabels([r["path"] + ("" if r["status"] == "ok" else f" ({r['status']})") for r in rows], fontsize=7)
        ax.set_xlabel("us (slowest rank, median)")
        ax.set_title(f"{s['case']}, EP{s['world']}, {s['tokens_per_rank']} tok/rank", fontsize=9)
        fl = s["traffic"]["floor_us"]["dispatch_bf16"]
        if fl:
            ax.axvline(fl, color="k", ls=":", lw=1, label="BF16 floor")
        ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
