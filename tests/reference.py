"""Single-process reference of the dispatch/combine contract, differentiable, over all ranks' inputs."""
from __future__ import annotations

import torch


def make_inputs(world, tokens, hidden, num_experts, topk, seed, dtype=torch.float32, mode="random"):
    """All ranks' inputs, identical on every rank (same seed). tokens: int or per-rank list.

    mode: random (with some -1), skew (every token to expert 0), nowhere (all -1),
    starve_last (no token picks the last rank's experts), repeats (as random, and every other token
    names its first expert again in its second pick)."""
    g = torch.Generator().manual_seed(seed)
    counts = tokens if isinstance(tokens, (list, tuple)) else [tokens] * world
    epr = num_experts // world
    xs, idxs, ws = [], [], []
    for T in counts:
        x = torch.randn(T, hidden, generator=g).to(dtype)
        pool = num_experts - (epr if mode == "starve_last" else 0)
        idx = torch.stack([torch.randperm(pool, generator=g)[:topk] for _ in range(T)]) if T else \
            torch.empty(0, topk, dtype=torch.int64)
        idx = idx.to(torch.int64)
        if mode in ("random", "repeats") and T:
            idx[torch.rand(T, topk, generator=g) < 0.15] = -1
            if mode == "repeats" and topk > 1:
                idx[::2, 1] = idx[::2, 0]
        elif mode == "skew":
            idx[:] = -1
            idx[:, 0] = 0
        elif mode == "nowhere":
            idx[:] = -1
        w = torch.rand(T, topk, generator=g)
        xs.append(x), idxs.append(idx), ws.append(w)
    return xs, idxs, ws


