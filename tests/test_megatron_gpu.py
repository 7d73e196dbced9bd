"""megatron-core integration on GPUs (NCCL): the CPU equality matrix of test_megatron.py on 2 (and 4)
GPUs, for the torch backend and for `auto` (nvlink where built), plus megatron's real EP-overlap
(combined 1F1B) schedule on CUDA streams, plus the no-host-sync check of EPGroupedMLP layers with
CUDA's sync debug mode. Skips without 2 GPUs."""
from __future__ import annotations

import traceback
import warnings

import pytest
import torch

from tests._dist import read_rank_results, spawn, write_rank_result
from tests._need import need_installed
from tests.megatron_cases import (
    CASES, SCHEDULE_CASES, HostSyncError, compare_case, compare_schedule, forbid_host_sync, make_config,
    make_moe_layer,
)

need_installed("megatron.core")

pytestmark = pytest.mark.gpu
NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLDS = [w for w in (2, 4, 8) if w <= NGPU]


def is_sync_warning(message: str) -> bool:
    """A warning of CUDA's sync debug mode about a synchronising call ("called a synchronizing CUDA
    operation"), not torch's notice that the mode itself is a prototype ("Synchronization debug mode
    is a prototype feature ...", emitted by set_sync_debug_mode since torch 2.11)."""
    m = message.lower()
    return "synchroniz" in m and "debug mode is a prototype" not in m


