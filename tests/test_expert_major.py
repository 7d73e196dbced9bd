"""The expert-major layout (dispatch(..., layout="expert")) on the torch backend, against a loop
reference, in real gloo groups; and the layout planner itself on single-process inputs."""
import pytest
import torch

import ep_plugin
from ep_plugin import expert_major
from tests._dist import parts_per_world
from tests.reference import make_inputs, reference_expert_dispatch

H, K = 32, 4


def _buf(E, topk=K, hidden=H, backend="torch"):
    cfg = {"moe": {"num_experts": E, "topk": topk},
           "comm": {"backend": backend, "max_tokens_per_rank": 128}}
    return ep_plugin.EPBuffer(None, cfg, hidden=hidden)


def check_expert_case(buf, rank, world, E, tokens, seed, mode, alignment, topk=K, hidden=H, device="cpu"):
    xs, idxs, ws = make_inputs(world, tokens, hidden, E, topk, seed, torch.float32, mode)
    ctx = f"rank {rank} world {world} tokens {tokens} mode {mode} seed {seed} alignment {alignment}"
    res = buf.dispatch(xs[rank].to(device), idxs[rank].to(device), ws[rank].to(device), layout="expert",
                       expert_alignment=alignment)
    assert isinstance(res, ep_plugin.ExpertDispatchResult), ctx
    rx, rw, offsets, tpe = reference_expert_dispatch(xs, idxs, ws, rank, E, alignment)
    n = offsets[-1]
    assert res.expert_offsets.tolist() == offsets, ctx
    assert res.tokens_per_expert == tpe and res.num_tokens_per_expert.tolist() == tpe, ctx
    assert res.padded_tokens_per_expert == [b - a for a, b in zip(offsets, offsets[1:])], ctx
    assert res.x.shape[0] >= n, ctx
    assert torch.equal(res.x[:n].cpu(), rx), ctx
    assert torch.equal(res.topk_weights[:n].cpu(), rw), ctx
    # combine: expert e's rows scaled by (1 + its global id): token t gets x_t * sum over its experts
    epr = E // world
    seg = torch.repeat_interleave(torch.arange(epr), torch.tensor([b - a for a, b in zip(offsets, offsets[1:])]))
    scale = torch.zeros(res.x.shape[0])
    scale[:n] = 1.0 + (rank * epr + seg).float()
    y = buf.combine(res.x * scale.to(device).unsqueeze(1), res.handle).cpu()
    idx = idxs[rank]
    factor = torch.where(idx >= 0, 1.0 + idx.float(), torch.zeros(())).sum(1)
    torch.testing.assert_close(y, xs[rank] * factor.unsqueeze(1), atol=1e-4, rtol=1e-5, msg=ctx)
    # combine's weight reduction: each (token, k) weight comes back to its place
    _, wsum = buf.combine(res.x, res.handle, res.topk_weights)
    torch.testing.assert_close(wsum.cpu(), torch.where(idx >= 0, ws[rank], 0.0), msg=ctx)
    # cached: same layout, new rows
    x2 = xs[rank] * 2
    c = buf.dispatch(x2.to(device), handle=res.handle)
    assert isinstance(c, ep_plugin.ExpertDispatchResult) and torch.equal(c.x[:n].cpu(), rx * 2), ctx
    return res


def expert_body(rank, world):
    E = 4 * world
    buf = _buf(E)
    seed = 0
    for alignment in (1, 4):
        for mode in ("random", "skew", "nowhere", "starve_last"):
            for tokens in (17, [0] + [9] * (world - 1)):
                seed += 1
                check_expert_case(buf, rank, world, E, tokens, seed, mode, alignment)
    buf.close()


@pytest.mark.parametrize("world", [2, 3])
def test_expert_major_matches_reference(runs, world):
    runs(world, "expert").check()


