"""comm.stats: per-call telemetry of EPBuffer (ep_plugin.telemetry).

Off, the buffer calls its backend directly and has no stats; on, each exchange (forward and
backward) is recorded: times, bytes per domain, rows per rank and per expert, timeouts. CUDA events
are read only once complete (faked here: nothing on the call's path may wait), and the reports
across ranks name the slowest rank. Real gloo groups of 2 ranks, one spawn for all of it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import ep_plugin
from ep_plugin.errors import EPTimeoutError
from ep_plugin.telemetry import CommStats, RecordingBackend, Report, collect, imbalance, log_to, training_step
from ep_plugin.telemetry import recorder as recorder_mod
from tests._dist import read_rank_results, spawn, spawn_parts, write_rank_result
from tests._need import need_installed
from tests._shared_run import DEEPSPEED_EXAMPLE_ARGS, deepspeed_example_run
from tests.fakes import RecordingMonitor

E, H, T, K = 4, 8, 6, 2


def routing(rank):
    g = torch.Generator().manual_seed(100 + rank)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[0, 1] = -1  # a slot routed nowhere
    return idx


def expected(rank, world):
    """(rows sent per destination, rows received, tokens per local expert) of one fresh dispatch."""
    def sent_by(src):
        idx = routing(src)
        return [sum(any(int(e) >= 0 and int(e) // (E // world) == d for e in row) for row in idx) for d in range(world)]

    received = sum(sent_by(s)[rank] for s in range(world))
    per_expert = [sum(int((routing(s) == rank * (E // world) + e).sum()) for s in range(world))
                  for e in range(E // world)]
    return sent_by(rank), received, per_expert


def _body(rank, world, out_dir):
    out = {}
    cfg = {"moe": {"num_experts": E, "topk": K}, "comm": {"backend": "torch", "max_tokens_per_rank": 64}}
    off = ep_plugin.EPBuffer(None, cfg, hidden=H)
    out["off_backend"] = type(off._backend).__name__
    try:
        off.stats()
        out["off_stats"] = None
    except RuntimeError as exc:
        out["off_stats"] = str(exc)
    off.close()

    on = ep_plugin.EPBuffer(None, {**cfg, "comm": {**cfg["comm"], "stats": True, "stats_interval": 2}}, hidden=H)
    x = torch.randn(T, H, requires_grad=True)
    w = torch.rand(T, K, requires_grad=True)
    res = on.dispatch(x, routing(rank), w)
    y = on.combine(res.x * 2, res.handle)
    (y.sum() + res.topk_weights.sum()).backward()  # backward: a combine, a cached dispatch, a weights sum
    out["summary"] = on.stats(reset=True)
    out["after_reset"] = on.stats()["calls"]

    for _ in range(3):  # report across ranks
        r = on.dispatch(torch.randn(T, H), routing(rank))
        on.combine(r.x, r.handle)
    rep = collect([on], tokens=3 * T, wall_s=10.0, steps=(1, 3))
    out["report"] = {"comm_s": rep.comm_s, "rows": rep.rows_received, "tokens": rep.tokens,
                     "slowest": rep.slowest_rank, "line": rep.line(), "share": rep.comm_share,
                     "sent": rep.bytes_sent, "sent_per_step": rep.bytes_sent_per_step,
                     "sent_local": rep.sent_local, "sent_remote": rep.sent_remote}

    lines = []
    layer_a, layer_b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    emit = lambda report: lines.append(report.line())  # noqa: E731
    made, reports = [], []
    for _ in range(4):
        got = training_step(layer_a, on, T, emit)  # a layer calls it before its step's exchanges
        made.append(got is not None)
        if got is not None:
            reports.append({"steps": got.steps, "step_count": got.step_count, "tokens": got.tokens,
                            "per_step": got.bytes_sent_per_step})
        made.append(training_step(layer_b, on, T, emit) is not None)  # not the first layer: no step
        with torch.no_grad():
            made.append(training_step(layer_a, on, T, emit) is not None)  # no gradients: not a step
        r = on.dispatch(torch.randn(T, H), routing(rank))  # the step's exchanges
        on.combine(r.x, r.handle)
    out["interval"] = {"made": made, "lines": lines, "reports": reports}
    logger = logging.getLogger("ep_plugin.test_telemetry")
    logger.setLevel(logging.INFO)
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    log_to(logger)(rep)
    out["logged"] = seen
    on.close()
    write_rank_result(out_dir, rank, out)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("telemetry")
    spawn(_body, 2, str(d), timeout=180)
    return read_rank_results(d, 2)


def test_off_is_the_backend_itself(ranks):
    for r in ranks:
        assert r["off_backend"] == "TorchBackend"
        assert "comm.stats: true" in r["off_stats"]


def test_counts_bytes_and_backward_exchanges(ranks):
    row = H * 4  # float32 rows
    for rank, r in enumerate(ranks):
        s = r["summary"]
        sent, received, per_expert = expected(rank, 2)
        ops = s["ops"]
        assert s["timer"] == "host" and s["backend"] == "torch"
        assert {k: v["calls"] for k, v in ops.items()} == {"dispatch": 2, "combine": 2, "combine_weights": 1}
        assert all(v["time_s"] > 0 and v["max_us"] >= v["p50_us"] > 0 for v in ops.values())
        d = ops["dispatch"]  # the forward (fresh) and the cached one of combine's backward move the same rows
        assert d["bytes_sent"] == {"local": 2 * sent[rank] * row, "remote": 2 * (sum(sent) - sent[rank]) * row}
        assert d["bytes_received"] == {"local": 2 * sent[rank] * row, "remote": 2 * (received - sent[rank]) * row}
        c = ops["combine"]  # combine sends back what dispatch received
        assert c["bytes_sent"] == d["bytes_received"] and c["bytes_received"] == d["bytes_sent"]
        assert ops["combine_weights"]["bytes_sent"]["local"] == sent[rank] * K * 4
        assert s["rows_sent_per_rank"] == sent and s["rows_received"] == received  # fresh dispatches only
        assert s["tokens_per_expert"] == per_expert
        assert s["expert_imbalance"] == pytest.approx(imbalance(per_expert))
        assert s["rank_imbalance"] == pytest.approx(imbalance(sent))
        assert s["timeouts"] == 0 and r["after_reset"] == 0
        for key in ("bytes_sent", "bytes_received"):  # every op, forward and backward, per domain
            assert s[key] == {d: sum(o[key][d] for o in ops.values()) for d in ("local", "remote")}


def test_report_across_ranks_names_the_slowest(ranks):
    a, b = ranks[0]["report"], ranks[1]["report"]
    assert a["comm_s"] == b["comm_s"] and a["rows"] == b["rows"]  # everyone sees the same table
    assert a["rows"] == [3 * expected(r, 2)[1] for r in range(2)]
    assert a["tokens"] == 2 * 3 * T
    assert a["slowest"] == max(range(2), key=a["comm_s"].__getitem__)
    assert a["share"] == pytest.approx(sum(a["comm_s"]) / 2 / 10.0)
    assert a["line"].startswith("ep_plugin stats [torch, EP2] steps 1-3: 4 tokens/s, comm ")
    assert f"slowest rank {a['slowest']}" in a["line"] and "timeouts 0" in a["line"]
    # bytes per domain: each rank's dispatches and combines (3 of each), summed over the ranks, per step
    assert a["sent"] == b["sent"] and a["sent_local"] == b["sent_local"]
    local = remote = 0
    for r in range(2):
        sent, received, _ = expected(r, 2)
        assert a["sent_local"][r] == 3 * 2 * sent[r] * H * 4  # dispatch to itself, and its combine back
        assert a["sent_remote"][r] == 3 * ((sum(sent) - sent[r]) + (received - sent[r])) * H * 4
        local, remote = local + a["sent_local"][r], remote + a["sent_remote"][r]
    assert a["sent"] == {"local": local, "remote": remote}
    assert a["sent_per_step"] == {"local": local / 3, "remote": remote / 3}
    assert re.search(r", timeouts 0, sent per step [\d.]+ [KMG]?B remote \+ [\d.]+ [KMG]?B local$", a["line"]), a["line"]


def test_integration_reports_every_interval(ranks):
    for rank, r in enumerate(ranks):
        made = r["interval"]["made"]
        assert made == [False, False, False, True, False, False] * 2  # steps 2 and 4 of the first layer
        lines = r["interval"]["lines"]
        assert len(lines) == (2 if rank == 0 else 0)  # collected everywhere, emitted by rank 0
        if lines:
            assert "steps 1-2" in lines[0] and "steps 3-4" in lines[1] and "tokens/s" in lines[0]
            assert "sent per step" in lines[0] and "sent per step" in lines[1]
        # made before the step's exchanges: the report of steps 1-2 holds step 1, that of 3-4 steps 2-3
        first, second = r["interval"]["reports"]
        assert first["steps"] == [1, 2] and first["step_count"] == 1 and first["tokens"] == 2 * T
        assert second["steps"] == [3, 4] and second["step_count"] == 2 and second["tokens"] == 2 * 2 * T
        assert first["per_step"] == second["per_step"] and first["per_step"]["remote"] > 0  # one pair a step
        assert r["logged"] and r["logged"][0].startswith("ep_plugin stats [torch, EP2]")


# ------------------------------------------------------------------------------------ one process

def handle(world=2, sent=(3, 5), recv=(3, 4), per_expert=(2, 5)):
    return SimpleNamespace(exact=True, send_counts=list(sent), recv_counts=list(recv),
                           tokens_per_expert=list(per_expert))


def test_records_fold_in_batches_and_directions():
    st = CommStats(rank=0, world=2, num_local_experts=2, backend="fake")
    x = torch.empty(4, 16)
    n = recorder_mod._FOLD_EVERY + 3
    for _ in range(n):
        st.end("dispatch", st.begin(x), x, 64, handle(), fresh=True)
    assert len(st._done) == 3  # folded once past the batch size, the rest waits for the report
    st.end("combine", st.begin(x), x, 64, handle())
    s = st.summary()
    d, c = s["ops"]["dispatch"], s["ops"]["combine"]
    assert d["calls"] == n and c["calls"] == 1
    assert d["bytes_sent"] == {"local": n * 3 * 64, "remote": n * 5 * 64}
    assert d["bytes_received"] == {"local": n * 3 * 64, "remote": n * 4 * 64}
    assert c["bytes_sent"] == {"local": 3 * 64, "remote": 4 * 64}
    assert s["rows_sent_per_rank"] == [3 * n, 5 * n] and s["tokens_per_expert"] == [2 * n, 5 * n]
    assert s["expert_imbalance"] == pytest.approx(5 / 3.5)


class _FakeEvent:
    """A CUDA event on a fake clock: complete once `tick` passes its time; waiting is refused
    unless the test allows it (nothing on the call's path may wait)."""

    clock = 0
    may_wait = False

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self, stream=None):
        _FakeEvent.clock += 1
        self.at = _FakeEvent.clock

    def query(self):
        return self.at <= _FakeEvent.done

    def synchronize(self):
        assert _FakeEvent.may_wait, "waited for a CUDA event on the call's path"
        _FakeEvent.done = max(_FakeEvent.done, self.at)

    def elapsed_time(self, end):
        return float(end.at - self.at)  # ms


