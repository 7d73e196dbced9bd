"""A model of ep_plugin's own internode calls, stage by stage, fed by what the stage timeline measured
(docs/COST_MODEL.md, "Our kernels, stage by stage").

cost_model.py models the kernel DeepEP ships (the rail and the NVLink forwarding pipelined, a call as
long as its slowest stage). Our calls today run their stages one after another on one stream
(hierarchical/timeline.py names them), so here a call is the sum of its stages:

    dispatch  rail_send + rail_recv + layout + forward + reorder + counts   (the path before session 10)
    dispatch  rail_send + rail_recv + layout + forward + counts             (now: at P > 1 the inner pull writes
              the contract's order itself, fresh and cached: no reorder pass; runs_reorder reads which a run had)
    combine   reorder + reduce_in_node + rail_send + rail_recv_sum       (the path before session 8)
    combine   reduce_in_node + rail_send + rail_recv_sum                 (now: no reorder; at P > 1 the inner
              combine stores each node's sum at its origin and the rail only signals; at P = 1 the rail's
              send reads x through the slot index, so there is no gather)

A stage is either fixed (µs: waits, small kernels, host launches) or moves bytes at a rate fitted from
the measurement (GB/s, fixed costs folded in). Bytes per GPU come from the routing's fan-out
(cost_model.fanout: nodes and GPUs a token reaches) and the buffer shapes:

    rail_send        T * nodes_per_token * row   (across hosts: the remote share crosses the NIC, and the
                                                  stage takes max(NIC time, the measured rate's time))
    forward (P > 1)  T * ranks_per_token * row   the nvlink backend's exchange inside the node (rate scaled
                                                  by the target's NVLink GB/s over the measured host's)
    forward (P = 1)  2 * N*M * row               the one-rank node's gather over every slot (a local copy: priced
                                                  at the reorder's rate in fits that have one, else at the
                                                  "gather" rate of a P = 1 run's timeline in the same JSON)
    reorder          2 * P*N*M * row             a copy over the inner output's worst-case rows
    reduce_in_node   T * ranks_per_token * row   (P = 1: the gather back to slots, 2 * N*M * row)
    rail_recv_sum    T * (nodes_per_token + 1) * row

The call measured (the cold call, slowest rank) is the rank that started first: it runs every stage as any
rank does and, at its first wait for its peers (dispatch: rail_recv, combine: rail_recv_sum), also waits out
the later ranks' start. So a stage costs what the typical rank (median over ranks) spends in it, and the call
adds one start-skew wait, θ * log2(ranks) µs, in that stage:

    wait             θ[kind] * log2(W)            W = N*P ranks; 0 for one rank (nobody to wait for)

In the session-8 timelines every other rank spends the same 22 (dispatch) / 12 (cached) / 181 (combine) µs
in that stage at 2x1 and 2x2, and the slowest cold call is the waiting rank's in all six rows. Rail bytes,
rail peers (N = 2) and tokens are the same at 2x1 and 2x2, so they cannot be what moves the stage; the ranks
whose start spreads are (2 and 4). The growth in W is assumed: log2 and W both fit 2x1 from 2x2 (W: 2 -> 4);
between them log2 is the slow growth of the spread of W start times, W would be ranks started one by one.

`costs_from_bench(doc)` fits the stages from `benchmarks/internode_device.sh`'s internode.json (or one
bench_internode JSON): the 2x2 row's timeline, the median rank per stage; at the wait's stage the fastest
rank's (no wait) and θ from the slowest's excess. `check(doc, costs)` predicts the 2x1 and 2x2 cold-call
times from them beside what was measured; `cluster_table()` predicts EP16/32/64.

    python -m ep_plugin.plan.stage_model --from results/internode_2026-11-26.json

MEASURED_2X2 below holds the fitted stage costs that the docs quote (session 17's 2x2 and 2x1 timelines on 4x
H200, 2026-11-27); SESSION_11_2X2 session 11's on 4x H100; SESSION_8_2X2 those of the paths before session 10 (with
the dispatches' reorder pass).
A StageCosts with placeholder=True (none now) is marked so in every table printed from it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .cost_model import DEEPEP_H800_CX7, HARDWARE, Fanout, Hardware, fanout, predict, row_bytes

DISPATCH_STAGES = ("rail_send", "rail_recv", "layout", "forward", "reorder", "counts")
CACHED_STAGES = ("rail_send", "rail_recv", "forward", "reorder")
COMBINE_STAGES = ("reorder", "reduce_in_node", "rail_send", "rail_recv_sum")
FIXED = ("rail_recv", "layout", "counts")   # stages with no byte term
# where the rank that started first waits out the others' start: its first wait for its peers (the timelines
# of session 8 show the excess there and nowhere else on that rank)
WAIT_STAGE = {"dispatch": "rail_recv", "dispatch_cached": "rail_recv", "combine": "rail_recv_sum"}
MEASURED_NVLINK_GBPS = 478.0                 # the measuring hosts' NVLink (H200; H100 SXM has the same 18 NVLink 4
                                             # links): forward rates scale from it


@dataclass(frozen=True)
class StageCosts:
    """Per call kind, per stage: ("fixed", µs) or ("rate", GB/s); wait: per call kind, θ of the start-skew
    wait (µs per doubling of the ranks, added to WAIT_STAGE[kind]; module docstring)."""

    dispatch: Dict[str, Tuple[str, float]]
    dispatch_cached: Dict[str, Tuple[str, float]]
    combine: Dict[str, Tuple[str, float]]
    source: str
    placeholder: bool = False
    measured: Dict[str, Dict[str, float]] = field(default_factory=dict)  # shape -> {op: cold µs}
    wait: Dict[str, float] = field(default_factory=dict)


# Fitted from session 11's device runs (4x H100, 2026-11-27; `python -m ep_plugin.plan.stage_model --from <JSON>
# --emit` on each, then the two tables joined): the dispatches from call 2's timeline (08:43 UTC, commit 4ad842f: both
# dispatches in the contract's order, no reorder stage at P > 1; the one-rank node's gather ("gather") from the 2x1
# timeline of that run, since no 2x2 stage copies any more; results/internode_2x2_2x1_timeline_h100x4_2026-11-27_s11call2.json),
# the combine from call 5's (09:19 UTC, the pulled combine, the default since; results/internode_2x2_default_h100x4_
# 2026-11-27_s11call5.json). Each stage the median rank's, the start-skew wait apart. The pulled combine's P = 1 terms
# (send_local: its send half, a copy into the rank's own rail rows; local_reduce: the stage that moves nothing at P = 1)
# from session 12's 2x1 timeline (2x H200, 10:34 UTC, commit 24a9261; results/internode_2x1_timeline_h200x2_2026-11-27_
# s12call1.json): no H100 was lent for it, so an H200's local copy rate stands in. Kept beside MEASURED_2X2 (the H100
# costs; tests/test_internode_stage_model.py pins both fits).
SESSION_11_2X2 = StageCosts(
    dispatch={'rail_send': ('rate', 459.7), 'rail_recv': ('fixed', 24.0), 'layout': ('fixed', 3.3), 'forward': ('rate', 375.7), 'counts': ('fixed', 8.4), 'gather': ('rate', 2186.0)},
    dispatch_cached={'rail_send': ('rate', 433.3), 'rail_recv': ('fixed', 11.8), 'forward': ('rate', 518.8), 'gather': ('rate', 2535.1)},
    combine={'reduce_in_node': ('rate', 356.8), 'rail_send': ('rate', 9072.1), 'rail_recv_sum': ('rate', 826.3),
             'send_local': ('rate', 658.0), 'local_reduce': ('fixed', 22.7)},
    wait={'dispatch': 27.9, 'dispatch_cached': 15.2, 'combine': 34.8},
    source='NVIDIA H100 80GB HBM3, 2026-11-27, commit 4ad842f (dispatches, 08:43 UTC) and the pulled combine of 10274e6 '
           '(09:19 UTC), 2x2 uniform timelines; the P = 1 combine terms from a 2x1 timeline on 2x H200 (session 12, '
           '10:34 UTC, 24a9261)')

# Fitted from session 17's device run (4x H200, 2026-11-27 19:50 UTC, the tree of b17bab8 -- internode code as in
# 49739af, the inner pull combine starting together -- `bench_internode.py --timeline 10` at 2x2 and at 2x1 in one call;
# results/internode_h200x4_2026-11-27_s17call4.json holds both): the 2x2 timeline's stages, the one-rank node's gather
# and the pulled combine's P = 1 terms (send_local, local_reduce) from the 2x1 timeline of the same call
# (`python -m ep_plugin.plan.stage_model --from <it> --emit`). The start-skew waits are smaller than session 11's
# (6.7 / 13.6 / 11.8 us against 27.9 / 15.2 / 34.8): the inner combine's ranks start together since session 16.
MEASURED_2X2 = StageCosts(
    dispatch={'rail_send': ('rate', 466.8), 'rail_recv': ('fixed', 19.8), 'layout': ('fixed', 2.9), 'forward': ('rate', 411.7), 'counts': ('fixed', 10.6), 'gather': ('rate', 2712.3)},
    dispatch_cached={'rail_send': ('rate', 510.7), 'rail_recv': ('fixed', 9.8), 'forward': ('rate', 504.6), 'gather': ('rate', 3246.5)},
    combine={'reduce_in_node': ('rate', 405.6), 'rail_send': ('rate', 11821.3), 'rail_recv_sum': ('rate', 839.3),
             'send_local': ('rate', 681.0), 'local_reduce': ('fixed', 17.4)},
    wait={'dispatch': 6.7, 'dispatch_cached': 13.6, 'combine': 11.8},
    source='NVIDIA H200, 2026-11-27 19:50 UTC, the tree of b17bab8 (internode as in 49739af), 2x2 uniform timeline; the '
           'gather and the P = 1 combine terms from the 2x1 timeline of the same call')

# Session 8's fit (4x H100, 2026-11-27 01:01 UTC, main after branch inter8: the combine that places its sums, the
# dispatches still with their reorder pass; results/internode_2x2_now_h100x4_2026-11-27_s8call4.json): the costs of
# the paths before session 10 (its reorder rates price `reorder=True`), kept for the A/B runs of sessions 8-10. The
# first fit (4x H200, 2026-11-26, commit bf92bb2, the combine with its reorder and rail copy) is in docs/COST_MODEL.md.
SESSION_8_2X2 = StageCosts(
    dispatch={'rail_send': ('rate', 440.7), 'rail_recv': ('fixed', 22.4), 'layout': ('fixed', 2.9), 'forward': ('rate', 418.0), 'reorder': ('rate', 2325.0), 'counts': ('fixed', 10.1)},
    dispatch_cached={'rail_send': ('rate', 472.9), 'rail_recv': ('fixed', 11.8), 'forward': ('rate', 510.8), 'reorder': ('rate', 2747.1)},
    combine={'reduce_in_node': ('rate', 273.2), 'rail_send': ('rate', 8933.6), 'rail_recv_sum': ('rate', 970.5)},
    wait={'dispatch': 47.5, 'dispatch_cached': 35.9, 'combine': 72.9},
    source='NVIDIA H100 80GB HBM3, 2026-11-27 01:01 UTC, main after inter8 (6c713e1), 2x2 uniform timeline')


@dataclass(frozen=True)
class Shape:
    nodes: int
    per_node: int
    tokens: int          # T per GPU
    max_tokens: int      # M (comm.max_tokens_per_rank): the buffers' worst case
    hidden: int
    topk: int = 8
    num_experts: int = 256
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None


def stage_bytes(shape: Shape, kind: str, fan: Fanout, dtype: str = "bf16") -> Dict[str, float]:
    """Bytes per GPU each byte-moving stage of `kind` moves (module docstring)."""
    b = row_bytes(shape.hidden, dtype if kind != "combine" else "bf16")
    T, N, P, M = shape.tokens, shape.nodes, shape.per_node, shape.max_tokens
    rail = T * fan.nodes_per_token * b
    inner = T * fan.ranks_per_token * b if P > 1 else 2.0 * N * M * b
    if kind == "combine":
        out = {"reduce_in_node": inner, "rail_send": rail, "rail_recv_sum": T * (fan.nodes_per_token + 1) * b}
        if P > 1:
            out["reorder"] = 2.0 * P * N * M * b
        return out
    out = {"rail_send": rail, "forward": inner}
    if P > 1:
        out["reorder"] = 2.0 * P * N * M * b
    return out


def _stages(kind: str, P: int, reorder: bool = True) -> Tuple[str, ...]:
    stages = {"dispatch": DISPATCH_STAGES, "dispatch_cached": CACHED_STAGES, "combine": COMBINE_STAGES}[kind]
    return tuple(s for s in stages if (P > 1 and reorder) or s != "reorder")


def runs_reorder(meta: dict, kind: str) -> bool:
    """Whether the bench run `meta` describes had the reorder pass in its call `kind` (at P > 1): the dispatches
    write the contract's order through the inner pull since session 10 (cached: meta "cached_path" "now"; fresh:
    any "fresh_path" but "before": "now", session 10's A/B "direct", sessions 13-18's "overlap", "inside",
    "notify_first"); runs from before those keys have it. The combine's has been gone since session 8 (placed_combine)."""
    if kind == "dispatch_cached":
        return meta.get("cached_path") != "now"
    if kind == "dispatch":
        return meta.get("fresh_path") in (None, "before")
    return True


