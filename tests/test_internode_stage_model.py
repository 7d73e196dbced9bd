"""The stage model of our internode calls (ep_plugin/plan/stage_model.py): fitted from a timeline JSON
in the layout benchmarks/internode_device.sh writes, it gives back the measured stages at the shape it
was fitted on, predicts the other shapes, and renders its tables."""
import dataclasses
import json
import pathlib

import pytest

from ep_plugin.plan import stage_model as sm


def _bench(world, P, stages, cold):
    per_rank = {kind: {s: {"gpu_us": us, "host_us": 5.0} for s, us in st.items()} for kind, st in stages.items()}
    slower = {kind: {s: {"gpu_us": us * 1.1, "host_us": 5.0} for s, us in st.items()} for kind, st in stages.items()}
    ops = {op: {"cold_us": [v * 0.95, v], "queued_us": [v, v]} for op, v in cold.items()}
    return {"meta": {"world": world, "ranks_per_node": P, "tokens": 4096, "hidden": 7168, "num_experts": 256,
                     "topk": 8, "device": "test", "date": "today", "commit": "abc"},
            "rows": [{"case": "uniform", "ops": ops, "timeline": [per_rank, slower] + [per_rank] * (world - 2)}]}


STAGES_22 = {"dispatch": {"rail_send": 400.0, "rail_recv": 40.0, "layout": 30.0, "forward": 500.0, "reorder": 300.0,
                          "counts": 20.0},
             "dispatch_cached": {"rail_send": 400.0, "rail_recv": 40.0, "forward": 350.0, "reorder": 250.0},
             "combine": {"reorder": 250.0, "reduce_in_node": 400.0, "rail_send": 350.0, "rail_recv_sum": 150.0}}
DOC = {"bench": {"2x2": _bench(4, 2, STAGES_22, {"nvshmem.dispatch_bf16": 1400.0, "nvshmem.dispatch_cached": 1100.0,
                                                 "nvshmem.combine_bf16": 1200.0}),
                 "2x1": _bench(2, 1, {}, {"nvshmem.dispatch_bf16": 900.0, "nvshmem.combine_bf16": 700.0})},
       "tests": {}}


def test_fit_gives_back_the_measured_stages():
    costs = sm.costs_from_bench(DOC)
    assert not costs.placeholder and "2x2 uniform timeline" in costs.source
    shape = sm._shape_of(DOC["bench"]["2x2"])
    for kind, stages in STAGES_22.items():
        pred = sm.predict_ours(shape, costs, kind, reorder=True)  # a timeline with the reorder pass
        for stage, us in stages.items():  # three ranks at 1x (the median), one at 1.1x: the one that waited
            want = us * 1.1 if stage == sm.WAIT_STAGE[kind] else us
            assert pred[stage] == pytest.approx(want, rel=2e-3), (kind, stage)
    assert costs.dispatch["layout"] == ("fixed", 30.0) and costs.dispatch["rail_send"][0] == "rate"
    assert costs.dispatch["rail_recv"] == ("fixed", 40.0) and costs.wait["dispatch"] == 2.0  # 4 us over log2(4)


def test_the_wait_grows_with_log2_of_the_ranks():
    costs = sm.costs_from_bench(DOC)
    at = {W: sm.start_wait(costs, "combine", W) for W in (1, 2, 4, 64)}
    assert at[1] == 0.0 and at[4] == pytest.approx(15.0) and at[2] == pytest.approx(7.5) and at[64] == pytest.approx(45.0)
    p21 = sm.predict_ours(sm._shape_of(DOC["bench"]["2x1"]), costs, "combine")
    assert p21["rail_recv_sum"] == pytest.approx(150.0 + 7.5, rel=2e-3)  # same bytes as 2x2, half its wait


