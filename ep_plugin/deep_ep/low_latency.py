"""deep_ep.Buffer's low-latency calls (DeepEP V1, tag v1.2.1) over EPBuffer.low_latency_dispatch /
low_latency_combine / set_low_latency_mask (docs/LOW_LATENCY.md).

Written from DeepEP's documented API (the docstrings of deep_ep/buffer.py), not from its code.

Mapping
- One EPBuffer per (hidden, num_experts, num_max_dispatch_tokens_per_rank) = (H, E, M), built at the
  first low-latency call of that shape (a collective, as DeepEP's calls are), with
  `comm.low_latency.max_tokens_per_rank = M`. The intranode EPBuffer of (H, E) is reused when its
  config already has that M. Otherwise a Buffer made with `num_nvl_bytes > 0` (meant for both kinds
  of call) builds one EPBuffer that both kinds share; one made with `num_nvl_bytes == 0` (low-latency
  only, as DeepEP's low-latency users make it) builds one whose normal path is sized to M tokens
  (`comm.max_tokens_per_rank = M`), so the unused high-throughput buffers stay small.
- recv_x, recv_count, handle[0] (src_info), handle[1] (layout_range), cumulative stats: the engine's,
  unchanged (its contract is DeepEP's layout). The handle is a 5-tuple subclass that also carries
  ep_plugin's LowLatencyHandle for combine.
- `use_ue8m0`: the engine's `round_scale` scales are exact powers of two; their exponent bytes
  (the float32 exponent field, i.e. log2(scale) + 127) are packed four per int32, little-endian along
  the scale dim, into DeepEP's `[E_l, W*M, H/512]` int32 (the transpose of a contiguous
  `[E_l, H/512, W*M]`). The packing is enqueued on the current stream after the receive half: at
  once, or inside the hook; an async_finish event covers it.
- Outputs. DeepEP V1 allocates the receive tensors on every call, so its callers may keep them;
  DeepEP's own tests/test_low_latency.py keeps the last checked dispatch's views (its check loop's
  names) through its whole bench. With no ep_config the EPBuffer takes comm.low_latency.output_buffers = 3
  heap sets with held_outputs = copy: rows written in place (no allocation, no receive copy), and a set
  a caller still holds is moved to memory of its own (one device copy) one dispatch before its turn --
  nothing is overwritten, nothing raised. An ep_config takes the EPBuffer's defaults: two heap sets, where a set
  still held raises OutputsStillHeldError (docs/LOW_LATENCY.md, "Held outputs").
- `zero_copy`: get_next_low_latency_combine_buffer returns a BF16 `[E_l, W*M, H]` staging tensor
  (two per shape, alternating, as DeepEP's two buffers); a zero_copy combine sends from it (x is
  only checked). Nothing is saved: the engine reads the rows from wherever they are.
- The mask calls of later DeepEP (low_latency_update_mask_buffer / query / clean; not in v1.2.1) map
  onto EPBuffer.set_low_latency_mask. Unlike DeepEP's, a rank that times out is not masked
  silently: the next call raises EPTimeoutError naming it; mask it to go on without it.

Not supported (NotImplementedError naming the argument): `dispatch_wait_recv_cost_stats`,
`combine_wait_recv_cost_stats`, `use_logfmt`.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import torch

from ..buffer import EPBuffer
from ..checks import deep_ep_ll as checks
from ..checks.core import FormMap
from ..config import load_config
from .events import DONE, EventOverlap
from .handle import DeepEPLowLatencyHandle, low_latency_handle
from .ll_support import (SIZE_HINT_TOPK, _pack_ue8m0, _ThenEvent, _ue8m0_target,  # noqa: F401 (re-exported)
                         low_latency_size_hint)

_NOT_LL_MODE = ("ep_plugin.deep_ep: {name} needs a Buffer made with low_latency_mode=True (as DeepEP's "
                "does); this one was made with low_latency_mode=False")

# A torch function mode on (DeepEP's tests call torch.set_default_device('cuda') in init_dist, which installs
# one) sends every tensor attribute and method call through Python: ~40 per dispatch + combine pair, which on
# 4x H100 made DeepEP's test_low_latency bench loop host-bound (86 us of host per pair, 2026-11-26; 184 us
# against 25 on the CPU box). A call of a form already checked reads attributes and pointers of plain tensors
# only (the form requires them), so it runs with torch function handling off -- cheaper with no mode on too
# (38 -> 25 us there). A new form (its checks, and any buffer it builds, allocating on the caller's default
# device) runs with it.
_NoTorchFunction = torch._C.DisableTorchFunction

_NO_EP_CONFIG = "<defaults>"  # EPConfig.source of load_config(None): a Buffer made without ep_config


class LowLatencyMixin:
    """The low-latency half of deep_ep.Buffer (mixed into buffer.Buffer)."""

    def _ll_init(self) -> None:
        self._ll_buffers: Dict[Tuple[int, int, int], EPBuffer] = {}
        self._ll_masked: Set[int] = set()
        self._ll_staging: Dict[Tuple[int, int, int], List[Optional[torch.Tensor]]] = {}
        self._ll_next: Dict[Tuple[int, int, int], int] = {}
        # the forms of the calls that passed every check (ep_plugin.checks.deep_ep_ll): a dispatch's form ->
        # (EPBuffer, M, E, the flags as bools); a combine's form -> its EPBuffer
        self._ll_dispatch_forms = FormMap()
        self._ll_combine_forms = FormMap()

    # ------------------------------------------------------------------ checks
    def _ll_mode(self, name: str) -> None:
        self._live()
        if not self.low_latency_mode:
            raise NotImplementedError(_NOT_LL_MODE.format(name=name))

    def _ll_shape(self, M, E) -> Tuple[int, int]:
        return checks.shape(M, E, self.group_size)

    # ------------------------------------------------------------------ buffers
    def _ll_buffer(self, hidden: int, num_experts: int, M: int, topk: int) -> EPBuffer:
        """The EPBuffer of the low-latency calls of shape (hidden, num_experts, M); built (a collective)
        at the first call, with moe.topk at least this call's top-k (the NVSHMEM engine sizes its
        combine slots by it)."""
        key = (hidden, num_experts, M)
        buf = self._ll_buffers.get(key)
        if buf is not None:
            return buf
        shared = self._buffers.get((hidden, num_experts))
        if shared is not None and _ll_tokens(shared) == M and topk <= max(shared.cfg.moe.topk, SIZE_HINT_TOPK):
            buf = shared
        else:
            raw = self._raw_config(num_experts)
            raw["moe"]["topk"] = min(max(int(raw["moe"]["topk"]), topk), num_experts)
            ll = dict(raw["comm"].get("low_latency") or {})
            ll["max_tokens_per_rank"] = M
            raw["comm"]["low_latency"] = ll
            both = shared is None and self.num_nvl_bytes > 0
            if not both:  # low-latency only: the high-throughput path's buffers sized to M tokens
                raw["comm"]["max_tokens_per_rank"] = M
            buf = EPBuffer(self.group, load_config(raw), hidden=hidden)
            if both:
                self._buffers[(hidden, num_experts)] = buf
        if self._cfg.source == _NO_EP_CONFIG and buf._low_latency is None:
            # DeepEP's callers may keep outputs as long as they like (DeepEP V1 allocates them per call;
            # its own test_low_latency keeps one dispatch's views through its whole bench): three heap sets
            # (rows written in place), a held one moved to memory of its own one dispatch before its turn.
            ll_cfg = buf.cfg.comm.low_latency
            ll_cfg.output_buffers, ll_cfg.held_outputs = max(ll_cfg.output_buffers, 3), "copy"
        if self._ll_masked:
            buf.set_low_latency_mask(sorted(self._ll_masked))
        self._ll_buffers[key] = buf
        return buf

    # ------------------------------------------------------------------ dispatch
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """(recv_x, recv_count, handle, event, hook), as DeepEP's low_latency_dispatch returns them.

        x [T, H] BF16 (T <= num_max_dispatch_tokens_per_rank = M); topk_idx [T, K] int64, -1 = none.
        recv_x: BF16 [E_l, W*M, H]; with use_fp8 the pair (float8_e4m3fn [E_l, W*M, H], float32
        scales [E_l, W*M, H/128] column-major), or with use_ue8m0 (needs round_scale) int32 scales
        [E_l, W*M, H/512] packing four exponent bytes. Rows of local expert e: source rank 0's first,
        by token index; only the first recv_count[e] are valid. recv_count [E_l] int32.
        handle: (src_info [E_l, W*M] int32, layout_range [E_l, W] int64, M, H, num_experts).
        event: an EventOverlap (holds the work when async_finish). hook: None, or with
        return_recv_hook the receive half: the outputs are valid once it has run.
        """
        if self._destroyed or not self.low_latency_mode:
            self._ll_mode("low_latency_dispatch")  # raises
        stats = cumulative_local_expert_recv_stats
        with _NoTorchFunction():  # see _NoTorchFunction
            key = checks.dispatch_key(x, topk_idx, stats, dispatch_wait_recv_cost_stats,
                                      num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0,
                                      async_finish, return_recv_hook)
            known = self._ll_dispatch_forms.find(key)
            if known is not None:
                # a form already checked (here and by the EPBuffer): straight to its engine
                return self._ll_dispatch_run(known, known[0]._ll_dispatch_run(
                    x, topk_idx, known[3], known[4], known[6], known[7], stats), x, topk_idx, stats)
        return self._ll_dispatch_checked(key, x, topk_idx, stats, dispatch_wait_recv_cost_stats,
                                         num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale,
                                         use_ue8m0, async_finish, return_recv_hook)

    def _ll_dispatch_checked(self, key, x, topk_idx, stats, dispatch_wait_recv_cost_stats,
                             num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0,
                             async_finish, return_recv_hook):
        """A dispatch of a new form (its key, from dispatch_key): every check, then the call, then the form is
        kept."""
        M, E = checks.dispatch_args(self.group_size, x, topk_idx, stats, dispatch_wait_recv_cost_stats,
                                    num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0,
                                    async_finish, return_recv_hook)
        buf = self._ll_buffer(x.shape[1], E, M, topk_idx.shape[1])
        known = (buf, M, E, bool(use_fp8), bool(round_scale), bool(use_fp8 and use_ue8m0), bool(async_finish),
                 bool(return_recv_hook))
        out = self._ll_dispatch_run(known, buf.low_latency_dispatch(
            x, topk_idx, use_fp8=known[3], round_scale=known[4], async_op=known[6], return_recv_hook=known[7],
            recv_stats=stats), x, topk_idx, stats)
        self._ll_dispatch_forms.put(key, known)  # after a call that passed every check
        return out

    @staticmethod
    def _ll_dispatch_run(known, result, x, topk_idx, stats):
        """DeepEP's outputs of an EPBuffer dispatch `result` of the form `known` (_ll_dispatch_forms' values)."""
        recv_x, recv_count, inner, event, hook = result
        buf, M, E, _, _, ue8m0, async_finish, _ = known
        if ue8m0:
            data, scales = recv_x
            packed = _ue8m0_target(scales)
            recv_x = (data, packed)
            if hook is not None:  # the scales land in the receive half: packed after it, in the same hook
                def hook(recv=hook, scales=scales, packed=packed):
                    recv()
                    _pack_ue8m0(scales, packed)
            else:  # the receive half is on the current stream already (the engine's contract)
                _pack_ue8m0(scales, packed)
                if event is not None:
                    event = _ThenEvent(event, scales.device)
        handle = low_latency_handle(inner, buf, M, buf.hidden, E)
        if not async_finish:
            return recv_x, recv_count, handle, DONE, hook
        rows = recv_x if isinstance(recv_x, tuple) else (recv_x,)
        return recv_x, recv_count, handle, EventOverlap(
            event, (x, topk_idx, *rows, recv_count, handle[0], handle[1], stats)), hook

    # ------------------------------------------------------------------ combine
    def _ll_handle(self, handle) -> DeepEPLowLatencyHandle:
        checks.handle(handle, DeepEPLowLatencyHandle, self._ll_buffers.values())
        return handle

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """(combined_x [T, H] BF16, event, hook), as DeepEP's low_latency_combine returns them.

        x [E_l, W*M, H] BF16: the expert outputs in the dispatch's layout (only rows below recv_count
        are read). combined_x[t] = sum over k of topk_weights[t, k] * row(t, k), in float32; -1 slots
        add nothing. out: written in place and returned. zero_copy: the rows are taken from the
        tensor get_next_low_latency_combine_buffer(handle) returned (x is only checked).
        """
        if self._destroyed or not self.low_latency_mode:
            self._ll_mode("low_latency_combine")  # raises
        with _NoTorchFunction():  # see _NoTorchFunction
            # the handle is checked on every call, as EPBuffer does: its type here, its (num_tokens, topk) in the key
            # (combine_key), its buffer below -- the form fixes x's shape, hence the EPBuffer
            inner = handle.inner if type(handle) is DeepEPLowLatencyHandle else None
            key = checks.combine_key(x, topk_idx, topk_weights, out, combine_wait_recv_cost_stats, use_logfmt,
                                     zero_copy, async_finish, return_recv_hook, inner)
            buf = self._ll_combine_forms.find(key)
            if buf is not None and handle.buffer is buf:
                # a form and handle already checked: straight to the engine
                rows = x
                if zero_copy:
                    buf._raise_pending_low_latency()  # before the staging tensor is taken (_ll_combine_run again)
                    rows = self._ll_take_staging(handle)
                return self._ll_combine_out(buf._ll_combine_run(rows, topk_idx, topk_weights, inner, out,
                                                                bool(async_finish), bool(return_recv_hook)),
                                            x, rows, topk_idx, topk_weights, handle)
        return self._ll_combine_checked(key, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                        return_recv_hook, out, combine_wait_recv_cost_stats)

    def _ll_combine_checked(self, key, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                            return_recv_hook, out, combine_wait_recv_cost_stats):
        """A combine of a new form or handle (its key, from combine_key): every check, then the call, then the
        form is kept."""
        checks.combine_args(self.group_size, handle, DeepEPLowLatencyHandle, self._ll_buffers.values(), x, topk_idx,
                            topk_weights, out, combine_wait_recv_cost_stats, use_logfmt, async_finish,
                            return_recv_hook)
        rows = self._ll_take_staging(handle) if zero_copy else x
        result = self._ll_combine_out(handle.buffer.low_latency_combine(
            rows, topk_idx, topk_weights, handle.inner, async_op=bool(async_finish),
            return_recv_hook=bool(return_recv_hook), out=out), x, rows, topk_idx, topk_weights, handle)
        self._ll_combine_forms.put(key, handle.buffer)  # after a call that passed every check
        return result

    @staticmethod
    def _ll_combine_out(result, x, rows, topk_idx, topk_weights, handle):
        """DeepEP's outputs of an EPBuffer combine `result`: its event holds the inputs while it runs."""
        y, event, hook = result
        if event is None:
            return y, DONE, hook
        return y, EventOverlap(event, (x, rows, topk_idx, topk_weights, handle[0], handle[1], y)), hook

    # ------------------------------------------------------------------ zero copy
    def get_next_low_latency_combine_buffer(self, handle: object) -> torch.Tensor:
        """The BF16 [E_l, W*M, H] tensor the next `low_latency_combine(..., zero_copy=True)` of this
        handle's shape sends from: fill it with the expert outputs, in the dispatch's layout.

        DeepEP hands out its registered send buffer; ep_plugin's engine reads the rows from any tensor,
        so this is a staging tensor kept by the Buffer (two per shape, used in turn, so that filling
        the next one never races a combine whose hook has not run yet). It saves nothing over passing
        the rows as x; it exists so that code written for zero-copy runs unchanged."""
        self._ll_mode("get_next_low_latency_combine_buffer")
        h = self._ll_handle(handle)
        _, _, M, H, E = h
        key = (H, E, M)
        slots = self._ll_staging.setdefault(key, [None, None])
        i = self._ll_next.setdefault(key, 0)
        if slots[i] is None:
            slots[i] = torch.empty((E // self.group_size, self.group_size * M, H), dtype=torch.bfloat16,
                                   device=h[0].device)
        return slots[i]

    def _ll_take_staging(self, h) -> torch.Tensor:
        key = (h[3], h[4], h[2])  # (H, E, M)
        i = self._ll_next.get(key, 0)
        slots = self._ll_staging.get(key)
        if slots is None or slots[i] is None:
            raise ValueError("low_latency_combine(zero_copy=True) sends the tensor that "
                             "get_next_low_latency_combine_buffer(handle) returned: call it and fill it first")
        self._ll_next[key] = i ^ 1
        return slots[i]

    # ------------------------------------------------------------------ buffer management
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """A no-op that checks its arguments. DeepEP's low-latency kernels need part of their RDMA
        buffer zeroed after it was used by something else (e.g. normal dispatch/combine). ep_plugin's
        engines need nothing of the kind: the low-latency signals are epoch counters owned by the
        engine (no flag is left to be zeroed between calls), its memory is its own (the normal
        dispatch/combine never write it), and the torch reference keeps no state between calls."""
        self._ll_mode("clean_low_latency_buffer")
        self._ll_shape(num_max_dispatch_tokens_per_rank, num_experts)
        checks.positive_int("hidden", hidden)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Leave out (mask=True) or take back (mask=False) a rank in the low-latency calls of this
        Buffer (from DeepEP after v1.2.1): EPBuffer.set_low_latency_mask on every low-latency EPBuffer,
        now and when later ones are built. A left-out rank neither receives from nor is waited for by
        the others, and rows routed to it count as routed nowhere."""
        self._ll_mode("low_latency_update_mask_buffer")
        checks.mask_rank(rank_to_mask, self.group_size)
        if mask:
            self._ll_masked.add(rank_to_mask)
        else:
            self._ll_masked.discard(rank_to_mask)
        self._ll_apply_mask()

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write into mask_status ([W] torch.int) 1 for each left-out rank, 0 otherwise (from DeepEP
        after v1.2.1). Only ranks left out through low_latency_update_mask_buffer: ep_plugin does not
        leave out a rank that timed out by itself, it raises EPTimeoutError naming it at the next call."""
        self._ll_mode("low_latency_query_mask_buffer")
        checks.mask_status(mask_status, self.group_size)
        status = torch.zeros(self.group_size, dtype=torch.int32)
        for r in self._ll_masked:
            status[r] = 1
        mask_status.copy_(status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Take every rank back (from DeepEP after v1.2.1)."""
        self._ll_mode("low_latency_clean_mask_buffer")
        self._ll_masked.clear()
        self._ll_apply_mask()

    def _ll_apply_mask(self) -> None:
        ranks = sorted(self._ll_masked)
        for buf in _unique(self._ll_buffers.values()):
            buf.set_low_latency_mask(ranks)


def _ll_tokens(buf: EPBuffer) -> Optional[int]:
    """comm.low_latency.max_tokens_per_rank of an EPBuffer's config (None if it has none)."""
    ll = getattr(buf.cfg.comm, "low_latency", None)
    if ll is None:
        return None
    return getattr(ll, "max_tokens_per_rank", None) if not isinstance(ll, dict) else ll.get("max_tokens_per_rank")


def _unique(bufs) -> List[EPBuffer]:
    out: List[EPBuffer] = []
    for b in bufs:
        if all(b is not o for o in out):
            out.append(b)
    return out
