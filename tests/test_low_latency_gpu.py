"""The low-latency calls on 2 GPUs (EP_TEST_WORLD=4: 4): the NVSHMEM engine against the torch reference engine.

Each test spawns one process per GPU and builds two EPBuffers on the same group: `comm.backend: auto`
(whose low-latency engine is the NVSHMEM kernels when ep_plugin._C is built with NVSHMEM) and
`comm.backend: torch` (the reference, torch.distributed on NCCL), and feeds both the same inputs.
Dispatch outputs must match bit for bit on the valid rows (counts, layout_range, src_info, rows;
FP8 data and scales), except that with round_scale the scales come from log2 of the block maximum,
which CUDA's fast log2 and torch's may round apart at a power of two: there the dequantised rows
are compared within one FP8 step. Combine must match bit for bit: the contract fixes the order of
the float32 sum (k ascending) and forbids fused multiply-add, so nothing is left to rounding choices.

If the auto buffer's engine turns out to be the torch reference (no NVSHMEM build, or its
check_available refuses), the tests skip with the reason instead of comparing the reference with
itself.
"""
import os
import time
import types

import pytest
import torch
import torch.distributed as dist

import ep_plugin
from ep_plugin.backends import registry
from ep_plugin.errors import EPTimeoutError
from tests._dist import read_rank_results, spawn_parts, write_rank_result
from tests._need import need_nvshmem
from tests.reference import make_inputs
from tests.test_low_latency import contract_body
from ep_plugin.backends.nvshmem.low_latency import KERNEL_FLAGS_DEFAULT

pytestmark = pytest.mark.gpu

# EP size: EP_TEST_WORLD=4 runs every test on 4 GPUs (the per-rank token lists below repeat to fit)
WORLD = int(os.environ.get("EP_TEST_WORLD", "2"))
M = 128          # comm.low_latency.max_tokens_per_rank
GARBAGE = 1.0e4  # fills the combine input past each expert's rows: a read of it shows in y


def _need_gpus():
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA GPUs")


def _need_nvshmem_engine():
    # without NVSHMEM in _C the low-latency engine would be the torch reference: fails where the
    # wheel is installed (a broken build), skips where it cannot be
    need_nvshmem(WORLD)


def _check_results(out_dir):
    """_need_nvshmem_engine has found the GPUs and NVSHMEM in _C, so a rank whose auto buffer still got
    the torch engine is a failure, not a skip."""
    results = read_rank_results(str(out_dir), WORLD)
    fallbacks = [r["skip"] for r in results if "skip" in r]
    assert not fallbacks, f"NVSHMEM is built, yet the low-latency engine is the torch reference: {fallbacks[0]}"
    assert all(r.get("ok") for r in results), results


def _no_nvshmem_engine(buf, out_dir, rank) -> bool:
    """After the first low-latency call: True (and the reason written for the parent) if `buf`'s
    engine is the torch reference."""
    if buf.low_latency_backend_name != "torch":
        return False
    why = registry.nvshmem_low_latency_unavailable(buf.group, buf.hidden)
    write_rank_result(out_dir, rank, {"skip": why or "make_low_latency chose the torch engine"})
    return True


def _buf(backend, E_l, K, hidden, timeout_s=20.0, output_buffers=0, held_outputs="raise", source_order="rank",
         combine_reduce=None):
    """combine_reduce None: the default (owner)."""
    ll = {"max_tokens_per_rank": M, "output_buffers": output_buffers, "held_outputs": held_outputs,
          "source_order": source_order}
    if combine_reduce is not None:
        ll["combine_reduce"] = combine_reduce
    cfg = {"moe": {"num_experts": E_l * WORLD, "topk": K},
           "comm": {"backend": backend, "max_tokens_per_rank": M, "timeout_s": timeout_s, "low_latency": ll}}
    return ep_plugin.EPBuffer(None, cfg, hidden=hidden)


ARRIVAL_ORDER = 32768  # csrc/nvshmem/ll_device.cuh's kArrivalOrder (comm.low_latency.source_order: arrival)


def _arrival(buf):
    eng = getattr(buf, "_low_latency", None)
    return bool(eng is not None and getattr(eng, "kernel_flags", 0) & ARRIVAL_ORDER)