def test_check_predicts_both_shapes():
    costs = sm.costs_from_bench(DOC)
    rows = sm.check(DOC, costs)
    shapes = {(r["shape"], r["op"]) for r in rows}
    assert ("2x1", "dispatch") in shapes and ("2x2", "combine") in shapes
    r22 = next(r for r in rows if r["shape"] == "2x2" and r["op"] == "dispatch")
    assert r22["predicted_us"] == round(sum(STAGES_22["dispatch"].values()) + 0.1 * STAGES_22["dispatch"]["rail_recv"])
    r21 = next(r for r in rows if r["shape"] == "2x1" and r["op"] == "dispatch")
    p21 = sm.predict_ours(sm._shape_of(DOC["bench"]["2x1"]), costs)
    assert 0 < r21["predicted_us"] and "reorder" not in p21
    # the one-rank node's gather over its 2 * 4096 slots runs at the reorder's copy rate
    gather_bytes = 2.0 * 2 * 4096 * 7168 * 2
    assert p21["forward"] == pytest.approx(gather_bytes / (costs.dispatch["reorder"][1] * 1e3))


def test_cluster_table_and_cli(tmp_path, capsys):
    costs = sm.costs_from_bench(DOC)
    rows = sm.cluster_table(costs, "h800-cx7")
    assert [r["ep"] for r in rows] == [16, 32, 64]
    assert all(r["dispatch_overlapped_us"] <= r["dispatch_us"] for r in rows)
    assert rows[0]["deepep_us"] is not None and rows[2]["rdma_mb_node_limited"] < rows[2]["rdma_mb_uniform"]
    path = tmp_path / "internode.json"
    path.write_text(json.dumps(DOC))
    assert sm.main(["--from", str(path)]) == 0
    out = capsys.readouterr().out
    assert "on-host check" in out and "| 64 |" in out and "PLACEHOLDER" not in out
    assert sm.main(["--from", str(path), "--emit"]) == 0
    text = capsys.readouterr().out
    ns = {"StageCosts": sm.StageCosts}
    exec(text, ns)
    assert ns["MEASURED_2X2"].dispatch == costs.dispatch


def test_timeline_tables(tmp_path, capsys):
    path = tmp_path / "internode.json"
    path.write_text(json.dumps(DOC))
    assert sm.main(["--from", str(path), "--timeline"]) == 0
    out = capsys.readouterr().out
    assert "| dispatch | rail_send 440 (5)" in out and "sum 1419" in out and "cold 1400" in out


def test_placeholder_is_marked(capsys, monkeypatch):
    assert not sm.MEASURED_2X2.placeholder and "2x2 uniform timeline" in sm.MEASURED_2X2.source
    sm.main([])
    assert "PLACEHOLDER" not in capsys.readouterr().out
    monkeypatch.setattr(sm, "MEASURED_2X2", dataclasses.replace(sm.MEASURED_2X2, placeholder=True))
    sm.main([])
    assert "PLACEHOLDER" in capsys.readouterr().out


RESULTS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "results"
SESSION_8 = {label: f"internode_{label}_now_h100x4_2026-11-27_s8call4.json" for label in ("2x2", "2x1")}


def test_session_8_costs_are_its_timelines_fit_within_15_percent():
    """Issue 30's target, guarded: SESSION_8_2X2 is what session 8's committed 2x2 timeline gives, and with it
    every cold call of the two committed shapes (dispatch, cached dispatch, combine) is within 15%."""
    doc = {"bench": {label: json.loads((RESULTS / name).read_text()) for label, name in SESSION_8.items()}}
    fitted = sm.costs_from_bench(doc)
    for kind in ("dispatch", "dispatch_cached", "combine"):
        assert getattr(fitted, kind) == getattr(sm.SESSION_8_2X2, kind), kind
    assert fitted.wait == sm.SESSION_8_2X2.wait
    rows = sm.check(doc, sm.SESSION_8_2X2)
    assert {(r["shape"], r["op"]) for r in rows} == {(s, op) for s in SESSION_8
                                                       for op in ("dispatch", "dispatch_cached", "combine")}
    for r in rows:
        assert abs(r["error"]) < 0.15, r