def _nosync(rank, world, device):
    """An ep_plugin + EPGroupedMLP layer (BF16, `auto`: the kernel backend where built, comm.host_sync
    false) after warm-up: its dispatcher hooks and experts run under torch.cuda.set_sync_debug_mode
    ("error") plus the Python-level guard (forbid_host_sync; only the torch backend's own exchange is
    exempt, it reads counts on the host by design); the rest of the layer's forward (megatron's router)
    runs under "warn", and what it warns is recorded."""
    import ep_plugin.megatron as epm

    cfg = make_config(world, 256, moe_token_dispatcher_type="ep_plugin", moe_router_topk=3,
                      params_dtype=torch.bfloat16, bf16=True)
    # a short timeout: a rank stopped by the check leaves its peer waiting in the exchange
    epm.attach_config(cfg, {"comm": {"backend": "auto", "max_tokens_per_rank": 64, "timeout_s": 30}})
    layer = make_moe_layer(cfg, experts="ep").to(device)
    for S in (7, 9 + rank):  # warm-up: builds the EPBuffer (collectives, IPC), first kernels
        y, _ = layer(torch.randn(S, 2, 256, device=device, dtype=torch.bfloat16, requires_grad=True))
        y.float().sum().backward()
    torch.cuda.synchronize()
    backend = layer.token_dispatcher.buffer.backend_name
    out = {"backend": backend, "host_sync": layer.token_dispatcher.buffer.cfg.comm.host_sync,
           "device_counts": layer.token_dispatcher.device_counts, "caught": [], "layer_warnings": [],
           "gemm": epm.GroupedMMLinear.impl}
    for S in (5 + 3 * rank, 11 - rank):
        x = torch.randn(S, 2, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with forbid_host_sync(layer, exempt_buffer=backend == "torch", cuda_sync_debug=True) as caught:
                    y, _ = layer(x)
            except (HostSyncError, RuntimeError) as exc:  # sync debug "error" raises RuntimeError
                out["caught"].append(f"{type(exc).__name__}: {exc}")
                y = None
            finally:
                torch.cuda.set_sync_debug_mode(0)
        out["caught"] += caught
        out["layer_warnings"] += [f"{w.filename}:{w.lineno}: {str(w.message)[:200]}" for w in seen
                                  if is_sync_warning(str(w.message))]
        if y is not None:
            y.float().sum().backward()
            out["finite"] = bool(torch.isfinite(x.grad).all())
    return out


def _gpu_body(rank, world, out_dir):
    import torch._dynamo as dynamo

    import ep_plugin.megatron as epm
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    dynamo.config.disable = True  # megatron's compiled router helper: no compile time in tests
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(123)
    device = torch.device("cuda", torch.cuda.current_device())
    results = {}
    for backend, dtype in (("torch", torch.float32), ("auto", torch.bfloat16)):
        for name in CASES:
            key = f"{name}[{backend}]"
            try:
                # hidden 256 and BF16 rows: what the nvlink kernels take, so `auto` really runs them
                results[key] = compare_case(rank, world, name, device=device, comm_backend=backend,
                                             hidden=256, dtype=dtype)
            except Exception:
                results[key] = {"error": traceback.format_exc()}
        epm.clear_buffers()
    for name in SCHEDULE_CASES:
        try:
            results[name] = compare_schedule(rank, world, name, device=device)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    try:
        results["nosync"] = _nosync(rank, world, device)
    except Exception:
        results["nosync"] = {"error": traceback.format_exc()}
    ps.destroy_model_parallel()
    epm.clear_buffers()
    write_rank_result(out_dir, rank, results)


@pytest.fixture(scope="module", params=WORLDS or [0], ids=lambda w: f"ep{w}")
def gpu_results(request, tmp_path_factory):
    world = request.param
    if world < 2:
        pytest.skip("needs 2 CUDA GPUs")
    d = tmp_path_factory.mktemp(f"megatron_gpu{world}")
    spawn(_gpu_body, world, str(d), backend="nccl", timeout=300)
    return read_rank_results(d, world)


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_alltoall_gpu(gpu_results, case, backend):
    for rank, results in enumerate(gpu_results):
        r = results[f"{case}[{backend}]"]
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        if case.startswith("ep_experts"):  # EPGroupedMLP: the attached comm.host_sync (false)
            assert r["host_sync"] is False, (rank, r)
        if backend == "torch" and r["dtype"] == "float32":  # equal up to the order of sums (atomics)
            tol = 1e-4 * max(1.0, r["scale"])
            assert r["out"] <= tol and r["grad_x"] <= tol and r["grad_params"] <= tol, (rank, r)
        else:  # bf16: the top-k outputs are summed in another order -> a few bf16 ulps
            from ep_plugin._ext import has_c

            if has_c() and backend == "auto":
                assert r["comm_backend"] == "nvlink", r["comm_backend"]
            # per element (megatron_cases.elem_excess), not 5% of the tensor's largest value
            assert max(r["elem_out"], r["elem_grad_x"], r["elem_grad_params"]) <= 1.0, (rank, r)


@pytest.mark.parametrize("case", list(SCHEDULE_CASES))
def test_ep_overlap_schedule_gpu(gpu_results, case):
    for rank, results in enumerate(gpu_results):
        r = results[case]
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        assert r["num_param_grads"] > 10
        assert r["grad_params"] <= 2e-2 * max(1.0, r["scale"]), (rank, r)  # bf16, atomics


def test_ep_experts_layer_forward_never_syncs_gpu(gpu_results):
    """Inside the dispatcher's hooks and EPGroupedMLP's forward: no sync (CUDA's sync debug mode
    "error", and no Python-level host read); with the C extension that is the nvlink kernels, with no
    exemption, and the rows are the worst-case-sized ones."""
    for rank, results in enumerate(gpu_results):
        r = results["nosync"]
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        assert r["device_counts"] and r["host_sync"] is False, (rank, r)
        assert r["caught"] == [], (rank, "\n".join(r["caught"]))
        assert r.get("finite"), (rank, r)
        from ep_plugin._ext import has_c

        if has_c():
            assert r["backend"] == "nvlink", r["backend"]
            assert r["gemm"] in ("grouped_mm", "_grouped_mm"), r["gemm"]


def test_whole_moe_layer_forward_never_syncs_gpu(gpu_results):
    """The whole layer forward (megatron's router included) under sync debug mode "warn": anything
    it reports is listed here, with where it came from."""
    for rank, results in enumerate(gpu_results):
        r = results["nosync"]
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        assert r["layer_warnings"] == [], (rank, "\n".join(r["layer_warnings"]))