def _in_rank_order(a, use_fp8):
    """An arrival-ordered dispatch (recv_x, recv_count, handle) moved into rank order, after checking that
    its sources' blocks tile each expert's rows [0, count) with no gap or overlap: rows, scales and
    src_info gathered block by block in rank order, layout_range rewritten with rank-order begins."""
    x, count, h = a
    E_l, W = h.layout_range.shape
    slots = h.src_info.shape[1]
    lr, cnt = h.layout_range.tolist(), count.tolist()
    perm, new_lr = [], []
    for el in range(E_l):
        blocks = [(v >> 32, v & 0xFFFFFFFF) for v in lr[el]]
        at = 0
        for b, n in sorted(bn for bn in blocks if bn[1]):
            assert b == at, f"expert {el}: source blocks {blocks} do not tile [0, {cnt[el]})"
            at += n
        assert at == cnt[el], f"expert {el}: source blocks {blocks} cover {at} rows, count {cnt[el]}"
        rows, row_lr = [], []
        for b, n in blocks:
            row_lr.append((len(rows) << 32) | n)
            rows.extend(range(b, b + n))
        perm.append(rows + list(range(len(rows), slots)))
        new_lr.append(row_lr)
    dev = count.device
    perm = torch.tensor(perm, dtype=torch.int64, device=dev)
    ar = torch.arange(E_l, device=dev).unsqueeze(1)
    if use_fp8:
        d, sc = x
        assert sc.transpose(1, 2).is_contiguous(), "scales must be the transpose of [E_l, H/128, W*M]"
        x = (d[ar, perm], sc[ar, perm].transpose(1, 2).contiguous().transpose(1, 2))
    else:
        x = x[ar, perm]
    handle = types.SimpleNamespace(layout_range=torch.tensor(new_lr, dtype=h.layout_range.dtype, device=dev),
                                   src_info=h.src_info[ar, perm])
    return x, count, handle


def _inputs(rank, tokens, hidden, E, K, seed, mode="random"):
    """This rank's (x BF16, topk_idx, topk_weights) on its GPU; tokens per rank as a list (repeated to
    WORLD ranks: [a, b] at 4 ranks is [a, b, a, b])."""
    tokens = [tokens[r % len(tokens)] for r in range(WORLD)]
    xs, idxs, ws = make_inputs(WORLD, tokens, hidden, E, K, seed, torch.bfloat16, mode)
    return xs[rank].cuda(), idxs[rank].cuda(), ws[rank].cuda()


def _valid(count, slots):
    """[E_l, slots] bool: the rows below each expert's count."""
    return torch.arange(slots, device=count.device).unsqueeze(0) < count.unsqueeze(1)


def _dequantized(recv_x):
    if not isinstance(recv_x, tuple):
        return recv_x
    data, scales = recv_x
    return (data.float() * scales.repeat_interleave(128, dim=-1)).to(torch.bfloat16)


def _expert_output(recv_x, count, rank, E_l):
    """What the test's experts make of their rows (an affine map per global expert); GARBAGE past the
    counts, which combine must not read."""
    rows = _dequantized(recv_x)
    scale = 1 + 0.125 * (rank * E_l + torch.arange(E_l, device=rows.device, dtype=torch.float32))
    out = (rows.float() * scale.view(-1, 1, 1) - 0.5).to(torch.bfloat16)
    return torch.where(_valid(count, rows.shape[1]).unsqueeze(2), out, torch.full_like(out, GARBAGE))


