"""The torch reference of the low-latency calls (docs/LOW_LATENCY.md): torch.distributed all-to-alls
on any process group (gloo with CPU tensors, NCCL with CUDA tensors), host syncs allowed. It defines
the semantics the NVSHMEM kernels must reproduce bit for bit: the packed expert-major layout, the
FP8 cast and the order of the combine's float32 sums.

One dispatch: the send half (at the call) picks one row per (token, expert) hit, ordered by
destination rank, local expert, then token, and packs it with its local expert and token index as
byte rows (backend.py's packing, so BF16 travels unchanged on every process group); the receive
half (at once, or in `hook()`) exchanges the per-(rank, expert) counts, then the rows, and scatters
them into the fixed `[E_l, W*M, H]` output: source ranks in order from slot 0, each source's rows by
token index (the order they arrive in). FP8 is cast on the receiver, row by row (the same numbers as
a cast on the sender). One combine: the expert rank sends each valid row back with its token index
and global expert id (after a counts exchange: masks may differ between ranks), and the token's rank
sums `acc = acc + w * row` over k ascending in float32, unfused, then casts to BF16. With
`comm.low_latency.combine_reduce: owner` the picks of each rank holding some are summed that way into
a BF16 row first, and the token's rows of those ranks are added in float32 in the order of each rank's
first pick, then cast (what the kernels' owners send, ll_combine.cu "Owner sums").

Masks (`set_mask`): a rank never sends rows to the ranks in its mask and drops (counts as 0) the
rows that arrive from them, so with the same mask on every rank a left-out rank's rows count as
routed nowhere. Unlike the NVSHMEM kernels this engine runs collectives: a left-out rank still takes
part in them (it sends and receives nothing that counts), so the mask changes what is delivered but
cannot route around a rank that is dead or stalled.

Timeouts: every exchange runs on a BoundedGroup (deadline.py) with comm.timeout_s; a rank that does
not arrive raises EPTimeoutError naming it from the call that waits (this engine waits on the host:
the dispatch or combine itself, or its hook), not only at the next call; the engine is unusable
afterwards (the kernels' engine can go on with a mask, this one cannot).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ...types import FP8_BLOCK, LowLatencyHandle
from .backend import _pack, _unpack, all_to_all_rows
from .deadline import BoundedGroup

FP8_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_MIN = 1e-4  # a block of zeros still gets a finite scale


# float32(1/448): `amax / 448.0` on a CUDA tensor is a multiply by this rounded reciprocal, which the
# kernels and DeepEP's reference cast reproduce; spelt out so that CPU and CUDA agree bit for bit.
INV_FP8_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))


def cast_fp8(rows: torch.Tensor, round_scale: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """[N, H] BF16 -> (data float8_e4m3fn [N, H], scales float32 [N, H/128]), the contract's cast
    (docs/LOW_LATENCY.md), each step in float32: amax = max(max|x|, 1e-4) per 128 channels;
    scale = amax * float32(1/448), data = x * (reciprocal(amax) * 448); or with round_scale
    scale = 2 ** ceil(log2(amax * float32(1/448))) and data = x * reciprocal(scale)."""
    n, h = rows.shape
    blocks = rows.float().view(n, h // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_MIN)
    if round_scale:
        scale = torch.exp2(torch.ceil(torch.log2(amax * INV_FP8_MAX)))
        factor = torch.reciprocal(scale)
    else:
        scale = amax * INV_FP8_MAX
        factor = torch.reciprocal(amax) * FP8_MAX
    data = (blocks * factor).to(torch.float8_e4m3fn).view(n, h)
    return data, scale.view(n, h // FP8_BLOCK)


@dataclass
class TorchLowLatencyState:
    """A dispatch's layout on the host, for its combine: counts[e][s] rows of local expert e from
    source rank s (0 for masked sources), starting at slot begins[e][s]. None until the receive ran."""

    counts: Optional[List[List[int]]] = None
    begins: Optional[List[List[int]]] = None


class TorchLowLatency:
    """The low-latency engine on torch.distributed collectives. Construction is collective over the
    group's members (it builds the engine's own bounded process group)."""

    name = "torch"
    checks_expert_ids = False  # EPBuffer checks them (on the device, or on the host with validate: full)
    max_topk = None            # no per-top-k sizing

    def __init__(self, group, cfg, hidden: int, num_experts: int):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.hidden = hidden
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.world
        self.max_tokens = cfg.comm.low_latency.max_tokens_per_rank
        # comm.low_latency.combine_reduce: owner sums each rank's picks into a BF16 row first (_combine_receive)
        self.owner_sums = str(getattr(cfg.comm.low_latency, "combine_reduce", "source")) == "owner"
        self._masked: Tuple[int, ...] = ()
        self._comm = BoundedGroup(group, cfg.comm.timeout_s)

    # ------------------------------------------------------------------ masks and errors
    def set_mask(self, ranks: Sequence[int]) -> None:
        """Leave out `ranks` (validated by EPBuffer); an empty list clears the mask."""
        self._masked = tuple(sorted(set(int(r) for r in ranks)))

    def _masked_ranks(self, mask: Tuple[int, ...], device) -> torch.Tensor:
        """[W] bool: the ranks in `mask`."""
        masked = torch.zeros(self.world, dtype=torch.bool)
        masked[list(mask)] = True
        return masked.to(device)

    def check(self) -> None:
        """Raise the EPTimeoutError of a failed exchange (host state only)."""
        if self._comm.failed is not None:
            raise self._comm.failed
        self._comm.poll_pending(block=False)

    def wait_pending(self) -> None:
        """Wait, within comm.timeout_s, for exchanges the stream waits on (before EPBuffer.check()
        synchronises the device)."""
        self._comm.poll_pending(block=True)

    def close(self) -> None:
        self._comm.close()

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, *, use_fp8: bool, round_scale: bool,
                 recv_stats: Optional[torch.Tensor], hook: bool):
        """-> (recv_x, recv_count, handle, recv): the outputs are allocated here with their fixed shapes
        and filled by the receive half, which runs now (recv None) or when `recv()` is called."""
        E_l, W, M, H = self.num_local_experts, self.world, self.max_tokens, self.hidden
        dev = x.device
        if use_fp8:
            # float8 tensors are filled and indexed through their bytes: not every device's kernels take them
            data = torch.zeros((E_l, W * M, H), dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
            # DeepGEMM's masked grouped GEMM reads the scales slot-major: [E_l, H/128, W*M] in memory
            scales = torch.zeros((E_l, H // FP8_BLOCK, W * M), dtype=torch.float32, device=dev).transpose(1, 2)
            recv_x = (data, scales)
        else:
            recv_x = torch.zeros((E_l, W * M, H), dtype=torch.bfloat16, device=dev)
        recv_count = torch.zeros(E_l, dtype=torch.int32, device=dev)
        handle = LowLatencyHandle(
            src_info=torch.full((E_l, W * M), -1, dtype=torch.int32, device=dev),
            layout_range=torch.zeros((E_l, W), dtype=torch.int64, device=dev),
            num_tokens=x.shape[0], max_tokens=M, hidden=H, num_experts=self.num_experts,
            topk=topk_idx.shape[1], use_fp8=use_fp8, backend=self.name, state=TorchLowLatencyState())
        # The send half: the rows leave x now, so x may change before the receive half runs. The
        # receive half keeps the mask of the call.
        mask = self._masked
        send_rows, send_counts = self._pick_rows(x, topk_idx, mask)

        def recv():
            self._receive(send_rows, send_counts, mask, recv_x, recv_count, handle, round_scale, recv_stats)

        if hook:
            return recv_x, recv_count, handle, recv
        recv()
        return recv_x, recv_count, handle, None

    def _pick_rows(self, x: torch.Tensor, topk_idx: torch.Tensor, mask: Tuple[int, ...]):
        """One packed row per (token, expert) hit, ordered by destination rank, local expert, then
        token; and the [W, E_l] counts of rows per (destination rank, local expert)."""
        E, E_l = self.num_experts, self.num_local_experts
        T = x.shape[0]
        ok = (topk_idx >= 0) & (topk_idx < E)  # ids outside are EPBuffer's error, never indexed
        dst = torch.div(topk_idx.clamp(0, E - 1), E_l, rounding_mode="floor")
        ok &= ~self._masked_ranks(mask, x.device)[dst]
        # [T, E + 1] hits, the last column collecting the entries routed nowhere; a token listing an
        # expert twice still sends one row (the contract's copy per (token, expert))
        hit = torch.zeros((T, E + 1), dtype=torch.bool, device=x.device)
        hit.scatter_(1, torch.where(ok, topk_idx, E), True)
        hit = hit[:, :E]
        expert, token = hit.t().nonzero().unbind(1)  # sorted by global expert, then token
        counts = hit.sum(0).view(self.world, E_l)
        meta = torch.stack([expert % E_l, token], 1)  # int64 [N, 2]: local expert, token index
        return _pack([x.index_select(0, token), meta]), counts

    def _receive(self, send_rows, send_counts, mask, recv_x, recv_count, handle, round_scale, recv_stats):
        """Exchange counts and rows; scatter the rows of unmasked sources into the packed layout."""
        E_l, W, M, H = self.num_local_experts, self.world, self.max_tokens, self.hidden
        dev = send_rows.device
        self._comm.arrive("low-latency dispatch")
        got_counts = torch.empty_like(send_counts)  # [W, E_l]: rows from source s for local expert e
        self._comm.all_to_all(got_counts, send_counts.contiguous()).wait()
        got = got_counts.tolist()
        in_splits = send_counts.sum(1).tolist()
        out_splits = [sum(row) for row in got]
        rows, _ = all_to_all_rows(self._comm, send_rows, sum(out_splits), out_splits, in_splits, async_op=False)
        x_rows, meta = _unpack(rows, [((H,), torch.bfloat16), ((2,), torch.int64)])

        # host layout: kept[s][e] rows of (source s, local expert e); begins in source order per expert
        kept = [[0 if s in mask else got[s][e] for e in range(E_l)] for s in range(W)]
        counts = [[kept[s][e] for s in range(W)] for e in range(E_l)]
        begins = [[sum(counts[e][:s]) for s in range(W)] for e in range(E_l)]
        assert all(sum(c) <= W * M for c in counts), "more rows than an expert's W*M slots"

        # where each received row goes: rows from source s arrive grouped by local expert, by token
        src = torch.repeat_interleave(torch.arange(W, device=dev), torch.tensor(out_splits, device=dev))
        local_e, token = meta[:, 0], meta[:, 1]
        got_t = torch.tensor(got, dtype=torch.int64, device=dev)                 # [W, E_l]
        split_start = torch.cumsum(torch.tensor([0] + out_splits[:-1], device=dev), 0)
        block_start = split_start.unsqueeze(1) + torch.cumsum(got_t, 1) - got_t  # [W, E_l]
        begin_t = torch.tensor(begins, dtype=torch.int64, device=dev).t()        # [W, E_l]
        j = torch.arange(rows.shape[0], device=dev) - block_start[src, local_e]
        slot = begin_t[src, local_e] + j
        keep = ~self._masked_ranks(mask, dev)[src]
        local_e, slot, token, x_rows = local_e[keep], slot[keep], token[keep], x_rows[keep]

        if isinstance(recv_x, tuple):
            data, scales = cast_fp8(x_rows, round_scale)
            recv_x[0].view(torch.uint8).index_put_((local_e, slot), data.view(torch.uint8))
            recv_x[1].index_put_((local_e, slot), scales)
        else:
            recv_x.index_put_((local_e, slot), x_rows)
        handle.src_info.index_put_((local_e, slot), token.to(torch.int32))
        counts_t = torch.tensor(counts, dtype=torch.int64, device=dev)           # [E_l, W]
        handle.layout_range.copy_((torch.tensor(begins, dtype=torch.int64, device=dev) << 32) | counts_t)
        recv_count.copy_(counts_t.sum(1))
        if recv_stats is not None:
            recv_stats.add_(recv_count)
        handle.state.counts, handle.state.begins = counts, begins

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                handle: LowLatencyHandle, *, out: Optional[torch.Tensor], hook: bool):
        """-> (y, recv): y [T, H] BF16 (or `out`), filled by the receive half, which runs now (recv
        None) or when `recv()` is called."""
        state = handle.state
        if state.counts is None:
            raise RuntimeError("low_latency_combine: the dispatch's receive hook has not run yet (call it first)")
        E_l, W, M, H = self.num_local_experts, self.world, self.max_tokens, self.hidden
        dev = x.device
        T = handle.num_tokens
        y = out if out is not None else torch.empty((T, H), dtype=torch.bfloat16, device=dev)
        # The send half: the valid rows, by source rank, local expert, slot; sources masked now get none.
        mask = self._masked
        slots, send_splits = [], []
        for s in range(W):
            n = 0
            if s not in mask:
                for e in range(E_l):
                    begin, count = state.begins[e][s], state.counts[e][s]
                    slots.append(torch.arange(e * W * M + begin, e * W * M + begin + count))
                    n += count
            send_splits.append(n)
        flat = (torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64)).to(dev)
        token = handle.src_info.view(-1).index_select(0, flat).long()
        expert = torch.div(flat, W * M, rounding_mode="floor") + self.rank * E_l
        send_rows = _pack([x.view(-1, H).index_select(0, flat), torch.stack([expert, token], 1)])

        def recv():
            self._combine_receive(send_rows, send_splits, mask, topk_idx, topk_weights, y)

        if hook:
            return y, recv
        recv()
        return y, None

    def _combine_receive(self, send_rows, send_splits, mask, topk_idx, topk_weights, y):
        """Get the rows back and sum them per token: acc = acc + w * row over k ascending, float32."""
        E, W, H = self.num_experts, self.world, self.hidden
        dev = y.device
        T = y.shape[0]
        self._comm.arrive("low-latency combine")
        send_counts = torch.tensor(send_splits, dtype=torch.int64, device=dev)
        got_counts = torch.empty_like(send_counts)
        self._comm.all_to_all(got_counts, send_counts).wait()
        out_splits = got_counts.tolist()
        rows, _ = all_to_all_rows(self._comm, send_rows, sum(out_splits), out_splits, send_splits, async_op=False)
        x_rows, meta = _unpack(rows, [((H,), torch.bfloat16), ((2,), torch.int64)])
        src = torch.repeat_interleave(torch.arange(W, device=dev), torch.tensor(out_splits, device=dev))
        keep = ~self._masked_ranks(mask, dev)[src]
        # which returned row holds (token, global expert): -1 where none came back
        where = torch.full((T, E), -1, dtype=torch.int64, device=dev)
        n = rows.shape[0]
        where[meta[keep, 1], meta[keep, 0]] = torch.arange(n, device=dev)[keep]
        tokens = torch.arange(T, device=dev)
        K = topk_idx.shape[1]
        picks = []  # per k: (kept, owner rank, the row's values)
        for k in range(K):
            ids = topk_idx[:, k]
            ok = (ids >= 0) & (ids < E)
            r = where[tokens, ids.clamp(0, E - 1)]
            ok &= r >= 0
            v = x_rows.index_select(0, r.clamp(min=0)).float() if n else torch.zeros((T, H), device=dev)
            picks.append((ok, torch.div(ids.clamp(0, E - 1), E // W, rounding_mode="floor"), v))
        acc = torch.zeros((T, H), dtype=torch.float32, device=dev)
        if not self.owner_sums:
            for k, (ok, _, v) in enumerate(picks):
                w = topk_weights[:, k:k + 1]
                # two roundings (product, then sum), as the kernels do without fused multiply-add
                acc = torch.where(ok.unsqueeze(1), acc + (w * v), acc)
            y.copy_(acc)
            return
        # owner sums: rank d's BF16 sum of its picks (k ascending), added where d's first pick stands
        sums = torch.zeros((W, T, H), dtype=torch.float32, device=dev)
        first = torch.zeros((T, K), dtype=torch.bool, device=dev)
        seen = torch.zeros((T, W), dtype=torch.bool, device=dev)
        for k, (ok, d, v) in enumerate(picks):
            w = topk_weights[:, k:k + 1]
            part = sums[d, tokens]
            sums[d, tokens] = torch.where(ok.unsqueeze(1), part + (w * v), part)
            first[:, k] = ok & ~seen[tokens, d]
            seen[tokens, d] |= ok
        sums = sums.to(torch.bfloat16).float()
        for k, (_, d, _) in enumerate(picks):
            acc = torch.where(first[:, k].unsqueeze(1), acc + sums[d, tokens], acc)
        y.copy_(acc)


__all__ = ["TorchLowLatency", "TorchLowLatencyState", "cast_fp8"]
