"""What the nvlink kernels run with: the SM count (`comm.num_sms`, or a count planned for `auto`) and
the dispatch / combine kernels (`comm.dispatch_kernel` / `comm.combine_kernel`, or `auto`), from the
measured runs named below."""
from __future__ import annotations

from typing import Union

# `auto` SMs at 4096 tokens (hidden 7168, top-8 of 256, 4x H200, 2026-11-26, bench_kernels; cold-call
# dispatch + combine with the auto kernels, us): the smallest count within 5% of the fastest measured.
# EP2: 8 SMs 1212, 24 SMs 674, 48 SMs 628 (24 is 7% off: 48); EP4: 16 SMs 1503, 24 SMs 1446, 48 SMs 1420
# (24 is 2% off: 24). Small batches are bound by latency and host work, not SMs: 24.
# EP4 re-measured with the kernels chosen below (4x H100, 2026-11-26 session 7 call 3, cold dispatch + combine,
# results/kernel_choices_skewed_h100x4_2026-11-26_s7call3.log): 24 SMs 1417, 32 SMs 1345, 48 SMs 1416 (then the
# pull combine and the split dispatch at 48): 32. With the kernels planned below (stage_pull; pull, pipelined from
# 48), dispatch + combine cold at 32 / 48 SMs: 4x H200 (session 7 call 4) 1381 / 1354; 4x H100 (session 8, calls
# 2, 4, 5, 6; results/bench_kernels_auto4_h100x4_2026-11-27_s8call2.log, s8call4_*, s8call5_6_*) 1370 / 1240,
# 1286 / 1385, 1404 / 1375-1412, 1348 / -: a tie within the cold rows' noise (means 1358 / 1353), so the fewer
# SMs, which leave more of the GPU to the computation beside the exchange: 32.
AUTO_SMS = 24
AUTO_SMS_BY_WORLD = {2: 48, 4: 32}
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
# 59 us vs fused 170 us). Compared with the buffer's max_tokens_per_rank, not a call's token count (the kernels
# of one combine must be the same on every rank); a small call on a large buffer runs the large kernel -- set
# comm.combine_kernel: split for a buffer that only ever combines a few hundred tokens.
AUTO_COMBINE_MIN_TOKENS = 512


# The fewest SMs at which `auto` picks the pull combine, per EP size. Below lo the push kernels win
# (EP2 16 SMs: pipelined 331 us queued vs pull 332, cold 372 vs 386-422; EP4 16 SMs: pipelined 659 vs fused 708
# and pull 779 queued on 4x H200, cold 731 vs 776 / 905 on 4x H100). EP2 from 24 SMs: pull 288 vs pipelined 353 cold
# (H100), 298 vs 344 (H200). EP4 from 24 SMs, 48 included since every rank's pull combine starts together (session
# 16; before it a late rank cost the pull kernel 2.3x its delay at 48 SMs and the pipelined push kernel was chosen
# there): at 48 SMs, three processes each, cold / queued / skewed us, pull 678.5 / 579.8 / 636.2 against pipelined
# 684.2 / 584.7 / 637.6 (4x H200, session 17, results/bench_kernels_ep4_48sms_pull_vs_pipelined_h200x4_2026-11-27_s17call2.json;
# 4x H100, session 16: 692.0 / 585.6 / 646.4 against 692.6 / 591.2 / 630.9), and a small call on a large buffer
# costs the pull kernel what the split kernels cost (EP4, 128 tokens, 24 SMs: pull 58 us, split 57, pipelined
# 108; session 17 call 1). Other sizes: unmeasured (the fused push combine).
AUTO_PULL_MIN_SMS = {2: 24, 4: 24}
# The pull combine's stager slots (the rest of its 224 KB ring loads rows): at EP4 a token holds up to four
# load slots, so one more load slot pays (24 SMs, queued, 4x H100: 4 stage slots 587 us, 5 618, 6 669, 3 702);
# at EP2 5 measured best (3 / 8: 292 / 305 against 244 on 4x H200).
PULL_STAGE_SLOTS = {2: 5, 4: 4}