def predict_ours(shape: Shape, costs: StageCosts, kind: str = "dispatch", hw: Optional[Hardware] = None,
                 dtype: str = "bf16", overlap: bool = False, reorder: Optional[bool] = None) -> Dict[str, float]:
    """µs per stage and "total" of our call `kind` for `shape`. hw None: on one host (virtual nodes: the
    rail rides NVLink P2P at the measured rate); else the rail's remote share also crosses hw's NIC and
    the forward rate scales by hw.nvlink_gbps / MEASURED_NVLINK_GBPS. overlap: the forwarding runs
    while the rail's data arrives (what issue 30's item 2 asks for): rail_send + forward -> their max.
    reorder: whether the call has the reorder pass at P > 1; None: as the calls run now (the dispatches write
    the contract's order through the inner pull since session 10: no reorder stage; the combine's table has none)."""
    if reorder is None:
        reorder = kind == "combine"
    fan = fanout(shape.nodes, shape.per_node, shape.topk, shape.num_experts, shape.num_groups, shape.group_topk)
    table = getattr(costs, kind)
    nbytes = stage_bytes(shape, kind, fan, dtype)
    placed = kind == "combine" and placed_combine(costs)
    out: Dict[str, float] = {}
    for stage in _stages(kind, shape.per_node, reorder):
        how, v = table.get(stage, ("fixed", 0.0))
        if placed and shape.per_node == 1 and stage == "reduce_in_node":
            # the rail's send reads x through the slot index: no gather at P = 1, only what a P = 1 timeline
            # measured in the stage (its launch and the kernel's start)
            how, v = table.get("local_reduce", ("fixed", 0.0))
        elif placed and shape.per_node == 1 and stage == "rail_send":
            # the pulled combine's send half at P = 1 is a copy into this rank's own rail rows (local HBM), priced at
            # a P = 1 timeline's rate; fits without one price it as the dispatch's rail copy over P2P
            how, v = table.get("send_local", costs.dispatch["rail_send"])
        elif shape.per_node == 1 and stage in ("forward", "reduce_in_node") and _gather_key(table):
            how, v = table[_gather_key(table)]  # one-rank nodes gather their slots: a local copy (module docstring)
        if how == "fixed":
            out[stage] = v
            continue
        gbps = v
        if stage in ("forward", "reduce_in_node") and hw is not None and shape.per_node > 1:
            gbps = v * hw.nvlink_gbps / MEASURED_NVLINK_GBPS
        out[stage] = nbytes.get(stage, 0.0) / (gbps * 1e3)
        if stage == "rail_send" and hw is not None:
            wire = shape.tokens * fan.remote_nodes_per_token * row_bytes(shape.hidden, dtype if kind != "combine" else "bf16")
            out[stage] = max(out[stage], wire / (hw.nic_gb_per_s * 1e3))
    out[WAIT_STAGE[kind]] = out.get(WAIT_STAGE[kind], 0.0) + start_wait(costs, kind, shape.nodes * shape.per_node)
    if overlap:
        fwd = "forward" if kind != "combine" else "reduce_in_node"
        pair = max(out.get("rail_send", 0.0), out.get(fwd, 0.0))
        out["overlapped"] = pair - out.get("rail_send", 0.0) - out.get(fwd, 0.0)
    out["total"] = sum(out.values())
    return out


