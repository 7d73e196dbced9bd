"""The call-form fuzzer of issue 31, shared by the CPU run (test_fuzz_checks.py: torch backend, gloo) and
the GPU runs (test_fuzz_gpu.py): random T (0 included), H (odd widths where the backend takes them), E,
K, dtypes, devices, contiguity, handles from other calls and buffers; valid and invalid.

Every valid case must equal tests/reference.py; every invalid one must raise a ValueError/TypeError
naming the argument before anything moves (expert ids out of range: when found on the device, at the
next check), and the group must stay usable (the next case runs on it).

One group per run: rank 0 draws the cases with hypothesis and broadcasts each to the other ranks, which
follow; every rank runs the case on the same few EPBuffers and reports, rank 0 asserts. A fault is
applied on every rank alike, so a refused call never leaves a peer inside a collective.
"""
from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import ep_plugin
from ep_plugin.expert_major import merge_repeats
from tests.reference import reference_dispatch, reference_expert_dispatch

FAULTS = ("x_dtype", "x_hidden", "x_noncontig", "x_device", "x_tokens", "idx_dtype", "idx_rows", "idx_k0",
          "idx_noncontig", "idx_range", "w_dtype", "w_shape", "layout", "alignment", "cached_idx", "cached_w",
          "other_buffer", "combine_rows", "combine_dtype", "fp8_scales")
DTYPES = ("float32", "bfloat16", "float16", "fp8")


class Bad(Exception):
    """A fault case whose call did not raise what it must."""


def case_strategy(num_buffers: int, max_tokens: int):
    from hypothesis import strategies as st

    return st.fixed_dictionaries({
        "buf": st.integers(0, num_buffers - 1), "T": st.integers(0, max_tokens), "K": st.integers(1, 4),
        "seed": st.integers(0, 2 ** 31 - 1), "dtype": st.sampled_from(DTYPES), "weights": st.booleans(),
        "layout": st.sampled_from(("rank", "expert")), "alignment": st.integers(1, 3),
        "async_op": st.booleans(), "repeats": st.booleans(), "cached": st.booleans(),
        "fault": st.one_of(st.none(), st.sampled_from(FAULTS)),
    })


def build_buffers(backend: str, shapes, max_tokens: int, comm=None):
    """One EPBuffer per (hidden, experts), reused by every case."""
    return [ep_plugin.EPBuffer(None, {"moe": {"num_experts": E, "topk": 1},
                                      "comm": {"backend": backend, "max_tokens_per_rank": max_tokens,
                                               "timeout_s": 20, **(comm or {})}}, hidden=H) for H, E in shapes]


def inputs(case, world, H, E, max_tokens, cap_k=False):
    """Every rank's (x float32, topk_idx, weights) are a function of the case: each rank rebuilds all of
    them (the reference). K past E only with repeats, unless cap_k."""
    xs, idxs, ws = [], [], []
    for r in range(world):
        g = torch.Generator().manual_seed(case["seed"] + 7919 * r)
        T = (case["T"] + 3 * r) % (max_tokens + 1)
        K = case["K"] if case["repeats"] and not cap_k else min(case["K"], E)
        x = torch.randn(T, H, generator=g)
        if case["repeats"]:
            idx = torch.randint(-1, E, (T, K), generator=g)
        else:
            idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
                torch.empty(0, K, dtype=torch.int64)
            idx[torch.rand(T, K, generator=g) < 0.15] = -1
        xs.append(x), idxs.append(idx), ws.append(torch.rand(T, K, generator=g))
    return xs, idxs, ws


