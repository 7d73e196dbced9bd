"""DeepSpeed AutoEP with ``"comm_backend": "ep_plugin"``: Hugging Face MoE models train as with "comm".

Tiny Mixtral-like (top-2 softmax) and DeepSeek-V3-like (sigmoid, group-limited top-4 over 4 groups,
a shared expert, a dense first layer) models are built from ``transformers`` configs with random
weights (nothing downloaded) and trained through ``deepspeed.initialize`` with AutoEP on 2 ranks, once
with DeepSpeed's collective path and once through ep_plugin: same losses and gradients at every step,
within float32 reduction-order noise. CPU cases run in one spawn (gloo, world 2): importing DeepSpeed
and transformers costs seconds per process.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings

import pytest
import torch

from tests._dist import spawn, spawn_parts
from tests._need import need_installed
from tests.fakes import RecordingMonitor

need_installed("deepspeed", "transformers", "deepspeed.module_inject.auto_ep_comm")  # DeepSpeed with AutoEP

VOCAB, SEQ, MICRO = 64, 16, 2


def tiny_model(kind: str, hidden: int = 32):
    """A tiny HF MoE causal LM with random weights, identical on every rank (fixed seed)."""
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64)
    if kind == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=48, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2, **common)
        return tf.MixtralForCausalLM(cfg)
    cfg = tf.DeepseekV3Config(intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=4,
                              n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                              first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                              qk_nope_head_dim=4, v_head_dim=8, routed_scaling_factor=2.5, **common)
    return tf.DeepseekV3ForCausalLM(cfg)


def ds_config(comm_backend: str, backend: str = "torch", **expert_parallel):
    ep = dict(enabled=True, autoep_size=2, use_grouped_mm=False, comm_backend=comm_backend, **expert_parallel)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
           "expert_parallel": ep}
    if comm_backend == "ep_plugin":
        cfg["ep_plugin"] = {"enabled": True, "overrides": {"comm.backend": backend}}
    return cfg


def _engine(model, cfg):
    import deepspeed
    # SGD: Adam's first step is sign(grad), which turns reduction-order noise in near-zero gradients
    # into parameter differences of the learning rate.
    engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                      optimizer=lambda params: torch.optim.SGD(params, lr=0.5))
    return engine


def _train(engine, rank, steps=3):
    losses, grads = [], []
    # one batch per rank, every step: the loss must fall
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(100 + rank)).to(engine.device)
    for _ in range(steps):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        grads.append({n: p.grad.detach().float().cpu().clone()
                      for n, p in engine.module.named_parameters() if p.grad is not None})
        engine.step()
        losses.append(loss.item())
    return losses, grads


def _compare(tag, ours, ref, tol, grad_steps=None):
    """Losses at every step and gradients at the first ``grad_steps`` steps (all by default) within
    ``tol``. A lossy wire (BF16 rows) compares gradients at step 0 only: after an update, BF16 noise
    in the parameters can flip a near-tie in the top-k routing, and a flipped route changes some
    gradients outright (not by noise) while the losses still agree."""
    (l_o, g_o), (l_r, g_r) = ours, ref
    for step, (a, b) in enumerate(zip(l_o, l_r)):
        assert abs(a - b) <= tol * max(1.0, abs(b)), f"{tag}: step {step} loss {a} vs comm {b}"
    assert l_o[-1] < l_o[0], f"{tag}: loss did not fall: {l_o}"
    for step, (a, b) in enumerate(list(zip(g_o, g_r))[:grad_steps]):
        assert a.keys() == b.keys(), f"{tag}: step {step} parameters with gradients differ"
        assert any("experts" in n for n in a), f"{tag}: no expert gradients"
        for name in b:
            err = (a[name] - b[name]).abs().max().item()
            scale = b[name].abs().max().item()
            assert err <= tol * max(scale, 1e-3), f"{tag}: step {step} grad of {name}: max diff {err} (scale {scale})"


def _ep_layers(engine):
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    return [m for m in engine.module.modules() if isinstance(m, AutoEPMoELayer)]


def _equality_cases(rank, world, device, backends, hidden, kinds):
    """Train each kind with "comm" once and with ep_plugin on each of ``backends`` ((backend, tol,
    grad_steps) triples); compare every ep_plugin run with the "comm" one."""
    import deepspeed
    import ep_plugin.deepspeed as epds
    from ep_plugin.integrations.deepspeed.autoep_exchange import EPPluginExchange
    from ep_plugin.testing import deepspeed_without_shm_op
    torch.set_num_threads(1)
    deepspeed_without_shm_op()  # without CUDA: DeepSpeed compiles no CPU all-reduce op (none used)
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    calls = {"dispatch": 0, "replay_dispatch": 0, "dispatch_with_handle": 0, "combine_with_weight_grad": 0}
    for name in calls:
        original = getattr(EPPluginExchange, name)
        setattr(EPPluginExchange, name,
                lambda self, *a, _n=name, _f=original, **kw: calls.__setitem__(_n, calls[_n] + 1) or _f(self, *a, **kw))
    for kind in kinds:
        for checkpointing in ((False, True) if kind == "mixtral" else (False,)):
            runs = {}
            for comm_backend, backend in [("comm", None)] + [("ep_plugin", b) for b, *_ in backends]:
                model = tiny_model(kind, hidden)
                if checkpointing:
                    model.gradient_checkpointing_enable()  # non-reentrant: the exchange replays its handle
                engine = _engine(model, ds_config(comm_backend, backend or "torch"))
                layers = _ep_layers(engine)
                assert len(layers) == (2 if kind == "mixtral" else 1)
                if comm_backend == "comm":  # the flag off: DeepSpeed's own layer and route
                    assert all(type(m).__name__ == "AutoEPMoELayer" and m.comm_backend == "comm" for m in layers)
                else:
                    assert all(type(m) is epds.EPPluginAutoEPLayer for m in layers)
                    assert engine._config.expert_parallel_config.comm_backend == "ep_plugin"
                before = dict(calls)
                runs[backend or comm_backend] = _train(engine, rank)
                if comm_backend == "ep_plugin":
                    exchanges = {id(m._deepep_exchange) for m in layers}
                    assert len(exchanges) == 1, "the layers of one model share one exchange"
                    assert layers[0]._deepep_exchange.buffer.backend_name == backend
                    assert calls["dispatch"] - before["dispatch"] == 3 * len(layers)
                    assert calls["combine_with_weight_grad"] > before["combine_with_weight_grad"]
                    assert calls["dispatch_with_handle"] > before["dispatch_with_handle"]
                    replays = calls["replay_dispatch"] - before["replay_dispatch"]
                    assert replays == (3 * len(layers) if checkpointing else 0), replays
                engine.destroy()
            for backend, tol, grad_steps in backends:
                _compare(f"rank {rank} {kind} backend={backend} checkpointing={checkpointing}", runs[backend],
                         runs["comm"], tol, grad_steps)
    epds.release_buffers()  # collective: closes the kernel backends' buffers while the group is up


def _behaviour_cases(rank, world):
    """Section keys, capacity, the BF16 wire, destroy and uninstall (Mixtral, CPU)."""
    import deepspeed
    import ep_plugin.deepspeed as epds
    from ep_plugin.integrations.deepspeed.autoep_exchange import live_exchanges
    from ep_plugin.testing import deepspeed_without_shm_op
    torch.set_num_threads(1)
    deepspeed_without_shm_op()  # without CUDA: DeepSpeed compiles no CPU all-reduce op (none used)
    deepspeed.init_distributed(dist_backend="gloo")

    # The section's own keys size the exchange; a bigger batch is refused before any communication.
    engine = _engine(tiny_model("mixtral"), ds_config("ep_plugin", comm_num_sm=6, comm_max_tokens_per_rank=20))
    ids = torch.randint(0, VOCAB, (1, SEQ))
    engine(input_ids=ids, labels=ids)
    layer = _ep_layers(engine)[0]
    exchange = layer._deepep_exchange
    assert exchange.num_max_tokens_per_rank == 20 and exchange.buffer.cfg.comm.num_sms == 6
    assert exchange.buffer.cfg.moe.num_experts == 4 and exchange.top_k == 2
    assert "exchange_backend=ep_plugin" in repr(layer)
    with pytest.raises(ValueError, match=r"32 tokens .*comm.max_tokens_per_rank=20.*comm_max_tokens_per_rank"):
        engine(input_ids=torch.zeros(MICRO, SEQ, dtype=torch.long), labels=torch.zeros(MICRO, SEQ, dtype=torch.long))
    # The contract: DeepSpeed's own, unmodified exchange route (written for DeepEPExchange; BF16 only)
    # drives our exchange to the same output and input gradient as the converted layer's route.
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer, RouterOutput
    x = torch.randn(12, layer.hidden_size, generator=torch.Generator().manual_seed(rank)).bfloat16()
    results = []
    for route in (AutoEPMoELayer._deepep_route, type(layer)._deepep_route):
        xr = x.clone().requires_grad_(True)
        y = route(layer, xr, RouterOutput(*layer.router(xr.float(), layer.expert_bias)))
        (y.float() * torch.arange(y.numel()).view_as(y).sin()).sum().backward()
        results.append((y.detach(), xr.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    # engine.destroy() releases the exchange through DeepSpeed's own destroy_exchanges.
    engine.destroy()
    assert layer._deepep_exchange is None and exchange.destroyed and exchange not in live_exchanges()

    # A backend that moves only BF16 rows (as nvlink does): a float32 model's rows travel as BF16,
    # a warning says so once, and training matches the collective path to BF16 precision.
    ref = _train(_engine(tiny_model("mixtral"), ds_config("comm")), rank, steps=2)
    engine = _engine(tiny_model("mixtral"), ds_config("ep_plugin"))
    ids = torch.randint(0, VOCAB, (1, SEQ))
    engine(input_ids=ids, labels=ids)  # builds the exchange
    buf = _ep_layers(engine)[0]._deepep_exchange.buffer
    buf._caps = dataclasses.replace(buf.capabilities, row_dtypes=(torch.bfloat16, torch.float16),
                                    combine_dtypes=(torch.bfloat16,))
    seen, dispatch = [], buf.dispatch
    buf.dispatch = lambda x, *a, **kw: seen.append(x.dtype) or dispatch(x, *a, **kw)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours = _train(engine, rank, steps=2)
        assert seen and set(seen) == {torch.bfloat16}, seen
        assert sum("does not move torch.float32 rows" in str(w.message) for w in caught) == 1
        _compare(f"rank {rank} BF16 wire", ours, ref, 3e-2)
    finally:
        epds.release_buffers()  # the patched buffer must not serve later engines

    # uninstall(): DeepSpeed's own validation again; install() brings the name back.
    epds.uninstall()
    try:
        assert not epds.is_installed()
        with pytest.raises(ValueError, match=r"comm_backend must be one of \('comm', 'deepep'\)"):
            _engine(tiny_model("mixtral"), ds_config("ep_plugin"))
    finally:
        assert epds.install()
    engine = _engine(tiny_model("mixtral"), ds_config("ep_plugin"))
    assert all(type(m) is epds.EPPluginAutoEPLayer for m in _ep_layers(engine))



def _stats_cases(rank, world):
    """comm.stats with comm.stats_interval 2: the AutoEP layers report every 2 steps, once for the
    model's shared exchange (not once per layer), through logging, or the engine's monitor when it
    is enabled; a checkpoint's recompute and an eval forward are no steps."""
    import logging

    import deepspeed
    import ep_plugin.deepspeed as epds
    from ep_plugin.testing import deepspeed_without_shm_op
    torch.set_num_threads(1)
    deepspeed_without_shm_op()  # without CUDA: DeepSpeed compiles no CPU all-reduce op (none used)
    deepspeed.init_distributed(dist_backend="gloo")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger("ep_plugin.deepspeed")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    cfg = ds_config("ep_plugin")
    cfg["ep_plugin"]["overrides"].update({"comm.stats": True, "comm.stats_interval": 2})
    model = tiny_model("mixtral")
    model.gradient_checkpointing_enable()  # backward recomputes each layer's forward (and exchange)
    engine = _engine(model, cfg)
    layers = _ep_layers(engine)
    _train(engine, rank, steps=4)
    with torch.no_grad():  # an eval forward: not a step
        ids = torch.zeros(MICRO, SEQ, dtype=torch.long)
        engine(input_ids=ids, labels=ids)
    logged = [m for m in seen if m.startswith("ep_plugin stats")]
    # DeepSpeed's monitor, when enabled, takes the reports instead of logging
    monitor = engine.monitor = RecordingMonitor()
    _train(engine, rank, steps=2)
    exchanges = {id(m._deepep_exchange) for m in layers}
    log.removeHandler(handler)
    engine.destroy()
    epds.release_buffers()

    # checked after the last collective, so that a failure on one rank does not leave the other waiting
    assert len(layers) == 2 and len(exchanges) == 1
    assert [m for m in seen if m.startswith("ep_plugin stats")] == logged  # none logged with the monitor
    tags = {tag: step for tag, _, step in monitor.events}
    if rank == 0:  # collected on every rank, written by rank 0: steps 1-2 and 3-4, one line each
        assert [line.split(":")[0] for line in logged] == ["ep_plugin stats [torch, EP2] steps 1-2",
                                                           "ep_plugin stats [torch, EP2] steps 3-4"], seen
        for line in logged:
            assert re.search(r": [\d,]+ tokens/s, comm \d+% \(slowest rank \d: \d+%\), .*, timeouts 0, "
                             r"sent per step [\d.]+ [KM]B remote \+ [\d.]+ [KM]B local$", line), line
        assert tags.get("ep_plugin/comm_share") == 6 and "ep_plugin/sent_remote_bytes_per_step" in tags, tags
    else:
        assert logged == [] and monitor.events == [], seen