def start_wait(costs: StageCosts, kind: str, ranks: int) -> float:
    """µs the rank that started first waits for the others' start in a call `kind` of `ranks` ranks."""
    return costs.wait.get(kind, 0.0) * math.log2(max(ranks, 1))


def placed_combine(costs: StageCosts) -> bool:
    """Whether `costs` were fitted on the combine that places its sums (no reorder stage in its timeline): its
    rail_send is a signal at P > 1, and a one-rank node neither gathers nor reorders."""
    return "reduce_in_node" in costs.combine and "reorder" not in costs.combine


# ---------------------------------------------------------------------------------------- ingest

def _bench_docs(doc: dict) -> Dict[str, dict]:
    """{label: bench_internode JSON} from internode.json ({"bench": {...}}) or one bench JSON."""
    if "bench" in doc:
        return doc["bench"]
    label = f"{doc['meta']['world'] // doc['meta']['ranks_per_node']}x{doc['meta']['ranks_per_node']}"
    return {label: doc}


def _shape_of(bench: dict, case: str = "uniform") -> Shape:
    m = bench["meta"]
    nodes = m["world"] // m["ranks_per_node"]
    groups = (nodes, 1) if case == "node_limited" else (None, None)
    return Shape(nodes, m["ranks_per_node"], m["tokens"], m["tokens"], m["hidden"], m["topk"], m["num_experts"],
                 *groups)