def _same_dispatch(a, b, use_fp8, round_scale, ctx):
    """a, b: (recv_x, recv_count, handle) of the engine under test and of the reference."""
    (ax, ac, ah), (bx, bc, bh) = a, b
    assert ac.dtype == torch.int32 and torch.equal(ac, bc), (ctx, ac.tolist(), bc.tolist())
    assert torch.equal(ah.layout_range, bh.layout_range), ctx
    valid = _valid(bc, bh.src_info.shape[1])
    assert torch.equal(ah.src_info[valid], bh.src_info[valid]), ctx
    if not use_fp8:
        assert ax.dtype == torch.bfloat16 and ax.shape == bx.shape, ctx
        assert torch.equal(ax[valid], bx[valid]), ctx
        return
    (ad, asc), (bd, bsc) = ax, bx
    assert ad.dtype == torch.float8_e4m3fn and ad.shape == bd.shape, ctx
    assert asc.dtype == torch.float32 and asc.shape == bsc.shape, ctx
    assert asc.transpose(1, 2).is_contiguous(), f"{ctx}: scales must be the transpose of [E_l, H/128, W*M]"
    if not round_scale:
        assert torch.equal(ad.view(torch.uint8)[valid], bd.view(torch.uint8)[valid]), ctx
        assert torch.equal(asc[valid], bsc[valid]), ctx
        return
    sa, sb = asc[valid], bsc[valid]
    assert bool((torch.frexp(sa).mantissa == 0.5).all()), f"{ctx}: round_scale scales must be powers of 2"
    # A scale one power of two apart moves each value by at most one FP8 step (1/8 relative in the
    # normal range, scale * 2^-9 in the subnormal one).
    da, db = _dequantized((ad, asc))[valid].float(), _dequantized((bd, bsc))[valid].float()
    step = (torch.maximum(sa, sb) * 2.0 ** -8).repeat_interleave(128, dim=-1)
    bound = 0.125 * torch.maximum(da.abs(), db.abs()) + step
    assert bool(((da - db).abs() <= bound).all()), (ctx, (da - db).abs().max())


def check_case(auto, ref, rank, E_l, K, hidden, tokens, mode, seed, use_fp8, round_scale, hook=False):
    """One dispatch + combine on both buffers, compared. With `hook`, the engine under test receives
    through its hooks, a matmul running on the stream between each call and its hook."""
    ctx = f"rank {rank} E_l {E_l} K {K} H {hidden} tokens {tokens} {mode} fp8 {use_fp8} round {round_scale} hook {hook}"
    x, idx, w = _inputs(rank, tokens, hidden, E_l * WORLD, K, seed, mode)
    ax, ac, ah, _, a_hook = auto.low_latency_dispatch(x, idx, use_fp8=use_fp8, round_scale=round_scale,
                                                      return_recv_hook=hook)
    if hook:
        _busy()
        a_hook()
    bx, bc, bh, _, _ = ref.low_latency_dispatch(x, idx, use_fp8=use_fp8, round_scale=round_scale,
                                                return_recv_hook=False)
    arrival = _arrival(auto)
    a = _in_rank_order((ax, ac, ah), use_fp8) if arrival else (ax, ac, ah)
    _same_dispatch(a, (bx, bc, bh), use_fp8, round_scale, ctx)
    # the same expert outputs (in the common layout; an arrival-ordered engine gets them in its own, a
    # function of each row) into both combines
    out = _expert_output(bx, bc, rank, E_l)
    ya, _, a_hook = auto.low_latency_combine(_expert_output(ax, ac, rank, E_l) if arrival else out, idx, w, ah,
                                             return_recv_hook=hook)
    if hook:
        _busy()
        a_hook()
    yb, _, _ = ref.low_latency_combine(out, idx, w, bh, return_recv_hook=False)
    assert ya.dtype == torch.bfloat16 and ya.shape == (x.shape[0], hidden), ctx
    torch.testing.assert_close(ya, yb, atol=0, rtol=0, msg=ctx)


def _busy():
    """Compute on the current stream, as a model would between a call and its hook."""
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(4):
        a = (a @ a) * 1e-3


# Hidden sizes: 7168 (DeepSeek-V3) and a small one for each row format: 256 with FP8 (128 channels
# per scale), 1032 BF16 only (2064-byte rows: a multiple of 16, not of 128 channels). The largest
# buffer comes first: a process's NVSHMEM heap is sized by its first engine (later ones reuse it).
SHAPES = [  # (local experts, top-k, hidden, FP8 too)
    (144, 8, 7168, True), (144, 8, 256, True), (144, 8, 1032, False),
    (2, 3, 7168, True), (2, 3, 256, True), (2, 3, 1032, False),
]
CASES = [  # (tokens per rank, routing)
    ([M, M], "random"),
    ([0, M], "random"),      # rank 0 sends nothing
    ([1, 17], "random"),
    ([M, M], "skew"),        # every token to expert 0 only: its W*M rows are all used
    ([7, 0], "nowhere"),
    ([M, 33], "repeats"),    # tokens naming an expert twice: one row each, both picks weighted in combine
]


