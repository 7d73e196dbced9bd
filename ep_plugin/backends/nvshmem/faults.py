"""What both NVSHMEM engines (low_latency.py, rail.py) do with what their kernels record in host-mapped
memory -- expert ids out of range, a peer that missed a deadline -- and how they give their symmetric
memory back. An engine sets `_rt` (its _C runtime), `num_experts`, `timeout_s`, `device`, and the
class attributes below."""
from __future__ import annotations

import torch

from ...errors import EPTimeoutError
from . import runtime


class ReportsFaults:
    what = "nvshmem"        # the engine in messages
    kernels: dict = {}      # the runtime's error_kernel() code -> the call it stands for
    mask_hint = ""          # how the caller leaves a missing rank out
    _reported = False

    def check(self) -> None:
        """Raise ValueError for ids outside [-1, E) a dispatch saw, EPTimeoutError (once) for a peer
        that did not arrive; reads host memory only."""
        rt = self._rt
        if rt is None:
            return
        if rt.take_bad_expert_ids():
            raise ValueError(f"topk_idx values must lie in [-1, {self.num_experts}); ids outside were treated as "
                             f"routed nowhere by a {self.what} dispatch")
        if self._reported or not rt.error():
            return
        self._reported = True
        runtime.mark_fault()
        missing = tuple(rt.missing_ranks())
        where = self.kernels.get(rt.error_kernel(), "?")
        raise EPTimeoutError(
            f"nvshmem {self.what}: rank(s) {list(missing)} did not arrive within comm.timeout_s={self.timeout_s}s "
            f"({where}); their rows are missing from that call. Leave them out with {self.mask_hint} to go on "
            "without them", missing)

    def _release(self) -> None:
        """Drop what points into the symmetric heap before it is freed (engines override)."""

    def close(self) -> None:
        if self._rt is None:
            return
        rt, self._rt = self._rt, None
        self._release()
        torch.cuda.synchronize(self.device)
        # nvshmem_free is collective: after a fault a peer may never join it
        rt.destroy(collective=not runtime.faulted() and not rt.error())

    def __del__(self):
        if getattr(self, "_rt", None) is not None:
            try:
                self._rt.destroy(collective=False)
            except Exception:  # noqa: BLE001 - interpreter teardown
                pass
