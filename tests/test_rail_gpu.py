"""The NVSHMEM rail (backends/nvshmem/rail.py) as 2 virtual nodes: on 2 GPUs (2x1, one GPU per node)
and on 4 GPUs (2x2: rank (n, l) talks to its rail peer (m, l) only, so each local index is its own rail).

Every case runs NvshmemRail and the reference TorchRail (torch.distributed on NCCL) on the same
group and inputs, and checks both against a brute-force expectation built from every rank's inputs.
Only what the contract defines is compared: topk_f and wf everywhere, the xf/sf rows (as bytes) of the
slots whose topk_f has an id, and combine's y bit for bit. The forwarders' rows at slots they did not
receive hold garbage, which no rank may read.

Between virtual nodes nvshmem_ptr maps the peer, so the kernels store over P2P; `force_puts` engines
take the RDMA path instead (staging copies and NVSHMEM puts, here over the P2P transport).

A failure on one rank must not leave the other waiting (an NCCL collective the peer never joins
waits for NCCL's 10-minute watchdog). So every rail call is followed by a sync and eng.check() before
any NCCL collective (TorchRail, the brute force): a rank whose peer left sees EPTimeoutError after
COMM_TIMEOUT_S. What a rank finds (check() errors, comparisons) is collected, then exchanged over a
gloo group with a timeout (_agree) and raised on every rank with every rank's messages. The ranks run
in spawn's abandon mode (one spawn per shape, spawn_parts): after a failed body the ranks exit, without
the later bodies and the collective teardown (NCCL, NVSHMEM finalize) that a peer might never join.
"""
import os
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ep_plugin.errors import EPTimeoutError
from tests._dist import read_rank_results, spawn_parts, write_rank_result
from tests._need import need_nvshmem

pytestmark = pytest.mark.gpu

WORLD = 2            # set per body by _setup(world): 2 (2x1) or 4 (2x2)
P = 1                # ranks per node: WORLD // 2 (always 2 nodes)
SHAPES = {"2x1": 2, "2x2": 4}  # test id -> GPUs
GARBAGE = 1.0e4      # y_f rows at slots a forwarder did not receive
HEAP = str(1 << 30)  # NVSHMEM_SYMMETRIC_SIZE: room for the largest engine of a body (they are freed in turn)
COMM_TIMEOUT_S = 10.0  # the test engines' comm.timeout_s: a rank whose peer failed raises EPTimeoutError after it
AGREE_TIMEOUT_S = 120  # the gloo group of _agree: a peer that left (or hangs) fails the exchange
_gloo = {}


def _need_nvshmem(world):
    need_nvshmem(world)


@pytest.fixture(scope="module", params=list(SHAPES))
def rail_parts(request, tmp_path_factory):
    """A shape's three bodies in one spawn (one process start, NCCL init and NVSHMEM bootstrap), the
    timeout last (it leaves its engine faulted). abandon: after a failed part the ranks exit without the
    collective teardown (destroy_process_group, NVSHMEM finalize) that a peer might never join; the
    peer's rail wait times out after COMM_TIMEOUT_S, so both tracebacks come back."""
    world = SHAPES[request.param]
    _need_nvshmem(world)
    # EP_RAIL_TEST_TIMEOUT: a shorter bound, so a rank's assertion is reported before an outer limit kills all.
    timeout = min(900.0, float(os.environ.get("EP_RAIL_TEST_TIMEOUT", 900.0)))
    root = tmp_path_factory.mktemp(f"rail{request.param}")
    parts = []
    for name, body in (("matches", body_matches_reference), ("order_graph_puts", body_order_graph_puts),
                       ("timeout", body_timeout)):
        (root / name).mkdir()
        parts.append((name, body, (str(root / name),)))
    return world, root, spawn_parts(parts, world, str(root), backend="nccl", timeout=timeout, abandon=True)


def _check(rail_parts, name):
    world, root, parts = rail_parts
    parts[name].check()
    results = read_rank_results(str(root / name), world)
    assert all(r.get("ok") for r in results), results


def _cfg(K, timeout_s=COMM_TIMEOUT_S, num_sms=24):
    return SimpleNamespace(comm=SimpleNamespace(timeout_s=timeout_s, num_sms=num_sms, rdma=None),
                           moe=SimpleNamespace(topk=K))


