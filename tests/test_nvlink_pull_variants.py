"""The pull combine's variants (Runtime.pull_variant, csrc/nvlink/combine_pull_tma.cu) against the torch
backend, on real NCCL groups of 2 and 4 GPUs: every variant with several stager slot counts gives the same
y as variant 0 bit for bit (they change which shared-memory slot a row goes through, how the stager
cuts rows, which block takes which tokens and positions and the L2 policy of x's reads, never the order of a
token's sum), and y equals the torch backend's within BF16 rounding.

Shapes: the benchmark's (4096 tokens, hidden 7168, 256 experts, top-8: many sub-chunks, every load slot
reused many times), hidden 2048 (the load ring capped at 32 slots: the full free mask), and hidden 16384
with 3 stager slots (4 load slots: at EP4 a token may need all of them at once), with empty ranks and
skewed routing.
"""
import pytest
import torch

import ep_plugin
from tests._dist import spawn
from tests.reference import make_inputs

WORLDS = (2, 4)
# +1 / +2: stager half / quarter rows; +4: free load slots; +8: contiguous spans per block; +16: x read evict_first;
# +64: every rank's combine starts together (F_START)
VARIANTS = (0, 1, 2, 4, 5, 6, 8, 12, 16, 24, 29, 48, 52, 64, 80, 117)
RING_BYTES = 224 * 1024  # combine_pull_tma.cu kPullRingBytes
LOAD_MAX_SLOTS = 32


def _need(world):
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    import ep_plugin._ext as ext
    if not ext.has_c():
        pytest.skip("ep_plugin._C is not built")


def _fits(hidden, world, stage_slots):
    """combine_pull_tma_fits: otherwise the runtime runs the fused kernel instead (and this test would
    check nothing of the pull kernel)."""
    load = min(RING_BYTES // (hidden * 2) - stage_slots, LOAD_MAX_SLOTS)
    return load >= world and load >= 2


def _buf(backend, E, K, hidden, max_tokens, **comm):
    cfg = {"moe": {"num_experts": E, "topk": K},
           "comm": {"backend": backend, "max_tokens_per_rank": max_tokens, "timeout_s": 30.0, "host_sync": True,
                    **comm}}
    return ep_plugin.EPBuffer(None, cfg, hidden=hidden)


def check_variants(nv, ref, rank, world, E, K, hidden, tokens, seed, mode, slots):
    xs, idxs, ws = make_inputs(world, tokens, hidden, E, K, seed, torch.bfloat16, mode)
    x, idx, w = xs[rank].cuda(), idxs[rank].cuda(), ws[rank].cuda()
    a, b = nv.dispatch(x, idx, w), ref.dispatch(x, idx, w)
    R = b.x.shape[0]
    assert torch.equal(a.x[:R], b.x)
    rows = (b.x.float() * (rank + 1) + 0.25).to(torch.bfloat16)  # distinct values per rank
    want = ref.combine(rows, b.handle).float()
    full = torch.zeros_like(a.x)
    full[:R] = rows
    be, rt = nv._backend, nv._backend._rt
    mode0, slots0, variant0 = be.combine_mode, rt.pull_stage_slots, rt.pull_variant
    be.combine_mode = "pull"
    base = None
    try:
        for s in slots:
            assert _fits(hidden, world, s), (hidden, world, s)
            rt.pull_stage_slots = s
            for v in VARIANTS:
                rt.pull_variant = v
                ctx = f"rank {rank} world {world} hidden {hidden} tokens {tokens} mode {mode} slots {s} variant {v}"
                for _ in range(2):  # twice: the second combine reuses flags and areas of the first (epochs)
                    y = nv.combine(full, a.handle)
                    torch.testing.assert_close(y.float(), want, atol=2e-2, rtol=1e-2, msg=ctx)
                    if base is None:
                        base = y.clone()
                    assert torch.equal(y, base), ctx + ": not bit for bit variant 0's"
    finally:
        be.combine_mode, rt.pull_stage_slots, rt.pull_variant = mode0, slots0, variant0


def body(rank, world):
    torch.cuda.set_device(rank)
    # the knob's values: 3 would be split 8, 7 and 11 too; 128 is no bit of a variant
    nv = _buf("nvlink", 8 * world, 4, 2048, 512)
    for bad in (-1, 3, 7, 11, 67, 128):
        with pytest.raises(ValueError, match="pull_variant"):
            nv._backend._rt.pull_variant = bad
    nv.close()
    # the benchmark's shape
    E, K, H, T = 256, 8, 7168, 4096
    nv, ref = _buf("nvlink", E, K, H, T, num_sms=24), _buf("torch", E, K, H, T)
    check_variants(nv, ref, rank, world, E, K, H, T, 7, "random", (3, 4, 5))
    nv.close()
    ref.close()
    # small rows (the 32-slot cap), an odd SM count, empty ranks, skew
    E, K = 8 * world, 4
    for H, sms in ((2048, 7), (16384, 24)):
        nv, ref = _buf("nvlink", E, K, H, 512, num_sms=sms), _buf("torch", E, K, H, 512)
        slots = tuple(s for s in (3, 4, 5) if _fits(H, world, s))
        seed = 40
        for mode in ("random", "skew", "starve_last"):
            for tokens in (300, [0] + [9] * (world - 1)):
                seed += 1
                check_variants(nv, ref, rank, world, E, K, H, tokens, seed, mode, slots)
        nv.close()
        ref.close()


@pytest.mark.gpu
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"world{w}")
def test_pull_variants_match_variant0_and_torch(world):
    _need(world)
    spawn(body, world, backend="nccl", timeout=600)


def test_bench_kernels_variant_argument():
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    try:
        import bench_kernels
    finally:
        sys.path.pop(0)
    assert bench_kernels._variant("5/3") == (5, 3) and bench_kernels._variant("4") == (4, None)


def test_bench_kernels_merges_processes():
    """--processes N: each row's "<protocol>_us" is the median over the runs that have it, the values kept beside."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    try:
        import bench_kernels
    finally:
        sys.path.pop(0)

    def run(cold, queued, note=None):
        ops = {"dispatch": {"cold_us": cold, "queued_us": queued}, "combine": {"cold_us": cold - 10}}
        return {"world": 2, "sms": [24], "rows": [{"name": "ep_plugin auto/auto", "sms": 24, "ops": ops, "note": note},
                                                  {"name": "deepep v1", "sms": 24, "ops": {}, "note": None}]}

    merged = bench_kernels.merge_processes([run(300.0, 260.0, "first"), run(340.0, 262.0), run(320.0, None)])
    row = merged["rows"][0]
    assert merged["processes"] == 3 and row["note"] == "first" and merged["rows"][1]["ops"] == {}
    assert row["ops"]["dispatch"]["cold_us"] == 320.0 and row["ops"]["dispatch"]["cold_us_runs"] == [300.0, 340.0, 320.0]
    assert row["ops"]["dispatch"]["queued_us"] == 261.0 and row["ops"]["dispatch"]["queued_us_runs"] == [260.0, 262.0]
    assert row["ops"]["combine"]["cold_us"] == 320.0 - 10
