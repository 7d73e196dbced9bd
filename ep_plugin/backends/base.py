"""The contract every transport implements; EPBuffer validates inputs and adds autograd on top.

A backend receives inputs that EPBuffer has already checked (dtype, device, shape, contiguity,
capacity, and its declared `capabilities`), so it only moves bytes. Semantics (DESIGN.md, "The core
contract"): rank r owns experts [r*E/W, (r+1)*E/W); a token goes to a rank once; received rows are
ordered by source rank, then by position on the source; combine sums the rows sent back per token.

The one rule for what a backend cannot take: it declares it in `Capabilities`; the chooser
(backends/__init__.py) consults `check_group` once, when the buffer is built, and EPBuffer refuses a
call outside the capabilities with a TypeError/ValueError naming the fix. No backend hands a call to
another.
"""
from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .. import expert_major
from ..types import ContractDispatch, DispatchOutput, EPEvent, Handle, ROW_DTYPES


@dataclass(frozen=True)
class Capabilities:
    row_dtypes: Tuple[torch.dtype, ...] = ROW_DTYPES  # dtypes of x that dispatch moves (FP8 aside)
    fp8: bool = True                                  # takes (x_fp8, scales) pairs
    combine_dtypes: Tuple[torch.dtype, ...] = ROW_DTYPES
    max_topk: Optional[int] = None
    max_ranks: Optional[int] = None
    hidden_rule: Optional[str] = None                 # for error messages; check_group enforces it
    checks_expert_ids: bool = False                   # finds ids outside [-1, E) itself and raises them
                                                      # from check(); else EPBuffer checks on the device
    merges_repeats: bool = False                      # its expert-major receive (fresh and cached) gives a
                                                      # token naming one expert twice one row, weights summed
                                                      # in slot order, and counts it once; EPBuffer then passes
                                                      # the picks as given (weights whose gradient is recorded
                                                      # through expert_major.repeats_share_grad). Else EPBuffer
                                                      # merges the picks first (expert_major.merge_repeats)
    combine_gathers: bool = False                     # combine_gathered reads x through the index in its own
                                                      # kernels (no gather pass before them)
    combine_to_blocks: bool = False                   # takes combine_to_blocks (sums stored at device addresses)
    dispatch_scatters: bool = False                   # takes dispatch_scattered (a cached dispatch's rows written
                                                      # through an index by its own kernels: no reorder after them)
    dispatch_contracts: bool = False                  # takes dispatch_contract where dispatch_contract_fits says so
                                                      # (a fresh dispatch whose kernels write the hierarchical
                                                      # contract's order and its index: no contract_order, no reorder)


def group_device_problem(group, device: torch.device) -> Optional[str]:
    """None when torch.distributed on `group` moves tensors on `device`: CUDA tensors of the current
    device with NCCL, CPU tensors with the others (gloo); else why not."""
    pg = dist.get_backend(group)
    if device.type == "cuda":
        if "nccl" not in pg:
            return f"is on {device}, but the group's backend {pg!r} moves CPU tensors"
        if device.index != torch.cuda.current_device():
            return f"is on {device}, but the current CUDA device is cuda:{torch.cuda.current_device()}"
        return None
    if device.type == "cpu" and pg != "nccl":
        return None
    return (f"is on {device}, but the group's backend {pg!r} moves "
            f"{'CUDA tensors of the current device' if 'nccl' in pg else 'CPU tensors'}")