def test_cuda_events_are_read_lazily(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    _FakeEvent.clock, _FakeEvent.done, _FakeEvent.may_wait = 0, 0, False
    st = CommStats(rank=1, world=2, num_local_experts=2, backend="fake")
    x = SimpleNamespace(is_cuda=True)
    for _ in range(3):
        st.end("dispatch", st.begin(x), x, 10, handle())
    assert len(st._in_flight) == 3 and not st._done  # nothing complete yet, nothing waited
    _FakeEvent.done = 2  # the first call's end (event 2) has completed
    st.end("dispatch", st.begin(x), x, 10, handle())
    assert len(st._in_flight) == 3 and len(st._done) == 1
    _FakeEvent.may_wait = True  # report time: the rest may be waited for
    s = st.summary()
    assert s["timer"] == "cuda_events" and s["ops"]["dispatch"]["calls"] == 4
    assert s["ops"]["dispatch"]["time_s"] == pytest.approx(4 * 1e-3)
    assert len(st._events) == 8  # the timing events are reused


class _FailingBackend:
    name = "fake"
    capabilities = "caps"

    def __init__(self):
        self.error = EPTimeoutError("rank 1 did not arrive", missing_ranks=(1,))

    def dispatch(self, *args):
        raise self.error

    def check(self):
        raise self.error


def test_timeouts_count_once_per_failure():
    st = CommStats(rank=0, world=2, num_local_experts=1, backend="fake")
    be = RecordingBackend(_FailingBackend(), st)
    assert be.name == "fake" and be.capabilities == "caps"
    x = torch.empty(1, 4)
    for call in (lambda: be.dispatch(x, None, None, None), be.check, be.check):
        with pytest.raises(EPTimeoutError):
            call()
    s = st.summary()
    assert s["timeouts"] == 1 and s["missing_ranks"] == [1]
    be._inner.error = EPTimeoutError("rank 0 did not arrive", missing_ranks=(0,))
    with pytest.raises(EPTimeoutError):
        be.check()
    assert st.summary()["timeouts"] == 2 and st.summary()["missing_ranks"] == [0, 1]


def test_report_text_and_events():
    rep = Report(rank=0, backend="nvlink", comm_s=[0.2, 0.3], rows_received=[100, 300], tokens=4000,
                 timeouts=0, expert_imbalance=1.5, dispatch_us=812.0, combine_us=1604.0, wall_s=1.0,
                 steps=(11, 20), local={})
    assert rep.text() == ("4,000 tokens/s, comm 25% (slowest rank 1: 30%), dispatch 812 us, combine 1.60 ms "
                          "per call, max/mean rows per rank 1.50, per expert 1.50, timeouts 0")
    assert rep.line().startswith("ep_plugin stats [nvlink, EP2] steps 11-20: 4,000 tokens/s")
    ev = dict((k, v) for k, v, step in rep.events(20))
    assert ev["ep_plugin/comm_share"] == pytest.approx(0.25) and ev["ep_plugin/slowest_rank"] == 1
    assert "ep_plugin/sent_remote_bytes_per_step" not in ev  # no bytes gathered


def test_report_bytes_sent_per_domain():
    """The bytes every rank sent to the others (remote) and to itself (local), summed over the ranks,
    per step of the interval (10 steps here), at the end of the line."""
    rep = Report(rank=0, backend="nvlink", comm_s=[0.2, 0.3], rows_received=[100, 300], tokens=4000,
                 timeouts=0, expert_imbalance=1.5, dispatch_us=812.0, combine_us=1604.0, wall_s=1.0,
                 steps=(11, 20), local={}, sent_local=[1.1e9, 1.06e9], sent_remote=[1.0e9, 1.1e9])
    assert rep.line() == ("ep_plugin stats [nvlink, EP2] steps 11-20: 4,000 tokens/s, comm 25% (slowest rank 1: "
                          "30%), dispatch 812 us, combine 1.60 ms per call, max/mean rows per rank 1.50, per "
                          "expert 1.50, timeouts 0, sent per step 210 MB remote + 216 MB local")
    assert rep.bytes_sent == {"remote": 2.1e9, "local": 2.16e9}
    ev = dict((k, v) for k, v, step in rep.events(20))
    assert ev["ep_plugin/sent_remote_bytes_per_step"] == pytest.approx(2.1e8)
    assert ev["ep_plugin/sent_local_bytes_per_step"] == pytest.approx(2.16e8)
    # the steps the exchanges belong to, when not the interval's span (an IntervalReporter's first report)
    assert rep.text() == dataclasses.replace(rep, steps=(1, 10), num_steps=10).text()
    assert dataclasses.replace(rep, num_steps=5).text().endswith("sent per step 420 MB remote + 432 MB local")
    # steps unknown: the interval's bytes; sizes in B, KB, MB, GB with three digits
    assert dataclasses.replace(rep, steps=None).text().endswith(", sent 2.10 GB remote + 2.16 GB local")
    small = dataclasses.replace(rep, steps=None, sent_local=[512, 0], sent_remote=[21_000, 4_000])
    assert small.text().endswith(", sent 25.0 KB remote + 512 B local")
    # no exchange stats on any rank: no bytes
    assert "sent" not in dataclasses.replace(rep, local=None).text()


class _Buf:
    cfg = SimpleNamespace(comm=SimpleNamespace(stats=True, stats_interval=5))


class _InBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer, buf):
        ctx.layer, ctx.buf = layer, buf
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.result = training_step(ctx.layer, ctx.buf, 4, lambda report: None)
        return grad, None, None


