"""The dispatch layout: the torch reference against a loop, and the CUDA kernel against the reference."""
import os
import shutil

import pytest
import torch

import ep_plugin._ext as ext
from ep_plugin.layout import dispatch_layout


def loop_layout(idx, E, W):
    epr = E // W
    per_rank, per_expert = [0] * W, [0] * E
    in_rank = torch.zeros(idx.shape[0], W, dtype=torch.bool)
    for t, row in enumerate(idx.tolist()):
        for e in row:
            if e >= 0:
                per_expert[e] += 1
                in_rank[t, e // epr] = True
    per_rank = in_rank.sum(0).tolist()
    return per_rank, per_expert, in_rank


def random_idx(T, K, E, gen, p_none=0.1):
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) if T else torch.empty(0, K)
    idx = idx.long()
    idx[torch.rand(idx.shape, generator=gen) < p_none] = -1
    return idx


@pytest.mark.parametrize("T,K,E,W", [(0, 2, 8, 2), (1, 1, 4, 4), (37, 8, 64, 4), (300, 2, 16, 8)])
def test_reference_layout_matches_loop(T, K, E, W):
    idx = random_idx(T, K, E, torch.Generator().manual_seed(T))
    r, e, m = dispatch_layout(idx, E, W)
    lr, le, lm = loop_layout(idx, E, W)
    assert r.tolist() == lr and e.tolist() == le and torch.equal(m, lm)


def test_compiled_module_is_built_where_nvcc_exists():
    if os.environ.get("EP_PLUGIN_BUILD_C", "") == "0" or not (shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")):
        pytest.skip("no nvcc here, so ep_plugin._C is legitimately absent")
    assert ext.has_c(), "nvcc is present but ep_plugin._C did not build/import"
    c = ext.get_c()
    assert c.cuda_runtime_version() >= 12000
    print(f"ep_plugin._C imported from {c.__file__}, CUDA runtime {c.cuda_runtime_version()}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T,K,E,W", [(0, 8, 256, 4), (1, 8, 256, 8), (4096, 8, 256, 4), (4096, 8, 256, 2),
                                     (8192, 2, 8, 8), (333, 6, 64, 64), (4096, 8, 256, 1)])
def test_layout_kernel_matches_reference(T, K, E, W):
    from ep_plugin.layout import dispatch_layout_cuda
    gen = torch.Generator().manual_seed(T * 7 + W)
    idx = random_idx(T, K, E, gen)
    if T > 8:
        idx[: T // 4] = -1          # tokens routed nowhere
        idx[T // 4: T // 2, 0] = 0  # skew towards expert 0
    cuda_idx = idx.cuda()
    r, e, m = dispatch_layout_cuda(cuda_idx, E, W)
    torch.cuda.synchronize()
    rr, re, rm = dispatch_layout(cuda_idx, E, W)
    assert torch.equal(r, rr) and torch.equal(e, re) and torch.equal(m, rm)
    print(f"layout kernel T={T} K={K} E={E} W={W}: tokens_per_rank={r.tolist()[:8]} ok")


def loop_merge(idx, w):
    """merge_repeats by its definition, slot by slot in Python (float64 sums: the kernel sums in slot order
    in float32, so a merged weight may differ in the last bit)."""
    out_idx, out_w = idx.clone(), torch.zeros(idx.shape, dtype=torch.float64)
    for t, row in enumerate(idx.tolist()):
        for k, e in enumerate(row):
            if e in row[:k]:
                out_idx[t, k] = -1
            out_w[t, k] = sum(float(w[t, j]) for j, f in enumerate(row) if f == e)
    return out_idx, out_w


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T,K,E", [(0, 8, 16), (1, 2, 4), (257, 8, 6), (4096, 8, 256), (77, 9, 3), (5, 1, 4)])
def test_merge_repeats_kernel_matches_definition(T, K, E):
    from ep_plugin._ext import c_op
    from ep_plugin.expert_major import merge_repeats, merge_repeats_torch

    gen = torch.Generator().manual_seed(T * 13 + K)
    idx = torch.randint(-1, E, (T, K), generator=gen)  # few experts: repeats and repeated -1s everywhere
    w = torch.rand(T, K, generator=gen)
    got_idx, got_w = merge_repeats(idx.cuda(), w.cuda())
    only_idx, none_w = merge_repeats(idx.cuda(), None)
    torch.cuda.synchronize()
    want_idx, want_w = loop_merge(idx, w)
    assert torch.equal(got_idx.cpu(), want_idx) and torch.equal(only_idx.cpu(), want_idx) and none_w is None
    torch.testing.assert_close(got_w.cpu().double(), want_w, rtol=2e-7, atol=0)
    ref_idx, ref_w = merge_repeats_torch(idx, w)  # the torch ops agree with the definition too
    assert torch.equal(ref_idx, want_idx)
    torch.testing.assert_close(ref_w.double(), want_w, rtol=2e-7, atol=0)
    assert c_op("merge_repeats") is not None, "ep_plugin._C lacks merge_repeats: the GPU path above ran the torch ops"
    # weights that record a gradient take the differentiable torch ops
    wg = w.cuda().requires_grad_()
    _, merged = merge_repeats(idx.cuda(), wg)
    if T and K > 1:
        assert merged.grad_fn is not None


@pytest.mark.parametrize("T,K,E", [(0, 8, 16), (1, 2, 4), (257, 8, 6), (77, 9, 3), (64, 33, 5), (5, 1, 4)])
def test_repeats_share_grad_matches_merge_repeats_torch(T, K, E):
    """expert_major.repeats_share_grad (weights with a gradient, for a backend whose kernels merge repeats:
    nvlink's stage) is a view of the weights, and with the gradient such a backend's backward gives (its
    row's at an expert's first slot, 0 at the repeats and at -1: their positions are -1) every slot gets
    the gradient it gets through merge_repeats_torch."""
    from ep_plugin.expert_major import merge_repeats_torch, repeats_share_grad

    gen = torch.Generator().manual_seed(T * 7 + K)
    idx = torch.randint(-1, E, (T, K), generator=gen)
    w = torch.rand(T, K, generator=gen)
    want_idx, _ = merge_repeats_torch(idx, w)
    keep = want_idx >= 0  # the slots that route: first slots of valid experts
    coef = torch.randn(T, K, generator=gen)  # the gradient of each expert's row weight
    wa, wb = w.clone().requires_grad_(), w.clone().requires_grad_()
    va = repeats_share_grad(idx, wa)
    assert va.data_ptr() == wa.data_ptr() and torch.equal(va, wa)
    va.backward(coef * keep)
    (merge_repeats_torch(idx, wb)[1] * coef * keep).sum().backward()
    torch.testing.assert_close(wa.grad, wb.grad, rtol=0, atol=0)
    if T and K > 1 and torch.cuda.is_available():  # the backward's ops on the GPU too
        wc = w.cuda().requires_grad_()
        repeats_share_grad(idx.cuda(), wc).backward((coef * keep).cuda())
        torch.testing.assert_close(wc.grad.cpu(), wb.grad, rtol=0, atol=0)
