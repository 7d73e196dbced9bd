"""The low-latency calls' fuzzer (issue 31): random T (0 included, up to M), K (0 and past 32 as faults),
repeated experts, FP8 or BF16, round_scale, hooks, async, handles of other buffers; valid and invalid.
Run by fuzz_cases.fuzz_body(..., low_latency=True), same protocol: rank 0 draws each case and
broadcasts it, every rank runs it, rank 0 asserts. The experts are the identity, so the reference is local: y[t] = sum over k ascending of
w[t, k] * row(t, k) in float32 (one row per (token, expert): a repeated expert weighs twice)."""
from __future__ import annotations


import torch

import ep_plugin
from tests.fuzz_cases import Bad, _expect, inputs

FAULTS = ("x_dtype", "x_hidden", "x_tokens", "x_noncontig", "idx_dtype", "idx_k0", "idx_k33", "idx_rows",
          "idx_noncontig", "idx_range", "fp8_flag", "round_scale", "c_other", "c_weights", "c_rows", "c_out",
          "c_idx")


def case_strategy(num_buffers: int, M: int):
    from hypothesis import strategies as st

    return st.fixed_dictionaries({
        "buf": st.integers(0, num_buffers - 1), "T": st.integers(0, M), "K": st.integers(1, 5),
        "seed": st.integers(0, 2 ** 31 - 1), "fp8": st.booleans(), "round_scale": st.booleans(),
        "hook": st.booleans(), "async_op": st.booleans(), "repeats": st.booleans(),
        "fault": st.one_of(st.none(), st.sampled_from(FAULTS)),
    })


def build_buffers(backend: str, shapes, M: int, comm=None):
    bufs = []
    for H, E in shapes:
        b = ep_plugin.EPBuffer(None, {"moe": {"num_experts": E, "topk": min(5, E)},
                                      "comm": {"backend": backend, "timeout_s": 60,
                                               "low_latency": {"max_tokens_per_rank": M},
                                               **(comm or {})}}, hidden=H)
        bufs.append(b)
    return bufs


