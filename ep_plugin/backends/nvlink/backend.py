"""nvlink backend: intranode dispatch/combine kernels over CUDA IPC-mapped buffers (ep_plugin._C).

Transport: every rank cudaMallocs one buffer (flags, counts, send lists, a stage area for its own
rows, and a combine area with one slot per (rank, row)) and opens its peers' buffers through CUDA IPC
handles gathered over the process group. Protocol and kernels: csrc/nvlink/.

Dispatch = notify (counts, positions) -> stage (own rows into the IPC stage area) -> pull (each
rank reads the rows addressed to it from the sources' stage areas, straight into its output
tensor; the rows move by bulk copies (TMA) through a shared-memory ring, csrc/nvlink/pull_tma.cu,
where a row fits it, `Runtime.tma` = False for register copies). With `comm.dispatch_kernel: fused`,
when the outputs exist before the counts (no host sync, or a cached dispatch), stage and the
rank-major pull are one kernel, csrc/nvlink/stage_pull_tma.cu: each 16-token sub-chunk is pulled as
soon as its source has staged it. Combine = every rank writes its rows back into the source's combine area at
[its rank, position]; the source sums per token in float and writes BF16. `comm.combine_kernel`
picks a send kernel then a reduce kernel ("split"), one fused kernel in which the source reduces each
8-token chunk as soon as its rows have arrived ("fused", "pipelined"), or turns the combine around
("pull": every rank stages its rows in its own area and the sources read and sum them,
csrc/nvlink/combine_pull_tma.cu); "auto" by EP size, SMs and tokens (plan.py). On 4x H200 (2026-11-22) split
was 2.5-3.5x faster in the 128-token case and equal within 4% at 4096 tokens.

Modes
- `comm.host_sync: false` (the default), and always while a CUDA graph is being captured: no host
  synchronisation. Outputs are sized for the worst case R_max = world * comm.max_tokens_per_rank
  rows; only the first R rows are valid (R = `res.num_recv`, a device scalar), the padding rows have
  topk_idx -1 and weight 0. The host counts are written by notify itself into a slot of a reused
  pinned ring (types.HostCounts, types.PinnedRing), read on demand after its event.
- `comm.host_sync: true`: dispatch waits on the host for the notify step (to size the outputs
  [R, H] exactly), like DeepEP's normal kernels. combine never waits on the host.
- Expert-major (`dispatch_expert`, EPBuffer's layout="expert"): pull is replaced by expert_meta +
  expert_pull, which write each row into its local experts' segments; its combine sums a row's
  experts on the way out, then reduces with the split kernels (comm.combine_kernel does not apply).
  A token naming one expert in several slots gets one row, weights summed (`merges_repeats`): notify
  counts the expert once and stage stages the picks merged (expert_major.merge_repeats' rule), so
  EPBuffer launches nothing before notify (topk_idx as given is the handle's).
- async_op: the kernels run on a communication stream; an EPEvent is returned.
- cached (handle given): no notify; the handle's layout is reused (what backward passes need).
  `dispatch_scattered` is a cached rank-major dispatch whose pull writes received row i at a row the
  caller names (the hierarchical backend's contract order; csrc/nvlink/nvlink.h, DispatchRoute).

What the kernels take is declared in `capabilities` (BF16/FP16 rows or FP8 pairs, BF16 combine,
top-k <= 32, hidden multiple of 128 in [256, 16384]); EPBuffer refuses the rest with a TypeError.
A kernel that waits past comm.timeout_s records the missing rank in host-mapped memory and returns;
the error is raised by the next call on this buffer, by EPEvent.synchronize() or by EPBuffer.check().

Host path: a cold call waits for the host's work before its first kernel (benchmarks/bench_nvlink_host.py
times it). So the tensors a call's kernels write -- notify's four, the dispatch's outputs, the combine's
sums -- are made at the end of the previous call of the same form, after its launches (spares.py,
`comm.spare_outputs`: one call's outputs held per kind of call; never under CUDA-graph capture), the
Stream object of the current stream is reused, the counts are copied without switching streams when they go to the
current one, and nothing is built that a synchronous call does not return. Of the no-sync counts only
the pinned ring slot (its addresses read once per slot) comes before notify; their HostCounts after it.
"""
from __future__ import annotations

import atexit
import dataclasses
import itertools
import os
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from ..._ext import get_c
from ...errors import BackendUnavailableError, EPTimeoutError
from ... import expert_major
from ...types import (FP8_DTYPES, ContractDispatch, DispatchOutput, ExpertLayout, Handle, PinnedRing,
                      counts_from_lists)
from ..base import Backend, Capabilities
from .limits import HIDDEN_ALIGN, HIDDEN_MAX, HIDDEN_MIN, KERNEL_NAMES, MAX_RANKS, MAX_TOPK, check_hidden
from .plan import (COMBINE_MODES, plan_combine_kernel, plan_dispatch_kernel, plan_kernel_sms, plan_num_sms,
                   plan_pull_stage_slots)
from .spares import Spares
from .state import NvlinkState, _DispatchCounts

_live = weakref.WeakSet()

# torch.cuda.current_stream() is Python around these (lazy-init checks, a new Stream object per call: a
# few us); CUDA is initialised once a backend exists (it queried the device), so the checks are dead
# weight on every call.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
if _raw_stream is not None:
    _get_device = torch._C._cuda_getDevice
    _is_capturing = torch._C._cuda_isCurrentStreamCapturing