def reference_dispatch(xs, idxs, ws, rank, num_experts):
    """What rank `rank` must receive: (rows, local topk_idx, weights, tokens_per_expert)."""
    world = len(xs)
    epr = num_experts // world
    rows, lidx, lw = [], [], []
    for src in range(world):
        idx = idxs[src]
        mine = (idx >= 0) & (idx // epr == rank)
        sel = mine.any(1).nonzero()[:, 0]
        rows.append(xs[src].index_select(0, sel))
        lidx.append(torch.where(mine, idx - rank * epr, -1).index_select(0, sel))
        lw.append(torch.where(mine, ws[src], 0.0).index_select(0, sel))
    tpe = [sum(int((i == rank * epr + e).sum()) for i in idxs) for e in range(epr)]
    return torch.cat(rows), torch.cat(lidx), torch.cat(lw), tpe


def reference_combine(per_rank_rows, idxs, src, num_experts):
    """y on rank `src` from every rank's rows (in each rank's receive order), float32 sum."""
    world = len(idxs)
    epr = num_experts // world
    T = idxs[src].shape[0]
    y = torch.zeros(T, per_rank_rows[0].shape[1], dtype=torch.float32)
    for r in range(world):
        # offset of src's rows inside rank r's receive buffer
        before = sum(int(((i >= 0) & (i // epr == r)).any(1).sum()) for i in idxs[:src])
        sel = ((idxs[src] >= 0) & (idxs[src] // epr == r)).any(1).nonzero()[:, 0]
        y = y.index_add(0, sel, per_rank_rows[r][before:before + len(sel)].float())
    return y


def reference_expert_dispatch(xs, idxs, ws, rank, num_experts, alignment=1):
    """What rank `rank` must receive in the expert-major layout: (rows [N, H], weights [N], offsets
    [E_local + 1], tokens_per_expert). Expert e's rows in received order, zero rows pad each segment
    to a multiple of `alignment`."""
    rx, ridx, rw, tpe = reference_dispatch(xs, idxs, ws, rank, num_experts)
    epr = num_experts // len(xs)
    rows, wts, offsets = [], [], [0]
    for e in range(epr):
        n = 0
        for i in range(rx.shape[0]):
            for k in range(ridx.shape[1]):
                if int(ridx[i, k]) == e:
                    rows.append(rx[i])
                    wts.append(float(rw[i, k]))
                    n += 1
        while n % alignment:
            rows.append(torch.zeros_like(rx[0]) if rx.shape[0] else torch.zeros(rx.shape[1], dtype=rx.dtype))
            wts.append(0.0)
            n += 1
        offsets.append(offsets[-1] + n)
    H = rx.shape[1]
    x = torch.stack(rows) if rows else torch.zeros(0, H, dtype=rx.dtype)
    return x, torch.tensor(wts, dtype=torch.float32), offsets, tpe


def reference_cast_fp8(rows, round_scale=False):
    """The low-latency FP8 cast of DESIGN.md / docs/LOW_LATENCY.md, written here in plain torch (not taken
    from ep_plugin): per token and per block of 128 channels, in float32, amax = max(max|x|, 1e-4);
    scale = amax * float32(1/448) and data = x * (float32(1/amax) * 448); with round_scale the scale is
    the power of two at or above amax / 448 (from frexp, not log2) and data = x / scale (exact)."""
    device, rows = rows.device, rows.cpu()
    n, h = rows.shape
    out = torch.empty(n, h, dtype=torch.float8_e4m3fn)
    scales = torch.empty(n, h // 128, dtype=torch.float32)
    inv448 = torch.tensor(1.0 / 448.0, dtype=torch.float32)
    for b in range(h // 128):
        blk = rows[:, b * 128:(b + 1) * 128].to(torch.float32)
        amax = torch.maximum(blk.abs().max(dim=1).values, torch.tensor(1e-4, dtype=torch.float32))
        if round_scale:
            mant, exp = torch.frexp(amax * inv448)  # v = mant * 2^exp, mant in [0.5, 1)
            scale = torch.ldexp(torch.ones_like(mant), torch.where(mant == 0.5, exp - 1, exp))
            out[:, b * 128:(b + 1) * 128] = (blk * (1.0 / scale).unsqueeze(1)).to(torch.float8_e4m3fn)
        else:
            scale = amax * inv448
            factor = (torch.ones_like(amax) / amax) * torch.tensor(448.0, dtype=torch.float32)
            out[:, b * 128:(b + 1) * 128] = (blk * factor.unsqueeze(1)).to(torch.float8_e4m3fn)
        scales[:, b] = scale
    return out.to(device), scales.to(device)


def ll_combine_reference(rows, idx, w, E_l, owner=True):
    """y [T, H] BF16 of a low-latency combine (docs/LOW_LATENCY.md): rows[k] [T, H] float32 is what pick k's
    expert returns for each token, idx [T, K] the picks (-1: nowhere), w [T, K] float32, E_l experts per rank.
    source: `acc = acc + w * row` over k ascending, float32, then BF16; owner (comm.low_latency.combine_reduce,
    the default): each rank's picks summed that way and rounded to BF16, those sums added in float32 in the
    order of each rank's first pick, then BF16."""
    K = idx.shape[1]
    valid = idx >= 0
    acc = torch.zeros_like(rows[0])
    if not owner:
        for k in range(K):
            acc = torch.where(valid[:, k:k + 1], acc + w[:, k:k + 1] * rows[k], acc)
        return acc.to(torch.bfloat16)
    rank = torch.div(idx, E_l, rounding_mode="floor")
    for k in range(K):  # where k is its rank's first pick, that rank's sum joins
        first = valid[:, k] & ~((rank[:, :k] == rank[:, k:k + 1]) & valid[:, :k]).any(1)
        part = torch.zeros_like(acc)
        for q in range(k, K):
            same = (valid[:, q] & (rank[:, q] == rank[:, k]) & first).unsqueeze(1)
            part = torch.where(same, part + w[:, q:q + 1] * rows[q], part)
        acc = torch.where(first.unsqueeze(1), acc + part.to(torch.bfloat16).float(), acc)
    return acc.to(torch.bfloat16)
