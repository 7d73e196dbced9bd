"""zero_tail_rows_ (EPGroupedMLP's tail of a worst-case-sized expert output): the rows past the last expert's end
zeroed in place, nothing before them touched, ends read on the device only -- the kernel (csrc/experts/zero_tail.cu,
CUDA) against the torch form (masked_fill_, everywhere), and the gradient passing through the kernel's form."""
import pytest
import torch

from ep_plugin.integrations.megatron.experts import _zero_tail_kernel, tail_rows, zero_tail_rows_

# (rows, columns, dtype, ends): the last end inside, at 0, at the end, past the end (clamped), one group, odd row
# bytes (the torch form), float32 rows
CASES = [(300, 256, torch.bfloat16, [10, 10, 170]), (64, 128, torch.bfloat16, [0, 0]),
         (64, 128, torch.bfloat16, [30, 64]), (64, 128, torch.bfloat16, [70]), (1, 8, torch.bfloat16, [0]),
         (37, 7, torch.bfloat16, [5, 20]), (129, 72, torch.float32, [128]), (5000, 7168, torch.bfloat16, [1234])]


def _check(device):
    for rows, cols, dtype, ends_l in CASES:
        ctx = f"{rows}x{cols} {dtype} ends {ends_l} on {device}"
        out = torch.randn(rows, cols, device=device).to(dtype)
        ends = torch.tensor(ends_l, dtype=torch.int32, device=device)
        want = out.clone().masked_fill_(tail_rows(ends, rows), 0)
        if min(ends_l[-1], rows) < rows:
            out[min(ends_l[-1], rows):] = float("nan")  # what grouped_mm leaves there: any bits
        got = zero_tail_rows_(out, ends)
        assert got is out, ctx
        assert torch.equal(out, want), ctx


def test_zero_tail_rows_torch_form():
    _check("cpu")


def test_zero_tail_rows_gradient_passes_through_cpu():
    x = torch.randn(20, 16, requires_grad=True)
    w = torch.randn(20, 16)
    out = zero_tail_rows_(x * 1, torch.tensor([4, 12], dtype=torch.int32))
    (out * w).sum().backward()
    assert torch.equal(x.grad[:12], w[:12]) and torch.equal(x.grad[12:], torch.zeros(8, 16))  # masked_fill's


@pytest.mark.gpu
def test_zero_tail_rows_kernel_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import ep_plugin._ext as ext
    if not ext.has_c():
        pytest.skip("ep_plugin._C is not built")
    probe = torch.empty(8, 128, device="cuda", dtype=torch.bfloat16)
    assert _zero_tail_kernel(probe, torch.tensor([3], dtype=torch.int32, device="cuda")) is not None
    _check("cuda")
    # the kernel's form: the gradient passes through (the tail's rows reach only grouped_mm's backward)
    x = torch.randn(20, 16, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(20, 16, device="cuda", dtype=torch.bfloat16)
    out = zero_tail_rows_(x * 1, torch.tensor([4, 12], dtype=torch.int32, device="cuda"))
    assert torch.equal(out[12:].float(), torch.zeros(8, 16, device="cuda"))
    (out * w).sum().backward()
    assert torch.equal(x.grad, w)
    # captured in a CUDA graph: the ends are read when the graph runs
    out = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    ends = torch.tensor([16], dtype=torch.int32, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        zero_tail_rows_(out, ends)
    for end in (40, 8, 64):
        out.normal_()
        ends.fill_(end)
        want = out.clone().masked_fill_(tail_rows(ends, 64), 0)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), end