else:  # a torch without CUDA, where torch._C holds placeholders: the public API (the backend cannot run)
    _get_device = torch.cuda.current_device
    _is_capturing = torch.cuda.is_current_stream_capturing


@atexit.register
def _close_all():  # release IPC mappings and buffers at interpreter exit
    for b in list(_live):
        try:
            b.close(barrier=False)
        except Exception:
            pass


def _host_recv_off(handle: Handle) -> Optional[list]:
    """The dispatch's receive offsets (W + 1) on the host without waiting, or None while its notify may still run."""
    counts = handle.counts
    if counts is None:
        return None
    offs = counts.peek("recv_off")
    if offs is not None:
        return offs
    recv = counts.peek("recv_counts")
    return None if recv is None else [0, *itertools.accumulate(recv)]


class NvlinkBackend(Backend):
    name = "nvlink"
    capabilities = Capabilities(
        row_dtypes=(torch.bfloat16, torch.float16), fp8=True, combine_dtypes=(torch.bfloat16,),
        max_topk=MAX_TOPK, max_ranks=MAX_RANKS, checks_expert_ids=True, merges_repeats=True,
        combine_gathers=True, combine_to_blocks=True, dispatch_scatters=True, dispatch_contracts=True,
        hidden_rule=f"a multiple of {HIDDEN_ALIGN} in [{HIDDEN_MIN}, {HIDDEN_MAX}]")

    @staticmethod
    def check_group(group, hidden: int) -> None:
        check_hidden(hidden)
        if dist.get_world_size(group) > MAX_RANKS:
            raise BackendUnavailableError(
                f"the nvlink backend supports at most {MAX_RANKS} ranks, got {dist.get_world_size(group)}")

    # The contract-order stage_pull (the hierarchical backend's fresh inner exchange, dispatch_contract) with notify
    # inside it too, as the plain fused dispatch (Runtime.stage_pull_contract given notify's outputs; its shifts wait
    # for the forwarders' lists and counts as the pull does). On since session 18: its GPU tests passed, and at 2x2 on
    # 4x H100 the fresh dispatch read 825-857 us cold against 864-880 with notify first, 1.13-1.15x a cached one
    # against 1.14-1.17x (three processes each; bench_internode.py --fresh-path notify_first is the path before).
    notify_inside_contract = True
    # combine_expert under the pull / push kernels: each row's local experts summed locally first (expert_sum), then
    # the planned kernel; False: the split kernels' send-side sum whatever the plan (the path before session 20).
    expert_sum_first = True
    # ... and under the pull kernel the sum is its stage (Runtime.combine_expert_staged): on the SMs the pull kernel
    # leaves free, beside it, straight into the combine area, released per sub-chunk; False: the sum first, then the
    # pull kernel with its own stager (session 20's path).
    expert_sum_beside = True

    def __init__(self, group, cfg, hidden: int, num_experts: int):
        super().__init__(group, cfg, hidden, num_experts)
        self.check_group(group, hidden)
        if not torch.cuda.is_available():
            raise BackendUnavailableError("the nvlink backend needs CUDA GPUs")
        C = get_c()
        self.device = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(self.device)
        self.max_tokens = int(cfg.comm.max_tokens_per_rank)
        # auto: by EP size and the batch the buffer is sized for (plan.py)
        self._dispatch_requested = cfg.comm.dispatch_kernel  # both kernels are planned with num_sms (below)
        self._combine_requested = cfg.comm.combine_kernel
        self.num_sms = plan_num_sms(cfg.comm.num_sms, props.multi_processor_count, self.world, self.max_tokens)
        self._gpu_sms = props.multi_processor_count
        # the combine's copy-engine stage overlaps its copies with the pull kernel: not with one hardware queue
        # (CUDA_DEVICE_MAX_CONNECTIONS=1, as Megatron sets it for overlapped TP communication), where the kernel
        # would wait behind every copy
        self._one_queue = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() == "1"
        self.timeout_s = float(cfg.comm.timeout_s)
        self.worst_case = not cfg.comm.host_sync
        if cfg.comm.dispatch_dtype == "fp8":  # the caller promised FP8 pairs: refuse BF16 rows early
            self.capabilities = dataclasses.replace(self.capabilities, row_dtypes=())
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
        self._rt.pull_stage_slots = plan_pull_stage_slots(self.world)
        dist.barrier(group=group)  # every rank's flags are zeroed and its peers mapped
        self._comm_stream: Optional[torch.cuda.Stream] = None
        self._tail: Optional[tuple] = None  # (stream, event) of the last async op
        self._cur: tuple = (None, None, None)  # (raw pointer, device, Stream) of the last current stream
        # the next call's tensors, made after this call's launches (spares.py)
        self._spares = Spares(bool(cfg.comm.spare_outputs))
        self._scratch_ints: dict = {}  # num_sms -> ints of expert_pull's scratch (a pybind call otherwise)
        self._notify_ev = torch.cuda.Event()  # the host waits on it for the notify step (host_sync mode)
        # A fresh rank-major worst-case stage_pull runs notify inside its block 0 (csrc/nvlink/notify.cuh) while
        # the other blocks stage; False: notify launched first (the A/B knob of the benchmarks).
        self.notify_inside = True
        # A split rank-major dispatch's copy-engine stage (Runtime.stage_copy_engine) on a side stream beside notify
        # (Runtime.stage_begin / stage_end); False: after notify on the call's stream (the A/B knob). On: 2x H200,
        # 2026-11-27 (benchmarks/NOTES_nvlink.md, session 14) per call 440.5 against 466.0 us at 8 SMs, 268.4
        # against 294.4 at 16 (the split kernel auto picks there at EP2).
        self.stage_beside_notify = True
        # The pull combine's stage by the copy engines (Runtime.combine_copy_engine) where the dispatch's receive
        # offsets are on the host without a wait; False: the kernel's stager. Off: measured on 4x H200 (2026-11-27,
        # benchmarks/NOTES_nvlink.md session 15) it does not pay -- EP4 cold +1.6% at 24 SMs, -1.4% at 48, queued
        # level or slower; EP2 cold +2-12% (the copies' and releases' host calls).
        self.combine_stage_copy_engine = False
        self._failed: Optional[EPTimeoutError] = None
        # pinned copies of the counts of no-sync dispatches
        self._ring = PinnedRing({"tokens_per_expert": ((self.experts_per_rank,), torch.int64),
                                 "recv_off": ((self.world + 1,), torch.int32)})
        # notify's pinned addresses per ring slot, and (0, 0) last: what a dispatch under capture (slot -1) passes
        self._ring_ptrs = self._ring.pointers("tokens_per_expert", "recv_off") + [(0, 0)]
        self._closed = False
        _live.add(self)

    # ---------------------------------------------------------------- helpers
    @property
    def buffer_bytes(self) -> int:
        return self._rt.buffer_bytes

    def device_problem(self, device: torch.device):
        if device.type == "cuda" and device.index != self.device:
            return f"is on {device}, but this nvlink buffer lives on cuda:{self.device}"
        return super().device_problem(device)  # the group's rule: an NCCL group refuses the CPU

    def check(self) -> None:
        """Raise EPTimeoutError if a kernel of this buffer timed out, ValueError if a notify saw an expert
        id outside [-1, E) (routed nowhere meanwhile); reads host-mapped memory only."""
        if self._failed is not None:
            raise self._failed
        if self._closed:
            raise RuntimeError("this nvlink EPBuffer backend is closed")
        if self._rt.error():
            missing = list(self._rt.missing_ranks())
            where = KERNEL_NAMES.get(self._rt.error_kernel(), "?")
            self._failed = EPTimeoutError(
                f"nvlink backend: rank(s) {missing} did not arrive within comm.timeout_s={self.timeout_s}s "
                f"(rank {self.rank} waited in the {where} kernel); this buffer cannot be used any more",
                missing_ranks=missing)
            raise self._failed
        if self._rt.take_bad_expert_ids():
            raise ValueError(f"topk_idx values must lie in [-1, {self.num_experts}); ids outside were treated "
                             "as routed nowhere")


    def _current(self):
        """(Stream, raw pointer) of the current stream. One Stream object per stream: a Stream is a value
        (its device and raw stream), so the one made when this stream was last current serves again."""
        if _raw_stream is None:
            s = torch.cuda.current_stream()
            return s, s.cuda_stream
        dev = _get_device()
        sp = _raw_stream(dev)
        c = self._cur
        if c[0] == sp and c[1] == dev:
            return c[2], sp
        s = torch.cuda.current_stream(dev)
        self._cur = (sp, dev, s)
        return s, sp

    def _stream(self, async_op: bool):
        """(stream, raw pointer) the call runs on, after what it must wait for, and the current stream."""
        cur, sp = self._current()
        if async_op:
            if self._comm_stream is None:
                self._comm_stream = torch.cuda.Stream(device=self.device)
            s = self._comm_stream
            s.wait_stream(cur)
            sp = s.cuda_stream
        else:
            s = cur
        if self._tail is not None:
            if self._tail[0] != s:
                s.wait_event(self._tail[1])
            self._tail = None
        return s, sp, cur

    def _finish(self, s, tensors):
        """The event of an async call; the next call on another stream waits for it."""
        event = self.stream_event(s, tensors)
        self._tail = (s, event.cuda_event)
        return event

    def _state(self, handle: Handle) -> NvlinkState:
        if not isinstance(handle.state, NvlinkState):
            raise TypeError(f"this handle was made by the {handle.backend} backend; an nvlink buffer takes "
                            "handles of its own dispatches only")
        return handle.state

    def _check_call(self, x, T: int, K: int):
        if T > self.max_tokens:
            raise ValueError(f"x has {T} tokens, more than comm.max_tokens_per_rank={self.max_tokens}")
        if K > MAX_TOPK:
            raise ValueError(f"the nvlink backend supports topk <= {MAX_TOPK}, got {K}")
        if x.data_ptr() % 16:
            raise ValueError("x must be 16-byte aligned for the nvlink kernels")

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, x, scales, topk_idx, topk_weights, handle=None, async_op=False):
        return self._dispatch(x, scales, topk_idx, topk_weights, handle, async_op, None)

    def dispatch_expert(self, x, scales, topk_idx, topk_weights, handle=None, async_op=False, alignment=1):
        """Expert-major receive (csrc/nvlink/expert.cu): rows land in their local experts' segments."""
        if handle is not None and handle.expert is None:
            raise ValueError("this handle comes from a rank-major dispatch; an expert-major cached dispatch "
                             "needs the handle of an expert-major one")
        return self._dispatch(x, scales, topk_idx, topk_weights, handle, async_op, alignment)

    def _dispatch(self, x, scales, topk_idx, topk_weights, handle, async_op, alignment, contract=None, out_rows=None):
        """contract: dispatch_contract's ContractDispatch (out None; its index and counts allocated, written by
        the pull; fresh rank-major worst-case fused only, which dispatch_contract checked). out_rows:
        dispatch_scattered's index (cached rank-major only, which dispatch_scattered checked)."""
        self.check()
        if scales is None and x.dtype in FP8_DTYPES:
            raise TypeError("FP8 dispatch needs (x_fp8, scales)")
        T, K = x.shape[0], (topk_idx if topk_idx is not None else handle.topk_idx).shape[1]
        self._check_call(x, T, K)
        if handle is not None:
            return self._dispatch_cached(x, scales, topk_weights, handle, async_op, alignment is not None, T, out_rows)
        W, dev = self.world, x.device
        s, sp, cur = self._stream(async_op)
        capturing = _is_capturing()
        # Only what notify writes comes before it, made by the previous dispatch if it could be (spares.py)
        spares = self._spares
        made = None if capturing else spares.take("notify", (T, dev), cur)
        (send_pos, is_in, recv_off, tpe), ptrs = made if made is not None else self._notify_tensors(T, dev)
        rt = self._rt
        worst = self.worst_case or capturing
        merge = 0 if alignment is None else 1  # expert-major: repeated experts merged by notify and stage
        # Outputs sized before the counts exist: with comm.dispatch_kernel fused, stage and a rank-major
        # pull go in one launch (stage_pull), each sub-chunk pulled once staged, notify inside it (for a contract's
        # order only with notify_inside_contract). Otherwise stage right after notify, ahead of the host's wait.
        together = worst and alignment is None and self.dispatch_mode == "fused"
        inside = together and self.notify_inside and (contract is None or self.notify_inside_contract)
        idx_ptr = topk_idx.data_ptr()
        row_bytes = x.shape[1] * x.element_size()
        nscales = scales.shape[1] if scales is not None else 0
        x_ptr, scales_ptr = x.data_ptr(), scales.data_ptr() if scales is not None else 0
        weights_ptr = topk_weights.data_ptr() if topk_weights is not None else 0
        stage_args = (x_ptr, T, row_bytes, scales_ptr, nscales, idx_ptr, weights_ptr, K)
        # the copy-engine stage beside notify (A/B knob): its copies on a side stream while notify runs
        beside = not together and not merge and self.stage_beside_notify and rt.stage_copy_engine
        if beside:  # the side stream forks here; its host calls follow notify's launch (the peers wait on notify)
            rt.stage_fork(sp)
        if worst:  # notify writes the counts into a pinned slot too: the host may read them before the rows land
            slot = -1 if capturing else self._ring.claim()  # their HostCounts made after the launch
            host_ptrs = self._ring_ptrs[slot]
            if not inside:  # (inside: the counts object after the one launch, off the way to it)
                rt.notify(idx_ptr, T, K, *ptrs, sp, *host_ptrs, merge)
                counts = _DispatchCounts(is_in, capturing, self._ring, slot)
                counts.written(s)
        else:
            rt.notify(idx_ptr, T, K, *ptrs, sp, 0, 0, merge)
            self._notify_ev.record(s)
        if beside:  # the stage's wait and copies from the fork, its release behind notify, the stream joined to it
            rt.stage_begin(*stage_args, sp)
            rt.stage_end(sp)
        elif not together:
            rt.stage(*stage_args, self.num_sms, sp, merge)
        if worst:
            R = W * self.max_tokens
        else:
            self._notify_ev.synchronize()
            R, send_counts, recv_counts, tpe_host, err = rt.results()
            if err:
                self.check()
            counts = counts_from_lists(send_counts, recv_counts, tpe_host)
        # rank-major: R rows; expert-major: N rows, one per (row, local expert), segments padded
        N = R if alignment is None else expert_major.capacity(R, K, self.experts_per_rank, alignment,
                                                                None if worst else tpe_host)
        form = (N, R, K, x.dtype, nscales, topk_weights is not None, alignment, dev)
        # host-synced outputs have their exact, changing size: a set made ahead would rarely fit
        ahead = worst and not capturing
        outs = spares.take("rows", form, cur) if ahead else None
        if outs is None:
            outs = self._dispatch_outputs(*form)
        (out_x, out_s, out_idx, out_w, recv_src, positions, offsets, scratch), (rows_ptr, s_ptr, w_ptr) = outs
        if contract is not None:  # dispatch_contract checked that the call goes through stage_pull (together)
            # notify inside: its outputs (send_pos, is_in, tpe; recv_off is the pull's) and the counts' pinned slot
            notify_args = (ptrs[0], ptrs[1], ptrs[3], *host_ptrs) if inside else ()
            rt.stage_pull_contract(*stage_args, rows_ptr, s_ptr, out_idx.data_ptr(), w_ptr, recv_off.data_ptr(),
                                   recv_src.data_ptr(), R, contract.recv_counts.numel() // W,
                                   contract.to_contract.data_ptr(), contract.recv_counts.data_ptr(),
                                   self._stage_pull_sms, sp,
                                   *notify_args)
            layout = None
        elif inside:  # notify's arguments, then stage_pull's
            rt.notify_stage_pull(idx_ptr, T, K, *ptrs, *host_ptrs, x_ptr, row_bytes, scales_ptr, nscales, weights_ptr,
                                 rows_ptr, s_ptr, out_idx.data_ptr(), w_ptr, recv_src.data_ptr(), R,
                                 self._stage_pull_sms, sp)
            layout = None
        elif together:
            rt.stage_pull(*stage_args, rows_ptr, s_ptr, out_idx.data_ptr(), w_ptr, recv_off.data_ptr(),
                          recv_src.data_ptr(), 0, R, self._stage_pull_sms, sp)
            layout = None
        elif alignment is None:
            rt.pull(rows_ptr, row_bytes, s_ptr, nscales, out_idx.data_ptr(), w_ptr, K, recv_off.data_ptr(),
                    recv_src.data_ptr(), 0, R, self.num_sms, sp)
            layout = None
        else:
            num_sms = self.num_sms
            rt.expert_pull(rows_ptr, row_bytes, s_ptr, nscales, out_idx.data_ptr(), w_ptr, K,
                           recv_off.data_ptr(), recv_src.data_ptr(), positions.data_ptr(), 0, R, alignment,
                           scratch.data_ptr(), offsets.data_ptr(), tpe.data_ptr(), num_sms, sp)
            layout = ExpertLayout(positions=positions, offsets=offsets, num_rows=N, alignment=alignment)
        if inside:  # notify ran inside the launch (plain or contract order): its counts object, off the way to it
            counts = _DispatchCounts(is_in, capturing, self._ring, slot)
            counts.written(s)
        if not capturing:  # the next dispatch's tensors, while these kernels run (spares.py)
            spares.refill("notify", (T, dev), cur, lambda: self._notify_tensors(T, dev))
            if ahead:
                spares.refill("rows", form, cur, lambda: self._dispatch_outputs(*form))
        handle = Handle(backend=self.name, num_tokens=T, num_recv=R, num_experts=self.num_experts,
                        is_token_in_rank=is_in, topk_idx=topk_idx, recv_topk_idx=out_idx,
                        num_recv_device=recv_off[W], num_tokens_per_expert=tpe, counts=counts,
                        state=NvlinkState(send_pos, recv_off, recv_src, worst), exact=not worst, expert=layout)
        event = None
        if async_op:
            kept = (x, scales, topk_idx, topk_weights, out_x, out_s, out_idx, out_w, recv_src, send_pos, is_in,
                    recv_off, tpe)
            if contract is not None:
                kept += (contract.to_contract, contract.recv_counts)
            event = self._finish(s, kept if layout is None else kept + (positions, offsets, scratch))
        return DispatchOutput(x=out_x, scales=out_s, topk_idx=out_idx, topk_weights=out_w, handle=handle,
                              event=event)

    def _dispatch_outputs(self, N: int, R: int, K: int, dtype, nscales: int, weights: bool, alignment, dev):
        """A fresh dispatch's outputs -- ((rows, scales, weights as _cached_outputs makes them (rank-major: N = R),
        topk_idx [R, K], source ranks [R], then expert-major's positions [R, K], offsets [E_l + 1], expert_pull's
        scratch, else None), (the pointers of rows, scales, weights; 0 for None))."""
        (out_x, out_s, out_w), ptrs = self._cached_outputs(N, K, dtype, nscales, weights, alignment is not None, dev)
        out_idx = torch.empty(R, K, dtype=torch.int64, device=dev)
        recv_src = torch.empty(R, dtype=torch.int32, device=dev)
        positions = offsets = scratch = None
        if alignment is not None:
            positions = torch.empty(R, K, dtype=torch.int32, device=dev)
            offsets = torch.empty(self.experts_per_rank + 1, dtype=torch.int64, device=dev)
            ints = self._scratch_ints.get(self.num_sms)
            if ints is None:
                ints = self._scratch_ints[self.num_sms] = self._rt.expert_scratch_ints(self.num_sms)
            scratch = torch.empty(ints, dtype=torch.int32, device=dev)
        return (out_x, out_s, out_idx, out_w, recv_src, positions, offsets, scratch), ptrs

    @property
    def num_sms(self) -> int:
        """The SM count of the calls; setting it (the benchmarks' sweeps, the deep_ep shim's Config.num_sms) plans
        comm.dispatch_kernel and comm.combine_kernel for the new count too, as a buffer built for it would."""
        return self._num_sms

    @num_sms.setter
    def num_sms(self, n: int) -> None:
        self._num_sms = int(n)
        self.dispatch_mode = plan_dispatch_kernel(self._dispatch_requested, self.world, self._num_sms)
        self._stage_pull_sms = plan_kernel_sms("stage_pull", self.world, self._num_sms)
        self._plan_combine()

    @property
    def combine_mode(self) -> str:
        """comm.combine_kernel as asked (auto, or a kernel); setting it (the tests and benchmarks switch it on a live
        buffer) plans the kernel the calls run."""
        return self._combine_requested

    @combine_mode.setter
    def combine_mode(self, mode: str) -> None:
        self._combine_requested = mode
        self._plan_combine()

    def _plan_combine(self) -> None:
        # planned by the buffer's max_tokens, the same on every rank, never by a call's T: ranks whose counts lie on
        # either side of AUTO_COMBINE_MIN_TOKENS would otherwise run split and pull in one exchange, whose flags and
        # areas do not interoperate (each side waits for flags the other never sets, to the timeout)
        self._combine_kernel = plan_combine_kernel(self._combine_requested, self.max_tokens, self.world, self._num_sms)
        self._combine_sms = plan_kernel_sms(self._combine_kernel, self.world, self._num_sms)

    def _notify_tensors(self, T: int, dev):
        """(send_pos [T, W] int32, is_in [T, W] bool, recv_off [W + 1] int32, tokens per expert [E_l] int64),
        and their pointers in notify's order (read here, so that a spare's cost nothing before notify)."""
        W = self.world
        t = (torch.empty(T, W, dtype=torch.int32, device=dev), torch.empty(T, W, dtype=torch.bool, device=dev),
             torch.empty(W + 1, dtype=torch.int32, device=dev),
             torch.empty(self.experts_per_rank, dtype=torch.int64, device=dev))
        return t, (t[0].data_ptr(), t[1].data_ptr(), t[2].data_ptr(), t[3].data_ptr())

    def dispatch_contract_fits(self, x, scales, nodes):
        """Backend.dispatch_contract_fits: the fresh call would run stage_pull_tma (no host sync, comm.dispatch_kernel
        fused, Runtime.tma on and the row fits its ring), over at most 256 source ranks whose slots split max_tokens
        evenly (Runtime.stage_pull_contract_fits). Every other case is the plain dispatch's."""
        return (self.worst_case and self.dispatch_mode == "fused" and x.dim() == 2
                and self._rt.stage_pull_contract_fits(x.shape[1] * x.element_size(), int(nodes)))

    def dispatch_contract(self, x, scales, topk_idx, topk_weights, nodes, async_op=False):
        """Backend.dispatch_contract: one stage_pull_tma launch in its contract-order mode (csrc/nvlink/nvlink.h,
        DispatchRoute) after notify (notify inside the launch with notify_inside_contract): each row's position
        computed by the pull from the forwarders' send lists.
        The handle is this backend's as ever (combine and cached dispatches take it; its recv_topk_idx is the
        output's, in the contract's order)."""
        if not self.dispatch_contract_fits(x, scales, nodes):
            raise ValueError(f"dispatch_contract runs the fused bulk-copy pull only (host_sync off: {self.worst_case}, "
                             f"dispatch_kernel {self.dispatch_mode!r}, tma {self._rt.tma}, row of {x.shape[-1]} x "
                             f"{x.element_size()} bytes, {nodes} nodes x {self.world} ranks); ask "
                             "dispatch_contract_fits first and use dispatch otherwise")
        dev = x.device
        got = ContractDispatch(out=None,
                               to_contract=torch.empty(self.world * self.max_tokens, dtype=torch.int64, device=dev),
                               recv_counts=torch.empty(int(nodes) * self.world, dtype=torch.int64, device=dev))
        got.out = self._dispatch(x, scales, topk_idx, topk_weights, None, async_op, None, got)
        return got

    def dispatch_scattered(self, x, scales, topk_weights, handle, out_rows, async_op=False):
        """Backend.dispatch_scattered: a cached rank-major dispatch whose pull (every kernel of it: stage_pull,
        the bulk-copy pull, the register pull) writes received row i and its scales and weights at row
        out_rows[i] (csrc/nvlink/nvlink.h, DispatchRoute); no pass over the rows after it."""
        if handle.expert is not None:
            raise ValueError("dispatch_scattered takes the handle of a rank-major dispatch; this one is expert-major")
        if (not isinstance(out_rows, torch.Tensor) or out_rows.dtype != torch.int64 or out_rows.dim() != 1
                or not out_rows.is_contiguous() or out_rows.device != x.device):
            raise TypeError(f"out_rows must be a contiguous 1-D int64 tensor on {x.device}, got "
                            f"{getattr(out_rows, 'dtype', type(out_rows))} {list(getattr(out_rows, 'shape', ()))} on "
                            f"{getattr(out_rows, 'device', None)}")
        if out_rows.numel() != handle.num_recv:
            raise ValueError(f"out_rows has {out_rows.numel()} entries; the handle's dispatch received "
                             f"{handle.num_recv} rows (one output row per received row, padding included)")
        return self._dispatch(x, scales, None, topk_weights, handle, async_op, None, out_rows=out_rows)

    def _dispatch_cached(self, x, scales, topk_weights, handle, async_op, expert: bool, T: int, out_rows=None):
        """Reuse the handle's layout: no notify; stage, then pull the rows (and weights if given) into
        the handle's rank-major rows (one stage_pull launch with comm.dispatch_kernel fused), or straight
        to its expert-major positions. T: x's tokens. out_rows: dispatch_scattered's index (rank-major only)."""
        st = self._state(handle)
        K = handle.topk_idx.shape[1]
        if T != handle.num_tokens:
            raise ValueError(f"handle was made for {handle.num_tokens} tokens, x has {T}")
        s, sp, cur = self._stream(async_op)
        nscales = scales.shape[1] if scales is not None else 0
        row_bytes = x.shape[1] * x.element_size()
        idx_ptr = handle.topk_idx.data_ptr() if topk_weights is not None else 0
        rt = self._rt
        stage_args = (x.data_ptr(), T, row_bytes, scales.data_ptr() if scales is not None else 0, nscales, idx_ptr,
                      topk_weights.data_ptr() if topk_weights is not None else 0, K)
        together = not expert and self.dispatch_mode == "fused"
        if not together:  # expert-major: the weights merged over the handle's (given) ids, as the fresh stage did
            rt.stage(*stage_args, self.num_sms, sp, 1 if expert else 0)
        lay, dev = handle.expert, x.device
        N = lay.num_rows if expert else handle.num_recv
        # the outputs of a cached dispatch of this form, made by the previous one (spares.py; the fresh
        # dispatch's rows are another form: training alternates the two by phase, not by call)
        form = (N, K, x.dtype, nscales, topk_weights is not None, expert, dev)
        ahead = st.worst_case and not _is_capturing()  # as in _dispatch: exact sizes change from handle to handle
        outs = self._spares.take("rows", form, cur) if ahead else None
        if outs is None:
            outs = self._cached_outputs(*form)
        (out_x, out_s, out_w), (rows_ptr, s_ptr, w_ptr) = outs
        if expert:
            rt.expert_pull(rows_ptr, row_bytes, s_ptr, nscales, 0, w_ptr, K, st.recv_off.data_ptr(),
                           st.recv_src.data_ptr(), lay.positions.data_ptr(), 1, handle.num_recv, lay.alignment, 0,
                           lay.offsets.data_ptr(), handle.num_tokens_per_expert.data_ptr(), self.num_sms, sp)
        else:
            route = () if out_rows is None else (out_rows.data_ptr(),)  # the plain call passes nothing more
            if together:
                rt.stage_pull(*stage_args, rows_ptr, s_ptr, 0, w_ptr, st.recv_off.data_ptr(),
                              st.recv_src.data_ptr(), 1, N, self._stage_pull_sms, sp, *route)
            else:
                rt.pull(rows_ptr, row_bytes, s_ptr, nscales, 0, w_ptr, K, st.recv_off.data_ptr(),
                        st.recv_src.data_ptr(), 1, N, self.num_sms, sp, *route)
        if ahead:
            self._spares.refill("rows", form, cur, lambda: self._cached_outputs(*form))
        event = self._finish(s, (x, scales, topk_weights, out_x, out_s, out_w, out_rows)) if async_op else None
        return DispatchOutput(x=out_x, scales=out_s, topk_idx=handle.recv_topk_idx if out_rows is None else None,
                              topk_weights=out_w, handle=handle, event=event)

    def _cached_outputs(self, N: int, K: int, dtype, nscales: int, weights: bool, expert: bool, dev):
        """A cached dispatch's outputs (and the first three of a fresh one's) -- ((rows [N, H], scales [N, nscales] or
        None, weights ([N, K], or [N] expert-major) or None), their pointers (0 for None))."""
        out_x = torch.empty(N, self.hidden, dtype=dtype, device=dev)
        out_s = torch.empty(N, nscales, dtype=torch.float32, device=dev) if nscales else None
        out_w = None
        if weights:
            out_w = (torch.empty(N, dtype=torch.float32, device=dev) if expert
                     else torch.empty(N, K, dtype=torch.float32, device=dev))
        return ((out_x, out_s, out_w), (out_x.data_ptr(), out_s.data_ptr() if out_s is not None else 0,
                                        out_w.data_ptr() if out_w is not None else 0))

    def _sums(self, T: int, dev, stream, capturing: bool) -> torch.Tensor:
        """A combine's output [T, H] BF16: made by the previous combine of T tokens on this stream if it could
        be (spares.py), the next one's made by _sums_next after the launch."""
        y = None if capturing else self._spares.take("sums", (T, dev), stream)
        return y if y is not None else torch.empty(T, self.hidden, dtype=torch.bfloat16, device=dev)

    def _sums_next(self, T: int, dev, stream, capturing: bool) -> None:
        if not capturing:
            self._spares.refill("sums", (T, dev), stream,
                                lambda: torch.empty(T, self.hidden, dtype=torch.bfloat16, device=dev))

    # ---------------------------------------------------------------- combine
    def combine_expert(self, x, handle, async_op=False):
        """Sum each received row's local experts (the unpermute), then combine those rank-major rows. Under the
        split kernels the sum is the send kernel's way out (one pass over the rows); under the others (expert_sum_first,
        the default) a local pass first (expert_sum, on the whole GPU: local work, not the exchange) into rank-major
        rows, which the planned kernel then combines on its SMs -- 4x H200, EP4, 24 SMs, queued: the split kernels
        with the sum on the way out ran 1603 us against the pull kernel's 580 for rank-major rows (session 20)."""
        if handle.expert is None:
            raise ValueError("combine of expert-major rows needs the handle of an expert-major dispatch")
        if self.expert_sum_first and self._combine_kernel != "split":
            return self._combine_routed(x, handle, async_op, None, None, 0, True, expert=handle.expert)
        self.check()
        st = self._state(handle)
        if not x.is_contiguous() or x.data_ptr() % 16:
            raise ValueError("x must be contiguous and 16-byte aligned for the nvlink kernels")
        s, sp, cur = self._stream(async_op)
        T, K = handle.num_tokens, handle.topk_idx.shape[1]
        dev, capturing = x.device, _is_capturing()
        y = self._sums(T, dev, cur, capturing)
        self._rt.combine_expert(x.data_ptr(), handle.expert.positions.data_ptr(), K, st.send_pos.data_ptr(),
                                st.recv_off.data_ptr(), y.data_ptr(), T, self.num_sms, sp)
        self._sums_next(T, dev, cur, capturing)
        return y, (self._finish(s, (x, y)) if async_op else None)

    def combine(self, x, handle, async_op=False):
        return self.combine_gathered(x, None, handle, async_op)

    def combine_gathered(self, x, x_rows, handle, async_op=False):
        """combine of x[x_rows] (x itself where x_rows is None), the gather done by the combine kernels' own reads
        of x (Backend.combine_gathered; csrc/nvlink/nvlink.h, CombineRoute)."""
        return self._combine_routed(x, handle, async_op, x_rows, None, 0, True)

    def combine_to_blocks(self, x, x_rows, handle, y_blocks, block_tokens, async_op=False):
        """combine whose sums the kernels store at y_blocks' addresses (Backend.combine_to_blocks): the event
        (async_op) or None."""
        if (not isinstance(y_blocks, torch.Tensor) or y_blocks.dtype != torch.int64 or y_blocks.dim() != 1
                or not y_blocks.is_contiguous() or y_blocks.device != x.device):
            raise TypeError(f"y_blocks must be a contiguous 1-D int64 tensor of addresses on {x.device}, got "
                            f"{getattr(y_blocks, 'dtype', type(y_blocks))} {list(getattr(y_blocks, 'shape', ()))}")
        block_tokens = int(block_tokens)
        if block_tokens < 1 or y_blocks.numel() * block_tokens < handle.num_tokens:
            raise ValueError(f"y_blocks ({y_blocks.numel()} blocks of block_tokens={block_tokens}) must hold the "
                             f"handle's {handle.num_tokens} tokens")
        return self._combine_routed(x, handle, async_op, x_rows, y_blocks, block_tokens, False)[1]

    def _combine_routed(self, x, handle, async_op, x_rows, y_blocks, block_tokens, sums: bool, expert=None):
        """(y [T, H] where `sums`, else None (the kernels store at y_blocks), the event of an async call or None).
        expert: the ExpertLayout of expert-major rows x, whose local experts expert_sum adds into rank-major rows
        first (combine_expert)."""
        self.check()
        st = self._state(handle)
        if not x.is_contiguous() or x.data_ptr() % 16:
            raise ValueError("x must be contiguous and 16-byte aligned for the nvlink kernels")
        if x_rows is not None and (x_rows.dtype != torch.int64 or x_rows.dim() != 1 or not x_rows.is_contiguous()
                                   or x_rows.device != x.device):
            raise TypeError(f"x_rows must be a contiguous 1-D int64 tensor on {x.device}, got {x_rows.dtype} "
                            f"{list(x_rows.shape)} on {x_rows.device}")
        s, sp, cur = self._stream(async_op)
        T, dev = handle.num_tokens, x.device
        y = None
        rt = self._rt
        keep = ()
        mode = self._combine_kernel  # (planned with num_sms and combine_mode: _plan_combine)
        capturing = sums and _is_capturing()
        # A stage beside the pull kernel, on the SMs it leaves free (Runtime.pull_beside_stage; not under graph
        # capture: the side stream is made at first use, and the copies' sizes are the host's): expert-major rows
        # summed as the stage (expert_sum_beside), or -- the A/B knob -- a plain call's rows staged by the copy engines
        # once its dispatch's receive offsets are on the host (notify done; a host-synced dispatch's always are).
        staged = copies = False
        if sums and mode == "pull" and x_rows is None and not capturing and self._combine_sms < self._gpu_sms:
            if expert is not None and self.expert_sum_beside:
                staged = rt.combine_copy_engine_fits
            elif self.combine_stage_copy_engine and not self._one_queue:
                copies = rt.combine_copy_engine_fits
        if expert is not None and not staged:  # the rows the kernels below combine: x's experts summed per row
            rows = torch.empty(handle.num_recv, self.hidden, dtype=torch.bfloat16, device=dev)
            rt.expert_sum(x.data_ptr(), expert.positions.data_ptr(), handle.topk_idx.shape[1], st.recv_off.data_ptr(),
                          rows.data_ptr(), self._gpu_sms, sp)
            keep, x = (x,), rows
        offs = _host_recv_off(handle) if copies else None
        if sums:
            y = self._sums(T, dev, cur, capturing)
        if staged:
            rt.combine_expert_staged(x.data_ptr(), expert.positions.data_ptr(), handle.topk_idx.shape[1],
                                     st.send_pos.data_ptr(), st.recv_off.data_ptr(), y.data_ptr(), T, self._combine_sms,
                                     sp)
        elif offs is not None:
            rt.combine_copy_engine(x.data_ptr(), st.send_pos.data_ptr(), st.recv_off.data_ptr(), y.data_ptr(), T,
                                   self._combine_sms, sp, offs)
        else:
            rt.combine(x.data_ptr(), st.send_pos.data_ptr(), st.recv_off.data_ptr(), st.recv_src.data_ptr(),
                       0 if y is None else y.data_ptr(), T, self._combine_sms, COMBINE_MODES[mode], sp,
                       0 if x_rows is None else x_rows.data_ptr(), 0 if y_blocks is None else y_blocks.data_ptr(),
                       block_tokens)
        if sums:
            self._sums_next(T, dev, cur, capturing)
        return y, (self._finish(s, (x, x_rows, y, y_blocks, *keep)) if async_op else None)

    # ---------------------------------------------------------------- teardown
    def close(self, barrier: bool = True) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._spares.clear()
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
