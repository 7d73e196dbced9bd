"""DeepSpeed integration: a converted MoE layer equals DeepSpeed's own, engine mode, config errors.

CPU, gloo, world 2, ep_size 2 (tests/_dist.py spawn). Each multi-process test runs many cases in
one spawn, since importing DeepSpeed costs seconds per process.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests._dist import spawn_parts
from tests._need import need_installed

need_installed("deepspeed")

EP_ON = {"enabled": True, "config": "tiny", "overrides": {"comm.backend": "torch"}}
H = 16


def _expert(h=H):
    return torch.nn.Sequential(torch.nn.Linear(h, 2 * h), torch.nn.GELU(), torch.nn.Linear(2 * h, h))


def _make_pair(rank, k, drop, num_experts=4, ep_size=2, capacity_factor=0.5, min_capacity=2, use_rts=True,
               device="cpu", backend="torch", hidden=H):
    """DeepSpeed's MoE and an identical copy converted to ep_plugin (params differ per rank)."""
    from deepspeed.moe.layer import MoE
    import ep_plugin.deepspeed as epds

    def build():  # twice from the same seed: deepcopy would drop the params' allreduce/group_name tags
        torch.manual_seed(7)
        moe = MoE(hidden, _expert(hidden), num_experts=num_experts, ep_size=ep_size, k=k, capacity_factor=capacity_factor,
                  eval_capacity_factor=capacity_factor, min_capacity=min_capacity, drop_tokens=drop, use_rts=use_rts)
        g = torch.Generator().manual_seed(100 + rank)
        with torch.no_grad():
            for name, p in moe.named_parameters():
                if "deepspeed_experts" in name:  # each rank's local experts differ
                    p.add_(0.1 * torch.randn(p.shape, generator=g))
        return moe.to(device)

    ref, ours = build(), build()
    ref.set_deepspeed_parallelism()
    flag = dict(EP_ON, overrides={"comm.backend": backend})
    n = epds.convert_moe_layers(ours, {"train_batch_size": 2, "ep_plugin": flag})
    assert n == 1
    assert type(ours.deepspeed_moe) is epds.EPPluginMOELayer
    assert ours.deepspeed_moe.ep_group is ref.deepspeed_moe.ep_group
    return ref, ours


def _run(layer, x, gy, seed):
    torch.manual_seed(seed)  # the gate draws random numbers (RTS, 2nd-expert sampling)
    x = x.detach().clone().requires_grad_(True)
    out, l_aux, counts = layer(x)
    ((out * gy).sum() + 0.3 * l_aux).backward()
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters()}
    return out.detach(), l_aux.detach(), counts.detach(), x.grad.detach(), grads


def _close(a, b, what, atol=1e-5, rtol=1e-5):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert torch.allclose(a, b, atol=atol, rtol=rtol), f"{what}: max abs diff {err}"


