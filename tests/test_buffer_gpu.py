"""The torch backend on NCCL: the same contract checks as on gloo, on CUDA tensors. One spawn per
world size runs both bodies (the async/cached modes at world 2, as on gloo)."""
import pytest
import torch

from tests._dist import spawn_parts
from tests.test_buffer import contract_body, modes_body

pytestmark = pytest.mark.gpu
WORLDS = (2, 4, 8)  # each where that many GPUs exist


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def nccl_parts(request, tmp_path_factory):
    world = request.param
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    parts = [("contract", contract_body, ("cuda",))] + ([("modes", modes_body, ("cuda",))] if world == 2 else [])
    return spawn_parts(parts, world, str(tmp_path_factory.mktemp(f"nccl{world}")), backend="nccl", timeout=600)


def test_torch_backend_contract_on_nccl(nccl_parts):
    nccl_parts["contract"].check()


def test_torch_backend_async_cached_on_nccl(nccl_parts):
    if "modes" not in nccl_parts:
        pytest.skip("the async/cached modes run at world 2")
    nccl_parts["modes"].check()
