"""DeepSpeed's gate with a faster capacity scan: the same gate, the same numbers.

DeepSpeed's top-1/2/k gating finds each route's slot with ``torch.cumsum(mask, dim=0)`` on a one-hot
``[tokens, experts]`` int64 mask. On CUDA, torch scans an outer dimension with one thread per column,
each walking every row in turn: with 16 experts and 4096 tokens the two scans of a top-2 gate took
1.46 ms of a 5.4 ms layer step on an H200 (benchmarks/results/deepspeed_layer_profile_2x_h200_2026-11-23.log),
in front of the dispatch that waits for the counts on the host. Scanning the transposed mask along its
last dimension does the same sums in parallel over rows; integer sums are exact, so the gate's
outputs are bit for bit DeepSpeed's.

``fast_gate_scan()`` puts that scan in place of ``torch.cumsum`` for the code of
``deepspeed.moe.sharded_moe`` only, while a gate runs; everything else there still sees torch.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from deepspeed.moe import sharded_moe

# Narrow masks only: with many columns the outer-dimension kernel already has threads enough.
MAX_COLUMNS = 1024
MIN_ROWS = 256


def scan_rows(x: torch.Tensor, dim: int, *args, **kwargs) -> torch.Tensor:
    """``torch.cumsum(x, dim, ...)``, computed along the last dimension of x's transpose when x is an
    integer 2-D CUDA mask scanned over its rows (dim 0), and by torch.cumsum otherwise."""
    if (not args and not kwargs and x.is_cuda and x.dim() == 2 and dim in (0, -2)
            and not x.is_floating_point() and not x.is_complex()
            and x.shape[1] <= MAX_COLUMNS and x.shape[0] >= MIN_ROWS):
        return transposed_scan(x)
    return torch.cumsum(x, dim, *args, **kwargs)


def transposed_scan(x: torch.Tensor) -> torch.Tensor:
    """Running sums down the rows of a 2-D tensor: torch.cumsum(x, 0) (values and dtype), contiguous;
    on any device (the tests check it on CPU)."""
    return torch.cumsum(x.t().contiguous(), dim=1).t().contiguous()


class _TorchWithRowScan:
    """The torch module as the gate code sees it during fast_gate_scan: cumsum is scan_rows."""

    cumsum = staticmethod(scan_rows)

    def __getattr__(self, name):
        return getattr(torch, name)


_SHIM = _TorchWithRowScan()


@contextlib.contextmanager
def fast_gate_scan() -> Iterator[None]:
    """While the block runs, ``torch.cumsum`` in deepspeed.moe.sharded_moe is scan_rows (restored on
    exit, also after an exception). Not under torch.compile, which traces the gate as it is."""
    if torch.compiler.is_compiling() or sharded_moe.__dict__.get("torch") is not torch:
        yield  # compiled, or someone else has replaced it: leave it alone
        return
    sharded_moe.torch = _SHIM
    try:
        yield
    finally:
        sharded_moe.torch = torch
