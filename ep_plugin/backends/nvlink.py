"""nvlink backend: intranode dispatch/combine kernels over CUDA IPC-mapped buffers (ep_plugin._C).

Transport: every rank cudaMallocs one buffer (flags, counts, send lists, a stage area for its own
rows, and a combine area with one slot per (rank, row)) and opens its peers' buffers through CUDA IPC
handles gathered over the process group. Protocol and kernels: csrc/nvlink.h.

Dispatch = notify (counts, positions) -> stage (own rows into the IPC stage area) -> pull (each
rank reads the rows addressed to it from the sources' stage areas, straight into its output
tensor). Combine = every rank writes its rows back into the source's combine area at
[its rank, position]; the source sums per token in float and writes BF16. The default combine is
a send kernel then a reduce kernel ("split"); ``EP_PLUGIN_NVLINK_COMBINE=fused`` selects one fused
kernel in which the source reduces each 8-token chunk as soon as its rows have arrived. On 4x H200
(2026-11-22) split was 2.5-3.5x faster in the 128-token case and equal within 4% at 4096 tokens.

Modes
- normal: dispatch waits on the host for the notify step (to size the outputs [R, H] and return
  host tokens_per_expert), like DeepEP's normal kernels. combine never waits on the host.
- async_op: the kernels run on a communication stream; an EPEvent is returned.
- cached (handle given): no notify; the handle's layout is reused (what backward passes need).
- worst case (``backend.worst_case = True``, env ``EP_PLUGIN_NVLINK_WORST_CASE=1``, and always
  while a CUDA graph is being captured): no host synchronisation at all. Outputs are sized for the
  worst case R_max = world * comm.max_tokens_per_rank rows; only the first R rows are valid, the
  padding rows have topk_idx -1 and weight 0 (their x is undefined). ``tokens_per_expert`` is then a
  device int64 tensor [E/world], ``handle.backend_state["num_recv"]`` a device int32 tensor [1]
  holding R, ``handle.num_recv`` = R_max (combine takes [R_max, H]), and the handle's host lists
  (send_counts, recv_counts) are empty.

Rows the kernels do not size for (float32 rows, non-BF16 combine) go through the torch reference
path with the same handle.
"""
from __future__ import annotations

import atexit
import os
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from .._ext import get_c
from ..errors import BackendUnavailableError, EPTimeoutError
from .base import Backend, DispatchOutput, EPEvent, Handle

MAX_RANKS = 8
MAX_TOPK = 32
HIDDEN_MIN, HIDDEN_MAX, HIDDEN_ALIGN = 256, 16384, 128
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
_KERNEL_KINDS = {"notify": 1, "stage": 2, "pull": 3, "combine-send": 4, "combine-reduce": 5}
_KERNEL_NAMES = {v: k for k, v in _KERNEL_KINDS.items()}

_live = weakref.WeakSet()


@atexit.register
def _close_all():  # release IPC mappings and buffers at interpreter exit
    for b in list(_live):
        try:
            b.close(barrier=False)
        except Exception:
            pass


def check_hidden(hidden: int) -> None:
    if not isinstance(hidden, int) or hidden % HIDDEN_ALIGN or not HIDDEN_MIN <= hidden <= HIDDEN_MAX:
        raise ValueError(f"the nvlink backend supports hidden sizes that are multiples of {HIDDEN_ALIGN} in "
                         f"[{HIDDEN_MIN}, {HIDDEN_MAX}] (e.g. 2048, 4096, 5120, 7168), got hidden={hidden}")