def test_recompute_in_backward_is_not_a_step():
    """An activation-checkpoint recompute runs the layer's forward inside the backward pass, with
    gradients on: it is no training step (nor a report, which is a collective)."""
    from ep_plugin.telemetry import report as report_mod

    buf, layer = _Buf(), torch.nn.Linear(1, 1)
    x = torch.ones(2, requires_grad=True)
    _InBackward.apply(x, layer, buf).sum().backward()
    assert buf not in report_mod._REPORTERS  # the backward's call counted nothing
    assert training_step(layer, buf, 4, lambda report: None) is None  # a forward: a step
    assert report_mod._REPORTERS[buf].steps == 1


def test_config_keys():
    cfg = ep_plugin.load_config("tiny")
    assert cfg.comm.stats is False and cfg.comm.stats_interval == 100
    assert ep_plugin.load_config({"comm": {"stats": True, "stats_interval": None}}).comm.stats_interval is None
    with pytest.raises(ep_plugin.ConfigError, match="comm.stats_interval"):
        ep_plugin.load_config({"comm": {"stats_interval": 0}})
    with pytest.raises(ep_plugin.ConfigError, match="comm.stats"):
        ep_plugin.load_config({"comm": {"stats": "yes"}})


def _nvlink_body(rank, world, worst_case):
    torch.cuda.set_device(rank)
    cfg = {"moe": {"num_experts": 8, "topk": 2},
           "comm": {"backend": "nvlink", "stats": True, "host_sync": not worst_case, "max_tokens_per_rank": 64}}
    ref_cfg = {**cfg, "comm": {**cfg["comm"], "backend": "torch"}}
    sums = []
    for c in (cfg, ref_cfg):
        with ep_plugin.EPBuffer(None, c, hidden=256) as buf:
            g = torch.Generator().manual_seed(rank)
            for async_op in (False, True):
                x = torch.randn(48, 256, generator=g).to("cuda", torch.bfloat16)
                idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(48)]).cuda()
                res = buf.dispatch(x, idx, async_op=async_op)
                if res.event is not None:
                    res.event.current_stream_wait()
                buf.combine(res.x[:res.handle.num_recv], res.handle)
            s = buf.stats()
            sums.append((s["ops"]["dispatch"]["bytes_received"], s["rows_sent_per_rank"], s["tokens_per_expert"]))
            assert s["timer"] == "cuda_events" and s["ops"]["dispatch"]["time_s"] > 0
    assert sums[0] == sums[1], sums  # the same bytes and loads as the reference backend reports