@pytest.fixture(scope="module")
def cpu_parts(tmp_path_factory):
    """The three CPU bodies in one spawn (DeepSpeed and transformers imported once per rank, not three
    times). The equality cases go last: they wrap EPPluginExchange's methods with call counters."""
    parts = [("behaviour", _behaviour_cases, ()), ("stats", _stats_cases, ()),
             ("equality", _equality_cases, ("cpu", (("torch", 1e-5, None),), 32, ("mixtral", "deepseek_v3")))]
    return spawn_parts(parts, 2, str(tmp_path_factory.mktemp("autoep_cpu")), timeout=660)


def test_autoep_reports_stats_every_interval_cpu(cpu_parts):
    cpu_parts["stats"].check()


def test_autoep_trains_like_comm_cpu(cpu_parts):
    cpu_parts["equality"].check()


def test_autoep_behaviour_cpu(cpu_parts):
    cpu_parts["behaviour"].check()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_autoep_trains_like_comm_gpu():
    """2 GPUs, float32 models: the torch backend over NCCL (exact rows: every step's gradients) and
    nvlink (float32 rows travel as BF16: losses within 3e-2, gradients at step 0), one spawn and one
    "comm" run for both."""
    from ep_plugin._ext import has_c
    backends = [("torch", 2e-4, None)]
    if has_c():  # without _C only the torch backend is compared (the nvlink tests say why they skip)
        backends.append(("nvlink", 3e-2, 1))
    # hidden 256: the nvlink backend's smallest row
    spawn(_equality_cases, 2, "cuda", tuple(backends), 256, ("mixtral", "deepseek_v3"), backend="nccl", timeout=400)


