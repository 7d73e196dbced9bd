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
