"""The torch backend on NCCL: the same contract checks as on gloo, on CUDA tensors."""
import pytest
import torch

from tests._dist import spawn
from tests.test_buffer import contract_body, modes_body

pytestmark = pytest.mark.gpu


def _need(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")


@pytest.mark.parametrize("world", [2, 4])
def test_torch_backend_contract_on_nccl(world):
    _need(world)
    spawn(contract_body, world, "cuda", backend="nccl")


def test_torch_backend_async_cached_on_nccl():
    _need(2)
    spawn(modes_body, 2, "cuda", backend="nccl")