class NvlinkBackend(Backend):
    name = "nvlink"

    def __init__(self, group, cfg, hidden: int, num_experts: int):
        super().__init__(group, cfg, hidden, num_experts)
        check_hidden(hidden)
        if self.world > MAX_RANKS:
            raise BackendUnavailableError(f"the nvlink backend supports at most {MAX_RANKS} ranks, got {self.world}")
        if not torch.cuda.is_available():
            raise BackendUnavailableError("the nvlink backend needs CUDA GPUs")
        C = get_c()
        self.device = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(self.device)
        self.num_sms = max(1, min(int(cfg.comm.num_sms), props.multi_processor_count))
        self.max_tokens = int(cfg.comm.max_tokens_per_rank)
        self.timeout_s = float(cfg.comm.timeout_s)
        self.worst_case = os.environ.get("EP_PLUGIN_NVLINK_WORST_CASE", "0") not in ("", "0")
        # combine: "split" (send kernel, then reduce kernel) or "fused" (one kernel; the source reduces
        # each 8-token chunk as soon as its rows have arrived). Split measured faster for small batches.
        self.combine_mode = os.environ.get("EP_PLUGIN_NVLINK_COMBINE", "split")
        if self.combine_mode not in ("fused", "split"):
            raise ValueError(f"EP_PLUGIN_NVLINK_COMBINE must be fused or split, got {self.combine_mode!r}")
        self._rt = C.NvlinkRuntime(self.device, self.rank, self.world, self.max_tokens, hidden,
                                   num_experts, self.timeout_s)
        mine = torch.frombuffer(bytearray(self._rt.ipc_handle()), dtype=torch.uint8).to(f"cuda:{self.device}")
        allh = torch.empty(self.world * mine.numel(), dtype=torch.uint8, device=mine.device)
        dist.all_gather_into_tensor(allh, mine, group=group)
        handles = [bytes(h.tolist()) for h in allh.cpu().view(self.world, -1)]
        try:
            self._rt.open_peers(handles)
        except RuntimeError as exc:
            self._rt.close()
            raise BackendUnavailableError(
                f"the nvlink backend could not map a peer's buffer through CUDA IPC ({exc}); all ranks must "
                "share one node with peer access: use comm.backend: torch or auto") from exc
        dist.barrier(group=group)  # every rank's flags are zeroed and its peers mapped
        self._comm_stream: Optional[torch.cuda.Stream] = None
        self._tail: Optional[tuple] = None  # (stream, event) of the last async op
        self._torch = None
        self._notify_ev = torch.cuda.Event()  # the host waits on it for the notify step (normal mode)
        self._failed: Optional[EPTimeoutError] = None
        self._closed = False
        _live.add(self)

    # ---------------------------------------------------------------- helpers
    @property
    def buffer_bytes(self) -> int:
        return self._rt.buffer_bytes

    def _fallback(self):
        if self._torch is None:
            from .torch import TorchBackend
            self._torch = TorchBackend(self.group, self.cfg, self.hidden, self.num_experts)
        return self._torch

    def check_errors(self) -> None:
        """Raise EPTimeoutError if a kernel of this buffer timed out (reads host-mapped memory only)."""
        if self._failed is not None:
            raise self._failed
        if self._closed:
            raise RuntimeError("this nvlink EPBuffer backend is closed")
        if self._rt.error():
            missing = list(self._rt.missing_ranks())
            where = _KERNEL_NAMES.get(self._rt.error_kernel(), "?")
            self._failed = EPTimeoutError(
                f"nvlink backend: rank(s) {missing} did not arrive within comm.timeout_s={self.timeout_s}s "
                f"(rank {self.rank} waited in the {where} kernel); this buffer cannot be used any more",
                missing_ranks=missing)
            raise self._failed

    def _stream(self, async_op: bool):
        cur = torch.cuda.current_stream()
        if async_op:
            if self._comm_stream is None:
                self._comm_stream = torch.cuda.Stream(device=self.device)
            s = self._comm_stream
            s.wait_stream(cur)
        else:
            s = cur
        if self._tail is not None and self._tail[0] != s:
            s.wait_event(self._tail[1])
        self._tail = None
        return s

    def _finish(self, s, async_op: bool, tensors=()):
        if not async_op:
            return None
        for t in tensors:
            if t is not None and t.numel():
                t.record_stream(s)
        ev = torch.cuda.Event()
        ev.record(s)
        self._tail = (s, ev)
        return EPEvent(cuda_event=ev, on_complete=self.check_errors)

    @staticmethod
    def _is_nvl(handle) -> bool:
        return handle is not None and isinstance(handle.backend_state, dict) and "nvl_send_pos" in handle.backend_state

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, x, scales, topk_idx, topk_weights, handle=None, async_op=False):
        self.check_errors()
        fp8 = x.dtype in _FP8
        if not (fp8 or x.element_size() == 2) or (handle is not None and not self._is_nvl(handle)):
            return self._fallback().dispatch(x, scales, topk_idx, topk_weights, handle, async_op)
        if fp8 and scales is None:
            raise TypeError("FP8 dispatch needs (x_fp8, scales)")
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must have shape [num_tokens, {self.hidden}], got {tuple(x.shape)}")
        if x.shape[0] > self.max_tokens:
            raise ValueError(f"x has {x.shape[0]} tokens, more than comm.max_tokens_per_rank={self.max_tokens}")
        K = topk_idx.shape[1] if topk_idx is not None else handle.topk_idx.shape[1]
        if K > MAX_TOPK:
            raise ValueError(f"the nvlink backend supports topk <= {MAX_TOPK}, got {K}")
        if x.data_ptr() % 16:
            raise ValueError("x must be 16-byte aligned for the nvlink kernels")
        for name, t in (("x", x), ("scales", scales), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
            if t is not None and not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        rt, W, dev = self._rt, self.world, x.device
        T = x.shape[0]
        row_bytes = x.shape[1] * x.element_size()
        nscales = scales.shape[1] if scales is not None else 0
        s = self._stream(async_op)
        sp = s.cuda_stream
        x_ptr = x.data_ptr()
        sc_ptr = scales.data_ptr() if scales is not None else 0
        w_ptr = topk_weights.data_ptr() if topk_weights is not None else 0

        if handle is None:  # ---- fresh layout
            worst = self.worst_case or torch.cuda.is_current_stream_capturing()
            send_pos = torch.empty((T, W), dtype=torch.int32, device=dev)
            is_in = torch.empty((T, W), dtype=torch.bool, device=dev)
            recv_off = torch.empty(W + 1, dtype=torch.int32, device=dev)
            tpe = torch.empty(self.experts_per_rank, dtype=torch.int64, device=dev)
            rt.notify(topk_idx.data_ptr(), T, K, send_pos.data_ptr(), is_in.data_ptr(), recv_off.data_ptr(),
                      tpe.data_ptr(), sp)
            ev = None
            if not worst:
                ev = self._notify_ev
                ev.record(s)
            rt.stage(x_ptr, T, row_bytes, sc_ptr, nscales, topk_idx.data_ptr(), w_ptr, K, self.num_sms, sp)
            if worst:
                R = W * self.max_tokens
                send_counts, recv_counts, tpe_out = [], [], tpe
            else:
                ev.synchronize()
                R, send_counts, recv_counts, tpe_out, err = rt.results()
                if err:
                    self.check_errors()
            out_x = torch.empty((R, self.hidden), dtype=x.dtype, device=dev)
            out_s = torch.empty((R, nscales), dtype=torch.float32, device=dev) if scales is not None else None
            out_idx = torch.empty((R, K), dtype=torch.int64, device=dev)
            out_w = torch.empty((R, K), dtype=torch.float32, device=dev) if topk_weights is not None else None
            recv_src = torch.empty(R, dtype=torch.int32, device=dev)
            rt.pull(out_x.data_ptr(), row_bytes, out_s.data_ptr() if out_s is not None else 0, nscales,
                    out_idx.data_ptr(), out_w.data_ptr() if out_w is not None else 0, K, recv_off.data_ptr(),
                    recv_src.data_ptr(), 0, R, self.num_sms, sp)
            state = {"nvl_send_pos": send_pos, "nvl_recv_off": recv_off, "nvl_recv_src": recv_src,
                     "nvl_worst": worst, "num_recv": recv_off[W:] if worst else R, "tokens_per_expert": tpe}
            handle = Handle(num_tokens=T, num_recv=R, num_experts=self.num_experts, is_token_in_rank=is_in,
                            send_counts=send_counts, recv_counts=recv_counts, tokens_per_expert=tpe_out,
                            topk_idx=topk_idx, recv_topk_idx=out_idx, backend_state=state)
            event = self._finish(s, async_op, (x, scales, topk_idx, topk_weights, out_x, out_s, out_idx, out_w,
                                               recv_src, send_pos, is_in, recv_off, tpe))
            return DispatchOutput(x=out_x, scales=out_s, topk_idx=out_idx, topk_weights=out_w,
                                  tokens_per_expert=tpe_out, handle=handle, event=event)

        # ---- cached: reuse the handle's layout, move rows (and weights if given)
        st = handle.backend_state
        if T != handle.num_tokens:
            raise ValueError(f"handle was made for {handle.num_tokens} tokens, x has {T}")
        idx_ptr = handle.topk_idx.data_ptr() if topk_weights is not None else 0
        rt.stage(x_ptr, T, row_bytes, sc_ptr, nscales, idx_ptr, w_ptr, K, self.num_sms, sp)
        R = handle.num_recv
        out_x = torch.empty((R, self.hidden), dtype=x.dtype, device=dev)
        out_s = torch.empty((R, nscales), dtype=torch.float32, device=dev) if scales is not None else None
        out_w = torch.empty((R, K), dtype=torch.float32, device=dev) if topk_weights is not None else None
        rt.pull(out_x.data_ptr(), row_bytes, out_s.data_ptr() if out_s is not None else 0, nscales, 0,
                out_w.data_ptr() if out_w is not None else 0, K, st["nvl_recv_off"].data_ptr(),
                st["nvl_recv_src"].data_ptr(), 1, R, self.num_sms, sp)
        event = self._finish(s, async_op, (x, scales, topk_weights, out_x, out_s, out_w))
        return DispatchOutput(x=out_x, scales=out_s, topk_idx=handle.recv_topk_idx, topk_weights=out_w,
                              tokens_per_expert=handle.tokens_per_expert, handle=handle, event=event)

    # ---------------------------------------------------------------- combine
    def combine(self, x, handle, async_op=False):
        self.check_errors()
        if x.dtype != torch.bfloat16 or not self._is_nvl(handle):
            if self._is_nvl(handle) and handle.backend_state["nvl_worst"]:
                raise TypeError(f"worst-case (graph) mode combines BF16 rows only, got {x.dtype}")
            from .torch import combine_rows
            return combine_rows(self.group, x, handle, async_op)
        if x.dim() != 2 or x.shape[1] != self.hidden or x.shape[0] != handle.num_recv:
            raise ValueError(f"x must have shape [{handle.num_recv}, {self.hidden}], got {tuple(x.shape)}")
        if not x.is_contiguous() or x.data_ptr() % 16:
            raise ValueError("x must be contiguous and 16-byte aligned for the nvlink kernels")
        st = handle.backend_state
        s = self._stream(async_op)
        T = handle.num_tokens
        y = torch.empty((T, self.hidden), dtype=torch.bfloat16, device=x.device)
        self._rt.combine(x.data_ptr(), st["nvl_send_pos"].data_ptr(), st["nvl_recv_off"].data_ptr(),
                         st["nvl_recv_src"].data_ptr(), y.data_ptr(), T, self.num_sms,
                         1 if self.combine_mode == "fused" else 0, s.cuda_stream)
        return y, self._finish(s, async_op, (x, y))

    # ---------------------------------------------------------------- teardown
    def close(self, barrier: bool = True) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        _live.discard(self)
        try:
            torch.cuda.synchronize(self.device)
        except Exception:
            pass
        if barrier:  # no peer may still be writing into (or reading from) our buffer when it is freed
            try:
                if dist.is_initialized():
                    dist.barrier(group=self.group)
            except Exception:
                pass
        self._rt.close()

    def __del__(self):
        try:
            self.close(barrier=False)
        except Exception:
            pass