# ---------------------------------------------------------------------------- no processes
def test_config_sources_and_precedence(tmp_path):
    from ep_plugin.deepspeed import autoep_ep_config, uses_ep_plugin
    from ep_plugin.errors import ConfigError

    assert autoep_ep_config({}).comm.backend == "auto"  # ep_plugin's defaults
    yaml = tmp_path / "ep.yaml"
    yaml.write_text("comm:\n  backend: torch\n  num_sms: 8\n  max_tokens_per_rank: 512\n")
    ds = {"expert_parallel": {"enabled": True, "comm_backend": "ep_plugin"},
          "ep_plugin": {"enabled": True, "config": str(yaml), "overrides": {"comm.timeout_s": 5}}}
    assert uses_ep_plugin(ds) and not uses_ep_plugin(ds_config("comm"))
    cfg = autoep_ep_config(ds)
    comm = cfg.comm
    assert (comm.backend, comm.num_sms, comm.max_tokens_per_rank, comm.timeout_s) == ("torch", 8, 512, 5)
    # The section's own keys win; comm_max_tokens_per_rank 0 is DeepSpeed's "unset".
    ds["expert_parallel"].update(comm_num_sm=20, comm_max_tokens_per_rank=0)
    cfg = autoep_ep_config(ds)
    assert (cfg.comm.num_sms, cfg.comm.max_tokens_per_rank) == (20, 512)
    ds["expert_parallel"]["comm_max_tokens_per_rank"] = 64
    assert autoep_ep_config(ds).comm.max_tokens_per_rank == 64
    ds["expert_parallel"]["comm_num_sm"] = 0
    with pytest.raises(ConfigError, match=r"expert_parallel.comm_num_sm' \(ep_plugin's comm.num_sms\).*out of range"):
        autoep_ep_config(ds)
    with pytest.raises(ConfigError, match=r"'ep_plugin.config' \(used by expert_parallel.comm_backend=\"ep_plugin\"\)"):
        autoep_ep_config({"ep_plugin": {"config": {"comm": {"backend": "carrier_pigeon"}}}})