def _row(bench: dict, case: str = "uniform") -> dict:
    for r in bench["rows"]:
        if r["case"] == case:
            return r
    raise ValueError(f"no {case!r} row in the bench JSON")


def typical_stages(row: dict) -> Tuple[Dict[str, Dict[str, float]], Dict[str, float]]:
    """({kind: {stage: GPU µs}}, {kind: wait µs}): per stage the median rank's median; at WAIT_STAGE[kind] the
    fastest rank's (it waited for no one) and, apart, the slowest rank's excess over it (module docstring)."""
    per: Dict[str, Dict[str, List[float]]] = {}
    for per_rank in row["timeline"]:
        for kind, stages in per_rank.items():
            for stage, v in stages.items():
                if stage != "total" and v.get("gpu_us") is not None:
                    per.setdefault(kind, {}).setdefault(stage, []).append(float(v["gpu_us"]))
    out: Dict[str, Dict[str, float]] = {}
    waits: Dict[str, float] = {}
    for kind, stages in per.items():
        out[kind] = {stage: statistics.median(vals) for stage, vals in stages.items()}
        at = WAIT_STAGE.get(kind)
        if at in stages:
            out[kind][at] = min(stages[at])
            waits[kind] = max(stages[at]) - min(stages[at])
    return out, waits