def _rows(x, dtype: str, H: int):
    """x [T, H] float32 -> what dispatch takes, and the float32 the rows carry (the reference)."""
    if dtype == "fp8":
        T = x.shape[0]
        scales = x.view(T, H // 128, 128).abs().amax(-1).clamp(min=1e-4) / 448.0
        data = (x.view(T, H // 128, 128) / scales.unsqueeze(-1)).view(T, H).to(torch.float8_e4m3fn)
        return (data, scales.contiguous()), data.float()
    t = x.to(getattr(torch, dtype))
    return t, t.float()


def _expect(call, exc, word: str, buf=None):
    """call() must raise exc naming `word` (expert ids found on the device: raised by buf.check())."""
    try:
        call()
        if buf is not None:
            if torch.cuda.is_available():  # the documented rule: raised at the first check after the device ran
                torch.cuda.synchronize()  # (an async_op dispatch may still be queued on the comm stream)
            buf.check()
    except (ValueError, TypeError) as e:
        if not isinstance(e, exc) or word not in str(e):
            raise Bad(f"expected {exc.__name__} naming {word!r}, got {type(e).__name__}: {e}") from e
        return
    raise Bad(f"expected {exc.__name__} naming {word!r}, nothing raised")


def _close(problems, got, want, what, tol):
    """Note a difference (the case goes on: a rank that stopped early would leave its peers in a collective)."""
    if got.shape != want.shape or not torch.allclose(got.float().cpu(), want.float().cpu(), rtol=tol, atol=tol):
        problems.append(f"{what} differs from the reference: got {tuple(got.shape)} {got.flatten()[:6].tolist()}, "
                  f"want {tuple(want.shape)} {want.flatten()[:6].tolist()}")


def _same(problems, got, want, what):
    if got != want:
        problems.append(f"{what} {got}, want {want}")


def run_case(run, case, rank, *args) -> str:
    """One case on this rank, run(case, rank, *args): '' when it behaved, else what went wrong."""
    try:
        run(case, rank, *args)
        return ""
    except Bad as e:
        return f"rank {rank}: {e}"
    except Exception as e:  # noqa: BLE001 - reported to rank 0 with the case
        return f"rank {rank}: {type(e).__name__}: {e}"


def run(case, rank, world, bufs, shapes, device, max_tokens):
    H, E = shapes[case["buf"]]
    buf = bufs[case["buf"]]
    caps = buf.capabilities
    fault, dtype, layout = case["fault"], case["dtype"], case["layout"]
    if dtype == "fp8" and (H % 128 or not caps.fp8):
        dtype = "bfloat16"
    if dtype != "fp8" and getattr(torch, dtype) not in caps.row_dtypes:
        dtype = "bfloat16"
    xs, idxs, ws = inputs(case, world, H, E, max_tokens)
    if caps.max_topk is not None and idxs[0].shape[1] > caps.max_topk:
        return
    x, rows = _rows(xs[rank], dtype, H)
    move = (lambda t: t.to(device)) if device != "cpu" else (lambda t: t)
    x = tuple(move(t) for t in x) if isinstance(x, tuple) else move(x)
    idx, w = move(idxs[rank]), move(ws[rank]) if case["weights"] else None
    kw = dict(layout=layout, expert_alignment=case["alignment"], async_op=case["async_op"])
    data = x[0] if isinstance(x, tuple) else x
    T = data.shape[0]
    rowdt = data.dtype if data.dtype in caps.row_dtypes else torch.bfloat16  # a dtype this buffer moves
    few = min(t.shape[0] for t in xs)  # a fault applies on every rank or on none (no rank left in a collective)
    V, Te = ValueError, TypeError

    # faults of the fresh dispatch's arguments (the same on every rank: nothing moves on any)
    if fault == "x_dtype":
        return _expect(lambda: buf.dispatch(data.to(torch.int32), idx, w, **kw), Te, "x")
    if fault == "x_hidden":
        return _expect(lambda: buf.dispatch(torch.zeros(T, H + 1, dtype=rowdt, device=device), idx, w, **kw), V, "x")
    if fault == "x_noncontig" and few > 1:
        wide = torch.zeros(T, 2 * H, dtype=rowdt, device=device)[:, ::2]
        return _expect(lambda: buf.dispatch(wide, idx, w, **kw), V, "x must be contiguous")
    if fault == "x_device":
        meta = torch.zeros(T, H, dtype=rowdt, device="meta")
        return _expect(lambda: buf.dispatch(meta, idx.to("meta"), None if w is None else w.to("meta"), **kw), V, "x")
    if fault == "x_tokens":
        big = torch.zeros(max_tokens + 1, H, dtype=rowdt, device=device)
        return _expect(lambda: buf.dispatch(big, torch.zeros(max_tokens + 1, 1, dtype=torch.int64, device=device)),
                       V, "max_tokens_per_rank")
    if fault == "idx_dtype":
        return _expect(lambda: buf.dispatch(x, idx.int(), w, **kw), Te, "topk_idx")
    if fault == "idx_rows":
        return _expect(lambda: buf.dispatch(x, torch.cat([idx, idx[:1] if T else idx.new_zeros(1, idx.shape[1])]),
                                            **kw), V, "topk_idx")
    if fault == "idx_k0":
        return _expect(lambda: buf.dispatch(x, idx[:, :0].contiguous(), **kw), V, "topk_idx")
    if fault == "idx_noncontig" and few > 1 and idx.shape[1] > 1:
        return _expect(lambda: buf.dispatch(x, idx.t().contiguous().t(), **kw), V, "topk_idx must be contiguous")
    if fault == "idx_range" and few:
        bad = idx.clone()
        bad[0, 0] = E if case["seed"] % 2 else -2
        return _expect(lambda: buf.dispatch(x, bad, w, **kw), V, "topk_idx values", buf)
    if fault == "w_dtype" and w is not None:
        return _expect(lambda: buf.dispatch(x, idx, w.double(), **kw), Te, "topk_weights")
    if fault == "w_shape" and w is not None:
        return _expect(lambda: buf.dispatch(x, idx, torch.cat([w, w], 1), **kw), V, "topk_weights")
    if fault == "layout":
        return _expect(lambda: buf.dispatch(x, idx, w, layout="experts"), V, "layout")
    if fault == "alignment":
        return _expect(lambda: buf.dispatch(x, idx, w, layout="expert", expert_alignment=0), V, "expert_alignment")
    if fault == "fp8_scales" and isinstance(x, tuple):
        return _expect(lambda: buf.dispatch((x[0], x[1][:, :1].contiguous()), idx, w, **kw), V, "x[1]")

    # a valid dispatch, checked against the reference
    problems = []
    res = buf.dispatch(x, idx, w, **kw)
    if res.event is not None:
        res.event.current_stream_wait()
    expert = layout == "expert"
    rx = res.x[0] if isinstance(res.x, tuple) else res.x
    if expert:
        merged = [merge_repeats(i, wt) for i, wt in zip(idxs, ws)]
        mi, mw = [m[0] for m in merged], [m[1] for m in merged]
        rowsf = [_rows(xx, dtype, H)[1] for xx in xs]
        ref_x, ref_w, offsets, tpe = reference_expert_dispatch(rowsf, mi, mw, rank, E, case["alignment"])
        n = offsets[-1]
        _close(problems, rx[:n], ref_x, "expert-major rows", 0)
        if w is not None:
            _close(problems, res.topk_weights[:n], ref_w, "expert-major weights", 1e-6)
        _same(problems, res.tokens_per_expert, tpe, "tokens_per_expert")
    else:
        rowsf = [_rows(xx, dtype, H)[1] for xx in xs]
        ref_x, ref_idx, ref_w, tpe = reference_dispatch(rowsf, idxs, ws, rank, E)
        n = ref_x.shape[0]
        _close(problems, rx[:n], ref_x, "rows", 0)
        _close(problems, res.topk_idx[:n], ref_idx, "topk_idx", 0)
        if w is not None:
            _close(problems, res.topk_weights[:n], ref_w, "weights", 1e-6)
        _same(problems, res.tokens_per_expert, tpe, "tokens_per_expert")

    # faults of the calls that take its handle
    h = res.handle
    cdt = torch.float32 if torch.float32 in caps.combine_dtypes else torch.bfloat16
    back = rx.to(cdt) if rx.dtype != cdt else rx
    late = None  # (call, exception, word): no collective follows, so a rank may stop here
    if fault == "cached_idx":
        late = (lambda: buf.dispatch(x, idx.clone(), handle=h), V, "topk_idx")
    elif fault == "cached_w" and idx.shape[1] > 1:
        late = (lambda: buf.dispatch(x, handle=h, topk_weights=torch.ones(T, 1, device=device)), V, "topk_weights")
    elif fault == "other_buffer" and [e2 for h2, e2 in shapes].count(E) > 1:
        j = next(i for i, (h2, e2) in enumerate(shapes) if e2 == E and i != case["buf"])
        rows2 = torch.zeros(back.shape[0], shapes[j][0], dtype=cdt, device=device)
        late = (lambda: bufs[j].combine(rows2, h), V, "handle")
    elif fault == "combine_rows":
        late = (lambda: buf.combine(torch.cat([back, back[:1] if back.shape[0] else back.new_zeros(1, H)]), h), V,
                "x")
    elif fault == "combine_dtype":
        late = (lambda: buf.combine(back.to(torch.int64), h), Te, "x")
    if late is not None:
        if problems:
            raise Bad("; ".join(problems))
        return _expect(*late)

    if case["cached"]:
        again = buf.dispatch(x, handle=h, topk_weights=w)
        if again.event is not None:
            again.event.current_stream_wait()
        ax = again.x[0] if isinstance(again.x, tuple) else again.x
        _close(problems, ax[:n], rx[:n], "cached rows", 0)
        if w is not None:
            _close(problems, again.topk_weights[:n], res.topk_weights[:n], "cached weights", 0)

    # combine: the experts are the identity, so y = x times the (rank or expert) copies the token made
    y = buf.combine(back, h)
    if isinstance(y, tuple):
        y[-1].current_stream_wait()
        y = y[0]
    i = idxs[rank]
    if expert:
        m = merge_repeats(i, None)[0]
        copies = (m >= 0).sum(1, keepdim=True)
    else:
        epr = E // world
        copies = torch.stack([((i >= 0) & (i // epr == r)).any(1) for r in range(world)], 1).sum(1, keepdim=True)
    want = rows.to(cdt).float() * copies
    _close(problems, y.float(), want, "combine", 1e-5 if cdt == torch.float32 else 3e-2)
    if problems:
        raise Bad("; ".join(problems))


def lead_or_follow(rank, world, strategy, run, examples, out):
    """The fuzz protocol: rank 0 draws `examples` cases from `strategy` (hypothesis, derandomized) and
    broadcasts each; every rank calls run(case) -> '' or what went wrong; rank 0 asserts on all ranks'
    answers, then writes "<cases> <seconds>" to `out`. The other ranks follow until rank 0 sends None."""
    group = dist.group.WORLD
    count, failed = [0], []

    def both(case):
        box = [case]
        dist.broadcast_object_list(box, src=0, group=group)
        case = box[0]
        if case is None:
            return None
        msgs = [None] * world
        dist.all_gather_object(msgs, run(case), group=group)
        errors = [m for m in msgs if m]
        if errors and rank == 0 and not failed:
            failed.append(case)  # the first failure as found, before hypothesis shrinks it
            print(f"fuzz: first failing case {case}: {'; '.join(errors)}", file=sys.stderr, flush=True)
        return errors

    if rank != 0:
        while both(None) is not None:
            pass
        return
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(strategy)
    def fuzz(case):
        count[0] += 1
        errors = both(case)
        assert not errors, f"case {case}: " + "; ".join(errors)

    start = time.perf_counter()
    try:
        fuzz()
    finally:
        dist.broadcast_object_list([None], src=0, group=group)
    with open(out, "w") as f:
        f.write(f"{count[0]} {time.perf_counter() - start:.1f}\n")


def set_device(rank, device) -> None:
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:  # ranks share the cores: intra-op threads of two processes spinning on 2 cores cost ~100x
        torch.set_num_threads(1)


def fuzz_body(rank, world, backend, shapes, device, max_tokens, examples, out, comm=None, low_latency=False):
    """One fuzz run on `backend`: one EPBuffer per (hidden, experts) of `shapes` (extra `comm` keys),
    `max_tokens` per rank (comm.low_latency.max_tokens_per_rank with low_latency: fuzz_ll_cases.py)."""
    import tests.fuzz_ll_cases as ll

    cases = ll if low_latency else sys.modules[__name__]
    set_device(rank, device)
    bufs = cases.build_buffers(backend, shapes, max_tokens, comm)
    try:
        lead_or_follow(rank, world, cases.case_strategy(len(shapes), max_tokens),
                       lambda case: run_case(cases.run, case, rank, world, bufs, shapes, device, max_tokens), examples,
                       out)
    finally:  # rank 0 raises when a case failed: it too must reach close()'s collective, or the others hang there
        for b in bufs:
            b.close()
