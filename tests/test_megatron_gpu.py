"""megatron-core integration on GPUs (NCCL): the CPU equality matrix of test_megatron.py on 2 (and 4)
GPUs, for the torch backend and for `auto` (nvlink where built), plus megatron's real EP-overlap
(combined 1F1B) schedule on CUDA streams. Skips without 2 GPUs."""
from __future__ import annotations

import traceback

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402

from tests._dist import read_rank_results, spawn, write_rank_result  # noqa: E402
from tests.megatron_cases import CASES, SCHEDULE_CASES, compare_case, compare_schedule  # noqa: E402

pytestmark = pytest.mark.gpu
NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLDS = [w for w in (2, 4) if w <= NGPU]


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
        if backend == "torch":  # fp32: equal up to the order of sums (atomics)
            tol = 1e-4 * max(1.0, r["scale"])
            assert r["out"] <= tol and r["grad_x"] <= tol and r["grad_params"] <= tol, (rank, r)
        else:  # bf16: the top-k outputs are summed in another order -> a few bf16 ulps
            from ep_plugin._ext import has_c

            if has_c():
                assert r["comm_backend"] == "nvlink", r["comm_backend"]
            assert max(r["rel_out"], r["rel_grad_x"], r["rel_grad_params"]) <= 5e-2, (rank, r)


@pytest.mark.parametrize("case", list(SCHEDULE_CASES))
def test_ep_overlap_schedule_gpu(gpu_results, case):
    for rank, results in enumerate(gpu_results):
        r = results[case]
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        assert r["num_param_grads"] > 10
        assert r["grad_params"] <= 2e-2 * max(1.0, r["scale"]), (rank, r)  # bf16, atomics