def grad_body(rank, world):
    """Gradients through the expert-major path equal those through the rank-major path."""
    E = 2 * world
    buf = _buf(E)
    xs, idxs, ws = make_inputs(world, [13, 7, 21][:world], H, E, K, seed=3)
    epr = E // world
    outs = {}
    for layout in ("rank", "expert"):
        x = xs[rank].clone().requires_grad_(True)
        w = ws[rank].clone().requires_grad_(True)
        res = buf.dispatch(x, idxs[rank], w, layout=layout, expert_alignment=2)
        if layout == "rank":
            # the same per-expert computation done rank-major: sum over local experts of w * f_e(row)
            lidx = res.topk_idx
            rows = torch.zeros_like(res.x)
            for e in range(epr):
                f = 1.0 + (rank * epr + e)
                hit = (lidx == e)
                rows = rows + (hit * res.topk_weights).sum(1, keepdim=True) * res.x * f
        else:
            off = res.expert_offsets.tolist()
            f = torch.zeros(res.x.shape[0])
            for e in range(epr):
                f[off[e]:off[e + 1]] = 1.0 + (rank * epr + e)
            rows = res.x * (res.topk_weights * f).unsqueeze(1)
        y = buf.combine(rows, res.handle)
        (y * torch.linspace(-1, 1, H)).sum().backward()
        outs[layout] = (y.detach(), x.grad, w.grad)
    for a, b, name in zip(outs["rank"], outs["expert"], ("y", "x.grad", "w.grad")):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5, msg=f"rank {rank}: {name}")
    buf.close()


@pytest.mark.parametrize("world", [2, 3])
def test_expert_major_gradients_match_rank_major(runs, world):
    runs(world, "grad").check()


def errors_body(rank, world):
    buf = _buf(2 * world)
    xs, idxs, ws = make_inputs(world, 8, H, 2 * world, K, seed=1)
    res = buf.dispatch(xs[rank], idxs[rank], ws[rank], layout="expert")
    with pytest.raises(ValueError, match="layout must be one of"):
        buf.dispatch(xs[rank], idxs[rank], layout="token")
    with pytest.raises(ValueError, match="expert_alignment"):
        buf.dispatch(xs[rank], idxs[rank], layout="expert", expert_alignment=0)
    with pytest.raises(ValueError, match="keeps its layout"):
        buf.dispatch(xs[rank], handle=res.handle, layout="rank")
    with pytest.raises(ValueError, match="expert-major rows"):
        buf.combine(res.x[:-1] if res.x.shape[0] else torch.zeros(1, H), res.handle)
    buf.close()


def test_expert_major_errors(runs):
    runs(2, "errors").check()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One spawn per world size for the bodies of that size (each leaves the group usable)."""
    both = [("expert", expert_body, ()), ("grad", grad_body, ())]
    return parts_per_world(tmp_path_factory, "expert_major", {2: both + [("errors", errors_body, ())], 3: both},
                           timeout=600)


def test_plan_positions_and_capacity():
    idx = torch.tensor([[1, -1, 0], [2, 1, -1], [-1, -1, -1], [0, 2, 1]])
    lay = expert_major.plan(idx, num_local_experts=3, alignment=2, num_rows=12)
    # expert 0: rows 0, 3 -> 0, 1; expert 1 (starts at 2): rows 0, 1, 3 -> 2, 3, 4 (+1 pad);
    # expert 2 (starts at 6): rows 1, 3 -> 6, 7
    assert lay.offsets.tolist() == [0, 2, 6, 8]
    assert lay.positions.tolist() == [[2, -1, 0], [6, 3, -1], [-1, -1, -1], [1, 7, 4]]
    assert expert_major.capacity(4, 3, 3, 2) == 4 * 3 + 3
    assert expert_major.capacity(4, 3, 3, 2, [2, 3, 2]) == 8
    x = torch.arange(4.0).unsqueeze(1).repeat(1, 2)
    ex = expert_major.expand(x, lay)
    assert ex[:, 0].tolist() == [0, 3, 0, 1, 3, 0, 1, 3, 0, 0, 0, 0]
    back = expert_major.collapse(ex, lay)
    assert back[:, 0].tolist() == [0, 2, 0, 9]  # each row times the number of its local experts