def measured_cold(bench: dict, case: str = "uniform") -> Dict[str, float]:
    """{op: slowest rank's cold median µs} of the bench row."""
    out = {}
    for op, m in _row(bench, case)["ops"].items():
        if m.get("cold_us"):
            out[op] = max(m["cold_us"])
    return out


def _gather_key(table: Dict[str, Tuple[str, float]]) -> Optional[str]:
    """The entry that prices a one-rank node's gather over its slots: "gather" (fitted on a P = 1 timeline since
    the P > 1 calls lost their reorder pass, session 10) or, in fits from before, the reorder's copy rate."""
    return "gather" if "gather" in table else ("reorder" if "reorder" in table else None)


def _one_rank_runs(benches: Dict[str, dict], case: str):
    """(bench meta, shape, fan-out, typical stages) of each bench of one-rank nodes that has a timeline."""
    for bench in benches.values():
        shape = _shape_of(bench, case)
        row = _row(bench, case)
        if shape.per_node == 1 and row.get("timeline"):
            fan = fanout(shape.nodes, 1, shape.topk, shape.num_experts, shape.num_groups, shape.group_topk)
            yield bench["meta"], shape, fan, typical_stages(row)[0]


def _gather_rate(benches: Dict[str, dict], kind: str, case: str) -> Optional[float]:
    """GB/s of the one-rank node's gather (the forward stage at P = 1: 2 * N*M rows) in the first bench of
    one-rank nodes that has a timeline, else None."""
    for _, shape, fan, stages in _one_rank_runs(benches, case):
        us = stages.get(kind, {}).get("forward")
        if us:
            return round(stage_bytes(shape, kind, fan)["forward"] / (us * 1e3), 1)
    return None


