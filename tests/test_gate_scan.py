"""gate_scan: DeepSpeed's gate with its capacity scan along rows gives DeepSpeed's numbers.

The row scan runs on CUDA only; here (CPU) the tests force it, so the gate code is checked against the
transposed result it would get on a GPU.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests._need import need_installed

need_installed("deepspeed")


@pytest.fixture(scope="module")
def gate_scan():
    """The module under test, imported when its first test runs: it imports DeepSpeed, which every xdist
    worker would otherwise import while collecting."""
    from ep_plugin.integrations.deepspeed import gate_scan

    return gate_scan


@pytest.mark.parametrize("rows,cols", [(1, 1), (7, 3), (4096, 16), (333, 64), (1000, 1)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_transposed_scan_equals_cumsum(gate_scan, rows, cols, dtype):
    g = torch.Generator().manual_seed(rows * 31 + cols)
    one_hot = F.one_hot(torch.randint(0, cols, (rows,), generator=g), cols).to(dtype)
    ints = torch.randint(-5, 6, (rows, cols), generator=g).to(dtype)
    for x in (one_hot, ints, ints[::2]):
        # an independent running sum (transposed_scan is built on torch.cumsum): row i = sum of rows 0..i,
        # as a lower-triangular matrix of ones times x, in float64 (exact for these small integers)
        n = x.shape[0]
        ref = (torch.tril(torch.ones(n, n, dtype=torch.float64)) @ x.double()).to(torch.int64)
        got = gate_scan.transposed_scan(x)
        # integers sum as int64, as torch.cumsum promotes them (what the gate code then sees)
        assert got.dtype == torch.int64 and got.is_contiguous() and torch.equal(got, ref)


def test_scan_rows_leaves_other_scans_to_torch(gate_scan):
    x = torch.arange(12.0).view(4, 3)
    assert torch.equal(gate_scan.scan_rows(x, 1), torch.cumsum(x, 1))
    assert torch.equal(gate_scan.scan_rows(x, 0), torch.cumsum(x, 0))  # CPU, float: torch's own
    assert torch.equal(gate_scan.scan_rows(x, 0, dtype=torch.float64), torch.cumsum(x, 0, dtype=torch.float64))


def test_fast_gate_scan_swaps_only_inside_the_block(gate_scan):
    from deepspeed.moe import sharded_moe

    assert sharded_moe.torch is torch
    with gate_scan.fast_gate_scan():
        assert sharded_moe.torch.cumsum is gate_scan.scan_rows
        assert sharded_moe.torch.Tensor is torch.Tensor and sharded_moe.torch.finfo is torch.finfo
    assert sharded_moe.torch is torch
    with pytest.raises(RuntimeError, match="boom"):
        with gate_scan.fast_gate_scan():
            raise RuntimeError("boom")
    assert sharded_moe.torch is torch


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("drop", [True, False])
def test_gate_outputs_are_deepspeeds(gate_scan, monkeypatch, k, drop):
    from deepspeed.moe.sharded_moe import TopKGate

    forced_shapes = []

    def forced(x, dim, *args, **kwargs):  # the CUDA choice, made on CPU
        if not args and not kwargs and x.dim() == 2 and dim in (0, -2) and not x.is_floating_point():
            forced_shapes.append(tuple(x.shape))
            return gate_scan.transposed_scan(x)
        return torch.cumsum(x, dim, *args, **kwargs)

    torch.manual_seed(3)
    gate = TopKGate(32, 8, k=k, capacity_factor=1.0, min_capacity=2, drop_tokens=drop)
    x = torch.randn(300, 32)

    def run(fast):
        torch.manual_seed(11)  # the gumbel sampling of the second expert
        if not fast:
            return gate(x, None, True, False)
        monkeypatch.setattr(gate_scan._TorchWithRowScan, "cumsum", staticmethod(forced))
        with gate_scan.fast_gate_scan():
            return gate(x, None, True, False)

    ref, got = run(False), run(True)
    assert forced_shapes and all(shape == (300, 8) for shape in forced_shapes), forced_shapes  # the row path
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        if torch.is_tensor(a):
            assert a.dtype == b.dtype and torch.equal(a, b)
        else:
            assert a == b