def test_refused_autoep_options():
    from types import SimpleNamespace

    from ep_plugin.errors import ConfigError
    from ep_plugin.integrations.deepspeed.autoep_config import check_autoep_options

    ok = dict(combine_impl="auto", autoep_size=2, expert_tensor_parallel_size=1, row_weighting_impl="auto")
    check_autoep_options(SimpleNamespace(**ok), tp_size=1)
    for change, tp, match in ((dict(combine_impl="fused_weighted_sum"), 1, "combine_impl.*leave combine_impl unset"),
                              (dict(expert_tensor_parallel_size=2), 1, "folded tensor parallelism"),
                              ({}, 2, "autotp_size=2"),
                              (dict(row_weighting_impl="fused", autoep_size=1), 1, "row_weighting_impl")):
        with pytest.raises(ConfigError, match=match):
            check_autoep_options(SimpleNamespace(**dict(ok, **change)), tp_size=tp)


def _torchrun(script, *args, gpu=False, timeout=400):
    """``torchrun --nproc-per-node 2 script args`` from the repo root (CPU unless gpu); asserts rc 0."""
    from tests._dist import run_launch, torchrun_cmd

    # this tree first, so that the script imports the ep_plugin under test (and an install
    # elsewhere, or none, does not matter)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = run_launch(torchrun_cmd(2, os.path.join(ROOT, script), *args), cwd=ROOT, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_example(tmp_path, *args, gpu=False):
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}.json"
    _torchrun(os.path.join("examples", "deepspeed", "autoep_hf_moe.py"), "--json", str(out), *args, gpu=gpu)
    res = json.loads(out.read_text())
    assert res["world"] == 2
    return res