SESSION_10 = {  # 2x2 runs of the cached / fresh dispatch in contract order and of the paths before, back to back
    "2x2 cached now": "internode_2x2_cached_now_h100x4_2026-11-27_s10call3.json",
    "2x2 cached before": "internode_2x2_cached_before_h100x4_2026-11-27_s10call3.json",
    "2x2 fresh now": "internode_2x2_fresh_direct_h100x4_2026-11-27_s10call4.json",
    "2x2 fresh before": "internode_2x2_fresh_before_h100x4_2026-11-27_s10call4.json",
}


def test_the_model_follows_the_dispatches_in_contract_order():
    """Session 10's 2x2 runs (no timeline: the model is not refitted on them): with session 8's costs, a run whose
    dispatch writes the contract's order is predicted without the reorder stage and one on the path before with it
    (runs_reorder reads which from the run's meta), and every cold call is within 15%; the reorder stage is what the
    two predictions differ by."""
    docs = {label: json.loads((RESULTS / name).read_text()) for label, name in SESSION_10.items()}
    assert [sm.runs_reorder(docs[k]["meta"], "dispatch_cached") for k in docs] == [False, True, False, False]
    assert [sm.runs_reorder(docs[k]["meta"], "dispatch") for k in docs] == [True, True, False, True]
    rows = sm.check({"bench": docs}, sm.SESSION_8_2X2)
    assert len(rows) == 12  # dispatch, cached dispatch, combine in each run
    for r in rows:
        assert abs(r["error"]) < 0.15, r
    shape = sm.Shape(2, 2, 4096, 4096, 7168)
    for kind in ("dispatch", "dispatch_cached"):
        now = sm.predict_ours(shape, sm.SESSION_8_2X2, kind)
        before = sm.predict_ours(shape, sm.SESSION_8_2X2, kind, reorder=True)
        assert "reorder" not in now and before["reorder"] > 0
        assert before["total"] - now["total"] == pytest.approx(before["reorder"])


SESSION_11 = "internode_2x2_2x1_timeline_h100x4_2026-11-27_s11call2.json"  # internode_device.sh bench22,bench21
SESSION_11_PULLED = {"2x2": "internode_2x2_default_h100x4_2026-11-27_s11call5.json",   # the pulled combine, the default
                     "2x1": "internode_2x1_pull_h100x4_2026-11-27_s11call5.json"}
SESSION_12_P1 = "internode_2x1_timeline_h200x2_2026-11-27_s12call1.json"  # the pulled combine's P = 1 terms


def test_session_11_costs_are_its_timelines_fit_within_15_percent():
    """Issue 30's target on 4x H100, guarded: SESSION_11_2X2 is what session 11's committed timelines give -- the dispatches from
    call 2's (no reorder stage at 2x2; the one-rank node's gather from the 2x1 timeline of the same run), the combine
    from call 5's (the pulled combine, the default), the pulled combine's P = 1 terms (its send half, a local copy no
    2x2 stage measures) from session 12's 2x1 timeline -- and with it the cold calls of call 5's runs of the default
    paths are within 15% (the 2x1 combine was +18% without the P = 1 terms), call 2's dispatches and session 12's
    2x1 run too."""
    call2 = json.loads((RESULTS / SESSION_11).read_text())
    call5 = {"bench": {label: json.loads((RESULTS / name).read_text()) for label, name in SESSION_11_PULLED.items()}}
    fitted, pulled = sm.costs_from_bench(call2), sm.costs_from_bench(call5)
    for kind in ("dispatch", "dispatch_cached"):
        assert getattr(fitted, kind) == getattr(sm.SESSION_11_2X2, kind), kind
        assert fitted.wait[kind] == sm.SESSION_11_2X2.wait[kind]
    p1 = ("send_local", "local_reduce")
    assert pulled.combine == {k: v for k, v in sm.SESSION_11_2X2.combine.items() if k not in p1}
    assert pulled.wait["combine"] == sm.SESSION_11_2X2.wait["combine"]
    s12 = json.loads((RESULTS / SESSION_12_P1).read_text())
    assert sm.local_combine_terms(s12) == {k: sm.SESSION_11_2X2.combine[k] for k in p1}
    assert sm.local_combine_terms(call5) == {}  # call 5's 2x1 run had no timeline
    pushed = json.loads((RESULTS / SESSION_12_P1).read_text())
    pushed["meta"]["pull_combine"] = False  # a run that says its combine pushed gives no P = 1 pulled terms
    assert sm.local_combine_terms(pushed) == {}
    assert "reorder" not in sm.SESSION_11_2X2.dispatch and "gather" in sm.SESSION_11_2X2.dispatch
    rows = sm.check(call5, sm.SESSION_11_2X2)
    assert {(r["shape"], r["op"]) for r in rows} == {(s, op) for s in ("2x1", "2x2")
                                                       for op in ("dispatch", "dispatch_cached", "combine")}
    for r in rows + sm.check(s12, sm.SESSION_11_2X2):
        assert abs(r["error"]) < 0.15, r
    for r in sm.check(call2, sm.SESSION_11_2X2):
        if r["op"] != "combine":  # call 2's combine was the pushed one
            assert abs(r["error"]) < 0.15, r
    # without a P = 1 timeline the one-rank gather has no rate: the fit says so by leaving it out
    alone = sm.costs_from_bench({"bench": {"2x2": call2["bench"]["2x2"]}})
    assert "gather" not in alone.dispatch