def plan_combine_kernel(requested: str, tokens: int, world: int, num_sms: int = 48) -> str:
    """`comm.combine_kernel` for a buffer of `tokens` tokens per rank (comm.max_tokens_per_rank: a value every rank
    shares, so that every rank runs the same kernel) over `world` ranks on `num_sms` SMs: as given, or for
    `auto` what measured fastest in the cold call (4096 tokens, hidden 7168, top-8 of 256; benchmarks/NOTES_nvlink.md,
    session 7, 16, 17): the pull kernel from AUTO_PULL_MIN_SMS on, the pipelined push kernel below it at EP2 and
    EP4, the fused push kernel at other sizes; split below AUTO_COMBINE_MIN_TOKENS."""
    if requested != "auto":
        return requested
    if tokens < AUTO_COMBINE_MIN_TOKENS:
        return "split"
    if num_sms >= AUTO_PULL_MIN_SMS.get(world, 1 << 30):
        return "pull"
    return "pipelined" if world <= 4 else "fused"


def plan_pull_stage_slots(world: int) -> int:
    """Runtime.pull_stage_slots for `world` ranks (PULL_STAGE_SLOTS; the EP2 count where unmeasured)."""
    return PULL_STAGE_SLOTS.get(world, PULL_STAGE_SLOTS[2])


# The most SMs a kernel runs on at an EP size, whatever comm.num_sms gives it: past these counts the kernel only
# slowed (both GPU types, queued us, 4096 tokens, hidden 7168, top-8 of 256, auto kernels; results/
# bench_kernels_*_s20call{1,2}.json; medians of three processes, 32 SMs on H200 one). The EP4 stage_pull dispatch
# (dispatch_kernel fused), BF16 / cached / FP8 at 24 / 32 / 48 SMs: 4x H100 (session 20 call 2) 584 / 548 / 359,
# 589 / 559 / 377, 608 / 568 / 374; 4x H200 (call 1) 579 / 546 / 353, 577 / 557 / 355, 578 / 557 / 364. The EP4 pull
# combine at 24 / 28 / 32 / 36 / 40 / 48 SMs: 4x H100 588 / 564 / 562 / 565 / 565 / 588; 4x H200 580 / - / 559 / - /
# - / 578 (DeepEP's combine peaks at 32 too: 552 on H100, 548 on H200). The SMs left over go to the computation beside
# the exchange. EP2 has no cap (its combine holds from 32 to 48: 222 / 220 / 221 us on H100; its dispatch is flat);
# other sizes are unmeasured.
KERNEL_SMS_CAP = {4: {"stage_pull": 24, "pull": 32}}


def plan_kernel_sms(kernel: str, world: int, num_sms: int) -> int:
    """The SMs `kernel` ("stage_pull", or a combine kernel: split, fused, pipelined, pull) runs on at `world` ranks
    when given `num_sms`: num_sms, or KERNEL_SMS_CAP's count if smaller -- the same on every rank, since world and
    num_sms are."""
    return min(num_sms, KERNEL_SMS_CAP.get(world, {}).get(kernel, num_sms))


def plan_dispatch_kernel(requested: str, world: int, num_sms: int) -> str:
    """`comm.dispatch_kernel`: as given, or for `auto` stage_pull ("fused") at every EP size and SM count. It ties
    stage-then-pull ("split") at EP2 (16 / 24 / 48 SMs, 4x H200, session 7: 288.6 / 223.4 / 216.3 us queued
    against 289.1 / 224.2 / 212.5) and leads at EP4 from 32 SMs, where split had been chosen from an older run
    (48 SMs: 631 vs 648 us per call queued on 4x H200, cold 722-729 vs 739 on 4x H100; 32 SMs: cold 671-727
    vs 703, queued 611 vs 616). Unmeasured beyond EP4: the same rule. Except EP2 at <= 16 SMs, where split leads
    since its stage moves the rows by the copy engine (2x H200, 2026-11-27, session 13, per call queued: 8 SMs
    473 us against fused 607-617, cached 407 against 552; 16 SMs notify 41 + stage 50 + pull 191 against fused
    338 -- the pull at 16 SMs from the stage-kernel run, the copy engine's stage 50 us at every SM count; 24 SMs
    split 290 against fused 265, so fused from there): at few SMs the fused kernel's two halves share too few SMs."""
    if requested != "auto":
        return requested
    return "split" if world == 2 and num_sms <= 16 else "fused"
