"""HierarchicalBackend: dispatch/combine across nodes in two hops (DESIGN.md, the nvshmem backend).

Dispatch: a token crosses the slow link once per node it selects an expert on -- to the rank with
the same local index there, its rail peer (the "rail": backends/*/rail.py) -- and that rank forwards
it over NVLink to the ranks of its node that own the experts (the "inner" backend over the node's
group, nvlink on GPUs). Combine runs the other way: the inner combine sums a token's rows inside
each node first, then one row per node goes back over the rail, where the origin sums them in
ascending node order. The inner combine reads the rows through the reorder's index and, where every
rail peer is mapped (P2P), stores each sum straight into its origin's rail rows, so that the rail
only signals (combine, _combine_routed). With pull_combine (issue 30, session 11; the default where every rail
peer is P2P) those sums stay in the forwarder's own rail rows (local stores) and the origin's receive half reads
them from its rail peers over P2P.

The parts come from the registry by name (no backend imports another): NvshmemBackend is the
NVSHMEM rail with the nvlink backend inside nodes; tests build the same composition from torch
parts. A node of one rank needs no inner exchange (local.LocalNode packs the rail's slots).

Order: the inner exchange delivers rows by forwarder, then slot (source node, position); the
contract wants them by source rank (node, local index), then position; with one rank per node the two
orders agree. With several ranks per node the inner pull writes each row at its contract position: a
fresh dispatch's pull computes the positions from the forwarders' send lists (dispatch_contracts;
direct_fresh_dispatch) and a cached one's takes them from the handle (dispatch_scatters; _forward_cached),
so no pass reorders the rows. Where it cannot (the torch parts; a fresh dispatch also with host-synced sizing or the
split kernels), contract_order computes the permutation on the device from the inner exchange's per-row
sources and scatter_rows applies it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..._ext import c_op
from ..._ext import raw_stream as _raw_stream
from ...errors import EPTimeoutError
from ...types import (BackendState, DispatchOutput, EPEvent, Handle, HostCounts, PinnedRing,
                      counts_from_lists)
from ..base import Backend, Capabilities
from .local import LocalNode
from .nodes import node_groups, resolve_ranks_per_node
from .rows import gather_rows, scatter_rows
from .timeline import NO_TIMELINE


@dataclass
class HierarchicalState(BackendState):
    slot_valid: torch.Tensor          # [N*M] bool: the rail slots this rank forwarded (combine sends them back)
    inner: Optional[Handle]           # the inner backend's handle (None for a one-rank node)
    order: Optional[torch.Tensor]     # one-rank node: slot of each received row
    to_contract: Optional[torch.Tensor]  # several ranks per node: contract position of each inner row
    rail: object                      # the rail that moved the rows (one per row form); combine sends back on it
    slot_row: Optional[torch.Tensor] = None  # one-rank node: received row of each slot (combine gathers)


_BOUNDS = {}  # (experts, world, dtype, device) -> the ranks' first expert ids, for _in_rank's bucketize


def _in_rank(topk_idx: torch.Tensor, num_experts: int, world: int) -> torch.Tensor:
    """[T, W] bool: the token selects an expert on rank w. Four host ops (bucketize, zeros, scatter_, a
    slice; was eight: two compares, an and, a floor division, a where, ...): this runs on the fresh
    dispatch's host path, ~20-40 us per torch op on the GPU hosts measured (docs/INTERNODE.md). bucketize
    against [0, E/W, 2E/W, ..., E] gives 0 for ids < 0, w + 1 for ids of rank w and W + 1 for ids >= E:
    columns 0 and W + 1 collect the ids routed nowhere, as the where to column W did."""
    key = (num_experts, world, topk_idx.dtype, topk_idx.device)
    bounds = _BOUNDS.get(key)
    if bounds is None:
        bounds = _BOUNDS[key] = torch.arange(0, num_experts + 1, num_experts // world, dtype=topk_idx.dtype,
                                             device=topk_idx.device)
    col = torch.bucketize(topk_idx, bounds, right=True)
    out = torch.zeros((topk_idx.shape[0], world + 2), dtype=torch.bool, device=topk_idx.device)
    out.scatter_(1, col, True)
    return out[:, 1:world + 1]


def _in_rank_torch(topk_idx: torch.Tensor, num_experts: int, world: int) -> torch.Tensor:
    """_in_rank as it was before (the reference its tests compare against)."""
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    rank = torch.where(valid, topk_idx // (num_experts // world), world)
    out = torch.zeros((topk_idx.shape[0], world + 1), dtype=torch.bool, device=topk_idx.device)
    out.scatter_(1, rank, True)
    return out[:, :world]


def contract_positions(recv_counts: torch.Tensor, nodes: int, per_node: int, rows: int) -> torch.Tensor:
    """[rows] int64: where each row of the inner order (forwarder l, source node s, position) goes in
    the contract's order (source rank s*P + l, position). Rows past the valid ones stay in place."""
    P, N = per_node, nodes
    c = recv_counts.long()
    inner = c.view(N, P).t().reshape(-1)             # block sizes in inner order: (l, s)
    inner_end = inner.cumsum(0)
    inner_start = inner_end - inner
    contract_start = (c.cumsum(0) - c).view(N, P).t().reshape(-1)
    i = torch.arange(rows, device=c.device)
    b = torch.searchsorted(inner_end, i, right=True)
    valid = b < N * P
    bc = b.clamp(max=N * P - 1)
    return torch.where(valid, contract_start[bc] + i - inner_start[bc], i)


