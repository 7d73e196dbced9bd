"""bounded_weighted_swiglu (EPGroupedMLP.bounded_activation): megatron's weighted SwiGLU and its backward over the rows
before the last expert's end only (csrc/experts/swiglu_rows.cu) -- bit for bit the same formulas as eager torch ops on
those rows (megatron's fused_bias_swiglu.weighted_swiglu / weighted_swiglu_back; the weight gradient's per-row sum in
another order), nothing read past them (NaN there), a zero weight gradient past them, the grid-stride loops (more rows
than the grid's warps), rows of more than 32 vectors, a gradient view at an odd offset, and None (the torch form)
wherever the kernels do not apply."""
import pytest
import torch
import torch.nn.functional as F

from ep_plugin.integrations.megatron.experts import bounded_weighted_swiglu


def ref_forward(h, w):  # megatron's weighted_swiglu, eager
    a, b = torch.chunk(h, 2, -1)
    return (F.silu(a) * b * w).to(h.dtype)


def ref_backward(g, h, w):  # megatron's weighted_swiglu_back, eager
    a, b = torch.chunk(h, 2, -1)
    gw = g * w
    dh = torch.cat((gw * torch.sigmoid(a) * (1 + a * (1 - torch.sigmoid(a))) * b, gw * F.silu(a)), -1)
    dw = (F.silu(a) * b * g.to(w.dtype)).sum(-1, keepdim=True)
    return dh.to(h.dtype), dw


def test_torch_form_where_the_kernels_do_not_apply():
    h, w, ends = torch.randn(8, 32).bfloat16(), torch.rand(8, 1), torch.tensor([5], dtype=torch.int32)
    assert bounded_weighted_swiglu(h, w, ends) is None  # CPU
    if torch.cuda.is_available():
        hc, wc, ec = h.cuda(), w.cuda(), ends.cuda()
        wide = torch.randn(8, 64, device="cuda").bfloat16()
        assert bounded_weighted_swiglu(hc.float(), wc, ec) is None           # float32 rows
        assert bounded_weighted_swiglu(hc, wc.bfloat16(), ec) is None        # BF16 probs
        assert bounded_weighted_swiglu(wide[:, :32], wc, ec) is None         # not contiguous (width 32 is fine)
        assert bounded_weighted_swiglu(hc[:, :24], wc, ec) is None           # F = 12, not a multiple of 8
        assert bounded_weighted_swiglu(hc, wc, ec.long()) is None            # int64 ends


def _need_kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import ep_plugin._ext as ext
    if not ext.has_c():
        pytest.skip("ep_plugin._C is not built")


@pytest.mark.gpu
@pytest.mark.parametrize("rows,F,end", [(300, 256, 170), (64, 2048, 0), (64, 2048, 64), (40, 8, 90), (1000, 1024, 999),
                                        (20000, 64, 15000), (50, 320, 33)])
def test_bounded_weighted_swiglu_gpu(rows, F, end):
    _need_kernels()
    torch.manual_seed(rows + F + end)
    used = min(end, rows)
    h0 = (torch.randn(rows, 2 * F, device="cuda") * 3).bfloat16()
    w0 = torch.rand(rows, 1, device="cuda")
    h0[used:], w0[used:] = float("nan"), float("nan")  # past the end: never read
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    ends = torch.tensor([used // 2, end], dtype=torch.int32, device="cuda")
    y = bounded_weighted_swiglu(h, w, ends)
    assert y is not None and y.shape == (rows, F) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y[:used], ref_forward(h0[:used], w0[:used]), atol=0, rtol=0)
    g = torch.randn(rows, F, device="cuda").bfloat16()
    g[used:] = float("nan")  # what grouped_mm's backward leaves past the end: any bits
    y.backward(g)
    dh, dw = ref_backward(g[:used], h0[:used], w0[:used])
    torch.testing.assert_close(h.grad[:used], dh, atol=0, rtol=0)
    torch.testing.assert_close(w.grad[:used], dw, atol=1e-4 * F ** 0.5, rtol=1e-4)  # the sum's order differs
    assert torch.equal(w.grad[used:], torch.zeros(rows - used, 1, device="cuda"))


@pytest.mark.gpu
def test_bounded_weighted_swiglu_odd_gradient_view_gpu():
    _need_kernels()
    h0 = torch.randn(40, 64, device="cuda").bfloat16()
    w0 = torch.rand(40, 1, device="cuda")
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    y = bounded_weighted_swiglu(h, w, torch.tensor([40], dtype=torch.int32, device="cuda"))
    flat = torch.randn(40 * 32 + 1, device="cuda").bfloat16()
    g = flat[1:].view(40, 32)  # contiguous, 2 bytes past a 16-byte boundary
    assert g.is_contiguous() and g.data_ptr() % 16
    y.backward(g)
    dh, dw = ref_backward(g, h0, w0)
    torch.testing.assert_close(h.grad, dh, atol=0, rtol=0)
    torch.testing.assert_close(w.grad, dw, atol=1e-3, rtol=1e-4)