def body_matches_reference(rank, world, out_dir, output_buffers=0, source_order="rank", combine_reduce=None):
    """output_buffers 2: the engine's outputs are sets in its heap, written by the senders directly.
    source_order arrival: each source's block where its reservation put it (compared in rank order).
    combine_reduce: the default (owner) -- with sets the owners send per-rank sums (ll_combine.cu, "Owner
    sums"); without, the token's rank makes them from the picks' rows -- or source (every pick's row to the
    token's rank); the reference sums the same way."""
    seed = 0
    for E_l, K, hidden, fp8 in SHAPES:
        auto = _buf("auto", E_l, K, hidden, output_buffers=output_buffers, source_order=source_order,
                    combine_reduce=combine_reduce)
        ref = _buf("torch", E_l, K, hidden, combine_reduce=combine_reduce)
        for tokens, mode in CASES:
            for use_fp8, round_scale in ([(False, False)] + ([(True, False), (True, True)] if fp8 else [])):
                seed += 1
                check_case(auto, ref, rank, E_l, K, hidden, tokens, mode, seed, use_fp8, round_scale)
                if seed == 1 and _no_nvshmem_engine(auto, out_dir, rank):
                    return
                if seed == 1 and output_buffers:  # two GPUs of one host: P2P, so the sets are in the heap
                    assert auto._low_latency.output_sets == output_buffers
        # receive hooks, with compute on the stream before each hook
        for use_fp8 in ((False, True) if fp8 else (False,)):
            seed += 1
            check_case(auto, ref, rank, E_l, K, hidden, [M, 33], "random", seed, use_fp8, False, hook=True)
        if hidden == 7168:
            for use_fp8 in (False, True):
                check_graph(auto, ref, rank, E_l, K, hidden, use_fp8)
        auto.close()
        ref.close()
    write_rank_result(out_dir, rank, {"ok": True})


def body_held_copy(rank, world, out_dir):
    """held_outputs copy (three heap sets, what ep_plugin.deep_ep takes with no ep_config): a dispatch's
    outputs kept across later calls -- BF16 and FP8, a hook, round_scale -- are moved out of the heap before
    the senders reuse their set, and still equal the reference's outputs of that dispatch afterwards."""
    E_l, K, hidden = 144, 8, 7168
    auto, ref = _buf("auto", E_l, K, hidden, output_buffers=3, held_outputs="copy"), _buf("torch", E_l, K, hidden)
    for use_fp8 in (False, True):
        x, idx, w = _inputs(rank, [M, 33], hidden, E_l * world, K, 100 + use_fp8)
        kept = auto.low_latency_dispatch(x, idx, use_fp8=use_fp8)[:3]
        if use_fp8 is False and _no_nvshmem_engine(auto, out_dir, rank):
            return
        want = ref.low_latency_dispatch(x, idx, use_fp8=use_fp8)[:3]
        eng = auto._low_latency
        assert eng.output_sets == 3 and eng.move_held, (eng.output_sets, eng.move_held)
        moved = eng.moved_sets
        for seed, fp8, rs, hook in ((1, True, True, False), (2, False, False, True), (3, True, False, False),
                                    (4, False, False, False)):
            check_case(auto, ref, rank, E_l, K, hidden, [M, M], "random", 200 + 10 * seed + use_fp8, fp8, rs, hook)
        assert eng.moved_sets == moved + 1, (moved, eng.moved_sets)
        torch.cuda.synchronize()
        _same_dispatch(kept, want, use_fp8, False, f"rank {rank} kept fp8 {use_fp8}")
        del kept, want
    auto.check()
    auto.close()
    ref.close()
    write_rank_result(out_dir, rank, {"ok": True})


# The direct dispatch's variant bits (engine.kernel_flags; csrc/nvshmem/ll_device.cuh): row-major FP8 scales,
# token + slot in one store, 16-byte FP8 stores, epoch-tagged counts, row loads before the count wait,
# store addresses made once with FP8 scales stored by a group's lanes, the first row's loads at entry, and
# the combine receive's loads ahead (picks before the signal wait, a thread's rows all in flight), and 8
# loads in flight per lane in the row copies (combine send; the slot path's dispatch receive), the combine
# send's rows dealt in a stride order, and the lean routing (the rank mask read once, slots counted by warps).
# Each alone, the lean stores on the default (64) with and without the others it meets, then all together
# (where kScalesRowMajor leaves the lanes' scale stores out: LEAN_SETS puts them in a CUDA graph).
SCALES_ROW_MAJOR, PACKED_INFO, FP8_WIDE, COUNT_WORDS, PRELOAD = 8, 16, 32, 64, 128
LEAN_STORES, EARLY_ROW, LOADS_AHEAD, COPY8 = 256, 512, 1024, 2048
SPREAD_ROWS, LEAN_ROUTING, LIGHT_TICKETS = 4096, 8192, 16384
ALL_DIRECT_FLAGS = (SCALES_ROW_MAJOR | PACKED_INFO | FP8_WIDE | COUNT_WORDS | PRELOAD | LEAN_STORES | EARLY_ROW
                    | LOADS_AHEAD | COPY8 | SPREAD_ROWS | LEAN_ROUTING | LIGHT_TICKETS)
