"""How many SMs the nvlink kernels use: `comm.num_sms` as given, or a count planned for `auto`."""
from __future__ import annotations

from typing import Union

# 24 SMs already reach the NVLink ceiling at 4096 tokens x 7168 on H200 (benchmarks/NOTES_nvlink.md),
# and leave the rest of the GPU to the experts.
AUTO_SMS = 24


def plan_num_sms(requested: Union[int, str], sm_count: int) -> int:
    """`auto` -> AUTO_SMS, at most a quarter of the GPU; an int is clamped to the GPU."""
    if requested == "auto":
        return max(1, min(AUTO_SMS, sm_count // 4))
    return max(1, min(int(requested), sm_count))


# Runtime.combine's mode numbers (csrc/nvlink/nvlink.h CombineMode).
COMBINE_MODES = {"split": 0, "fused": 1, "pipelined": 2}
# Below this many tokens the split kernels win: the queue-driven kernels pay for their work queue and
# per-chunk counters, which a few hundred rows do not repay (4x H200, 2026-11-22: 128 tokens split
# 59 us vs fused 170 us).
AUTO_COMBINE_MIN_TOKENS = 512


def plan_combine_kernel(requested: str, tokens: int) -> str:
    """`comm.combine_kernel` for a combine of `tokens` tokens: as given, or for `auto` the pipelined
    kernel (bulk-copy sends, the reduce overlapped with arrival) from AUTO_COMBINE_MIN_TOKENS up,
    split below."""
    if requested != "auto":
        return requested
    return "pipelined" if tokens >= AUTO_COMBINE_MIN_TOKENS else "split"


def plan_dispatch_kernel(requested: str) -> str:
    """`comm.dispatch_kernel`: as given, or for `auto` stage then pull ("split")."""
    return "split" if requested == "auto" else requested