def _falls(losses):
    return sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


@pytest.fixture(scope="module")
def cpu_example(tmp_path_factory):
    """One CPU run of the example for both tests below (a run is two DeepSpeed + transformers start-ups):
    30 steps, with --stats (timers only: the training is the same) and --no-progress."""
    out = tmp_path_factory.mktemp("autoep_example") / "run.json"
    proc = _torchrun(os.path.join("examples", "deepspeed", "autoep_hf_moe.py"), "--json", str(out), "--steps", "30",
                     "--log-every", "15", "--stats", "--no-progress")
    return proc, json.loads(out.read_text())


def test_example_pretrains_on_cpu(cpu_example):
    _, res = cpu_example
    assert res["world"] == 2
    assert res["ep_plugin_layers"] == 2 and res["backend"] == "torch"
    assert _falls(res["losses"]), res["losses"]


def test_example_stats_lines_cpu(cpu_example):
    """--stats --no-progress: a line per interval with the loss, and the AutoEP layers' own stats line
    per interval (comm.stats_interval = --log-every): tokens/s, the exchanges' share of the time
    naming the slowest rank, time per call, imbalance and bytes per domain; no tqdm bar."""
    proc, _ = cpu_example
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["15", "30"], proc.stdout
    for line in lines:
        assert re.match(r"step +\d+  loss \d+\.\d+( +[\d,]+ tokens/s)?$", line), line
    stats = [line for line in proc.stdout.splitlines() if line.startswith("ep_plugin stats")]
    assert [line.split(":")[0] for line in stats] == ["ep_plugin stats [torch, EP2] steps 1-15",
                                                      "ep_plugin stats [torch, EP2] steps 16-30"], proc.stdout
    for line in stats:
        assert re.search(r": [\d,]+ tokens/s, comm \d+% \(slowest rank \d: \d+%\), dispatch .* per call, "
                         r"max/mean rows per rank [\d.]+, per expert [\d.]+, timeouts 0, "
                         r"sent per step [\d.]+ [KMG]?B remote \+ [\d.]+ [KMG]?B local$", line), line
    assert "ep_plugin stats" not in proc.stderr  # printed once, with the script's lines
    assert "it/s" not in proc.stdout and "\r" not in proc.stdout