LEAN_SETS = [COUNT_WORDS | LEAN_STORES,
             COUNT_WORDS | LEAN_STORES | PRELOAD | EARLY_ROW | LOADS_AHEAD | COPY8 | SPREAD_ROWS | LEAN_ROUTING,
             COUNT_WORDS | LEAN_STORES | FP8_WIDE, COUNT_WORDS | SPREAD_ROWS | LEAN_ROUTING,
             COUNT_WORDS | LEAN_STORES | LEAN_ROUTING | LIGHT_TICKETS,
             COUNT_WORDS | LEAN_STORES | LEAN_ROUTING | LIGHT_TICKETS | SCALES_ROW_MAJOR]
DIRECT_FLAG_SETS = [SCALES_ROW_MAJOR, PACKED_INFO, FP8_WIDE, COUNT_WORDS, PRELOAD, *LEAN_SETS, ALL_DIRECT_FLAGS]


def body_direct_flags(rank, world, out_dir):
    """Each flag set on one engine (heap output sets, so the direct dispatch) against the reference:
    FP8 over every routing case (BF16 too where a bit touches it, round_scale with all bits), through
    hooks (the split launches: the receive half alone, on every block when it has rows to fix up),
    and with all bits in a CUDA graph. The bits change between calls of one engine, as every rank
    changes them alike (each bit has regions of its own, so no call reads another variant's words).
    Then kFp8Wide, the one dispatch send bit the slot path (output_buffers 0) reads, on an engine of that
    path, with kCopy8 (its receive copy and the combine send) and the combine's kLoadsAhead."""
    seed = 500
    for E_l, K, hidden in ((144, 8, 7168), (2, 3, 256)):
        auto, ref = _buf("auto", E_l, K, hidden, output_buffers=2), _buf("torch", E_l, K, hidden)
        check_case(auto, ref, rank, E_l, K, hidden, [M, M], "random", seed, True, False)  # builds both engines
        if _no_nvshmem_engine(auto, out_dir, rank):
            return
        assert auto._low_latency.output_sets == 2
        for flags in DIRECT_FLAG_SETS:
            auto._low_latency.kernel_flags = flags
            kinds = [(True, False)]
            if flags & (PACKED_INFO | COUNT_WORDS | PRELOAD | LEAN_STORES | EARLY_ROW | LOADS_AHEAD | COPY8 | SPREAD_ROWS
                        | LEAN_ROUTING | LIGHT_TICKETS):
                kinds.append((False, False))
            if flags == ALL_DIRECT_FLAGS or flags & LEAN_STORES:
                kinds.append((True, True))
            for tokens, mode in CASES:
                for use_fp8, round_scale in kinds:
                    seed += 1
                    check_case(auto, ref, rank, E_l, K, hidden, tokens, mode, seed, use_fp8, round_scale)
            seed += 1
            check_case(auto, ref, rank, E_l, K, hidden, [M, 33], "random", seed, True, False, hook=True)
            if flags == ALL_DIRECT_FLAGS or flags in LEAN_SETS[:2] or flags & LIGHT_TICKETS:
                seed += 1
                check_case(auto, ref, rank, E_l, K, hidden, [0, M], "random", seed, False, False, hook=True)
                if hidden == 7168:
                    for use_fp8 in (True, False):
                        check_graph(auto, ref, rank, E_l, K, hidden, use_fp8)
        auto.check()
        auto.close()
        # the slot path (fresh outputs; also the torch-tensor sets of ep_plugin.deep_ep): kFp8Wide only
        slots = _buf("auto", E_l, K, hidden, output_buffers=0)
        seed += 1
        check_case(slots, ref, rank, E_l, K, hidden, [M, M], "random", seed, True, False)  # builds the engine
        # the combine's bits act on either path
        slots._low_latency.kernel_flags = FP8_WIDE | LOADS_AHEAD | COPY8 | SPREAD_ROWS | LIGHT_TICKETS
        for tokens, mode in CASES:
            for round_scale in (False, True):
                seed += 1
                check_case(slots, ref, rank, E_l, K, hidden, tokens, mode, seed, True, round_scale)
        seed += 1
        check_case(slots, ref, rank, E_l, K, hidden, [M, 33], "random", seed, True, False, hook=True)
        slots.check()
        slots.close()
        ref.close()
    write_rank_result(out_dir, rank, {"ok": True})