def run(case, rank, world, bufs, shapes, device, M):
    H, E = shapes[case["buf"]]
    buf = bufs[case["buf"]]
    E_l = E // world
    fault = case["fault"]
    fp8 = case["fp8"] and H % 128 == 0
    rs = case["round_scale"] and fp8
    xs, idxs, ws = inputs(case, world, H, E, M, cap_k=True)  # the engines are sized for moe.topk <= E
    xs = [x.to(torch.bfloat16) for x in xs]
    x, idx, w = xs[rank].to(device), idxs[rank].to(device), ws[rank].to(device)
    T, K = idx.shape
    few = min(t.shape[0] for t in xs)
    V, Te = ValueError, TypeError
    kw = dict(use_fp8=fp8, round_scale=rs, async_op=case["async_op"], return_recv_hook=case["hook"])
    d = buf.low_latency_dispatch
    if fault == "x_dtype":
        return _expect(lambda: d(x.float(), idx, **kw), Te, "x")
    if fault == "x_hidden":
        return _expect(lambda: d(torch.zeros(T, H + 8, dtype=torch.bfloat16, device=device), idx, **kw), V, "x")
    if fault == "x_tokens":
        return _expect(lambda: d(torch.zeros(M + 1, H, dtype=torch.bfloat16, device=device),
                                 torch.zeros(M + 1, 1, dtype=torch.int64, device=device), **kw), V,
                       "max_tokens_per_rank")
    if fault == "x_noncontig" and few > 1:
        wide = torch.zeros(T, 2 * H, dtype=torch.bfloat16, device=device)[:, ::2]
        return _expect(lambda: d(wide, idx, **kw), V, "x must be contiguous")
    if fault == "idx_dtype":
        return _expect(lambda: d(x, idx.int(), **kw), Te, "topk_idx")
    if fault == "idx_k0":
        return _expect(lambda: d(x, idx[:, :0].contiguous(), **kw), V, "topk")
    if fault == "idx_k33":
        return _expect(lambda: d(x, torch.full((T, 33), -1, dtype=torch.int64, device=device), **kw), V, "topk")
    if fault == "idx_rows":
        return _expect(lambda: d(x, torch.zeros(T + 1, K, dtype=torch.int64, device=device), **kw), V, "topk_idx")
    if fault == "idx_noncontig" and few > 1 and K > 1:
        return _expect(lambda: d(x, idx.t().contiguous().t(), **kw), V, "topk_idx must be contiguous")
    if fault == "idx_range" and few:
        bad = idx.clone()
        bad[0, 0] = E if case["seed"] % 2 else -2

        def call():
            out = d(x, bad, **kw)
            if out[4] is not None:
                out[4]()
        return _expect(call, V, "topk_idx values", buf)
    if fault == "fp8_flag":
        return _expect(lambda: d(x, idx, use_fp8=1), Te, "use_fp8")
    if fault == "round_scale":
        return _expect(lambda: d(x, idx, use_fp8=False, round_scale=True), V, "round_scale")

    recv_x, count, handle, event, hook = d(x, idx, **kw)
    if hook is not None:
        hook()
    if event is not None:
        event.current_stream_wait()
    problems = []
    # counts and rows: for each local expert, the rows by source rank, then token index
    want_count = []
    for e in range(E_l):
        g = rank * E_l + e
        rows = [xs[s][t] for s in range(world) for t in range(idxs[s].shape[0]) if g in idxs[s][t].tolist()]
        want_count.append(len(rows))
        if not fp8 and rows and not torch.equal(recv_x[e, :len(rows)].cpu(), torch.stack(rows)):
            problems.append(f"rows of local expert {e} differ")
    if count.cpu().tolist() != want_count:
        problems.append(f"recv_count {count.cpu().tolist()}, want {want_count}")
    rows = recv_x if not fp8 else \
        (recv_x[0].float() * recv_x[1].repeat_interleave(128, dim=-1)).to(torch.bfloat16)
    rows = rows.contiguous()

    late = None
    c = buf.low_latency_combine
    if fault == "c_other":
        others = [j for j, (h2, e2) in enumerate(shapes) if j != case["buf"]]
        if others:
            late = (lambda: bufs[others[0]].low_latency_combine(rows, idx, w, handle), V, "handle")
    elif fault == "c_weights":
        late = (lambda: c(rows, idx, torch.cat([w, w], 1), handle), V, "topk_weights")
    elif fault == "c_rows":
        late = (lambda: c(rows[:, :-1].contiguous(), idx, w, handle), V, "x")
    elif fault == "c_out":
        late = (lambda: c(rows, idx, w, handle, out=torch.empty(T, H, device=device)), Te, "out")
    elif fault == "c_idx":
        late = (lambda: c(rows, idx.int(), w, handle), Te, "topk_idx")
    if late is not None:
        if problems:
            raise Bad("; ".join(problems))
        return _expect(*late)

    y, event, hook = c(rows, idx, w, handle, async_op=case["async_op"], return_recv_hook=case["hook"])
    if hook is not None:
        hook()
    if event is not None:
        event.current_stream_wait()
    want = torch.zeros(T, H, dtype=torch.float32)
    xf = xs[rank].float()
    for k in range(K):
        on = (idxs[rank][:, k] >= 0).unsqueeze(1)
        want = want + torch.where(on, ws[rank][:, k:k + 1] * xf, torch.zeros_like(xf))
    got = y.float().cpu()
    tol = 0.15 if fp8 else 2e-2
    if got.shape != want.shape or not torch.allclose(got, want.to(torch.bfloat16).float(), rtol=tol, atol=tol):
        err = (got - want).abs().max() if got.shape == want.shape else f"shape {tuple(got.shape)}"
        problems.append(f"combine differs: max error {err}")
    if problems:
        raise Bad("; ".join(problems))
