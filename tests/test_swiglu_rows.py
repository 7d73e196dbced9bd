"""bounded_weighted_swiglu (EPGroupedMLP.bounded_activation): megatron's weighted SwiGLU and its backward over the rows
before the last expert's end only (csrc/experts/swiglu_rows.cu) -- against the same formulas as torch ops on those
rows (megatron's fused_bias_swiglu.weighted_swiglu / weighted_swiglu_back, eager), a zero weight gradient past them,
and None (the torch form) wherever the kernels do not apply."""
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
        assert bounded_weighted_swiglu(hc.float(), wc, ec) is None           # float32 rows
        assert bounded_weighted_swiglu(hc, wc.bfloat16(), ec) is None        # BF16 probs
        assert bounded_weighted_swiglu(hc[:, :24], wc, ec) is None           # not contiguous
        assert bounded_weighted_swiglu(hc, wc, ec.long()) is None            # int64 ends


@pytest.mark.gpu
@pytest.mark.parametrize("rows,F,end", [(300, 256, 170), (64, 2048, 0), (64, 2048, 64), (40, 8, 90), (1000, 1024, 999)])
def test_bounded_weighted_swiglu_gpu(rows, F, end):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import ep_plugin._ext as ext
    if not ext.has_c():
        pytest.skip("ep_plugin._C is not built")
    torch.manual_seed(rows + F + end)
    h = (torch.randn(rows, 2 * F, device="cuda") * 3).bfloat16().requires_grad_()
    w = torch.rand(rows, 1, device="cuda", requires_grad=True)
    ends = torch.tensor([end // 2, end], dtype=torch.int32, device="cuda")
    y = bounded_weighted_swiglu(h, w, ends)
    assert y is not None and y.shape == (rows, F) and y.dtype == torch.bfloat16
    used = min(end, rows)
    want = ref_forward(h.detach()[:used], w.detach()[:used])
    torch.testing.assert_close(y[:used], want, atol=0, rtol=8e-3)  # one BF16 step at most (exp's last bit)
    g = torch.randn(rows, F, device="cuda").bfloat16()
    g[used:] = float("nan")  # what grouped_mm's backward leaves past the end: any bits
    y.backward(g)
    dh, dw = ref_backward(g[:used], h.detach()[:used], w.detach()[:used])
    torch.testing.assert_close(h.grad[:used], dh, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(w.grad[:used], dw, atol=1e-3 * F ** 0.5, rtol=1e-3)
    assert torch.equal(w.grad[used:], torch.zeros(rows - used, 1, device="cuda"))