def check_graph(auto, ref, rank, E_l, K, hidden, use_fp8):
    """dispatch + experts + combine (no hooks) captured in one CUDA graph after a warm-up outside
    capture, replayed on new inputs: each replay matches the reference on the same inputs."""
    sx = torch.zeros(M, hidden, dtype=torch.bfloat16, device="cuda")
    sidx = torch.full((M, K), -1, dtype=torch.int64, device="cuda")
    sw = torch.zeros(M, K, dtype=torch.float32, device="cuda")

    def step():
        recv_x, count, handle, _, _ = auto.low_latency_dispatch(sx, sidx, use_fp8=use_fp8)
        y, _, _ = auto.low_latency_combine(_expert_output(recv_x, count, rank, E_l), sidx, sw, handle)
        return recv_x, count, handle, y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv_x, count, handle, y = step()
    for s in range(3):
        x, idx, w = _inputs(rank, [M, M], hidden, E_l * WORLD, K, 900 + s, "random" if s < 2 else "skew")
        sx.copy_(x)
        sidx.copy_(idx)
        sw.copy_(w)
        graph.replay()
        torch.cuda.synchronize()
        ctx = f"graph replay {s} rank {rank} E_l {E_l} fp8 {use_fp8}"
        bx, bc, bh, _, _ = ref.low_latency_dispatch(x, idx, use_fp8=use_fp8)
        a = (recv_x, count, handle)
        _same_dispatch(_in_rank_order(a, use_fp8) if _arrival(auto) else a, (bx, bc, bh), use_fp8, False, ctx)
        yb, _, _ = ref.low_latency_combine(_expert_output(bx, bc, rank, E_l), idx, w, bh)
        torch.testing.assert_close(y, yb, atol=0, rtol=0, msg=ctx)
    del graph
    auto.check()


@pytest.fixture(scope="module")
def ll_parts(tmp_path_factory):
    """The bodies that leave the group whole, in one spawn (one process start, NCCL init and NVSHMEM
    bootstrap instead of four): output sets first (the process's NVSHMEM heap is sized by its first
    engine, and an engine with output sets needs the most: three sets of held_copy), the direct dispatch's flags (output sets
    too), then fresh outputs, then the torch engine.
    Without NVSHMEM in _C only the torch engine runs (the NVSHMEM tests then skip or fail in
    _need_nvshmem_engine)."""
    _need_gpus()
    import ep_plugin._ext as ext

    root = tmp_path_factory.mktemp("ll_parts")
    parts = []
    # EP_TEST_LL_PARTS=source_sets,source_fresh: only those bodies (a device run that checks one change); the
    # tests of the others then fail on their missing part
    only = [p for p in os.environ.get("EP_TEST_LL_PARTS", "").split(",") if p]
    if ext.has_c() and getattr(ext.get_c(), "HAS_NVSHMEM", False):
        for name, body, args in (("held_copy", body_held_copy, ()), ("sets", body_matches_reference, (2,)),
                                 ("direct_flags", body_direct_flags, ()),
                                 ("arrival", body_matches_reference, (2, "arrival")),
                                 ("source_sets", body_matches_reference, (2, "rank", "source")),
                                 ("source_fresh", body_matches_reference, (0, "rank", "source")),
                                 ("fresh", body_matches_reference, (0,))):
            if only and name not in only:
                continue
            (root / name).mkdir()
            parts.append((name, body, (str(root / name), *args)))
    if not only or "torch_engine" in only:
        parts.append(("torch_engine", contract_body, ("cuda",)))
    return root, spawn_parts(parts, WORLD, str(root), backend="nccl", timeout=900)