def contract_order(recv_off: torch.Tensor, recv_src: torch.Tensor, nodes: int, per_node: int, max_tokens: int,
                   rows: int):
    """contract_order_torch's result; on the GPU one launch (csrc/layout/contract_order.cu) instead of ~17
    small ops, which kept the fresh 2x2 dispatch's stream waiting on the host."""
    kernel = c_op("contract_order") if recv_src.is_cuda and _raw_stream is not None else None
    if (kernel is None or recv_off.dtype != torch.int32 or recv_src.dtype != torch.int32
            or recv_off.numel() != per_node + 1 or not recv_src.is_contiguous() or not recv_off.is_contiguous()):
        return contract_order_torch(recv_off, recv_src, nodes, per_node, max_tokens, rows)
    dev = recv_src.device
    counts = torch.empty(nodes * per_node, dtype=torch.int64, device=dev)
    pos = torch.empty(rows, dtype=torch.int64, device=dev)
    kernel(recv_off.data_ptr(), recv_src.data_ptr(), nodes, per_node, max_tokens, rows, counts.data_ptr(),
           pos.data_ptr(), _raw_stream(dev.index))
    return counts, pos


def contract_order_torch(recv_off: torch.Tensor, recv_src: torch.Tensor, nodes: int, per_node: int,
                         max_tokens: int, rows: int):
    """(recv_counts [W] int64, positions [rows] int64), read off the inner exchange on the device (no
    exchange of counts, no host wait): row i came from forwarder l (recv_off[l] <= i < recv_off[l + 1],
    recv_off [P + 1]) out of its slot recv_src[i] = s*M + t, i.e. from rank g = s*P + l, and goes to
    contract position start[g] + (i - the first inner row of (l, s)). Rows from recv_off[P] on (their
    recv_src is undefined) are not counted and stay in place. What recv_counts + contract_positions
    give, in fewer launches (the fresh dispatch's host time). Positions always lie in [0, rows)."""
    P, N, M = per_node, nodes, max_tokens
    W = N * P
    dev = recv_src.device
    # ~17 launches (the host issues them while the GPU forwards; at ~20 us each on the measured host
    # they were on the critical path at 28): the row's forwarder and source rank, the counts, and one
    # shift per source rank, delta[g] = contract start - first inner row of (l, s), which telescopes to
    # cumsum(c)[g] - cumsum over nodes of c[., l] up to s - recv_off[l]
    i = torch.arange(rows, device=dev)
    off = recv_off.long()
    fwd = torch.searchsorted(off[1:], i, right=True)  # P for rows past the valid ones
    valid = fwd < P
    g = torch.add(fwd, torch.div(recv_src[:rows], M, rounding_mode="floor"), alpha=P)
    src = torch.where(valid, g, W).clamp_(0, W)  # after an inner timeout recv_src is anything
    counts = torch.zeros(W + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, src, torch.ones_like(src))  # bincount would wait on the host for its size
    c = counts[:W]
    delta = (c.cumsum(0).view(N, P) - c.view(N, P).cumsum(0)).sub_(off[:P]).view(-1)
    delta = torch.nn.functional.pad(delta, (0, 1))  # rows past the valid ones (src W) stay in place
    pos = delta[src].add_(i)
    # a no-op on a complete exchange (a permutation of [0, rows)); after an inner timeout recv_off and
    # recv_src hold whatever was there, and an index out of range would end the process's CUDA context
    # with a device assert instead of letting check() raise EPTimeoutError
    return c, pos.clamp_(0, max(rows - 1, 0))