def _engines(hidden, E, M, K, fp8, force_puts=False, timeout_s=COMM_TIMEOUT_S):
    from ep_plugin.backends.nvshmem.rail import NvshmemRail
    from ep_plugin.backends.torch_ref.rail import TorchRail
    group = dist.group.WORLD
    cfg = _cfg(K, timeout_s)
    return (NvshmemRail(group, cfg, hidden, E, P, M, fp8, force_puts=force_puts),
            TorchRail(group, cfg, hidden, E, P, M, fp8))


# ---------------------------------------------------------------------------------------- inputs
def _routing(g, T, E, K, mode):
    """[T, K] int64 ids: random distinct experts, then the mode's twist."""
    EN = E // (WORLD // P)
    scores = torch.rand(T, E, generator=g)
    if mode == "skew":
        scores[:, 0] += 10.0  # every token on expert 0 (node 0)
    if mode == "node0":  # nothing for node 1 from this rank
        scores[:, EN:] -= 10.0
    idx = scores.topk(K, dim=1).indices
    if mode == "nowhere" and T:
        idx[::3] = -1                  # routed nowhere
        idx[1::3, K // 2:] = -1        # partly
    if mode == "bad" and T >= 2:
        idx[0, 0] = E                  # outside [-1, E): counts as -1, raises the sticky flag
        idx[1, K - 1] = -7
    return idx


def _inputs(rank, T, hidden, E, K, fp8, seed, mode, weights=True):
    g = torch.Generator().manual_seed(seed * 101 + rank)
    x = torch.randn(T, hidden, generator=g) * 2
    if fp8:
        x = x.to(torch.float8_e4m3fn)
        scales = torch.rand(T, hidden // 128, generator=g) + 0.5
    else:
        x = x.to(torch.bfloat16)
        scales = None
    idx = _routing(g, T, E, K, mode)
    w = torch.rand(T, K, generator=g) if weights else None
    cuda = (lambda t: None if t is None else t.cuda())
    return cuda(x), cuda(scales), cuda(idx), cuda(w)


def _forwarder_rows(rank, seed, NM, hidden, slot_valid):
    """What the node's experts made of each slot (random), GARBAGE at slots not received."""
    g = torch.Generator().manual_seed(seed * 7 + 1000 * rank + 3)
    y = (torch.randn(NM, hidden, generator=g)).to(torch.bfloat16).cuda()
    return torch.where(slot_valid.view(-1, 1), y, torch.full_like(y, GARBAGE))


def _gather_padded(t, M, fill):
    """Every rank's [T, ...] tensor padded to [M, ...] (NCCL all_gather on this GPU)."""
    pad = torch.full((M,) + tuple(t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    pad[:t.shape[0]] = t
    out = [torch.empty_like(pad) for _ in range(WORLD)]
    dist.all_gather(out, pad)
    return out


def _bytes(t):
    """[rows, bytes] uint8 view (rows may be 0)."""
    width = 1
    for d in t.shape[1:]:
        width *= d
    return t.reshape(t.shape[0], width).view(torch.uint8)


# ------------------------------------------------------------------------------ expectations
def _expected_dispatch(rank, M, E, K, x, scales, idx, w):
    """Brute force from every rank's inputs: (xf bytes, sf, topk_f, wf) with undefined rows zero."""
    N = WORLD // P
    n, l = divmod(rank, P)
    EN = E // N
    T_all = [0] * WORLD
    dist.all_gather_object(T_all, idx.shape[0])
    xs = _gather_padded(_bytes(x), M, 0)
    ss = _gather_padded(scales, M, 0.0) if scales is not None else None
    ids = _gather_padded(idx, M, -1)
    ws = _gather_padded(w, M, 0.0) if w is not None else None
    dev = idx.device
    e_ids = torch.full((N * M, K), -1, dtype=torch.int64, device=dev)
    e_w = torch.zeros((N * M, K), dtype=torch.float32, device=dev)
    e_x = torch.zeros((N * M, xs[0].shape[1]), dtype=torch.uint8, device=dev)
    e_s = torch.zeros((N * M, scales.shape[1]), dtype=torch.float32, device=dev) if scales is not None else None
    for s in range(N):
        src = s * P + l
        T = T_all[src]
        i = ids[src][:T]
        on = (i >= 0) & (i < E) & (torch.div(i, EN, rounding_mode="floor") == n)
        e_ids[s * M:s * M + T] = torch.where(on, i - n * EN, -1)
        if ws is not None:
            e_w[s * M:s * M + T] = torch.where(on, ws[src][:T], 0.0)
        e_x[s * M:s * M + T] = xs[src][:T]
        if e_s is not None:
            e_s[s * M:s * M + T] = ss[src][:T]
    return e_x, e_s, e_ids, (e_w if w is not None else None)


def _expected_combine(rank, M, E, y_f, idx):
    N = WORLD // P
    n, l = divmod(rank, P)
    EN = E // N
    y_all = [torch.empty_like(y_f) for _ in range(WORLD)]
    dist.all_gather(y_all, y_f)
    T = idx.shape[0]
    acc = torch.zeros((T, y_f.shape[1]), dtype=torch.float32, device=y_f.device)
    valid = (idx >= 0) & (idx < E)
    for m in range(N):  # ascending nodes
        hit = (valid & (torch.div(idx, EN, rounding_mode="floor") == m)).any(1)
        acc = torch.where(hit.view(-1, 1), acc + y_all[m * P + l][n * M:n * M + T].float(), acc)
    return acc.to(torch.bfloat16)


def _same_dispatch(got, want, ctx):
    """Equal where the contract defines: topk_f and wf everywhere, xf/sf rows of slots with an id."""
    gx, gs, gi, gw = got
    wx, ws, wi, ww = want
    assert torch.equal(gi, wi), f"{ctx}: topk_f differs at rows {(gi != wi).any(1).nonzero()[:8].flatten().tolist()}"
    assert (gw is None) == (ww is None), ctx
    if gw is not None:
        assert torch.equal(gw, ww), f"{ctx}: wf differs at rows {(gw != ww).any(1).nonzero()[:8].flatten().tolist()}"
    rows = (gi >= 0).any(1)
    gxb, wxb = _bytes(gx)[rows], _bytes(wx)[rows]
    assert torch.equal(gxb, wxb), f"{ctx}: xf differs in {int((gxb != wxb).any(1).sum())} of {int(rows.sum())} rows"
    assert (gs is None) == (ws is None), ctx
    if gs is not None:
        assert torch.equal(_bytes(gs)[rows], _bytes(ws)[rows]), f"{ctx}: sf differs"


def _clone(views):
    return tuple(None if v is None else v.clone() for v in views)


def _setup(world):
    """Every body starts here (collective): the shape's globals, the gloo group _agree exchanges results over."""
    global WORLD, P
    WORLD, P = world, world // 2
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", HEAP)
    _gloo["group"] = dist.new_group(backend="gloo", timeout=timedelta(seconds=AGREE_TIMEOUT_S))


class _Soft:
    """A rank's failures, collected so that every rank still reaches the case's collectives; _agree
    raises them on every rank at once."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.errors = []

    def __call__(self, fn, *args):
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - reported by _agree with the other ranks'
            self.errors.append(f"{type(e).__name__}: {e}")

    def expect(self, cond, msg):
        if not cond:
            self.errors.append(f"AssertionError: {msg}")


def _agree(soft):
    """Collective over the gloo group (bounded by AGREE_TIMEOUT_S, fails at once if a peer left): raise
    on every rank if any rank recorded a failure, with all ranks' messages."""
    every = [None] * WORLD
    try:
        dist.all_gather_object(every, soft.errors, group=_gloo["group"])
    except Exception as e:  # noqa: BLE001 - a peer left (its own traceback is reported) or hangs
        raise AssertionError(f"{soft.ctx}: the exchange with the other ranks failed ({type(e).__name__}: {e}); "
                             f"this rank: {' | '.join(soft.errors) or 'ok'}") from e
    failed = {r: e for r, e in enumerate(every) if e}
    if failed:
        raise AssertionError(f"{soft.ctx}: " + "; ".join(f"rank {r}: {' | '.join(e)}" for r, e in failed.items()))


def _rail_done(eng, ctx, bad=False):
    """Waits for the rail calls just issued and checks what they recorded, on every rank together, before
    any NCCL collective: a peer that failed (and left) shows here as EPTimeoutError after COMM_TIMEOUT_S.
    bad: this rank's ids had values outside [-1, E), which check() must report once as ValueError."""
    torch.cuda.synchronize()
    soft = _Soft(f"{ctx} (rail check)")
    if bad:
        try:
            eng.check()
            soft.errors.append("check() did not raise ValueError for ids outside [-1, E)")
        except ValueError:
            pass
        except Exception as e:  # noqa: BLE001
            soft.errors.append(f"{type(e).__name__}: {e}")
    soft(eng.check)
    _agree(soft)


def check_case(eng, ref, rank, M, hidden, E, K, fp8, tokens, mode, seed, weights=True):
    """One dispatch + combine on both engines and the brute force."""
    ctx = (f"rank {rank} H {hidden} fp8 {fp8} M {M} E {E} K {K} tokens {tokens} mode {mode} seed {seed} "
           f"weights {weights} puts {not eng._rt.all_p2p}")
    soft = _Soft(ctx)
    T = tokens[rank]
    x, scales, idx, w = _inputs(rank, T, hidden, E, K, fp8, seed, mode, weights)
    bad = mode == "bad" and T >= 2
    got = _clone(eng.dispatch(x, scales, idx, w))
    _rail_done(eng, f"{ctx} dispatch", bad)
    want = ref.dispatch(x, scales, idx, w)
    torch.cuda.synchronize()
    soft.expect(ref.take_bad_expert_ids() == bad, "TorchRail's bad-id flag")
    N = WORLD // P
    soft.expect(got[0].shape == (N * M, hidden) and got[2].shape == (N * M, K),
                f"shapes {[None if g is None else tuple(g.shape) for g in got]}")
    soft(_same_dispatch, got, want, "vs TorchRail")
    soft(_same_dispatch, got, _expected_dispatch(rank, M, E, K, x, scales, idx, w), "vs brute force")
    _agree(soft)  # dispatch's findings on every rank, before combine builds on them
    slot_valid = (got[2] >= 0).any(1)
    y_f = _forwarder_rows(rank, seed, WORLD // P * M, hidden, slot_valid)
    y = eng.combine(y_f, slot_valid, idx, T)
    _rail_done(eng, f"{ctx} combine")
    y_ref = ref.combine(y_f, slot_valid, idx, T)
    y_bf = _expected_combine(rank, M, E, y_f, idx)
    torch.cuda.synchronize()
    soft.expect(y.shape == (T, hidden) and y.dtype == torch.bfloat16, f"combine gave {y.dtype} {list(y.shape)}")
    soft.expect(torch.equal(y, y_ref), "combine differs from TorchRail")
    soft.expect(torch.equal(y, y_bf), "combine differs from brute force")
    # the pulled form (session 11): the rows stay at the forwarder, the origin reads them; the same sums bit for bit
    # where every rail peer is P2P, refused before any launch (on every rank alike) where one is not
    if eng.can_pull:
        y_pull = eng.combine(y_f, slot_valid, idx, T, pull=True)
        _rail_done(eng, f"{ctx} pulled combine")
        torch.cuda.synchronize()
        soft.expect(torch.equal(y_pull, y), "pulled combine differs from the pushed one")
    else:
        try:
            eng.combine(y_f, slot_valid, idx, T, pull=True)
            soft.expect(False, "pull=True was taken by a rail with a peer not over P2P")
        except ValueError:
            pass
    _agree(soft)


# ------------------------------------------------------------------------------------ bodies
MODES = (("random", "both"), ("skew", "both"), ("nowhere", "both"), ("node0", "both"),
         ("random", "zero"), ("random", "one"), ("bad", "both"))


def _tokens(kind, M):
    """Tokens per rank: all full, every other rank empty, or rank 0 with one token."""
    return {"both": [M] * WORLD, "zero": [M if r % 2 == 0 else 0 for r in range(WORLD)],
            "one": [1] + [M - 3] * (WORLD - 1)}[kind]


def body_matches_reference(rank, world, out_dir):
    _setup(world)
    seed = 0
    # (hidden, fp8, M, E, K): the headline size, FP8 rows, a width not a multiple of 128, FP8 at 7168+128
    for hidden, fp8, M, E, K in ((7168, False, 4096, 256, 8), (7168, True, 1024, 64, 8),
                                 (2056, False, 512, 16, 4), (7296, True, 256, 32, 6)):
        eng, ref = _engines(hidden, E, M, K, fp8)
        for mode, kind in MODES:  # several calls in a row: both parities, twice over
            seed += 1
            check_case(eng, ref, rank, M, hidden, E, K, fp8, _tokens(kind, M), mode, seed)
        seed += 1
        check_case(eng, ref, rank, M, hidden, E, K, fp8, [M // 2 if r % 2 == 0 else M for r in range(world)], "random",
                   seed, weights=False)
        seed += 1
        check_case(eng, ref, rank, M, hidden, E, K - 1, fp8, [M if r % 2 == 0 else M // 3 for r in range(world)],
                   "random", seed)  # a smaller K
        eng.close()
    write_rank_result(out_dir, rank, {"ok": True})


def test_nvshmem_rail_matches_reference(rail_parts):
    _check(rail_parts, "matches")


def _interleaved(eng, ref, rank, M, hidden, E, K, fp8, seed):
    """dispatch k, dispatch k+1, combine k, combine k+1: dispatch k's views, read after dispatch k+1
    (and before combine k), still hold call k (rail.h's parity argument)."""
    calls = []
    for j in range(2):
        tokens = [M if (r + j) % 2 == 0 else (M // 2 if j == 0 else M // 3) for r in range(WORLD)]
        x, scales, idx, w = _inputs(rank, tokens[rank], hidden, E, K, fp8, seed + j, "random")
        calls.append((x, scales, idx, w, eng.dispatch(x, scales, idx, w)))
    ctx = f"interleaved rank {rank} H {hidden} fp8 {fp8} seed {seed} puts {not eng._rt.all_p2p}"
    _rail_done(eng, f"{ctx} dispatch")
    soft = _Soft(ctx)
    ys = []
    for j, (x, scales, idx, w, got) in enumerate(calls):
        want = ref.dispatch(x, scales, idx, w)
        torch.cuda.synchronize()
        soft(_same_dispatch, got, want, f"call {j}")
        slot_valid = (got[2] >= 0).any(1)
        ys.append((idx, slot_valid, _forwarder_rows(rank, seed + j, 2 * M, hidden, slot_valid)))
    _agree(soft)
    outs = [eng.combine(y_f, sv, idx, idx.shape[0]) for idx, sv, y_f in ys]
    _rail_done(eng, f"{ctx} combine")
    for j, ((idx, sv, y_f), y) in enumerate(zip(ys, outs)):
        soft.expect(torch.equal(y, ref.combine(y_f, sv, idx, idx.shape[0])), f"combine {j}")
    _agree(soft)


def _graph(eng, ref, rank, M, hidden, E, K):
    """dispatch + combine captured in one CUDA graph, replayed on new inputs."""
    sx = torch.zeros(M, hidden, dtype=torch.bfloat16, device="cuda")
    sidx = torch.full((M, K), -1, dtype=torch.int64, device="cuda")
    sw = torch.zeros(M, K, dtype=torch.float32, device="cuda")
    sy = torch.zeros(2 * M, hidden, dtype=torch.bfloat16, device="cuda")

    def step():
        xf, sf, tf, wf = eng.dispatch(sx, None, sidx, sw)
        sv = (tf >= 0).any(1)
        return xf, tf, wf, sv, eng.combine(sy, sv, sidx, M)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    _rail_done(eng, f"graph warm-up rank {rank}")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        xf, tf, wf, sv, y = step()
    for r in range(3):
        x, _, idx, w = _inputs(rank, M, hidden, E, K, False, 500 + r, "random" if r < 2 else "skew")
        sx.copy_(x)
        sidx.copy_(idx)
        sw.copy_(w)
        sy.copy_(_forwarder_rows(rank, 500 + r, 2 * M, hidden, torch.ones(2 * M, dtype=torch.bool, device="cuda")))
        graph.replay()
        ctx = f"graph replay {r} rank {rank}"
        _rail_done(eng, ctx)
        soft = _Soft(ctx)
        want = ref.dispatch(x, None, idx, w)
        torch.cuda.synchronize()
        soft(_same_dispatch, (xf, None, tf, wf), want, "dispatch")
        soft.expect(torch.equal(y, ref.combine(sy, sv, idx, M)), "combine differs from TorchRail")
        _agree(soft)
    del graph


def body_order_graph_puts(rank, world, out_dir):
    _setup(world)
    hidden, E, M, K = 7168, 64, 512, 8
    eng, ref = _engines(hidden, E, M, K, False)
    for it in range(3):  # six dispatches: the parities wrap
        _interleaved(eng, ref, rank, M, hidden, E, K, False, 40 + 2 * it)
    _graph(eng, ref, rank, M, hidden, E, K)
    eng.close()
    # the RDMA path (staging + NVSHMEM puts + signals), here over the P2P transport
    for fp8, hidden in ((False, 7168), (True, 7168), (False, 2056)):
        eng, ref = _engines(hidden, E, M, K, fp8, force_puts=True)
        assert not eng._rt.all_p2p
        for seed, (mode, kind) in enumerate(MODES[:6]):
            check_case(eng, ref, rank, M, hidden, E, K, fp8, _tokens(kind, M), mode, 200 + seed)
        _interleaved(eng, ref, rank, M, hidden, E, K, fp8, 300)
        eng.close()
    write_rank_result(out_dir, rank, {"ok": True})


def test_nvshmem_rail_order_graph_and_puts(rail_parts):
    _check(rail_parts, "order_graph_puts")


TIMEOUT_S = 2.0


def body_timeout(rank, world, out_dir):
    """Rank 0's rail peer on node 1 (rank P) skips a dispatch that rank 0 makes (the other ranks make
    none): rank 0's check() raises EPTimeoutError naming rank P. Then rank 0 leaves it out (set_mask)
    and goes on alone: node 1's slots are routed nowhere, and combine sums node 0's rows only. No rank
    closes the engine (spawn's abandon mode): NVSHMEM's collective free would pair a faulted rank with
    a healthy one."""
    _setup(world)
    hidden, E, M, K = 7168, 16, 256, 4
    eng, ref = _engines(hidden, E, M, K, False, timeout_s=TIMEOUT_S)
    check_case(eng, ref, rank, M, hidden, E, K, False, [M] * world, "random", 1)  # a healthy round
    dist.barrier()
    if rank == 0:
        x, _, idx, w = _inputs(rank, M, hidden, E, K, False, 2, "random")
        start = time.monotonic()
        eng.dispatch(x, None, idx, w)  # returns at once: the kernels wait on the device
        torch.cuda.synchronize()
        with pytest.raises(EPTimeoutError) as info:
            eng.check()
        elapsed = time.monotonic() - start
        assert info.value.missing_ranks == (P,), str(info.value)
        assert elapsed < TIMEOUT_S + 10, f"raised after {elapsed:.1f}s"
        eng.set_mask([P])
        xf, _, tf, wf = eng.dispatch(x, None, idx, w)
        torch.cuda.synchronize()
        eng.check()  # nobody was waited for
        on0 = (idx >= 0) & (idx < E // 2)
        assert torch.equal(tf[:M], torch.where(on0, idx, -1)), "mask: own node's slots"
        assert torch.equal(wf[:M], torch.where(on0, w, 0.0)), "mask: own node's weights"
        assert bool((tf[M:] == -1).all()) and bool((wf[M:] == 0).all()), "mask: the left-out node's slots"
        rows = on0.any(1)
        assert torch.equal(xf[:M][rows], x[rows])
        sv = (tf >= 0).any(1)
        y_f = _forwarder_rows(rank, 3, 2 * M, hidden, sv)
        y = eng.combine(y_f, sv, idx, M)
        torch.cuda.synchronize()
        eng.check()
        want = torch.where(rows.view(-1, 1), y_f[:M].float(), 0.0).to(torch.bfloat16)
        assert torch.equal(y, want), "mask: combine sums the own node's rows only"
    dist.barrier()  # the other ranks wait here until rank 0 is done
    write_rank_result(out_dir, rank, {"ok": True})


def test_timeout_names_the_rank_that_skipped(rail_parts):
    _check(rail_parts, "timeout")