def test_bench_autoep_smoke_cpu(tmp_path):
    """benchmarks/bench_autoep.py on CPU (gloo, tiny shape, one timed step): both routes go through
    its timers, the outputs agree, the JSON says what ran (not a timing)."""
    out = tmp_path / "bench_autoep.json"
    proc = _torchrun(os.path.join("benchmarks", "bench_autoep.py"), "--cpu", "--tiny", "--iters", "1",
                     "--warmup", "1", "--out", str(out))
    res = json.loads(out.read_text())
    assert res["world"] == 2 and res["device"] == "cpu" and res["commit"] and res["deepspeed"]
    rows = res["shapes"]["tiny"]["results"]
    assert [r["variant"] for r in rows] == ["comm", "ep_plugin:torch"]
    assert [r["exchange_backend"] for r in rows] == ["gloo", "torch"]
    assert rows[0]["max_diff"] is None and rows[1]["max_diff"] < 1e-5  # same weights, same routing
    for r in rows:
        assert 0 < r["exchange_ms"] <= r["step_ms"], r
    assert 0 < rows[1]["epbuffer_ms"] <= rows[1]["exchange_ms"]
    assert "AutoEP MoE layer [tiny:" in proc.stdout and "ep_plugin:torch" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_example_pretrains_on_gpus_bf16(tmp_path):
    """The example's GPU setting (BF16, grouped GEMM, ep_plugin.yaml's backend: auto) against "comm"."""
    from ep_plugin._ext import has_c
    from concurrent.futures import ThreadPoolExecutor

    args = ("--preset", "deepseek_v3", "--hidden", "256", "--steps", "30", "--seq-len", "128")
    # Both runs at once on the same two GPUs (own ports, own process groups, a few hundred MiB each):
    # most of each run is the start-up (imports, DeepSpeed's engine), which overlaps.
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(_run_example, tmp_path / name, *more, gpu=True)
                for name, more in (("ours", args), ("ref", (*args, "--comm-backend", "comm")))]
        ours, ref = (r.result() for r in runs)
    assert ours["ep_plugin_layers"] == 1 and ref["ep_plugin_layers"] == 0
    assert ours["backend"] == ("nvlink" if has_c() else "torch"), ours["backend"]
    assert _falls(ours["losses"]), ours["losses"]
    # BF16 rows and sums in another order: the first steps agree to BF16 noise
    diffs = [abs(a - b) for a, b in zip(ours["losses"][:3], ref["losses"][:3])]
    assert max(diffs) < 5e-2, (ours["losses"][:3], ref["losses"][:3])