class HierarchicalBackend(Backend):
    name = "hierarchical"
    capabilities = Capabilities(row_dtypes=(torch.bfloat16,), combine_dtypes=(torch.bfloat16,))
    rail_engine = "torch"
    inner_backend = "torch"
    # combine without the passes the flat path does not have (session 8, issue 30): the inner combine reads
    # x through the reorder's index and, where the rail allows it, stores its sums at the rail peers; the
    # one-rank node's rail reads x in place. False: the gather back to the inner order (or to slots) and
    # the rail's own copy of the rows, as before (benchmarks/bench_internode.py --combine-path before).
    fused_combine = True
    # the cached dispatch without its reorder pass (session 10, issue 30): with several ranks per node the inner
    # backend's pull writes each row straight to its contract position (dispatch_scattered, where the inner backend
    # declares dispatch_scatters), the index being the fresh dispatch's to_contract. False: the inner dispatch in
    # its own order, then scatter_rows, as before (benchmarks/bench_internode.py --cached-path before).
    direct_cached_dispatch = True
    # the fresh dispatch without contract_order and its reorder pass (session 10's design, docs/INTERNODE.md): with
    # several ranks per node the inner pull computes each row's contract position itself and writes the rows, the
    # index and the counts there (dispatch_contract, where the inner backend declares dispatch_contracts and the
    # call fits: the worst-case fused bulk-copy pull). On since session 10's device run (4x H100, 2x2): bit for bit
    # the path before (tests/test_internode_gpu.py, test_fresh_dispatch_writes_contract_order), the contract test
    # passed with it on, 2x2 fresh dispatch 875 us cold against 1058 (bench_internode.py; --fresh-path before
    # turns it off for an A/B).
    direct_fresh_dispatch = True
    # the pulled combine (session 11, issue 30): where the rail can (can_pull: every rail peer over P2P, virtual nodes
    # on one host), each forwarder keeps the sums it owes an origin in its OWN rail rows (the inner combine's stores,
    # or the rail's send half at P = 1, go to local HBM) and signals; the origin's receive + sum reads its rail peers'
    # rows over P2P. Session 8's timeline put ~220 us of the 2x2 combine in the inner combine's remote stores; here
    # they become the origin's remote reads. The same sums in the same order, bit for bit. On by default since session
    # 11's device runs (4x H100, 24 SMs, cold): 2x2 882.6 us against 1057.8 pushed (1.25x flat nvlink's 705.1), 2x1
    # 424.0 against 532.3 (tests/test_internode_gpu.py test_pull_combine: bit for bit the pushed path);
    # False: pushed (benchmarks/bench_internode.py --combine-path push). Every rank must have the same value: the
    # rail's signal means "ready to read" on this path and "landed" on the other (class attribute, as the other
    # switches; the rail's P2P reach is the same on every rank too).
    pull_combine = True

    def __init__(self, group, cfg, hidden: int, num_experts: int, *, ranks_per_node: Optional[int] = None):
        from .. import registry  # the parts are named, never imported

        super().__init__(group, cfg, hidden, num_experts)
        if ranks_per_node is None:
            ranks_per_node, _ = resolve_ranks_per_node(group, cfg.comm.ranks_per_node)
        self.P = P = int(ranks_per_node)
        self.N = N = self.world // P
        if num_experts % self.world:
            raise ValueError(f"{num_experts} experts do not split evenly over {self.world} ranks")
        self.M = int(cfg.comm.max_tokens_per_rank)
        self.fp8 = cfg.comm.dispatch_dtype == "fp8"
        # one rail per row form (its buffers hold BF16 rows or FP8 rows + scales); the form the config
        # names is built now, the other at its first call (collective: every rank makes the same call)
        # a partial, not a lambda over self: a backend -> closure -> backend cycle kept its rails' process
        # groups (and gloo's threads) alive past destroy_process_group, to be torn down by the cyclic GC
        # during interpreter exit, where gloo's threads can abort the process ("terminate called ...")
        self._make_rail = functools.partial(registry.make_rail, self.rail_engine, group, cfg, hidden, num_experts,
                                            P, self.M)
        self._rails = {self.fp8: self._make_rail(self.fp8)}
        self.local = LocalNode(self.experts_per_rank) if P == 1 else None
        self.inner = None
        if P > 1:
            node_group, _ = node_groups(group, P)
            # the forwarder's slots are the inner backend's tokens: N*M of them, the node's experts
            # (through validation, as every config: a bad combination is a ConfigError naming the key)
            from ...config import load_config  # config imports the backend registry: import it late

            inner_cfg = load_config(cfg, {"comm.max_tokens_per_rank": N * self.M, "comm.backend": self.inner_backend})
            self.inner = registry.backend_class(self.inner_backend)(node_group, inner_cfg, hidden, num_experts // N)
        self.worst_case = not cfg.comm.host_sync
        self._ring = None
        self._comm_stream = None
        self.timeline = NO_TIMELINE  # a StageTimeline (timeline.py) marks each call's stages

    # ------------------------------------------------------------------ helpers
    def _counts(self, is_in: torch.Tensor, recv_counts: torch.Tensor, tpe: torch.Tensor, exact: bool):
        """The handle's host counts. tpe is int64 already (one .long() in _dispatch, not two); the send
        counts' sum is launched only when they are read (it was one more launch on every fresh dispatch's
        host path)."""
        if exact or not tpe.is_cuda:
            return counts_from_lists(is_in.sum(0).tolist(), recv_counts.tolist(), tpe.tolist())
        if self._ring is None:
            self._ring = PinnedRing({"tokens_per_expert": ((self.experts_per_rank,), torch.int64)})
        # only tokens_per_expert is copied on every dispatch; the per-rank counts are read rarely (the
        # generic weight reduction, DeepEP's host-synced dispatch) and then at the cost of a sync, as
        # the nvlink backend's
        return HostCounts(device={"tokens_per_expert": tpe}, ring=self._ring,
                          derived={"send_counts": lambda _c: is_in.sum(0).tolist(),
                                   "recv_counts": lambda _c: recv_counts.tolist()})

    def _recv_counts(self, is_in: torch.Tensor, slot_valid: torch.Tensor) -> torch.Tensor:
        """[W] int64 rows this rank receives from each rank: read off the slots for one-rank nodes, else
        one all-to-all of the send counts (on the stream, no host wait). Only for inner backends that
        keep no per-row source: with the nvlink backend inside nodes, contract_order reads them off
        the inner exchange (no collective a dead peer could hang)."""
        if self.P == 1:  # every rank is a rail peer: block s of the slots came from rank s
            return slot_valid.view(self.N, self.M).sum(1)
        send = is_in.sum(0).long()
        got = torch.empty_like(send)
        dist.all_to_all_single(got, send, group=self.group)
        return got

    def _stream(self, async_op: bool):
        if not async_op or not torch.cuda.is_available():
            return None
        if self._comm_stream is None:
            self._comm_stream = torch.cuda.Stream()
        self._comm_stream.wait_stream(torch.cuda.current_stream())
        return self._comm_stream

    def _event(self, s, tensors) -> EPEvent:
        """The event of an async call: on the communication stream, or an empty one (CPU)."""
        return EPEvent() if s is None else self.stream_event(s, tensors)

    def _state(self, handle: Handle) -> HierarchicalState:
        if not isinstance(handle.state, HierarchicalState):
            raise TypeError(f"this handle was made by the {handle.backend} backend; a {self.name} buffer takes "
                            "handles of its own dispatches only")
        return handle.state

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x, scales, topk_idx, topk_weights, handle=None, async_op=False):
        if handle is not None:
            self._state(handle)
            topk_idx = handle.topk_idx
        s = self._stream(async_op)
        with torch.cuda.stream(s) if s is not None else contextlib.nullcontext():
            out = self._dispatch(x, scales, topk_idx, topk_weights, handle)
        if async_op:
            out.event = self._event(s, (x, scales, topk_idx, topk_weights, out.x, out.scales, out.topk_idx,
                                        out.topk_weights))
        return out

    def _rail(self, fp8: bool):
        rail = self._rails.get(fp8)
        if rail is None:
            rail = self._rails[fp8] = self._make_rail(fp8)
        return self._marked(rail)

    def _marked(self, rail):
        """The rail, marking its send half on the timeline where it launches its halves separately."""
        if hasattr(rail, "on_phase"):
            rail.on_phase = self.timeline.mark if self.timeline.enabled else None
        return rail

    def _dispatch(self, x, scales, topk_idx, topk_weights, handle):
        T = x.shape[0]
        tl = self.timeline
        tl.begin("dispatch" if handle is None else "dispatch_cached")
        rail = self._rail(scales is not None)
        if handle is not None:
            xf, sf, topk_f, wf = rail.dispatch(x, scales, topk_idx, topk_weights)
            tl.mark("rail_recv")
            return self._forward_cached(xf, sf, topk_f, wf, handle, handle.state)
        xf, sf, topk_f, wf, is_in = self._rail_and_routing(rail, x, scales, topk_idx, topk_weights)
        tl.mark("rail_recv")
        # the slots' flags need the rail's rows: one-rank nodes pack by them now (with the order, the counts
        # per source node and per expert: one launch on GPUs, LocalNode.pack); with an inner exchange they are
        # launched after it, while the GPU forwards (only combine reads them)
        if self.P == 1:
            slot_valid, recv_counts, order, place, num_recv, tpe = self.local.pack(topk_f, self.N, self.M)
        tl.mark("layout")
        if self.P == 1:
            rows = order
            exact = not self.worst_case and not (xf.is_cuda and torch.cuda.is_current_stream_capturing())
            if exact:
                n = int(num_recv)  # host_sync: true asked for this wait
                rows = order[:n]
            out_x, out_s = LocalNode.gather(xf, rows), LocalNode.gather(sf, rows)
            out_idx, out_w = LocalNode.gather(topk_f, rows), LocalNode.gather(wf, rows)
            state = HierarchicalState(slot_valid=slot_valid, inner=None, order=order, to_contract=None, rail=rail,
                                      slot_row=LocalNode.slot_rows(place, rows.shape[0]))
            tl.mark("forward")
        else:
            direct = self._direct_fresh(xf, sf)  # the pull writes each row at its contract position
            if direct:
                got = self.inner.dispatch_contract(xf, sf, topk_f, wf, self.N)
                res = got.out
            else:
                res = self.inner.dispatch(xf, sf, topk_f, wf)
            if res.event is not None:
                res.event.current_stream_wait()
            slot_valid = (topk_f >= 0).any(1)
            tl.mark("forward")
            ih = res.handle
            exact, num_recv, tpe = ih.exact, ih.num_recv_device, ih.num_tokens_per_expert
            if direct:  # no contract_order, no reorder pass
                recv_counts, to_contract = got.recv_counts, got.to_contract
                out_x, out_s, out_idx, out_w = res.x, res.scales, res.topk_idx, res.topk_weights
            else:
                recv_off, recv_src = getattr(ih.state, "recv_off", None), getattr(ih.state, "recv_src", None)
                if recv_off is not None and recv_src is not None and recv_src.numel() >= ih.num_recv:
                    recv_counts, to_contract = contract_order(recv_off, recv_src, self.N, self.P, self.M,
                                                              ih.num_recv)
                else:  # an inner backend that keeps no per-row source (the torch parts): counts by all-to-all
                    recv_counts = self._recv_counts(is_in, slot_valid)
                    to_contract = contract_positions(recv_counts, self.N, self.P, ih.num_recv)
                out_x, out_s, out_idx, out_w = (scatter_rows(t, to_contract)
                                                for t in (res.x, res.scales, res.topk_idx, res.topk_weights))
                tl.mark("reorder")
            state = HierarchicalState(slot_valid=slot_valid, inner=ih, order=None, to_contract=to_contract, rail=rail)
        tpe = tpe.long()  # the inner nvlink backend's may be int32: one launch, not one per use
        handle = Handle(backend=self.name, num_tokens=T, num_recv=out_x.shape[0], num_experts=self.num_experts,
                        is_token_in_rank=is_in, topk_idx=topk_idx, recv_topk_idx=out_idx,
                        num_recv_device=num_recv, num_tokens_per_expert=tpe,
                        counts=self._counts(is_in, recv_counts, tpe, exact), state=state, exact=exact)
        tl.end("counts")
        return DispatchOutput(x=out_x, scales=out_s, topk_idx=out_idx, topk_weights=out_w, handle=handle)

    def _rail_and_routing(self, rail, x, scales, topk_idx, topk_weights):
        """The rail's dispatch and the routing mask is_in [T, W] (the handle's is_token_in_rank). A rail
        that launches its send and receive halves separately (on_phase: the NVSHMEM rail) gets the mask's
        launches between them: the host issues them while the GPU runs the send (~230 us at 4096 x 7168)
        instead of after the receive, when the stream would wait idle for ~10 small launches (the
        "layout" stage of the 2026-11-26 timeline: 103 us GPU, 238 us host). Same values either way."""
        is_in = []
        if hasattr(rail, "on_phase"):
            marks = rail.on_phase

            def after_send(stage):
                if marks is not None:
                    marks(stage)
                is_in.append(_in_rank(topk_idx, self.num_experts, self.world))

            rail.on_phase = after_send
            try:
                xf, sf, topk_f, wf = rail.dispatch(x, scales, topk_idx, topk_weights)
            finally:
                rail.on_phase = marks
        else:
            xf, sf, topk_f, wf = rail.dispatch(x, scales, topk_idx, topk_weights)
        if not is_in:  # no phases (the torch rail)
            is_in.append(_in_rank(topk_idx, self.num_experts, self.world))
        return xf, sf, topk_f, wf, is_in[0]

    def _forward_cached(self, xf, sf, topk_f, wf, handle, st):
        """Cached dispatch: the rail moves the rows again (its slots are fixed), the inner hop reuses
        its layout. The routing is the handle's, so the valid slots are the same as then."""
        tl = self.timeline
        if self.P == 1:
            rows = st.order[:handle.num_recv]
            out_x, out_s = LocalNode.gather(xf, rows), LocalNode.gather(sf, rows)
            out_w = LocalNode.gather(wf, rows)
            tl.end("forward")
        else:
            inner = dataclasses.replace(st.inner, topk_idx=topk_f)  # the rail's view of the slots is reused
            direct = self._direct_cached(st)  # the pull writes each row at its contract position: no reorder pass
            res = (self.inner.dispatch_scattered(xf, sf, wf, inner, st.to_contract) if direct
                   else self.inner.dispatch(xf, sf, topk_f, wf, handle=inner))
            if res.event is not None:
                res.event.current_stream_wait()
            if direct:
                out_x, out_s, out_w = res.x, res.scales, res.topk_weights
                tl.end("forward")
            else:
                tl.mark("forward")
                out_x, out_s, out_w = (scatter_rows(t, st.to_contract) for t in (res.x, res.scales, res.topk_weights))
                tl.end("reorder")
        return DispatchOutput(x=out_x, scales=out_s, topk_idx=handle.recv_topk_idx, topk_weights=out_w,
                              handle=handle)

    def _pulls(self, rail) -> bool:
        """Whether this combine is the pulled one: the switch and the rail's P2P reach to every rail peer -- both the
        same on every rank, as the pulled protocol needs."""
        return self.pull_combine and getattr(rail, "can_pull", False)

    def _direct_fresh(self, xf: torch.Tensor, sf: Optional[torch.Tensor]) -> bool:
        """Whether the fresh dispatch at P > 1 can have the inner pull write into the contract's order: the switch
        is on, the inner backend declares dispatch_contracts and takes this call (dispatch_contract_fits: on the
        nvlink backend the worst-case fused bulk-copy pull; host-synced sizing, split kernels, the register pull
        are the path before). Asked before any inner launch."""
        return (self.direct_fresh_dispatch and self.inner.capabilities.dispatch_contracts
                and self.inner.dispatch_contract_fits(xf, sf, self.N))

    def _direct_cached(self, st: HierarchicalState) -> bool:
        """Whether the cached dispatch can have the inner pull write into the contract's order: the switch is on,
        the inner backend writes through an index (dispatch_scatters), and to_contract has one entry per inner
        output row. It has, wherever the fresh dispatch made it (contract_order and contract_positions: int64
        on the rows' device, valid rows among the first num_recv positions, the padding rows of a worst-case
        output in place), so it covers every row the pull writes, padding included; its form is checked by
        the inner backend (a TypeError, not a fallback: no such index is made here). Per call: no tensor work."""
        t = st.to_contract
        return (self.direct_cached_dispatch and self.inner.capabilities.dispatch_scatters and t is not None
                and t.shape[0] == st.inner.num_recv)

    # ------------------------------------------------------------------ combine
    @staticmethod
    def _cut_index(index: torch.Tensor, rows: int, keep_all: bool) -> torch.Tensor:
        """combine's x may be cut to its valid rows (EPBuffer.combine allows it; DeepEP's combine takes
        back the exact-size rows of a host-synced dispatch), while the reorder's index was made for all
        the rows the dispatch returned: it must not reach past x (an index past it was the device-side
        assert of DeepEP's test_internode.py on 2026-11-26). Valid rows come first in both orders and
        map among themselves; the rest map to themselves (to_contract: keep the first `rows` entries)
        or anywhere (slot_row, keep_all: those slots are never sent back). Bounded to x's rows either
        way, so a handle left by a timed-out exchange cannot index out of x either. Only called for a
        cut x: a full one takes the index as it is, with no extra launch."""
        if not keep_all:
            index = index[:rows]
        return index.clamp(max=max(rows - 1, 0))

    def combine(self, x, handle, async_op=False):
        st = self._state(handle)
        s = self._stream(async_op)
        tl = self.timeline
        with torch.cuda.stream(s) if s is not None else contextlib.nullcontext():
            tl.begin("combine")
            cut = x.shape[0] < handle.num_recv
            rail = self._marked(st.rail)
            # the passes cut below read x in place: they need its rows as they are in memory (any mix of ranks
            # taking them or not is fine: the kernels' protocols are the same either way)
            direct = self.fused_combine and x.is_contiguous() and x.data_ptr() % 16 == 0
            # unlike `direct`, the same on every rank (the switch and the rail's P2P reach), as the pulled
            # protocol needs: each branch below takes it
            pull = self._pulls(rail)
            if self.P == 1:
                slot_row = self._cut_index(st.slot_row, x.shape[0], True) if cut else st.slot_row
                if direct and x.shape[0] > 0:  # the rail's send reads each slot's row of x in place: no gather
                    tl.mark("reduce_in_node")
                    y = rail.combine(x, st.slot_valid, handle.topk_idx, handle.num_tokens, y_rows=slot_row, pull=pull)
                    tl.end("rail_recv_sum")
                    return y, (self._event(s, (x, y)) if async_op else None)
                y_f = LocalNode.to_slots(x, slot_row, self.N * self.M)
            else:  # back to the inner order
                to_inner = self._cut_index(st.to_contract, x.shape[0], False) if cut else st.to_contract
                if direct and self.inner.capabilities.combine_gathers:
                    return self._combine_routed(x, to_inner, handle, st, rail, s, async_op, pull)
                rows = gather_rows(x, to_inner)
                tl.mark("reorder")
                y_f, ev = self.inner.combine(rows, st.inner)
                if ev is not None:
                    ev.current_stream_wait()
            tl.mark("reduce_in_node")
            y = rail.combine(y_f, st.slot_valid, handle.topk_idx, handle.num_tokens, pull=pull)
            tl.end("rail_recv_sum")
        return y, (self._event(s, (x, y)) if async_op else None)

    def _combine_routed(self, x, to_inner, handle, st, rail, s, async_op, pull):
        """combine with several ranks per node, where the inner backend gathers in its kernels (combine_gathers):
        its combine reads x[to_inner] in place (no reorder pass back to the inner order), and where the rail names
        the rail peers' receive rows (combine_targets: every rail peer over P2P, none masked) and the inner backend
        can store there (combine_to_blocks), the inner reduce writes each node's sum of slot s*M + t straight
        into rank (s, l)'s rows, so the rail's send half only signals (no y_f, no copy of the rows). The sums
        are the same values in the same order as the passes they replace, bit for bit. pull:
        the pulled combine, where the targets are this rank's own rail rows (rail.combine_targets(pull=True)) and
        the rail's receive half reads its peers' (or, without such targets, the rail's send half copies y_f there)."""
        tl = self.timeline
        targets = rail.combine_targets(pull=pull) if self.inner.capabilities.combine_to_blocks else None
        if targets is not None:
            ev = self.inner.combine_to_blocks(x, to_inner, st.inner, targets, self.M)
        else:
            y_f, ev = self.inner.combine_gathered(x, to_inner, st.inner)
        if ev is not None:
            ev.current_stream_wait()
        tl.mark("reduce_in_node")
        if targets is not None:
            y = rail.combine_placed(handle.topk_idx, handle.num_tokens, pull=pull)
        else:
            y = rail.combine(y_f, st.slot_valid, handle.topk_idx, handle.num_tokens, pull=pull)
        tl.end("rail_recv_sum")
        return y, (self._event(s, (x, y)) if async_op else None)

    # ------------------------------------------------------------------ faults
    def check(self) -> None:
        for rail in self._rails.values():
            rail.check()
        if self.inner is not None:
            try:
                self.inner.check()
            except EPTimeoutError as e:  # the inner backend names ranks of the node's group: name ours
                first = (self.rank // self.P) * self.P
                missing = tuple(first + int(r) for r in e.missing_ranks)
                raise EPTimeoutError(f"{self.name} backend, inside node {self.rank // self.P} (group ranks "
                                     f"{first}..{first + self.P - 1}): rank(s) {list(missing)} did not arrive; "
                                     f"{e}", missing) from e

    def wait_pending(self) -> None:
        if self.inner is not None:
            self.inner.wait_pending()

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
        for rail in self._rails.values():
            rail.close()


class NvshmemBackend(HierarchicalBackend):
    """comm.backend: nvshmem -- the NVSHMEM rail (RDMA across nodes, P2P between virtual nodes) and the
    nvlink backend inside each node. The rail's send half flags ids outside [-1, E) (as routed nowhere)
    and check() raises them, so EPBuffer queues no check of its own."""

    name = "nvshmem"
    capabilities = Capabilities(row_dtypes=(torch.bfloat16,), combine_dtypes=(torch.bfloat16,),
                                checks_expert_ids=True)
    rail_engine = "nvshmem"
    inner_backend = "nvlink"

    @staticmethod
    def check_group(group, hidden: int) -> None:
        from .. import registry

        registry.rail_class("nvshmem").check_available(group, hidden)