def local_combine_terms(doc: dict, case: str = "uniform") -> Dict[str, Tuple[str, float]]:
    """The pulled combine's terms at one-rank nodes from the first bench of one-rank nodes with a timeline in
    doc whose combine pulled: "send_local" (GB/s of its rail send, a copy into its own rail rows) and
    "local_reduce" (µs in the reduce_in_node stage, which moves no bytes at P = 1); {} without such a bench.
    A run that says it pushed (meta pull_combine false, bench_internode since session 12) is skipped; for runs
    from before that key the caller vouches that the combine pulled (those before session 11 pushed)."""
    for meta, shape, fan, stages in _one_rank_runs(_bench_docs(doc), case):
        comb = stages.get("combine", {})
        if meta.get("pull_combine") is False or not comb.get("rail_send"):
            continue
        rate = stage_bytes(shape, "combine", fan)["rail_send"] / (comb["rail_send"] * 1e3)
        return {"send_local": ("rate", round(rate, 1)),
                "local_reduce": ("fixed", round(comb.get("reduce_in_node", 0.0), 1))}
    return {}


def default_label(doc: dict) -> str:
    """The bench `costs_from_bench` fits by default: 2x2 where doc has it, else doc's only bench (else 2x2, which
    then raises naming what doc has)."""
    benches = _bench_docs(doc)
    if "2x2" not in benches and len(benches) == 1:
        return next(iter(benches))
    return "2x2"


def costs_from_bench(doc: dict, label: str = "2x2", case: str = "uniform") -> StageCosts:
    """Stage costs fitted from the `label` bench's timeline: fixed stages as measured, byte stages as
    bytes / measured µs, each the median rank's; the start-skew wait's θ from the waiting rank's excess
    (module docstring)."""
    benches = _bench_docs(doc)
    if label not in benches:
        raise ValueError(f"no {label!r} bench in the JSON (have {sorted(benches)})")
    bench = benches[label]
    row = _row(bench, case)
    if not row.get("timeline"):
        raise ValueError(f"the {label} bench has no timeline (run bench_internode.py with --timeline N)")
    shape = _shape_of(bench, case)
    fan = fanout(shape.nodes, shape.per_node, shape.topk, shape.num_experts, shape.num_groups, shape.group_topk)
    stages, waits = typical_stages(row)
    ranks = shape.nodes * shape.per_node
    kinds = {}
    for kind in ("dispatch", "dispatch_cached", "combine"):
        nbytes = stage_bytes(shape, kind, fan)
        table = {}
        for stage, us in stages.get(kind, {}).items():
            if stage in nbytes and us > 0:
                table[stage] = ("rate", round(nbytes[stage] / (us * 1e3), 1))
            else:
                table[stage] = ("fixed", round(us, 1))
        kinds[kind] = table
    if shape.per_node > 1:
        for kind in ("dispatch", "dispatch_cached"):
            if "reorder" not in kinds[kind]:  # no P > 1 stage copies any more: the gather's rate from a P = 1 run
                rate = _gather_rate(benches, kind, case)
                if rate is not None:
                    kinds[kind]["gather"] = ("rate", rate)
    measured = {lab: measured_cold(b, case) for lab, b in benches.items()}
    commit = bench["meta"].get("commit", "?")
    wait = {kind: round(us / math.log2(ranks), 1) for kind, us in waits.items()} if ranks > 1 else {}
    return StageCosts(kinds["dispatch"], kinds["dispatch_cached"], kinds["combine"],
                      source=f"{bench['meta'].get('device', '?')}, {bench['meta'].get('date', '?')}, commit {commit}, "
                             f"{label} {case} timeline", measured=measured, wait=wait)


def check(doc: dict, costs: StageCosts, case: str = "uniform") -> List[Dict[str, object]]:
    """Predicted (on-host) against measured cold-call µs for every bench shape in doc: rows of shape,
    op, predicted, measured, error."""
    rows = []
    ops = {"dispatch": "nvshmem.dispatch_bf16", "dispatch_cached": "nvshmem.dispatch_cached",
           "combine": "nvshmem.combine_bf16"}
    for label, bench in sorted(_bench_docs(doc).items()):
        shape = _shape_of(bench, case)
        got = measured_cold(bench, case)
        for kind, op in ops.items():
            if op not in got:
                continue
            pred = predict_ours(shape, costs, kind, reorder=runs_reorder(bench["meta"], kind))["total"]
            rows.append({"shape": label, "op": kind, "predicted_us": round(pred), "measured_us": round(got[op]),
                         "error": pred / got[op] - 1})
    return rows


