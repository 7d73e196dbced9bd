"""NvshmemLowLatency: EPBuffer's low-latency engine on NVSHMEM (docs/LOW_LATENCY.md has the contract).

The kernels (csrc/nvshmem/ll_*.cu) write each (token, expert) row straight into the owner's
symmetric slot over NVLink P2P (NVSHMEM puts where a peer has no P2P path: the RDMA path, compiled
but not run on the GPU machines here), signal with epoch counters kept on the device, and pack rows
into the caller's tensors in the receive half. No host sync, fixed shapes, so a dispatch/combine
pair captures into a CUDA graph. The send half is launched first; the receive half right after it, or
when the hook is called. (The kernels also take both halves in one launch, phases SEND | RECV: worth
it once the outputs are known before the launch, with output_buffers; not used yet.)

A wait past comm.timeout_s records the missing rank in host-mapped memory; check() raises it as
EPTimeoutError (once), and set_mask() lets the others go on without that rank.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..._ext import get_c
from ...errors import BackendUnavailableError, EPTimeoutError
from ...types import FP8_BLOCK, LowLatencyHandle
from . import runtime

SEND, RECV = 1, 2
MAX_RANKS = 64
MIN_TOPK_CAPACITY = 16  # combine slots per token: the config's topk or this, whichever is larger


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream() -> int:
    """The current CUDA stream of the current device as an integer: torch's raw accessor (no Stream
    object built per call: the cold-call path is host-bound), else the public API."""
    if _raw_stream is not None:
        return _raw_stream(torch.cuda.current_device())
    return torch.cuda.current_stream().cuda_stream


class NvshmemLowLatency:
    name = "nvshmem"
    checks_expert_ids = True  # the send half flags ids outside [-1, E); check() raises them

    @staticmethod
    def check_available(group, hidden: int) -> None:
        C = get_c()
        if not getattr(C, "HAS_NVSHMEM", False):
            raise BackendUnavailableError("ep_plugin._C is built without NVSHMEM")
        if not torch.cuda.is_available():
            raise BackendUnavailableError("the NVSHMEM low-latency kernels need CUDA GPUs")
        world = dist.get_world_size(group)
        if world > MAX_RANKS:
            raise ValueError(f"the NVSHMEM low-latency kernels support at most {MAX_RANKS} ranks, got {world}")
        if hidden % 8:
            raise ValueError(f"the NVSHMEM low-latency kernels need hidden % 8 == 0 (16-byte rows), got {hidden}")

    def __init__(self, group, cfg, hidden: int, num_experts: int):
        C = get_c()
        self.group = group
        self.hidden = hidden
        self.num_experts = num_experts
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.local_experts = num_experts // self.world
        self.max_tokens = int(cfg.comm.low_latency.max_tokens_per_rank)
        self.max_topk = max(int(cfg.moe.topk), MIN_TOPK_CAPACITY)
        self.timeout_s = float(cfg.comm.timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device())
        heap = C.LowLatencyRuntime.heap_bytes(self.world, num_experts, self.max_tokens, self.max_topk, hidden)
        runtime.join(group, heap, cfg.comm.rdma)
        blocks = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._rt = C.LowLatencyRuntime(self.rank, self.world, num_experts, self.max_tokens, self.max_topk, hidden,
                                       self.timeout_s, blocks)
        self._reported = False
        # comm.low_latency.output_buffers = N > 0: outputs come from N sets allocated once and used in
        # turn (a call's outputs stay valid for the next N - 1 calls of its kind); 0: fresh tensors.
        self.output_buffers = int(getattr(cfg.comm.low_latency, "output_buffers", 0) or 0)
        self._ring = {}
        self._turn = {}

    def _dispatch_outputs(self, use_fp8: bool, dev):
        """(recv_x, recv_count, src_info, layout_range, row_slot, pointers): fresh, or the next set."""
        n = self.output_buffers
        if n:
            sets = self._ring.get(use_fp8)
            if sets is None:
                sets = self._ring[use_fp8] = [self._new_dispatch_outputs(use_fp8, dev) for _ in range(n)]
            i = self._turn.get(use_fp8, 0)
            self._turn[use_fp8] = (i + 1) % n
            return sets[i]
        return self._new_dispatch_outputs(use_fp8, dev)

    def _new_dispatch_outputs(self, use_fp8: bool, dev):
        EL, WM, H = self.local_experts, self.world * self.max_tokens, self.hidden
        if use_fp8:
            data = torch.empty((EL, WM, H), dtype=torch.float8_e4m3fn, device=dev)
            scales = torch.empty((EL, H // FP8_BLOCK, WM), dtype=torch.float32, device=dev).transpose(1, 2)
            recv_x = (data, scales)
        else:
            data = recv_x = torch.empty((EL, WM, H), dtype=torch.bfloat16, device=dev)
            scales = None
        recv_count = torch.empty((EL,), dtype=torch.int32, device=dev)
        src_info = torch.empty((EL, WM), dtype=torch.int32, device=dev)
        layout_range = torch.empty((EL, self.world), dtype=torch.int64, device=dev)
        row_slot = torch.empty((EL, WM), dtype=torch.int32, device=dev)
        ptrs = (data.data_ptr(), _ptr(scales), recv_count.data_ptr(), src_info.data_ptr(), layout_range.data_ptr(),
                row_slot.data_ptr())
        return recv_x, recv_count, src_info, layout_range, row_slot, ptrs

    def _combine_output(self, T: int, dev):
        n = self.output_buffers
        if not n:
            return torch.empty((T, self.hidden), dtype=torch.bfloat16, device=dev)
        sets = self._ring.get("y")
        if sets is None:
            sets = self._ring["y"] = [torch.empty((self.max_tokens, self.hidden), dtype=torch.bfloat16, device=dev)
                                      for _ in range(n)]
        i = self._turn.get("y", 0)
        self._turn["y"] = (i + 1) % n
        return sets[i][:T]

    # ------------------------------------------------------------------ dispatch
    # The send half is launched first, with nothing but pointers: in a cold call the host's work
    # before the first launch is on the critical path, the allocations after it overlap the send.
    def dispatch(self, x, topk_idx, *, use_fp8: bool, round_scale: bool, recv_stats, hook: bool):
        T, K = topk_idx.shape
        rt = self._rt
        stream = _current_stream()
        rt.dispatch(x.data_ptr(), topk_idx.data_ptr(), T, K, int(use_fp8), int(round_scale), SEND,
                    0, 0, 0, 0, 0, 0, 0, stream)
        recv_x, recv_count, src_info, layout_range, row_slot, ptrs = self._dispatch_outputs(use_fp8, x.device)
        handle = LowLatencyHandle(src_info=src_info, layout_range=layout_range, num_tokens=T,
                                  max_tokens=self.max_tokens, hidden=self.hidden, num_experts=self.num_experts,
                                  topk=K, use_fp8=use_fp8, backend=self.name,
                                  state={"row_slot": row_slot, "recv_count": recv_count})
        # the receive half reads no input (x and topk_idx may go once the send half is queued)
        outs = ptrs + (_ptr(recv_stats),)
        if not hook:
            rt.dispatch(0, 0, T, K, int(use_fp8), 0, RECV, *outs, stream)
            return recv_x, recv_count, handle, None

        def recv(_alive=recv_stats):  # on the stream current when the hook runs; keeps recv_stats alive
            rt.dispatch(0, 0, T, K, int(use_fp8), 0, RECV, *outs, _current_stream())

        return recv_x, recv_count, handle, recv

    # ------------------------------------------------------------------ combine
    def combine(self, x, topk_idx, topk_weights, handle, *, out, hook: bool):
        T, K = topk_idx.shape
        rt, state = self._rt, handle.state
        stream = _current_stream()
        rt.combine(x.data_ptr(), state["row_slot"].data_ptr(), state["recv_count"].data_ptr(), 0, 0, T, K, SEND, 0,
                   stream)
        y = out if out is not None else self._combine_output(T, x.device)
        if not hook:
            rt.combine(0, 0, 0, topk_idx.data_ptr(), topk_weights.data_ptr(), T, K, RECV, y.data_ptr(), stream)
            return y, None

        def recv():  # reads topk_idx and topk_weights, which the closure keeps alive until then
            rt.combine(0, 0, 0, topk_idx.data_ptr(), topk_weights.data_ptr(), T, K, RECV, y.data_ptr(),
                       _current_stream())

        return y, recv

    # ------------------------------------------------------------------ faults
    def wait_pending(self) -> None:
        """Nothing in flight outside the stream: every wait is inside the kernels, with a deadline."""

    def set_mask(self, ranks: Sequence[int]) -> None:
        self._rt.set_mask(list(ranks))
        self._reported = False

    def check(self) -> None:
        if self._rt is None:
            return
        if self._rt.take_bad_expert_ids():
            raise ValueError(f"topk_idx values must lie in [-1, {self.num_experts}); ids outside were treated as "
                             "routed nowhere by a low-latency dispatch")
        if self._reported or not self._rt.error():
            return
        self._reported = True
        runtime.mark_fault()
        missing = tuple(self._rt.missing_ranks())
        where = {10: "low-latency dispatch", 11: "low-latency combine"}.get(self._rt.error_kernel(), "?")
        raise EPTimeoutError(
            f"nvshmem low-latency: rank(s) {list(missing)} did not arrive within comm.timeout_s={self.timeout_s}s "
            f"({where}); their rows are missing from that call. Leave them out with "
            "EPBuffer.set_low_latency_mask(ranks) to go on without them", missing)

    def close(self) -> None:
        if self._rt is None:
            return
        rt, self._rt = self._rt, None
        torch.cuda.synchronize(self.device)
        # nvshmem_free is collective: after a fault a peer may never join it
        rt.destroy(collective=not runtime.faulted() and not rt.error())

    def __del__(self):
        if getattr(self, "_rt", None) is not None:
            try:
                self._rt.destroy(collective=False)
            except Exception:  # noqa: BLE001 - interpreter teardown
                pass
