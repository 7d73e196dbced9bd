"""What the nvlink kernels can take. The numbers come from the compiled module (csrc/nvlink/), so
Python and CUDA cannot disagree; `check_hidden` is what the chooser asks before picking nvlink."""
from __future__ import annotations

from ..._ext import has_c, get_c

HIDDEN_MIN, HIDDEN_MAX, HIDDEN_ALIGN = 256, 16384, 128  # 16-byte warp copies of BF16 rows, stage size
if has_c():
    _C = get_c()
    MAX_RANKS = int(_C.NVLINK_MAX_RANKS)
    MAX_TOPK = int(_C.NVLINK_MAX_TOPK)
    KERNEL_NAMES = dict(_C.NVLINK_KERNEL_NAMES)   # id reported by a timed-out kernel -> name
else:  # pure-Python install: the backend cannot run, but the chooser can still explain why
    MAX_RANKS, MAX_TOPK, KERNEL_NAMES = 0, 0, {}


def check_hidden(hidden: int) -> None:
    if not isinstance(hidden, int) or hidden % HIDDEN_ALIGN or not HIDDEN_MIN <= hidden <= HIDDEN_MAX:
        raise ValueError(f"the nvlink backend supports hidden sizes that are multiples of {HIDDEN_ALIGN} in "
                         f"[{HIDDEN_MIN}, {HIDDEN_MAX}] (e.g. 2048, 4096, 5120, 7168), got hidden={hidden}")