def cluster_table(costs: StageCosts, hardware: str = "h800-cx7", eps: Sequence[int] = (16, 32, 64),
                  tokens: int = 4096, hidden: int = 7168, gpus_per_node: int = 8) -> List[Dict[str, object]]:
    """Our dispatch (FP8) / combine at EP16/32/64 as they run today and with the forwarding overlapped (of
    which the start-skew wait, extrapolated in log2 of the ranks), DeepEP's published figures as µs, and RDMA
    bytes per rank for uniform and node-limited routing."""
    hw = HARDWARE[hardware]
    rows = []
    for ep in eps:
        N = ep // gpus_per_node
        limited = Shape(N, gpus_per_node, tokens, tokens, hidden, 8, 256, N, min(N, 4))
        uniform = Shape(N, gpus_per_node, tokens, tokens, hidden)
        fan_l = fanout(N, gpus_per_node, 8, 256, N, min(N, 4))
        fan_u = fanout(N, gpus_per_node, 8, 256)
        d = predict_ours(limited, costs, "dispatch", hw, "fp8")
        d_ov = predict_ours(limited, costs, "dispatch", hw, "fp8", overlap=True)
        c = predict_ours(limited, costs, "combine", hw)
        pipelined = predict(N, gpus_per_node, tokens, hidden, fan_l, hw, "fp8", 24)["time_us"]
        pub = DEEPEP_H800_CX7.get(ep)
        deepep = None
        if pub is not None and hardware == "h800-cx7":  # logical GB/s -> µs: T * nodes_per_token * row / GB/s
            deepep = (tokens * fan_l.nodes_per_token * row_bytes(hidden, "fp8") / (pub[0] * 1e3),
                      tokens * fan_l.nodes_per_token * row_bytes(hidden, "bf16") / (pub[1] * 1e3))
        rows.append({"ep": ep, "dispatch_us": round(d["total"]), "dispatch_overlapped_us": round(d_ov["total"]),
                     "combine_us": round(c["total"]), "pipelined_model_dispatch_us": round(pipelined),
                     "deepep_us": None if deepep is None else (round(deepep[0]), round(deepep[1])),
                     "reorder_share": d.get("reorder", 0.0) / d["total"],
                     "wait_us": (round(start_wait(costs, "dispatch", ep)), round(start_wait(costs, "combine", ep))),
                     "rdma_mb_uniform": tokens * fan_u.remote_nodes_per_token * row_bytes(hidden, "fp8") / 1e6,
                     "rdma_mb_node_limited": tokens * fan_l.remote_nodes_per_token * row_bytes(hidden, "fp8") / 1e6})
    return rows


def timeline_markdown(doc: dict, case: str = "uniform") -> str:
    """docs/INTERNODE.md's stage tables from the device JSON: per bench shape and call, each stage's
    slowest-rank median GPU µs (host µs), their sum, and the call's cold median (slowest rank)."""
    out = []
    names = {"dispatch": "nvshmem.dispatch_bf16", "dispatch_cached": "nvshmem.dispatch_cached",
             "combine": "nvshmem.combine_bf16"}
    for label, bench in sorted(_bench_docs(doc).items()):
        row = _row(bench, case)
        if not row.get("timeline"):
            continue
        cold = measured_cold(bench, case)
        flat = [cold.get(f"nvlink.{op}") for op in ("dispatch_bf16", "combine_bf16", "dispatch_cached")]
        out.append(f"{label} ({bench['meta'].get('device', '?')}, {bench['meta'].get('date', '?')}), {case}; flat nvlink "
                   f"same run, cold dispatch / combine / cached: " + " / ".join("-" if v is None else f"{v:.0f}" for v in flat))
        for kind in ("dispatch", "dispatch_cached", "combine"):
            stages = [s_ for s_ in row["timeline"][0].get(kind, {}) if s_ != "total"]
            if not stages:
                continue
            cells, gpu_sum = [], 0.0
            for st in stages:
                vals = [t[kind][st] for t in row["timeline"] if st in t.get(kind, {})]
                g = max((v["gpu_us"] or 0.0) for v in vals)
                h = max(v["host_us"] for v in vals)
                gpu_sum += g
                cells.append(f"{st} {g:.0f} ({h:.0f})")
            c = cold.get(names[kind])
            out.append(f"| {kind} | " + " | ".join(cells) + f" | sum {gpu_sum:.0f} | cold {'-' if c is None else f'{c:.0f}'} |")
    return "\n".join(out)