@pytest.fixture(scope="module")
def nvlink_stats_parts(tmp_path_factory):
    """Both modes in one spawn (one process start and NCCL init)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    from ep_plugin._ext import has_c

    if not has_c():
        pytest.skip("ep_plugin._C is not built")
    parts = [(f"worst_case={w}", _nvlink_body, (w,)) for w in (False, True)]
    return spawn_parts(parts, 2, str(tmp_path_factory.mktemp("nvlink_stats")), backend="nccl", timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("worst_case", [False, True])
def test_nvlink_stats_match_reference(nvlink_stats_parts, worst_case):
    nvlink_stats_parts[f"worst_case={worst_case}"].check()


def _megatron_body(rank, world, out_dir):
    import ep_plugin.megatron as epm
    from ep_plugin.testing import cpu_stand_ins

    cpu_stand_ins()
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    from tests.megatron_cases import H as MH, make_config, make_moe_layer

    ps.initialize_model_parallel(expert_model_parallel_size=world)
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("ep_plugin.megatron")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    cfg = make_config(world, moe_token_dispatcher_type="ep_plugin")
    epm.attach_config(cfg, {"comm": {"backend": "torch", "stats": True, "stats_interval": 2}})
    layers = [make_moe_layer(cfg) for _ in range(2)]
    for _ in range(4):
        x = torch.randn(6, 2, MH, requires_grad=True)
        for layer in layers:
            x, _ = layer(x)
        x.sum().backward()
    ps.destroy_model_parallel()
    epm.clear_buffers()
    write_rank_result(out_dir, rank, seen)


def test_megatron_dispatcher_logs_every_interval(tmp_path):
    need_installed("megatron.core")  # its ranks import it, not this process
    spawn(_megatron_body, 2, str(tmp_path), timeout=180)
    lines = read_rank_results(tmp_path, 2)
    assert lines[1] == [] and len(lines[0]) == 2, lines  # steps 1-2 and 3-4, logged by rank 0
    assert lines[0][0].startswith("ep_plugin stats [torch, EP2] steps 1-2: ")
    assert "tokens/s" in lines[0][1] and "slowest rank" in lines[0][1]



def test_deepspeed_layer_reports_to_monitor_else_logging(caplog):
    pytest.importorskip("deepspeed")
    from ep_plugin.integrations.deepspeed.layer import EPPluginMOELayer

    rep = Report(rank=0, backend="torch", comm_s=[0.1, 0.2], rows_received=[5, 5], tokens=100, timeouts=0,
                 expert_imbalance=None, dispatch_us=10.0, combine_us=10.0, wall_s=1.0, steps=(1, 10), local={})
    layer = SimpleNamespace(_ep_monitor=RecordingMonitor())
    EPPluginMOELayer._ep_report(layer, rep)
    assert ("ep_plugin/comm_share", pytest.approx(0.15), 10) in layer._ep_monitor.events
    layer._ep_monitor.enabled = False
    with caplog.at_level(logging.INFO, logger="ep_plugin.deepspeed"):
        EPPluginMOELayer._ep_report(layer, rep)
    assert any(r.name == "ep_plugin.deepspeed" and "steps 1-10" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------- the bench and the examples

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    """CPU, one thread per rank, this tree's ep_plugin first."""
    return dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))