def test_nvshmem_engine_matches_reference(ll_parts):
    _need_nvshmem_engine()
    root, parts = ll_parts
    parts["fresh"].check()
    _check_results(root / "fresh")


def test_output_sets_match_reference(ll_parts):
    _need_nvshmem_engine()
    root, parts = ll_parts
    parts["sets"].check()
    _check_results(root / "sets")


def test_held_heap_sets_are_moved_with_their_values(ll_parts):
    _need_nvshmem_engine()
    root, parts = ll_parts
    parts["held_copy"].check()
    _check_results(root / "held_copy")


def test_arrival_order_matches_reference(ll_parts):
    """comm.low_latency.source_order arrival: every routing case, FP8 and BF16, hooks, CUDA graphs."""
    _need_nvshmem_engine()
    root, parts = ll_parts
    parts["arrival"].check()
    _check_results(root / "arrival")


@pytest.mark.parametrize("outputs", ["sets", "fresh"])
def test_source_sums_match_reference(ll_parts, outputs):
    """comm.low_latency.combine_reduce source (the default, owner, runs in the other bodies): every pick's
    row back to the token's rank, summed there in k order. Every routing case (repeats, nowhere, skew), FP8
    and BF16, hooks, CUDA graphs, bit for bit."""
    _need_nvshmem_engine()
    root, parts = ll_parts
    parts[f"source_{outputs}"].check()
    _check_results(root / f"source_{outputs}")


def test_direct_dispatch_flags_match_reference(ll_parts):
    _need_nvshmem_engine()
    root, parts = ll_parts
    parts["direct_flags"].check()
    _check_results(root / "direct_flags")