def _layer_cases(rank, world, device="cpu", backend="torch", align=None):
    import deepspeed
    if align is not None:  # padded expert segments (zero rows, weight 0) must change nothing
        from ep_plugin.integrations.deepspeed import layer as ds_layer
        ds_layer.expert_alignment = lambda *args: align
    from ep_plugin.testing import deepspeed_without_shm_op
    deepspeed_without_shm_op()  # without CUDA: DeepSpeed compiles no CPU all-reduce op (none used)
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    tol = 1e-5
    if device == "cuda":  # GEMM kernels differ with the row count (DeepSpeed pads): looser fp32 match
        device, tol = f"cuda:{rank}", 2e-4
    torch.set_num_threads(1)
    cases = [(1, True), (1, False), (2, True), (2, False), (3, True), (3, False)]
    for k, drop in cases:
        ref, ours = _make_pair(rank, k, drop, device=device, backend=backend)
        for step, shape in enumerate(((2, 12, H), (3, 8, H) if drop else (1, 5, H))):
            g = torch.Generator().manual_seed(1000 * k + 10 * step + rank)
            x = torch.randn(shape, generator=g).to(device)
            gy = torch.randn(x.shape, generator=g).to(device)
            seed = 4242 + step + rank
            r = _run(ref, x, gy, seed)
            layer, seen = ours.deepspeed_moe, []
            run_experts = layer._ep_run_experts
            layer._ep_run_experts = lambda rows, w, counts: seen.append(list(counts)) or run_experts(rows, w, counts)
            o = _run(ours, x, gy, seed)
            del layer._ep_run_experts
            # Exactly the routes DeepSpeed keeps travel: compare with the gate's own sparse routes.
            torch.manual_seed(seed)
            kept = (layer.gate(x.reshape(-1, H), None, True, False)[3] >= 0).sum().reshape(1)
            got = torch.tensor([sum(layer._ep_counts)], device=kept.device)
            assert sum(seen[0]) % (align or 1) == 0 and sum(seen[0]) >= sum(layer._ep_counts)
            torch.distributed.all_reduce(kept), torch.distributed.all_reduce(got)
            assert got.item() == kept.item(), f"{got.item()} rows received, DeepSpeed keeps {kept.item()} routes"
            if drop:
                assert kept.item() < world * x.shape[0] * x.shape[1] * k, "capacity dropped nothing"
            tag = f"rank {rank} k={k} drop_tokens={drop} step {step}"
            _close(o[0], r[0], f"{tag}: output", tol, tol)
            _close(o[1], r[1], f"{tag}: l_aux", tol, tol)
            assert torch.equal(o[2], r[2]), f"{tag}: exp_counts {o[2]} != {r[2]}"
            _close(o[3], r[3], f"{tag}: input grad", tol, tol)
            assert o[4].keys() == r[4].keys()
            for name in r[4]:
                _close(o[4][name], r[4][name], f"{tag}: grad of {name}", tol, tol)
            if drop and k == 1:  # the capacity limit really dropped tokens: their output is 0
                assert (r[0].reshape(-1, H).abs().sum(-1) == 0).any(), f"{tag}: nothing was dropped"
            ref.zero_grad(set_to_none=True)
            ours.zero_grad(set_to_none=True)
    # eval mode (eval capacity factor) and no_grad forward
    ref.eval(), ours.eval()
    x = torch.randn(3, 4, H, device=device)
    with torch.no_grad():
        torch.manual_seed(5)
        a = ref(x)
        torch.manual_seed(5)
        b = ours(x)
    _close(b[0], a[0], f"rank {rank}: eval output", tol, tol)
    _capacity_and_cast_cases(rank, device, backend)


def _capacity_and_cast_cases(rank, device, backend):
    import dataclasses
    import warnings
    import ep_plugin.deepspeed as epds
    from ep_plugin.integrations.buffer_cache import get_buffer

    # One buffer for every batch size, sized by comm.max_tokens_per_rank (tiny: 256); more tokens
    # are refused on every rank before any communication, naming the key to raise.
    ref, ours = _make_pair(rank, 2, False, device=device, backend=backend)
    layer = ours.deepspeed_moe
    for shape in ((2, 12, H), (1, 5, H), (4, 64, H)):
        ours(torch.randn(shape, device=device))
    buf = layer.ep_buffer(H)
    assert get_buffer(layer.ep_group, layer._ep_cfg, H) is buf
    with pytest.raises(ValueError, match=r"257 tokens.*comm.max_tokens_per_rank=256.*overrides"):
        ours(torch.randn(1, 257, H, device=device))
    assert layer.ep_buffer(H) is buf

    # A backend that moves only BF16 rows (as nvlink does): a float32 layer casts around the exchange,
    # warns once, and still matches DeepSpeed to BF16 precision, gradients included.
    buf._caps = dataclasses.replace(buf.capabilities, row_dtypes=(torch.bfloat16, torch.float16),
                                    combine_dtypes=(torch.bfloat16,))
    seen, dispatch, combine = [], buf.dispatch, buf.combine
    buf.dispatch = lambda x, *a, **kw: seen.append(x.dtype) or dispatch(x, *a, **kw)
    buf.combine = lambda x, *a, **kw: seen.append(x.dtype) or combine(x, *a, **kw)
    try:
        g = torch.Generator().manual_seed(77 + rank)
        x = torch.randn(2, 12, H, generator=g).to(device)
        gy = torch.randn(x.shape, generator=g).to(device)
        r = _run(ref, x, gy, 31 + rank)
        # the warning is once per process (lru_cache): an earlier part of this spawn may have used it up
        from ep_plugin.integrations.deepspeed import layer as ds_layer
        ds_layer._warn_cast.cache_clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            o = _run(ours, x, gy, 31 + rank)
            _run(ours, x, gy, 31 + rank)
        assert seen == [torch.bfloat16] * 4, seen
        msgs = [str(w.message) for w in caught if "does not move torch.float32 rows" in str(w.message)]
        assert len(msgs) == 1, [str(w.message) for w in caught]
        assert o[0].dtype == torch.float32
        tag = f"rank {rank} BF16 wire"
        _close(o[0], r[0], f"{tag}: output", 3e-2, 3e-2)
        _close(o[3], r[3], f"{tag}: input grad", 3e-2, 3e-2)
        for name in r[4]:
            _close(o[4][name], r[4][name], f"{tag}: grad of {name}", 3e-2, 3e-2)
    finally:
        epds.release_buffers()  # the patched buffer must not serve later layers
    assert layer.ep_buffer(H) is not buf