def test_bench_writes_json(tmp_path):
    """python -m ep_plugin.telemetry.bench, one process (gloo): off/on per round, the cost per call
    and relative to a dispatch + combine pair, as printed and as JSON (not a timing)."""
    out = tmp_path / "telemetry_bench.json"
    proc = subprocess.run([sys.executable, "-m", "ep_plugin.telemetry.bench", "--calls", "200", "--iters", "3",
                           "--rounds", "2", "--tokens", "16", "--hidden", "32", "--out", str(out)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "us per call" in proc.stdout and "% of a pair" in proc.stdout, proc.stdout
    res = json.loads(out.read_text())
    assert res["world"] == 1 and res["backend"] == "torch" and res["device"] == "cpu" and res["commit"]
    assert len(res["pair_us_off"]) == len(res["pair_us_on"]) == 2 and res["recorder_us_per_call"] > 0
    assert res["relative_cost"] == pytest.approx(res["pair_us_on_median"] / res["pair_us_off_median"] - 1)
    assert res["device_pair_us_off"] is None  # CUDA events on GPUs only


# every interval: loss, tokens/s, the exchanges' share naming the slowest rank, time per call,
# imbalance over ranks and experts, timeouts, bytes per step to other ranks and to itself
INTERVAL_LINE = re.compile(
    r"^step +\d+  loss \d+\.\d+  [\d,]+ tokens/s, comm \d+% \(slowest rank \d: \d+%\), dispatch [\d.]+ (ms|us), "
    r"combine [\d.]+ (ms|us) per call, max/mean rows per rank [\d.]+, per expert [\d.]+, timeouts 0, "
    r"sent per step [\d.]+ [KMG]?B remote \+ [\d.]+ [KMG]?B local$")


@pytest.mark.parametrize("example,args", [
    ("examples/megatron/pretrain_gpt_moe.py", ["--steps", "4", "--log-every", "2", "--no-progress"]),
    # the run of test_deepspeed_example.py (30 steps; tests/_shared_run.py): one launch for both tests
    ("examples/deepspeed/train_moe_ds.py", DEEPSPEED_EXAMPLE_ARGS),
])
def test_examples_print_one_stats_line_per_interval(example, args, tmp_path_factory):
    """The Megatron and DeepSpeed examples on CPU (gloo, torch backend): one line per interval with
    everything comm.stats reports, nothing else per step (no bar, no notices)."""
    from tests._dist import run_launch, torchrun_cmd

    need_installed("megatron.core" if "megatron" in example else "deepspeed")  # the example's processes import it
    if "deepspeed" in example:
        proc, _ = deepspeed_example_run(tmp_path_factory)
    else:
        proc = run_launch(torchrun_cmd(2, os.path.join(ROOT, example), *args), cwd=ROOT, env=_env(), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    every = int(args[args.index("--log-every") + 1])
    assert [line.split()[1] for line in steps] == [str(s) for s in range(every, int(args[1]) + 1, every)], proc.stdout
    for line in steps:
        assert INTERVAL_LINE.match(line), line
    assert "it/s" not in proc.stdout and "\r" not in proc.stdout