def body_mask(rank, world, out_dir, output_buffers=0, kernel_flags=0, combine_reduce=None):
    """Both ranks leave rank 1 out. Rank 1 then stays away from the engine under test (as a dead rank
    would), and rank 0's calls must neither wait for it nor deliver to it: rank 0 receives its own
    rows only and combine sums its own experts only, as the reference computes with every entry to or
    from rank 1 set to -1. output_buffers 2: the direct dispatch into heap sets, with kernel_flags."""
    E_l, K, hidden = 2, 3, 7168
    auto = _buf("auto", E_l, K, hidden, output_buffers=output_buffers, combine_reduce=combine_reduce)
    ref = _buf("torch", E_l, K, hidden, combine_reduce=combine_reduce)
    x, idx, w = _inputs(rank, [M, M], hidden, E_l * WORLD, K, seed=71)
    check_case(auto, ref, rank, E_l, K, hidden, [M, M], "random", 70, False, False)  # builds both engines
    if _no_nvshmem_engine(auto, out_dir, rank):
        return
    auto._low_latency.kernel_flags = kernel_flags
    torch.cuda.synchronize()
    dist.barrier()
    cut = idx.clone()
    cut[(cut // E_l == 1) | torch.full_like(cut, rank == 1, dtype=torch.bool)] = -1
    for use_fp8 in (False, True):
        for buf in (auto, ref):
            buf.set_low_latency_mask([1])
        # the reference with the mask (its collectives need rank 1 too) ...
        masked = ref.low_latency_dispatch(x, idx, use_fp8=use_fp8)[:3]
        y_masked = ref.low_latency_combine(_expert_output(masked[0], masked[1], rank, E_l), idx, w, masked[2])[0]
        # ... equals the reference without it on the routing cut by hand
        ref.set_low_latency_mask([])
        want = ref.low_latency_dispatch(x, cut, use_fp8=use_fp8)[:3]
        out = _expert_output(want[0], want[1], rank, E_l)
        y_want = ref.low_latency_combine(out, cut, w, want[2])[0]
        if rank == 1:
            continue
        ctx = f"mask [1], rank 0, fp8 {use_fp8}"
        _same_dispatch(masked, want, use_fp8, False, f"reference {ctx}")
        torch.testing.assert_close(y_masked, y_want, atol=0, rtol=0, msg=f"reference {ctx}")
        # the engine under test, on rank 0 alone
        got = auto.low_latency_dispatch(x, idx, use_fp8=use_fp8)[:3]
        _same_dispatch(got, want, use_fp8, False, ctx)
        y = auto.low_latency_combine(out, idx, w, got[2])[0]
        torch.testing.assert_close(y, y_want, atol=0, rtol=0, msg=ctx)
        auto.check()  # nobody was waited for: no timeout
    dist.barrier()
    auto.close()
    ref.close()
    write_rank_result(out_dir, rank, {"ok": True})


@pytest.fixture(scope="module")
def fault_parts(tmp_path_factory):
    """The masks and the timeout in one spawn of their own (abandon mode: the timeout leaves its buffer
    broken, so it runs last; a mask leaves the group whole)."""
    _need_nvshmem_engine()
    root = tmp_path_factory.mktemp("ll_faults")
    parts = []
    for name, body, args in (("mask", body_mask, ()), ("mask_flags", body_mask, (2, ALL_DIRECT_FLAGS)),
                             ("mask_lean", body_mask, (2, LEAN_SETS[1])),
                             ("mask_source", body_mask, (2, KERNEL_FLAGS_DEFAULT, "source")),
                             ("timeout", body_timeout, ())):
        (root / name).mkdir()
        parts.append((name, body, (str(root / name), *args)))
    return root, spawn_parts(parts, WORLD, str(root), backend="nccl", timeout=300, abandon=True)


def test_mask_leaves_a_rank_out(fault_parts):
    root, parts = fault_parts
    parts["mask"].check()
    _check_results(root / "mask")


def test_mask_with_direct_dispatch_flags(fault_parts):
    root, parts = fault_parts
    parts["mask_flags"].check()
    _check_results(root / "mask_flags")


def test_mask_with_lean_stores(fault_parts):
    """The lane-stored scales, the early row, the combine's loads ahead and the 8-deep copies (with the
    default's count words) past a left-out rank."""
    root, parts = fault_parts
    parts["mask_lean"].check()
    _check_results(root / "mask_lean")


def test_mask_with_source_sums(fault_parts):
    """combine_reduce source past a left-out rank (the other mask bodies run the default, owner: no weights
    sent to it, no sums waited for from it)."""
    root, parts = fault_parts
    parts["mask_source"].check()
    _check_results(root / "mask_source")


TIMEOUT_S = 2.0


def body_timeout(rank, world, out_dir):
    """Rank 1 skips a dispatch that rank 0 makes: rank 0's check() raises EPTimeoutError naming rank 1
    within the deadline. Rank 1 calls nothing on the buffer after that. Neither rank closes the
    buffer; both processes exit (spawn's abandon mode): closing pairs the ranks (the nvlink backend's
    barrier, then NVSHMEM's collective free for a rank that saw no fault, which rank 0, faulted, no
    longer joins), and a test of the timeout must not hang on that. No wait here is unbounded: the
    kernels' own deadline, then a barrier that rank 0 reaches once it has its error."""
    E_l, K, hidden = 2, 3, 7168
    auto = _buf("auto", E_l, K, hidden, timeout_s=TIMEOUT_S)
    x, idx, w = _inputs(rank, [M, M], hidden, E_l * WORLD, K, seed=5)
    recv_x, count, handle, _, _ = auto.low_latency_dispatch(x, idx)  # a healthy round: builds the engine
    auto.low_latency_combine(_expert_output(recv_x, count, rank, E_l), idx, w, handle)
    if _no_nvshmem_engine(auto, out_dir, rank):
        return
    auto.check()
    dist.barrier()
    if rank == 0:
        start = time.monotonic()
        auto.low_latency_dispatch(x, idx)  # returns at once: the kernels wait on the device
        with pytest.raises(EPTimeoutError) as info:
            auto.check()
        elapsed = time.monotonic() - start
        assert info.value.missing_ranks == tuple(range(1, WORLD)), str(info.value)
        assert elapsed < TIMEOUT_S + 10, f"raised after {elapsed:.1f}s"
    dist.barrier()  # rank 1 waits here until rank 0 has its error
    write_rank_result(out_dir, rank, {"ok": True})


def test_timeout_names_the_rank_that_skipped(fault_parts):
    root, parts = fault_parts
    parts["timeout"].check()
    _check_results(root / "timeout")


def test_torch_engine_on_nccl(ll_parts):
    """The reference itself on CUDA tensors and NCCL: the CPU contract test's brute-force checks."""
    ll_parts[1]["torch_engine"].check()