@pytest.fixture(scope="module")
def cpu_parts(tmp_path_factory):
    """The CPU bodies in one spawn (DeepSpeed imported once per rank, not four times). align 8 goes
    last: it replaces the layer module's expert_alignment for the rest of the process."""
    root = tmp_path_factory.mktemp("deepspeed_cpu")
    (root / "ckpt").mkdir()
    parts = [("engine", _engine_cases, ()), ("zero", _zero_cases, (str(root / "ckpt"),)),
             ("layer_None", _layer_cases, ("cpu", "torch", None)), ("layer_8", _layer_cases, ("cpu", "torch", 8))]
    return spawn_parts(parts, 2, str(root), timeout=600)


@pytest.mark.parametrize("align", [None, 8])
def test_layer_matches_deepspeed(cpu_parts, align):
    cpu_parts[f"layer_{align}"].check()


@pytest.fixture(scope="module")
def gpu_parts(tmp_path_factory):
    """The GPU cases in one spawn (DeepSpeed's import and NCCL's start-up once, not three times)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    from ep_plugin._ext import has_c
    parts = [("layer_torch", _layer_cases, ("cuda", "torch")), ("layer_auto", _layer_cases, ("cuda", "auto"))]
    if has_c():
        parts.append(("nvlink_float32", _nvlink_float32_cases, ()))
    return spawn_parts(parts, 2, str(tmp_path_factory.mktemp("deepspeed_gpu")), backend="nccl", timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_layer_matches_deepspeed_gpu(gpu_parts, backend):
    gpu_parts[f"layer_{backend}"].check()


def _nvlink_float32_cases(rank, world):
    """A float32 DeepSpeed layer on the nvlink backend (BF16 rows only) runs and matches DeepSpeed."""
    import deepspeed
    deepspeed.init_distributed(dist_backend="nccl")
    hidden, device = 256, f"cuda:{rank}"
    ref, ours = _make_pair(rank, 2, True, device=device, backend="nvlink", hidden=hidden)
    assert ours.deepspeed_moe.ep_buffer(hidden).backend_name == "nvlink"
    g = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(4, 32, hidden, generator=g).to(device)
    gy = torch.randn(x.shape, generator=g).to(device)
    r, o = _run(ref, x, gy, 11 + rank), _run(ours, x, gy, 11 + rank)
    assert o[0].dtype == torch.float32
    _close(o[0], r[0], f"rank {rank}: nvlink float32 output", 3e-2, 3e-2)
    _close(o[3], r[3], f"rank {rank}: nvlink float32 input grad", 3e-2, 3e-2)


@pytest.mark.gpu
def test_float32_layer_on_nvlink_gpu(gpu_parts):
    if "nvlink_float32" not in gpu_parts:
        pytest.skip("ep_plugin._C is not built")
    gpu_parts["nvlink_float32"].check()


class TinyMoELM(torch.nn.Module):
    """Embedding -> 2 x (pre-norm residual MoE block) -> LM head."""

    def __init__(self, vocab=32, hidden=H, num_experts=4, ep_size=2, k=2, layers=2):
        super().__init__()
        from deepspeed.moe.layer import MoE
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(hidden) for _ in range(layers))
        self.moes = torch.nn.ModuleList(
            MoE(hidden, _expert(hidden), num_experts=num_experts, ep_size=ep_size, k=k, capacity_factor=2.0,
                min_capacity=2) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, ids, labels):
        h = self.emb(ids)
        aux = 0.0
        for norm, moe in zip(self.norms, self.moes):
            out, l_aux, _ = moe(norm(h))
            h = h + out
            aux = aux + l_aux
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)) + 0.01 * aux


def _ds_config(flag):
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}
    if flag is not None:
        cfg["ep_plugin"] = flag
    return cfg


def _train(engine, rank, steps=6):
    g = torch.Generator().manual_seed(50 + rank)
    losses = []
    ids = torch.randint(0, 32, (4, 8), generator=g)
    labels = (ids * 3 + 1) % 32  # learnable map
    for step in range(steps):
        torch.manual_seed(900 + step + rank)
        loss = engine(ids, labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _engine_cases(rank, world):
    import deepspeed
    from deepspeed.moe.sharded_moe import MOELayer
    import ep_plugin.deepspeed as epds
    from ep_plugin.testing import deepspeed_without_shm_op
    torch.set_num_threads(1)
    deepspeed_without_shm_op()  # without CUDA: DeepSpeed compiles no CPU all-reduce op (none used)

    def build():  # same seed, same weights (not deepcopy: it drops the params' allreduce/group_name tags)
        torch.manual_seed(3)
        return TinyMoELM()

    m_off, m_on, m_absent = build(), build(), build()

    # Flag off: exactly deepspeed.initialize, the model untouched.
    state = {k: v.clone() for k, v in m_off.state_dict().items()}
    eng_off, opt, _, _ = epds.initialize(model=m_off, model_parameters=m_off.parameters(),
                                         config=_ds_config({"enabled": False, "config": "tiny"}))
    assert all(type(m) is MOELayer for m in m_off.modules() if isinstance(m, MOELayer))
    assert all(torch.equal(v, m_off.state_dict()[k]) for k, v in state.items())
    assert epds.convert_moe_layers(m_absent, _ds_config(None)) == 0
    assert all(type(m) is MOELayer for m in m_absent.modules() if isinstance(m, MOELayer))

    # Flag on.
    eng_on, opt_on, _, _ = epds.initialize(model=m_on, model_parameters=m_on.parameters(), config=_ds_config(EP_ON))
    assert isinstance(eng_on, deepspeed.DeepSpeedEngine) and opt_on is not None
    conv = [m for m in m_on.modules() if isinstance(m, MOELayer)]
    assert len(conv) == 2 and all(type(m) is epds.EPPluginMOELayer for m in conv)
    assert [n for n, _ in m_on.named_parameters()] == [n for n, _ in m_off.named_parameters()]
    assert eng_on.has_moe_layers and len(eng_on.moe_layers) == 2
    for (n, p), (_, q) in zip(m_on.named_parameters(), m_off.named_parameters()):
        assert getattr(p, "allreduce", True) == getattr(q, "allreduce", True), n
        assert getattr(p, "group_name", None) == getattr(q, "group_name", None), n
        if "deepspeed_experts" in n:
            assert p.allreduce is False and p.group_name == "ep_size_2", n
    groups_on = [(g.get("name"), g.get("moe", False), len(g["params"])) for g in opt_on.param_groups]
    assert ("ep_size_2", True, 16) in groups_on, groups_on  # DeepSpeed's expert param group
    # Converting again does nothing new.
    assert epds.convert_moe_layers(m_on, _ds_config(EP_ON)) == 0

    l_off = _train(eng_off, rank)
    l_on = _train(eng_on, rank)
    assert l_on[-1] < l_on[0] * 0.9, f"loss did not fall: {l_on}"
    # Same model, same data, same RNG: DeepSpeed's path and ours train identically.
    assert max(abs(a - b) for a, b in zip(l_on, l_off)) < 1e-4, (l_on, l_off)

    # Checkpoints: same keys as DeepSpeed's own model.
    assert m_on.state_dict().keys() == m_off.state_dict().keys()


def test_engine_flag_on_off_and_training(cpu_parts):
    cpu_parts["engine"].check()


@pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed builds its CPU all-reduce op only without CUDA")
def test_deepspeed_comm_builds_no_cpu_op():
    """What the examples and CPU tests call before DeepSpeed's comm starts: DeepSpeed's comm then has no
    shared-memory op to build (~120 CPU-s in the first DeepSpeed process of a venv, and again whenever
    another venv built it last: ep_plugin/testing/deepspeed_cpu.py)."""
    from deepspeed.comm.torch import build_shm_op

    from ep_plugin.testing import deepspeed_without_shm_op

    assert deepspeed_without_shm_op() is True
    assert build_shm_op() is None


# ---------------------------------------------------------------------------- config errors
def test_bad_section_unknown_key():
    import ep_plugin.deepspeed as epds
    from ep_plugin.errors import ConfigError
    with pytest.raises(ConfigError, match=r"unknown key 'enable'.*did you mean 'enabled'"):
        epds.convert_moe_layers(torch.nn.Linear(2, 2), {"ep_plugin": {"enable": True, "config": "tiny"}})
    with pytest.raises(ConfigError, match=r"ep_plugin.enabled' must be true or false"):
        epds.ep_plugin_config({"ep_plugin": {"enabled": "yes"}})
    with pytest.raises(ConfigError, match=r"must be an object"):
        epds.ep_plugin_config({"ep_plugin": [1]})


def test_bad_section_missing_file(tmp_path):
    import ep_plugin.deepspeed as epds
    from ep_plugin.errors import ConfigError
    with pytest.raises(ConfigError, match=r"ep_plugin.config': file not found: 'nope/missing.yaml'"):
        epds.convert_moe_layers(torch.nn.Linear(2, 2), {"ep_plugin": {"enabled": True, "config": "nope/missing.yaml"}})
    # A bad ep_plugin YAML names our section and the YAML key.
    bad = tmp_path / "bad.yaml"
    bad.write_text("comm:\n  backend: carrier_pigeon\n")
    with pytest.raises(ConfigError, match=r"ep_plugin.config'.*comm.backend"):
        epds.ep_plugin_config({"ep_plugin": {"enabled": True, "config": str(bad)}})
    # Through initialize, the error comes before DeepSpeed runs (no process group needed).
    with pytest.raises(ConfigError, match="file not found"):
        epds.initialize(model=torch.nn.Linear(2, 2),
                        config={"train_batch_size": 1, "ep_plugin": {"enabled": True, "config": "missing.yaml"}})


def test_section_from_json_file_resolves_relative_yaml(tmp_path):
    import ep_plugin.deepspeed as epds
    (tmp_path / "ep.yaml").write_text("moe:\n  num_experts: 4\ncomm:\n  backend: torch\n")
    p = tmp_path / "ds_config.json"
    p.write_text(json.dumps({"train_batch_size": 2, "ep_plugin": {"enabled": True, "config": "ep.yaml"}}))
    cwd = os.getcwd()
    try:
        os.chdir("/")
        cfg = epds.ep_plugin_config(str(p))
    finally:
        os.chdir(cwd)
    assert cfg.comm.backend == "torch" and cfg.moe.num_experts == 4
    assert epds.ep_plugin_config({"ep_plugin": {"enabled": False, "config": "tiny"}}) is None
    assert epds.ep_plugin_config({"ep_plugin": {"enabled": False, "config": "not/there.yaml"}}) is None
    assert epds.ep_plugin_config({"train_batch_size": 1}) is None
    assert epds.is_enabled({"ep_plugin": {"enabled": True, "config": {"comm": {"backend": "torch"}}}})


def _zero_cases(rank, world, ckpt_dir):
    import ep_plugin.deepspeed as epds
    from ep_plugin.testing import deepspeed_without_shm_op
    torch.set_num_threads(1)
    deepspeed_without_shm_op()  # without CUDA: DeepSpeed compiles no CPU all-reduce op (none used)
    losses, engines = {}, {}
    for name, flag in (("off", {"enabled": False}), ("on", EP_ON)):
        torch.manual_seed(3)
        m = TinyMoELM()
        cfg = dict(_ds_config(flag), zero_optimization={"stage": 2})
        engines[name], _, _, _ = epds.initialize(model=m, model_parameters=list(m.parameters()), config=cfg)
        losses[name] = _train(engines[name], rank, steps=4)
    assert max(abs(a - b) for a, b in zip(losses["on"], losses["off"])) < 1e-4, losses
    # Checkpoints written by a converted engine load into DeepSpeed's own model and back.
    on, off = engines["on"], engines["off"]
    on.save_checkpoint(ckpt_dir, tag="t")
    off.load_checkpoint(ckpt_dir, tag="t")
    for (n, p), (_, q) in zip(on.module.named_parameters(), off.module.named_parameters()):
        assert torch.equal(p, q), n
    assert abs(_train(on, rank, steps=1)[0] - _train(off, rank, steps=1)[0]) < 1e-4


def test_zero2_and_checkpoint(cpu_parts):
    cpu_parts["zero"].check()