class Backend(abc.ABC):
    name = "base"
    capabilities = Capabilities()

    @staticmethod
    def check_group(group, hidden: int) -> None:
        """Raise ValueError/BackendUnavailableError if this backend cannot serve the group and row width.
        Called by the chooser before construction (no collectives)."""

    def __init__(self, group, cfg, hidden: int, num_experts: int):
        self.group = group
        self.cfg = cfg
        self.hidden = hidden
        self.num_experts = num_experts
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.experts_per_rank = num_experts // self.world

    @abc.abstractmethod
    def dispatch(self, x: torch.Tensor, scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                 topk_weights: Optional[torch.Tensor], handle: Optional[Handle] = None,
                 async_op: bool = False) -> DispatchOutput:
        """Send rows to the ranks owning their experts. With `handle`, reuse its layout (cached mode);
        `topk_idx` is then the handle's. With `async_op`, return before completion with `event` set."""

    @abc.abstractmethod
    def combine(self, x: torch.Tensor, handle: Handle, async_op: bool = False):
        """Send received rows back and sum them per original token: returns (y [T, H], event or None)."""

    def combine_gathered(self, x: torch.Tensor, x_rows: torch.Tensor, handle: Handle, async_op: bool = False):
        """combine of the rows x[x_rows] (x_rows int64 [R], values in [0, x.shape[0]); only rows this rank
        received are read): (y [T, H], event or None). The default gathers first; a backend declaring
        `combine_gathers` reads through the index in its kernels (the hierarchical backend's rows come back
        in the contract's order and its inner backend wants them in its own)."""
        return self.combine(x.index_select(0, x_rows), handle, async_op)

    def combine_to_blocks(self, x: torch.Tensor, x_rows: Optional[torch.Tensor], handle: Handle,
                          y_blocks: torch.Tensor, block_tokens: int, async_op: bool = False):
        """combine_gathered (x as it is where x_rows is None) whose per-token sums go to memory the caller names
        instead of a new y: token t's BF16 row is written at address y_blocks[t // block_tokens] +
        (t % block_tokens) * 2H (y_blocks int64 [n] on this GPU, addresses it can store to, 0: drop those
        tokens), and a token no rank holds a row of is not written. Returns the event (async_op) or None. Only
        where `capabilities.combine_to_blocks`: the hierarchical backend's inner combine writes each node's
        sums straight into the rail peers' receive rows (csrc/nvlink/nvlink.h, CombineRoute)."""
        raise NotImplementedError(f"the {self.name} backend does not write combine's sums to other buffers "
                                  "(capabilities.combine_to_blocks is False)")

    def dispatch_scattered(self, x, scales: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
                           handle: Handle, out_rows: torch.Tensor, async_op: bool = False) -> DispatchOutput:
        """A cached rank-major dispatch (the handle's layout) whose received row i, with its scales and weights,
        lands at output row out_rows[i] instead of i (out_rows int64 [handle.num_recv] on x's device, a
        permutation of [0, handle.num_recv): padding rows included). The outputs have handle.num_recv rows, as a
        cached dispatch's; the result's topk_idx is None (a cached dispatch writes no ids: the caller holds them in
        its own order). Only where `capabilities.dispatch_scatters`: the hierarchical backend's cached dispatch has
        its inner rows written straight into the contract's order (csrc/nvlink/nvlink.h, DispatchRoute)."""
        raise NotImplementedError(f"the {self.name} backend does not write a dispatch's rows through an index "
                                  "(capabilities.dispatch_scatters is False)")

    def dispatch_contract_fits(self, x: torch.Tensor, scales: Optional[torch.Tensor], nodes: int) -> bool:
        """Whether dispatch_contract takes this call (rows of x's form, `nodes` blocks of slots); False where the
        backend does not declare `capabilities.dispatch_contracts`. The caller asks before anything launches."""
        return False

    def dispatch_contract(self, x: torch.Tensor, scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                          topk_weights: Optional[torch.Tensor], nodes: int, async_op: bool = False) -> ContractDispatch:
        """A fresh rank-major dispatch of the hierarchical backend's forwarded slots (x [nodes * M, H], token
        s*M + t being node s's slot t; this group being one node's P ranks) whose rows, scales, local ids and
        weights land in the contract's order (source rank s*P + l of the whole job, then slot), as
        contract_order + scatter_rows would put the plain dispatch's, with that order's index and counts
        (ContractDispatch). Only where `capabilities.dispatch_contracts` and dispatch_contract_fits(x, scales,
        nodes): csrc/nvlink/nvlink.h, DispatchRoute's contract order."""
        raise NotImplementedError(f"the {self.name} backend does not dispatch in the contract's order "
                                  "(capabilities.dispatch_contracts is False)")

    def combine_weights(self, weights: torch.Tensor, handle: Handle, async_op: bool = False,
                        local_only: bool = True):
        """Per-token sum over ranks of [R, K] float32 weights: ([T, K] float32, event or None). With
        local_only, each (token, k) counts on the rank owning expert k only (other ranks' entries count
        as 0); without, every entry every rank sends back is summed (DeepEP's combine).

        A small exchange, so the default is one torch.distributed all-to-all on the group for every
        backend; it needs the handle's host counts (a wait when the dispatch did not sync)."""
        idx = handle.recv_topk_idx[:weights.shape[0]]  # weights may be cut to the valid rows
        local = torch.where(idx >= 0, weights.float(), 0.0) if local_only else weights.float()
        send_counts, recv_counts = handle.send_counts, handle.recv_counts
        R = sum(recv_counts)
        back = local.new_empty((sum(send_counts), local.shape[1]))
        work = dist.all_to_all_single(back, local[:R].contiguous(), output_split_sizes=send_counts,
                                      input_split_sizes=recv_counts, group=self.group, async_op=async_op)
        y = local.new_zeros((handle.num_tokens, local.shape[1]))
        # rows come back ordered by destination rank, then token position: the tokens each rank got
        send_idx = handle.is_token_in_rank.t().nonzero()[:, 1]

        def finish():
            y.index_add_(0, send_idx, back)

        if work is None:
            finish()
            return y, None
        return y, EPEvent([work], on_complete=finish)

    # ------------------------------------------------------------ expert-major layout
    # The defaults go through the rank-major exchange and build the layout with torch ops
    # (ep_plugin/expert_major.py, the reference); a backend that receives straight into expert
    # segments overrides all three.
    def dispatch_expert(self, x, scales, topk_idx, topk_weights, handle: Optional[Handle] = None,
                        async_op: bool = False, alignment: int = 1) -> DispatchOutput:
        """Like dispatch, but one row per (token, local expert), grouped by expert (types.ExpertLayout):
        x [N, H], scales [N, H/128], topk_weights [N]; `handle.expert` is set. With `handle` (an
        expert-major one), its layout is reused."""
        out = self.dispatch(x, scales, topk_idx, topk_weights, handle, async_op)
        if out.event is not None:  # the layout is built on the caller's stream, after the exchange
            out.event.current_stream_wait()
        h = out.handle
        if handle is not None:
            layout = handle.expert
        else:
            exact = h.tokens_per_expert if h.exact else None
            n = expert_major.capacity(h.num_recv, h.topk_idx.shape[1], self.experts_per_rank, alignment, exact)
            layout = expert_major.plan(h.recv_topk_idx, self.experts_per_rank, alignment, n)
            h = dataclasses.replace(h, expert=layout)
        return DispatchOutput(
            x=expert_major.expand(out.x, layout),
            scales=expert_major.expand(out.scales, layout) if out.scales is not None else None,
            topk_idx=out.topk_idx,
            topk_weights=expert_major.expand_weights(out.topk_weights, layout) if out.topk_weights is not None else None,
            handle=h, event=EPEvent() if async_op else None)

    def combine_expert(self, x: torch.Tensor, handle: Handle, async_op: bool = False):
        """combine for expert-major rows [N, H]: each received row is the sum of its local experts' rows
        (float32, slot order), then the rank-major combine."""
        return self.combine(expert_major.collapse(x, handle.expert), handle, async_op)

    def combine_weights_expert(self, weights: torch.Tensor, handle: Handle, async_op: bool = False):
        """combine_weights for [N] per-row weights of an expert-major dispatch: ([T, K], event)."""
        return self.combine_weights(expert_major.collapse_weights(weights, handle.expert), handle, async_op)

    def stream_event(self, stream, tensors) -> EPEvent:
        """The event of an async call that ran on `stream`: its tensors are kept from reuse until the
        stream is done (record_stream), and the event raises what the backend's check() reports."""
        for t in tensors:
            if t is not None and t.numel():
                t.record_stream(stream)
        ev = torch.cuda.Event()
        ev.record(stream)
        return EPEvent(cuda_event=ev, check=self.check)

    def device_problem(self, device: torch.device) -> Optional[str]:
        """Why this backend cannot move tensors on `device`, or None when it can (asked once per call
        form). The default goes by the group's process-group backend (group_device_problem); a backend
        bound to one GPU answers for that GPU."""
        return group_device_problem(self.group, device)

    def check(self) -> None:
        """Raise what finished work reported (EPTimeoutError; ValueError for expert ids out of range
        when the backend checks them); reads host memory only."""

    def wait_pending(self) -> None:
        """Wait, within comm.timeout_s, for exchanges the backend left in flight without a host wait
        (called before the caller synchronises the device, so a dead peer cannot hang it)."""

    def close(self) -> None:
        """Release transport resources; safe to call more than once."""


__all__ = ["Backend", "Capabilities", "DispatchOutput", "EPEvent", "Handle"]
