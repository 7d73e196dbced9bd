"""What the nvlink kernels run with: the SM count (`comm.num_sms`, or a count planned for `auto`) and
the dispatch / combine kernels (`comm.dispatch_kernel` / `comm.combine_kernel`, or `auto`), from the
measured runs named below."""
from __future__ import annotations

from typing import Union

# `auto` SMs at 4096 tokens (hidden 7168, top-8 of 256, 4x H200, 2026-11-26, bench_kernels; cold-call
# dispatch + combine with the auto kernels, us): the smallest count within 5% of the fastest measured.
# EP2: 8 SMs 1212, 24 SMs 674, 48 SMs 628 (24 is 7% off: 48); EP4: 16 SMs 1503, 24 SMs 1446, 48 SMs 1420
# (24 is 2% off: 24). Small batches are bound by latency and host work, not SMs: 24.
AUTO_SMS = 24
AUTO_SMS_BY_WORLD = {2: 48}
AUTO_SMS_MIN_TOKENS = 1024  # below this many tokens per rank: AUTO_SMS


def plan_num_sms(requested: Union[int, str], sm_count: int, world: int = 0, tokens: int = 0) -> int:
    """`auto` -> the table above for this EP size and batch (at most half of the GPU); an int is
    clamped to the GPU."""
    if requested == "auto":
        want = AUTO_SMS_BY_WORLD.get(world, AUTO_SMS) if tokens >= AUTO_SMS_MIN_TOKENS else AUTO_SMS
        return max(1, min(want, sm_count // 2))
    return max(1, min(int(requested), sm_count))


# Runtime.combine's mode numbers (csrc/nvlink/nvlink.h CombineMode).
COMBINE_MODES = {"split": 0, "fused": 1, "pipelined": 2, "pull": 3}
# Below this many tokens the split kernels win: the queue-driven kernels pay for their work queue and
# per-chunk counters, which a few hundred rows do not repay (4x H200, 2026-11-22: 128 tokens split
# 59 us vs fused 170 us).
AUTO_COMBINE_MIN_TOKENS = 512


# The fewest SMs at which `auto` picks the pull combine, per EP size (EP2: it won with 48 SMs on H200 and H100,
# lost once at 24 on H100; EP4: it won at 24 and 48 on 4x H100, 2026-11-26 session 3). Other sizes: unmeasured.
AUTO_PULL_MIN_SMS = {2: 32, 4: 24}
# The pull combine's stager slots (the rest of its 224 KB ring loads rows): at EP4 a token holds up to four
# load slots, so one more load slot pays (24 SMs, queued, 4x H100: 4 stage slots 587 us, 5 618, 6 669, 3 702);
# at EP2 5 measured best (3 / 8: 292 / 305 against 244 on 4x H200).
PULL_STAGE_SLOTS = {2: 5, 4: 4}


def plan_combine_kernel(requested: str, tokens: int, world: int, num_sms: int = 48) -> str:
    """`comm.combine_kernel` for a combine of `tokens` tokens over `world` ranks: as given, or for `auto`
    what measured fastest (benchmarks/results/bench_kernels_ep*_2026-11-26*.json, 4096 tokens, hidden 7168,
    cold call): the pull kernel where AUTO_PULL_MIN_SMS says (EP2, 48 SMs: 242 us cold against the
    pipelined one's 302 on 4x H200, ..._pull_v2_..._s2call2, 278 against 307 on 4x H100, ..._s2call5; EP4 on
    4x H100, ..._s3call2: 24 SMs 635 against fused 669-686, 48 SMs 604 against 624), else the pipelined one
    at EP2 (24 SMs on H100: pull 392 against 334; on H200 the pull won, 273 against 340) and the fused one
    above (EP4, 16 / 24 / 48 SMs: 781 / 714 / 681 us against split's 1005 / 751 / 757 and pipelined's 915 /
    818 / 707); split below AUTO_COMBINE_MIN_TOKENS."""
    if requested != "auto":
        return requested
    if tokens < AUTO_COMBINE_MIN_TOKENS:
        return "split"
    if num_sms >= AUTO_PULL_MIN_SMS.get(world, 1 << 30):
        return "pull"
    return "pipelined" if world <= 2 else "fused"


def plan_pull_stage_slots(world: int) -> int:
    """Runtime.pull_stage_slots for `world` ranks (PULL_STAGE_SLOTS; the EP2 count where unmeasured)."""
    return PULL_STAGE_SLOTS.get(world, PULL_STAGE_SLOTS[2])


def plan_dispatch_kernel(requested: str, world: int, num_sms: int) -> str:
    """`comm.dispatch_kernel`: as given, or for `auto` stage_pull ("fused") at EP2 and at 24 SMs or fewer,
    stage then pull ("split") otherwise (first runs: EP2 24 / 48 SMs fused 319 / 315 us against split's
    349 / 325; EP4 16 SMs 722 against 765, 48 SMs split 698 against 752. EP4 24 SMs, cold / queued, in
    three calls of 2026-11-26 session 2: fused 747 / 603, 679 / 603 (4x H200), 717 / 606 (4x H100) against
    split's 757 / 610, 735-742 / 608, 746 / 622)."""
    if requested != "auto":
        return requested
    return "fused" if world <= 2 or num_sms <= 24 else "split"