def emit(costs: StageCosts) -> str:
    """Python text of `costs` for MEASURED_2X2."""
    def tab(t):
        return "{" + ", ".join(f"{k!r}: ({h!r}, {v})" for k, v in [(k, v[1]) for k, v in t.items()]
                               for h in [t[k][0]]) + "}"
    return (f"MEASURED_2X2 = StageCosts(\n    dispatch={tab(costs.dispatch)},\n    dispatch_cached="
            f"{tab(costs.dispatch_cached)},\n    combine={tab(costs.combine)},\n    wait={costs.wait!r},\n"
            f"    source={costs.source!r})")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ep_plugin.plan.stage_model", description=__doc__.split("\n")[0])
    p.add_argument("--from", dest="src", default=None,
                   help="internode.json of benchmarks/internode_device.sh (or a bench_internode JSON); default: "
                        "MEASURED_2X2")
    p.add_argument("--label", default=None,
                   help="the bench whose timeline is fitted (default: 2x2, or the JSON's only bench)")
    p.add_argument("--emit", action="store_true", help="print the fitted costs as MEASURED_2X2 source text")
    p.add_argument("--timeline", action="store_true", help="print the stage tables of every bench in --from")
    p.add_argument("--p1-from", default=None, metavar="JSON",
                   help="a bench JSON with a 2x1 timeline of the pulled combine: its P = 1 terms join the fitted "
                        "combine (local_combine_terms); default: --from's own bench of one-rank nodes, if it has one")
    a = p.parse_args(argv)
    doc = None
    if a.src:
        with open(a.src) as f:
            doc = json.load(f)
        costs = costs_from_bench(doc, a.label or default_label(doc))
    else:
        costs = MEASURED_2X2
    if a.p1_from:
        with open(a.p1_from) as f:
            terms = local_combine_terms(json.load(f))
        if not terms:
            p.error(f"{a.p1_from}: no bench of one-rank nodes with a timeline")
    else:
        # a one-rank-node timeline in --from prices the P = 1 combine (without it a 2x1 check prices the pulled
        # combine's send as the dispatch's rail copy: +22% on session 17's 2x1 run)
        terms = local_combine_terms(doc) if doc is not None else {}
    if terms:
        costs = dataclasses.replace(costs, combine={**costs.combine, **terms})
    if a.emit:
        print(emit(costs))
        return 0
    if a.timeline:
        if doc is None:
            p.error("--timeline needs --from")
        print(timeline_markdown(doc))
        return 0
    mark = " -- PLACEHOLDER COSTS, NOT MEASURED" if costs.placeholder else ""
    print(f"stage costs: {costs.source}{mark}")
    for kind in ("dispatch", "dispatch_cached", "combine"):
        t = getattr(costs, kind)
        wait = f" | + wait {costs.wait[kind]:g} us x log2(ranks)" if kind in costs.wait else ""
        print(f"  {kind:16s} " + " | ".join(f"{s} {v:g} {'us' if h == 'fixed' else 'GB/s'}" for s, (h, v) in t.items())
              + wait)
    if doc is not None:
        print("on-host check (cold call, slowest rank):")
        for r in check(doc, costs):
            print(f"  {r['shape']} {r['op']:16s} predicted {r['predicted_us']:6d} us, measured {r['measured_us']:6d} us "
                  f"({r['error']:+.1%})")
    for hwname in ("h800-cx7", "h200-cx7"):
        print(f"{hwname}: our calls as they run today (stages in sequence) / with forwarding overlapped; "
              f"the pipelined model (cost_model, 24 SMs); DeepEP published (H800){mark}")
        print("| EP | dispatch fp8 us | overlapped | combine us | of which start wait disp/comb | pipelined model "
              "| DeepEP disp/comb us | reorder share | RDMA MB/rank uniform | node-limited |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in cluster_table(costs, hwname):
            dee = "-" if r["deepep_us"] is None else f"{r['deepep_us'][0]} / {r['deepep_us'][1]}"
            print(f"| {r['ep']} | {r['dispatch_us']} | {r['dispatch_overlapped_us']} | {r['combine_us']} | "
                  f"{r['wait_us'][0]} / {r['wait_us'][1]} | {r['pipelined_model_dispatch_us']} | {dee} | {r['reorder_share']:.0%} | {r['rdma_mb_uniform']:.1f} | "
                  f"{r['rdma_mb_node_limited']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