SESSION_17 = "internode_h200x4_2026-11-27_s17call4.json"  # 2x2 and 2x1 timelines of one call (4x H200)
SESSION_17_2X1 = "internode_2x1_timeline_h200x4_2026-11-27_s17call4.json"


def test_measured_costs_are_session_17s_fit_and_predict_both_shapes_within_15_percent():
    """Issue 30's target on 4x H200, guarded: MEASURED_2X2 (what the docs' tables come from) is the fit of session 17's
    2x2 timeline with the gather and the pulled combine's P = 1 terms from the 2x1 timeline of the same call, and it
    predicts that call's six cold calls (2x1, 2x2; dispatch, cached, combine) within 15%."""
    doc = json.loads((RESULTS / SESSION_17).read_text())
    assert sm.default_label(doc) == "2x2"
    fitted = sm.costs_from_bench(doc)
    terms = sm.local_combine_terms(doc)
    assert set(terms) == {"send_local", "local_reduce"}
    assert terms == sm.local_combine_terms(json.loads((RESULTS / SESSION_17_2X1).read_text()))
    for kind in ("dispatch", "dispatch_cached"):
        assert getattr(fitted, kind) == getattr(sm.MEASURED_2X2, kind), kind
    assert {**fitted.combine, **terms} == sm.MEASURED_2X2.combine
    assert fitted.wait == sm.MEASURED_2X2.wait
    rows = sm.check(doc, sm.MEASURED_2X2)
    assert {(r["shape"], r["op"]) for r in rows} == {(sh, op) for sh in ("2x1", "2x2")
                                                       for op in ("dispatch", "dispatch_cached", "combine")}
    for r in rows:
        assert abs(r["error"]) < 0.15, r


def test_cli_fits_a_lone_bench_and_takes_p1_terms_from_it(capsys):
    """`--from` a JSON with one 2x1 bench fits it without --label, and its own one-rank timeline prices the P = 1
    combine (without those terms the check read +22% for session 17's 2x1 combine)."""
    path = RESULTS / SESSION_17_2X1
    assert sm.default_label(json.loads(path.read_text())) == "2x1"
    assert sm.main(["--from", str(path)]) == 0
    out = capsys.readouterr().out
    assert "send_local" in out and "local_reduce" in out
    lines = [ln for ln in out.splitlines() if ln.strip().startswith("2x1 combine")]
    assert lines and "+21.9%" not in lines[0]
    err = float(lines[0].rsplit("(", 1)[1].rstrip("%)")) / 100
    assert abs(err) < 0.15
