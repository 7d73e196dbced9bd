"""NvshmemLowLatency: EPBuffer's low-latency engine on NVSHMEM (docs/LOW_LATENCY.md has the contract).

The kernels (csrc/nvshmem/ll_*.cu) write each (token, expert) row straight into the owner's
symmetric slot over NVLink P2P (NVSHMEM puts where a peer has no P2P path: the RDMA path, compiled
but not run on the GPU machines here), signal with epoch counters kept on the device, and pack rows
into the caller's tensors in the receive half. No host sync, fixed shapes, so a dispatch/combine
pair captures into a CUDA graph.

Launches. With a receive hook: the send half now, the receive half from the hook. Without one, when
`fused_launch` is set (the default with comm.low_latency.output_buffers > 0, where the outputs exist
before the call): one launch with phases SEND | RECV, which saves the host a second launch and the
GPU the gap between two kernels. Otherwise the send half first, then the receive half: with fresh
outputs the allocations then overlap the send half instead of delaying it.

The fused launch relies on every block of its grid becoming resident: blocks that finish sending
wait in the receive half for this rank's own signal, which only the last block to send gives. The
grid is one 512-thread block per SM and one always fits an SM (launch bounds, shared memory checked
at build), so this holds unless SMs stay held by something that itself waits on this call (a kernel
on another stream waiting on another rank, an MPS share of the SMs): there the wait runs into
comm.timeout_s. Set `fused_launch = False` on such a setup; the split launches need no co-residency.

A wait past comm.timeout_s records the missing rank in host-mapped memory; check() raises it as
EPTimeoutError (once), and set_mask() lets the others go on without that rank.

Output sets. With comm.low_latency.output_buffers = N (1..MAX_OUTPUT_SETS) and every peer reachable
over P2P, the dispatch's outputs are N sets in the NVSHMEM heap (views made once, heap_views.py) and the
senders write each row into its final place there (ll_dispatch_direct.cu): no receive copy. The host
picks the set of each dispatch in turn, the same on every rank; a set is rewritten N dispatches later
(of either precision: BF16 and FP8 outputs of one set share its bytes), and its tensors are valid
until close().

Held outputs. Output sets change what a caller may keep: DeepEP V1 returns fresh tensors from every
call, so code written for it may hold a call's outputs as long as it likes. The engine keeps, per set,
the reference counts of what it returned (and the storage use counts, which views raise); when a set's
turn comes while a caller still holds any of it, a set of torch tensors (a job without P2P everywhere)
gives way to the next set nobody holds, or to fresh tensors when all are held (nothing is overwritten;
the choice is this rank's own: senders write the slots, not the sets), and a set in the heap -- which
every rank must pick alike, so no rank can switch alone -- is used anyway and the call raises
OutputsStillHeldError after its launch, naming the fix -- unless `comm.low_latency.held_outputs: copy`
(N >= 3): then each dispatch looks at the set of the next one before its launch, and a held set is moved
to memory of its own (held.move_out: the caller's tensors and views keep their values, one
device copy queued before this rank's send half, which every peer's next dispatch waits for) and the
engine takes new views of the heap. The combine's outputs (torch tensors) are
never overwritten while held: a held one is replaced by a fresh tensor. A decode loop that drops a
step's outputs before the step after next (N = 2) never sees either. DeepEP's own
tests/test_low_latency.py does hold a set for good (its check loop's names keep the last checked
dispatch's views through the whole bench that follows), so ep_plugin.deep_ep with no ep_config asks
for heap sets with `held_outputs: copy` and N = 3: a held set there costs one copy, never an error.

Own rows. Every dispatch records where the rows of this rank's own experts landed (the handle's
state["self_pos"]); a combine without a hook sends only the other ranks' rows and its receive half
reads its own from the combine's input. With a hook every row is sent: the input may change before
the hook runs.

The host path is short on purpose (a cold call at 128 tokens is host-bound; benchmarks/bench_ll_host.py
times it): pointers of reused outputs are computed once, nothing is built that the call does not return.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..._ext import get_c
from ...types import FP8_BLOCK, LowLatencyHandle
from . import runtime
from .faults import ReportsFaults
from .heap_views import heap_tensor
from .held import Watch, move_out
from .launch import MIN_TOPK_CAPACITY, RECV, SEND, require_kernels, current_stream as _current_stream

SEND_RECV = SEND | RECV
MAX_RANKS = 64
MAX_OUTPUT_SETS = 8  # kMaxSets in csrc/nvshmem/ll_device.cuh


# csrc/nvshmem/ll_device.cuh's variant bits in the default: 8 kScalesRowMajor (FP8 scales leave as one
# contiguous write per row, transposed on receive), 64 kCountWords (epoch-tagged count words), 256
# kLeanStores, 8192 kLeanRouting, 16384 kLightTickets (docs/LOW_LATENCY.md, "Phase stamps")
SCALES_ROW_MAJOR = 8
ARRIVAL_ORDER = 32768  # kArrivalOrder: comm.low_latency.source_order arrival
OWNER_REDUCE = 65536  # kOwnerReduce: comm.low_latency.combine_reduce owner
PER_PICK_SEND = 131072  # kPerPickSend: a hooked combine sends every pick's row (its send half waits for nobody)
MAX_ROW_MAJOR_SCALE_GROUPS = 256  # kMaxScaleGroups: a row's scales pass through shared memory
KERNEL_FLAGS_DEFAULT = SCALES_ROW_MAJOR | 64 | 256 | 8192 | 16384

class OutputsStillHeldError(RuntimeError):
    """A low-latency dispatch reused an output set whose tensors a caller still holds (module docstring,
    "Held outputs"); raised after the call was launched, so that every rank stays in step."""


class NvshmemLowLatency(ReportsFaults):
    name = "nvshmem"
    what = "low-latency"
    kernels = {10: "low-latency dispatch", 11: "low-latency combine"}
    mask_hint = "EPBuffer.set_low_latency_mask(ranks)"
    checks_expert_ids = True  # the send half flags ids outside [-1, E); check() raises them

    @staticmethod
    def check_available(group, hidden: int) -> None:
        require_kernels("low-latency", hidden)
        world = dist.get_world_size(group)
        if world > MAX_RANKS:
            raise ValueError(f"the NVSHMEM low-latency kernels support at most {MAX_RANKS} ranks, got {world}")

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
        # comm.low_latency.output_buffers = N > 0: outputs come from N sets allocated once and used in
        # turn (a call's outputs stay valid for the next N - 1 calls of its kind); 0: fresh tensors.
        self.output_buffers = int(getattr(cfg.comm.low_latency, "output_buffers", 0) or 0)
        # comm.low_latency.heap_outputs false keeps the sets torch tensors even where the heap could hold
        # them, so that a held set falls back on this rank alone instead of raising ("Held outputs").
        heap_ok = bool(cfg.comm.low_latency.heap_outputs)
        sets = self.output_buffers if heap_ok and self.output_buffers <= MAX_OUTPUT_SETS else 0
        heap = C.LowLatencyRuntime.heap_bytes(self.world, num_experts, self.max_tokens, self.max_topk, hidden, sets)
        runtime.join(group, heap, cfg.comm.rdma)
        blocks = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._rt = C.LowLatencyRuntime(self.rank, self.world, num_experts, self.max_tokens, self.max_topk, hidden,
                                       self.timeout_s, blocks, sets)
        self.output_sets = int(self._rt.sets)  # 0 where a peer lacks P2P: the slots and a receive copy instead
        # held_outputs copy: a heap set a caller still holds is moved out one dispatch before its turn
        # (_move_if_held)
        self.move_held = bool(self.output_sets) and str(cfg.comm.low_latency.held_outputs) == "copy"
        self._reported = False
        # One SEND|RECV launch per call without a hook (module docstring); a plain attribute so that a
        # benchmark can compare both ways on the same engine.
        self.fused_launch = self.output_buffers > 0
        # Variant bits ORed into both calls' phases, for A/B runs (benchmarks/bench_decode_pair.py); 0 = the
        # default kernels. csrc/nvshmem/ll_device.cuh: 4 the earlier combine prologue; the direct dispatch's
        # 8 row-major FP8 scales, 16 token + slot in one store, 32 16-byte FP8 stores, 64 epoch-tagged counts,
        # 128 row loads before the count wait, 256 store addresses made once (FP8 scales stored by a group's
        # lanes, no 64-bit division), 512 with 128: the first row's loads before the routing's; the combine's
        # 1024: its receive loads a token's picks before the signal wait and all of a thread's rows at once;
        # 2048: the row copies (combine send, the slot path's dispatch receive) keep 8 loads in flight per lane;
        # 4096: the combine send deals rows to warps in a stride order; 8192: the dispatch reads the rank
        # mask once and counts slots by warps; 16384: send tickets behind fence.acq_rel.sys, receive tickets
        # unfenced. Every rank must set the same bits (the senders' and receivers' layouts must agree).
        # Default 8|64|256|8192|16384, chosen by the phase stamps and pair A/B of 2026-11-26 (session 6, 2x H100,
        # docs/LOW_LATENCY.md): EP2 graph queued FP8 70.8 us, BF16 77.6 against 79.9 / 83.2 with 64 alone and
        # DeepEP's 72.0 / 86.4 in the same call. Row-major scales need hidden / 128 <= 256 (else left out).
        flags = KERNEL_FLAGS_DEFAULT
        if hidden // 128 > MAX_ROW_MAJOR_SCALE_GROUPS:
            flags &= ~SCALES_ROW_MAJOR
        if str(cfg.comm.low_latency.source_order) == "arrival":
            flags |= ARRIVAL_ORDER
        self.kernel_flags = flags
        # comm.low_latency.combine_reduce owner: kOwnerReduce on every launch, apart from kernel_flags (the A/B
        # bits a benchmark or test may replace), since it decides combine's numbers, which the reference follows
        self.sum_bits = OWNER_REDUCE if str(cfg.comm.low_latency.combine_reduce) == "owner" else 0
        self._dispatch_sets = [None, None]  # per use_fp8: the N dispatch output sets, built at first use
        self._dispatch_watch = [None, None]  # per use_fp8: a Watch per set
        self._dispatch_turn = [0, 0]        # per use_fp8; with output sets in the heap [0] serves both
        self._held = -1                     # the heap set this dispatch overwrote while held (raised after launch)
        self.moved_sets = 0                 # held heap sets moved out (held_outputs copy), for tests and benches
        self._y_sets = None                 # the N combine outputs [M, H]
        self._y_views = {}                  # T -> their [:T] views, made once per T
        self._y_watch = None                # a _Watch per combine output (its base tensor and views)
        self._y_turn = 0

    def _dispatch_outputs(self, use_fp8: bool, x):
        """(recv_x, recv_count, src_info, layout_range, state, pointers, output set or -1): fresh (on x's
        device), or the next set (in the heap when output_sets). x.device is read only where tensors are made."""
        n = self.output_buffers
        if not n:
            return self._new_dispatch_outputs(use_fp8, x.device)
        kind = 1 if use_fp8 else 0
        sets = self._dispatch_sets[kind]
        if sets is None:
            make = self._heap_dispatch_outputs if self.output_sets else self._new_dispatch_outputs
            dev = x.device
            self._dispatch_sets[kind] = [make(use_fp8, dev, i) for i in range(n)]
            self._dispatch_watch[kind] = [Watch(self._watched(o)) for o in self._dispatch_sets[kind]]
            sets = self._dispatch_sets[kind]
        turn = 0 if self.output_sets else kind  # heap sets: one turn for both precisions (they share bytes)
        i = self._dispatch_turn[turn]
        self._dispatch_turn[turn] = i + 1 if i + 1 < n else 0
        if self.move_held:
            # Set i was looked at one dispatch ago (below) and moved out if held then; what a caller dropped
            # cannot come back. The next set is looked at now, before this call's launch: a peer writes into
            # it only after this dispatch's send half ran (its own dispatch of that set waits for this one's
            # rows first), so a copy queued here on this stream is done before any peer overwrites the set.
            self._move_if_held(i + 1 if i + 1 < n else 0, x)
        elif self.output_sets:  # both precisions' views of set i share its bytes
            watches = self._dispatch_watch
            if (watches[0] is not None and watches[0][i].held()) or (watches[1] is not None and watches[1][i].held()):
                self._held = i  # used all the same (every rank picks set i): raised after the launch
        elif self._dispatch_watch[kind][i].held():
            # this rank's own tensors (the senders write the slots, the receive copy writes the set): any set
            # nobody holds will do, and the turn goes on from it; fresh tensors when every set is held
            watch = self._dispatch_watch[kind]
            for j in range(1, n):
                k = i + j if i + j < n else i + j - n
                if not watch[k].held():
                    self._dispatch_turn[turn] = k + 1 if k + 1 < n else 0
                    return sets[k]
            return self._new_dispatch_outputs(use_fp8, x.device)
        return sets[i]

    def _move_if_held(self, i: int, x) -> None:
        """Heap set i, where a caller still holds any of it (per precision's views), is moved to memory of
        its own: each heap tensor's storage gets a fresh allocation holding a copy (queued on the current
        stream), so the caller's tensors and views keep their values; the set gets new views of the heap.
        A held handle stays usable: its state's row_slot pointer follows the move."""
        held = [k for k in (0, 1) if self._dispatch_sets[k] is not None and self._dispatch_watch[k][i].held()]
        if not held:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            self._held = i  # a graph would replay the copy: raised after the launch, as `raise` does
            return
        dev = x.device
        heap, states = [], []
        for kind in (0, 1):  # both precisions' views of set i go: they share its bytes (and a scan finds both)
            sets = self._dispatch_sets[kind]
            if sets is None:
                continue
            recv_x, _count, src_info, _layout, state = sets[i][:5]
            if kind in held:
                heap += ([*recv_x] if isinstance(recv_x, tuple) else [recv_x]) + [src_info, state["row_slot"],
                                                                                    state["rec"]]
                states.append(state)
            sets[i] = self._dispatch_watch[kind][i] = None  # only the caller's references are followed
            del recv_x, src_info, state
        if not move_out(heap, dev):
            self._held = i  # a holder not found: raised after the launch, as `raise` does
        for state in states:  # a held handle's row_slot and records moved with it
            state["ptrs"] = (state["row_slot"].data_ptr(), *state["ptrs"][1:3], state["rec"].data_ptr())
        del heap, states
        for kind in (0, 1):
            sets = self._dispatch_sets[kind]
            if sets is not None:
                sets[i] = self._heap_dispatch_outputs(kind == 1, dev, i)
                self._dispatch_watch[kind][i] = Watch(self._watched(sets[i]))
        self.moved_sets += 1

    @staticmethod
    def _watched(outputs) -> list:
        """The objects of a dispatch output set that a caller may hold: recv_x (or its pair), recv_count,
        src_info, layout_range (the handle's tensors) and the handle's state."""
        recv_x, recv_count, src_info, layout_range, state = outputs[:5]
        xs = [recv_x, *recv_x] if isinstance(recv_x, tuple) else [recv_x]
        return xs + [recv_count, src_info, layout_range, state]

    def _raise_held(self, i: int) -> None:
        raise OutputsStillHeldError(
            f"low-latency dispatch: output set {i} of comm.low_latency.output_buffers={self.output_buffers} was "
            f"still referenced (recv_x, recv_count, the handle, or a view of them, from the dispatch "
            f"{self.output_buffers} calls earlier, or kept from a CUDA graph capture) and this call has overwritten "
            "it. Drop those references before then, .clone() what you keep, raise output_buffers, or set "
            "comm.low_latency.output_buffers: 0 for fresh tensors on every call (as DeepEP V1 returns them)")

    def _heap_dispatch_outputs(self, use_fp8: bool, dev, i: int):
        """Output set i of the heap as tensors; recv_count and layout_range are this rank's own tensors."""
        EL, WM, H = self.local_experts, self.world * self.max_tokens, self.hidden
        data_ptr, scales_ptr, src_ptr, slot_ptr, rec_ptr = self._rt.set_pointers(i)
        if use_fp8:
            data = heap_tensor(data_ptr, (EL, WM, H), torch.float8_e4m3fn, dev)
            # the transpose of a contiguous [EL, S, WM] (the contract)
            recv_x = (data, heap_tensor(scales_ptr, (EL, H // FP8_BLOCK, WM), torch.float32, dev).transpose(1, 2))
        else:
            recv_x = heap_tensor(data_ptr, (EL, WM, H), torch.bfloat16, dev)
            scales_ptr = 0
        src_info = heap_tensor(src_ptr, (EL, WM), torch.int32, dev)
        row_slot = heap_tensor(slot_ptr, (EL, WM), torch.int32, dev)
        # kOwnerReduce's records (ll_device.cuh, "set's rec"): written by the senders, read by the combine
        rec = heap_tensor(rec_ptr, (self.world * (1 + self.max_tokens * self.max_topk),), torch.int32, dev)
        return self._with_counts(recv_x, data_ptr, scales_ptr, src_info, row_slot, dev, i, rec)

    def _new_dispatch_outputs(self, use_fp8: bool, dev, _i: int = 0):
        EL, WM, H = self.local_experts, self.world * self.max_tokens, self.hidden
        # torch.empty(*sizes) parses faster than torch.empty(sizes); each tensor costs ~1-2 us of host
        if use_fp8:
            data = torch.empty(EL, WM, H, dtype=torch.float8_e4m3fn, device=dev)
            S = H // FP8_BLOCK
            # the transpose of a contiguous [EL, S, WM] (the contract), made in one call
            scales = torch.empty_strided((EL, WM, S), (S * WM, 1, WM), dtype=torch.float32, device=dev)
            recv_x = (data, scales)
            scales_ptr = scales.data_ptr()
        else:
            data = recv_x = torch.empty(EL, WM, H, dtype=torch.bfloat16, device=dev)
            scales_ptr = 0
        src_info = torch.empty(EL, WM, dtype=torch.int32, device=dev)
        row_slot = torch.empty(EL, WM, dtype=torch.int32, device=dev)
        return self._with_counts(recv_x, data.data_ptr(), scales_ptr, src_info, row_slot, dev, -1)

    def _with_counts(self, recv_x, data_ptr: int, scales_ptr: int, src_info, row_slot, dev, out_set: int, rec=None):
        """A dispatch's outputs around its rows: this rank's recv_count, layout_range and self_pos (where
        (token, k) of its own experts landed: combine reads those rows from its input), the handle's
        state and the launch's pointers."""
        recv_count = torch.empty(self.local_experts, dtype=torch.int32, device=dev)
        layout_range = torch.empty(self.local_experts, self.world, dtype=torch.int64, device=dev)
        self_pos = torch.empty(self.max_tokens * self.max_topk, dtype=torch.int32, device=dev)
        count_ptr, row_slot_ptr = recv_count.data_ptr(), row_slot.data_ptr()
        # combine reads the pointers from the handle's state: no data_ptr() calls there
        state = {"row_slot": row_slot, "recv_count": recv_count, "self_pos": self_pos, "rec": rec,
                 "ptrs": (row_slot_ptr, count_ptr, self_pos.data_ptr(), 0 if rec is None else rec.data_ptr())}
        ptrs = (data_ptr, scales_ptr, count_ptr, src_info.data_ptr(), layout_range.data_ptr(), row_slot_ptr)
        return recv_x, recv_count, src_info, layout_range, state, ptrs, out_set

    def _combine_output(self, T: int, x):
        """y [T, H]: fresh (on x's device), or the next of the output buffers' views."""
        n = self.output_buffers
        if not n:
            return torch.empty(T, self.hidden, dtype=torch.bfloat16, device=x.device)
        views = self._y_views.get(T)
        if views is None:
            if self._y_sets is None:
                self._y_sets = [torch.empty(self.max_tokens, self.hidden, dtype=torch.bfloat16, device=x.device)
                                for _ in range(n)]
            views = self._y_views[T] = [y[:T] for y in self._y_sets]
            self._y_watch = [Watch([y] + [v[j] for v in self._y_views.values()]) for j, y in enumerate(self._y_sets)]
        i = self._y_turn
        self._y_turn = i + 1 if i + 1 < n else 0
        if self._y_watch[i].held():  # a caller still holds that output: a fresh one, nothing overwritten
            return torch.empty(T, self.hidden, dtype=torch.bfloat16, device=x.device)
        return views[i]

    @property
    def blocks(self) -> int:
        """The grid of the kernels (default: one block per SM); fewer for an A/B run, never more."""
        return int(self._rt.num_blocks)

    @blocks.setter
    def blocks(self, n: int) -> None:
        self._rt.num_blocks = int(n)

    def phase_stamps(self, on: bool = True):
        """Benchmarks: the kernels' phase stamps (csrc/nvshmem/ll_device.cuh, "Phase stamps") from the
        next launch on, into the returned uint64 tensor [2 (dispatch, combine), 1024 (block), 8 (slot)]
        of %globaltimer ns (0 where nothing ran), each launch overwriting the last; off: None. A CUDA
        graph keeps the setting of its capture. Only the output-set dispatch and the combine stamp."""
        if not on:
            self._rt.set_stamps(0)
            self._stamps = None
            return None
        self._stamps = torch.zeros(2, 1024, 8, dtype=torch.int64, device=self.device)
        self._rt.set_stamps(self._stamps.data_ptr())
        return self._stamps

    # ------------------------------------------------------------------ dispatch
    # Unfused, the send half is launched first, with nothing but pointers: in a cold call the host's
    # work before the first launch is on the critical path, the allocations after it overlap the send.
    def dispatch(self, x, topk_idx, *, use_fp8: bool, round_scale: bool, recv_stats, hook: bool):
        T, K = topk_idx.shape
        rt = self._rt
        fp8 = 1 if use_fp8 else 0
        stats_ptr = 0 if recv_stats is None else recv_stats.data_ptr()
        flags = self.kernel_flags | self.sum_bits
        if self.fused_launch and not hook:
            recv_x, recv_count, src_info, layout_range, state, ptrs, out_set = self._dispatch_outputs(use_fp8, x)
            held, self._held = self._held, -1  # the held heap set _dispatch_outputs picked (-1: none), cleared
            rt.dispatch(x.data_ptr(), topk_idx.data_ptr(), T, K, fp8, 1 if round_scale else 0, SEND_RECV | flags, *ptrs,
                        stats_ptr, _current_stream(), out_set, state["ptrs"][2])
            recv = None
        else:
            stream = _current_stream()
            # Output sets: the senders need the set, so the outputs come first (views made once). Fresh
            # outputs: their allocations follow the send half, overlapping it.
            outputs = self._dispatch_outputs(use_fp8, x) if self.output_sets else None
            held, self._held = self._held, -1  # the held heap set _dispatch_outputs picked (-1: none), cleared
            set_args = (outputs[6], outputs[4]["ptrs"][2]) if outputs else ()  # the set and self_pos
            rt.dispatch(x.data_ptr(), topk_idx.data_ptr(), T, K, fp8, 1 if round_scale else 0, SEND | flags,
                        0, 0, 0, 0, 0, 0, 0, stream, *set_args)
            recv_x, recv_count, src_info, layout_range, state, ptrs, out_set = \
                outputs or self._dispatch_outputs(use_fp8, x)
            # the receive half reads no input (x and topk_idx may go once the send half is queued)
            self_ptr = state["ptrs"][2]
            if not hook:
                rt.dispatch(0, 0, T, K, fp8, 0, RECV | flags, *ptrs, stats_ptr, stream, out_set, self_ptr)
                recv = None
            else:
                def recv(_alive=recv_stats):  # on the stream current when the hook runs; keeps recv_stats alive
                    rt.dispatch(0, 0, T, K, fp8, 0, RECV | flags, *ptrs, stats_ptr, _current_stream(), out_set,
                                self_ptr)
        if held >= 0:
            self._raise_held(held)
        # positional, in the dataclass's field order (src_info, layout_range, num_tokens, max_tokens, hidden,
        # num_experts, topk, use_fp8, backend, state): keywords make type.__call__ build a dict (~0.5 us)
        handle = LowLatencyHandle(src_info, layout_range, T, self.max_tokens, self.hidden, self.num_experts, K,
                                  use_fp8, self.name, state)
        return recv_x, recv_count, handle, recv

    # ------------------------------------------------------------------ combine
    def combine(self, x, topk_idx, topk_weights, handle, *, out, hook: bool):
        T, K = topk_idx.shape
        rt = self._rt
        row_slot, count, self_pos, rec = handle.state["ptrs"]
        x_ptr = x.data_ptr()
        flags = self.kernel_flags | self.sum_bits
        idx_ptr, w_ptr = topk_idx.data_ptr(), topk_weights.data_ptr()
        if self.fused_launch and not hook:
            y = out if out is not None else self._combine_output(T, x)
            rt.combine(x_ptr, row_slot, count, idx_ptr, w_ptr, T, K, SEND_RECV | flags, y.data_ptr(), _current_stream(),
                       self_pos, rec)
            return y, None
        stream = _current_stream()
        # Without a hook the receive half reads this rank's own rows from x (self_pos), right behind the
        # send half; with one, x may change before the hook runs, so every row goes through the send.
        # (kOwnerReduce's send half sends this rank's weights to the picks' owners first: topk_idx, weights.)
        # With a hook the send half must not wait for the peers (it would hold SMs through the caller's
        # compute), which the owners' sums need (the sources' weights): every pick's row leaves, and the
        # hook makes the owners' sums, the same numbers (kPerPickSend).
        if hook and self.sum_bits:
            flags |= PER_PICK_SEND
        rt.combine(x_ptr, row_slot, count, idx_ptr, w_ptr, T, K, SEND | flags, 0, stream, 0 if hook else self_pos, rec)
        y = out if out is not None else self._combine_output(T, x)
        if not hook:
            rt.combine(x_ptr, 0, 0, idx_ptr, w_ptr, T, K, RECV | flags, y.data_ptr(), stream, self_pos)
            return y, None

        def recv(_alive=(topk_idx, topk_weights)):  # reads them: the closure keeps them alive until then
            rt.combine(0, 0, 0, idx_ptr, w_ptr, T, K, RECV | flags, y.data_ptr(), _current_stream())

        return y, recv

    # ------------------------------------------------------------------ faults
    def wait_pending(self) -> None:
        """Nothing in flight outside the stream: every wait is inside the kernels, with a deadline."""

    def set_mask(self, ranks: Sequence[int]) -> None:
        self._rt.set_mask(list(ranks))
        self._reported = False

