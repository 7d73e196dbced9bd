"""deep_ep.Buffer (DeepEP V1, tag v1.2.1) over EPBuffer: the intranode and low-latency calls.

Written from DeepEP's documented API (the docstrings of deep_ep/buffer.py), not from its code. The
same arguments and return tuples; what is not supported raises an error naming the argument.

Supported
- intranode: get_dispatch_layout, dispatch (fresh, cached, FP8 pairs, num_worst_tokens,
  expert_alignment, routing by is_token_in_rank alone), combine (weights, bias), capture,
  set_num_sms, get_dispatch_config / get_combine_config, destroy.
- low-latency (low_latency.py, Buffer(low_latency_mode=True)): low_latency_dispatch (BF16, FP8,
  round_scale, use_ue8m0, cumulative_local_expert_recv_stats, async_finish, return_recv_hook),
  low_latency_combine (out, zero_copy, async_finish, return_recv_hook),
  get_next_low_latency_combine_buffer, clean_low_latency_buffer (a no-op),
  get_low_latency_rdma_size_hint, and later DeepEP's low_latency_{update,query,clean}_mask_buffer.
- internode (internode.py): get_dispatch_layout's num_tokens_per_rdma_rank, internode_dispatch /
  internode_combine, and dispatch/combine with DeepEP's internode handle when the Buffer's nodes
  (ep_config's comm.ranks_per_node, or the hosts) are more than one.
Not supported: `dispatch_wait_recv_cost_stats`, `combine_wait_recv_cost_stats`, `use_logfmt`,
get_local_buffer_tensor: NotImplementedError naming them.

Intranode mapping: one EPBuffer per (hidden, num_experts), built at the first dispatch of that shape
(every rank dispatches the same shapes in the same order, as with DeepEP). Its config comes from
`ep_config` (path, preset, dict or EPConfig; default: ep_plugin's defaults, backend auto, so nvlink
on one node of GPUs and the torch backend elsewhere), with `Buffer.num_sms` as comm.num_sms.
A dispatch without `topk_idx` routes by `is_token_in_rank` (a stand-in expert per destination).
Outputs have exactly the received rows (the host waits for the counts, as DeepEP's does), or
`num_worst_tokens` rows with no host sync when that is given. The low-latency mapping (one EPBuffer
per (hidden, num_experts, num_max_dispatch_tokens_per_rank)) is described in low_latency.py.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..buffer import EPBuffer
from ..checks import ExpertIdCheck, Forms
from ..checks import deep_ep as checks
from ..config import EPConfig, load_config
from ..expert_major import padded
from .events import Config, EventOverlap, capture
from .handle import DeepEPHandle
from .internode import as_internode, check_rdma_arg, internode_combine, internode_dispatch, tokens_per_node
from .low_latency import LowLatencyMixin, low_latency_size_hint


def _cut(t: Optional[torch.Tensor], n: int, fill=0) -> Optional[torch.Tensor]:
    """The first n rows of t, padded with `fill` when t has fewer."""
    if t is None or t.shape[0] == n:
        return t
    if t.shape[0] > n:
        return t[:n]
    out = t.new_full((n,) + tuple(t.shape[1:]), fill)
    out[:t.shape[0]] = t
    return out


class Buffer(LowLatencyMixin):
    """deep_ep.Buffer over ep_plugin.EPBuffer (intranode and low-latency APIs).

    num_nvl_bytes, num_rdma_bytes, num_qps_per_rank, allow_nvlink_for_low_latency_mode and allow_mnnvl
    are accepted and kept: ep_plugin sizes and connects its own memory (comm.max_tokens_per_rank,
    comm.low_latency.max_tokens_per_rank; the engine picks NVLink or RDMA per peer). ep_config: the
    EPConfig source of every EPBuffer this Buffer builds (ep_plugin's own keyword)."""

    num_sms: int = 20

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, comm=None, *, ep_config=None) -> None:
        if group is None:
            raise ValueError("ep_plugin.deep_ep.Buffer: group must be a torch.distributed ProcessGroup "
                             "(the mpi4py `comm` form is not supported)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode, self.allow_mnnvl = allow_nvlink_for_low_latency_mode, allow_mnnvl
        self.explicitly_destroy = explicitly_destroy
        self._cfg: EPConfig = load_config(ep_config)
        self._buffers: Dict[Tuple[int, int], EPBuffer] = {}
        self._forms = Forms()                              # call forms of the dispatches that passed the checks
        self._layout_ids: Dict[int, ExpertIdCheck] = {}    # get_dispatch_layout's expert ids, per expert count
        self._layout_check = checks.LayoutCheck()          # layout tensors of the dispatches without a host wait
        self._ll_init()
        self._destroyed = False

    # ------------------------------------------------------------------ class-level settings
    @staticmethod
    def is_sm90_compiled() -> bool:
        """True where FP8 dispatch runs (a GPU of compute capability 9.0 or newer)."""
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        if new_num_sms % 2:
            raise ValueError(f"The SM count must be even, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    capture = staticmethod(capture)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes the low-latency engine holds per rank for this shape (BF16 rows; the formula is in
        low_latency.low_latency_size_hint). A hint only: Buffer(num_rdma_bytes=...) is kept, not used."""
        return low_latency_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    def get_comm_stream(self) -> torch.Stream:
        return torch.cuda.current_stream()

    def get_local_buffer_tensor(self, *args, **kwargs):
        raise NotImplementedError("ep_plugin.deep_ep: get_local_buffer_tensor exposes DeepEP's raw NVLink buffer, "
                                  "which ep_plugin does not have")

    # ------------------------------------------------------------------ buffers
    def _live(self) -> None:
        if self._destroyed:
            raise RuntimeError("ep_plugin.deep_ep.Buffer: this buffer was destroyed")
        for ids in self._layout_ids.values():  # what earlier calls found on the device (no waiting)
            ids.raise_if_seen()
        self._layout_check.raise_if_seen()

    def _raw_config(self, num_experts: int) -> dict:
        """The config (a dict) of an EPBuffer for num_experts experts: ep_config, with Buffer.num_sms."""
        raw = self._cfg.to_dict()
        raw["moe"] = {"num_experts": num_experts, "topk": min(int(raw["moe"].get("topk") or 1), num_experts)}
        raw["comm"]["num_sms"] = Buffer.num_sms
        return raw

    def _buffer(self, hidden: int, num_experts: int) -> EPBuffer:
        key = (hidden, num_experts)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = EPBuffer(self.group, load_config(self._raw_config(num_experts)), hidden=hidden)
        return buf

    @staticmethod
    def _apply(buf: EPBuffer, config: Optional[Config]) -> None:
        """A Config's num_sms reaches the kernels of backends that have an SM count."""
        backend = getattr(buf._backend, "wrapped", buf._backend)
        if config is not None and hasattr(backend, "num_sms") and backend.num_sms != int(config.num_sms):
            backend.num_sms = int(config.num_sms)  # (nvlink: its dispatch kernel planned for the count too)

    def _rank_prefix_matrix(self, num_tokens_per_rank: torch.Tensor) -> torch.Tensor:
        """[W, W] int32: entry [i][j] = tokens ranks 0..i send to rank j (one small all-gather)."""
        mine = num_tokens_per_rank.to(torch.int32).contiguous()
        every = [torch.empty_like(mine) for _ in range(self.group_size)]
        dist.all_gather(every, mine, group=self.group)
        return torch.cumsum(torch.stack(every), 0, dtype=torch.int32)

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """(num_tokens_per_rank [W] int32, None, num_tokens_per_expert [E] int32, is_token_in_rank [T, W]
        bool, EventOverlap)."""
        from ..layout import dispatch_layout, dispatch_layout_cuda
        from .._ext import has_c

        self._live()
        checks.layout_args(topk_idx, num_experts, self.group_size)
        ids = self._layout_ids.get(num_experts)
        if ids is None:
            ids = self._layout_ids[num_experts] = ExpertIdCheck(num_experts)
        ids.record(topk_idx)  # on CPU: raised now; on a GPU: by this Buffer's next call
        if previous_event is not None:
            previous_event.current_stream_wait()
        fn = dispatch_layout_cuda if topk_idx.is_cuda and has_c() else dispatch_layout
        per_rank, per_expert, in_rank = fn(topk_idx, num_experts, self.group_size)
        per_node = tokens_per_node(self, in_rank)  # None on one node (internode.py)
        return per_rank, per_node, per_expert, in_rank, EventOverlap(capture().event if async_finish else None)

    # ------------------------------------------------------------------ dispatch / combine
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], handle: Optional[tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event),
        as DeepEP's intranode dispatch returns them."""
        self._live()
        check_rdma_arg(self, num_tokens_per_rdma_rank)
        if previous_event is not None:
            previous_event.current_stream_wait()
        data, scales = x if isinstance(x, tuple) else (x, None)
        rows = (data, scales.contiguous()) if scales is not None else data  # DeepEP takes column-major scales
        if handle is not None:
            if not isinstance(handle, DeepEPHandle):
                raise TypeError("handle must come from this module's dispatch")
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("a cached dispatch (handle given) takes no topk_idx / topk_weights")
            self._apply(handle.buffer, config)
            res = handle.buffer.dispatch(rows, handle=handle.inner, async_op=async_finish)
            return self._rows(res, handle.num_rows), None, None, None, None, EventOverlap(res.event)
        W = self.group_size
        checks.dispatch_args(self._forms, data, topk_idx, num_tokens_per_rank, is_token_in_rank,
                             num_tokens_per_expert, W)
        E = num_tokens_per_expert.numel()
        # the layout tensors' values against topk_idx's layout, found on the device: raised now on CPU or
        # before a new EPBuffer is built (a sync, once per shape), else once the host waits for the counts,
        # or (num_worst_tokens: no host wait) by the next call
        bad = checks.layout_mismatch(topk_idx, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, W)
        if not bad.is_cuda or (data.shape[1], E) not in self._buffers:
            checks.raise_mismatch(bad.tolist())
        elif num_worst_tokens > 0:
            self._layout_check.record(bad)
        buf = self._buffer(data.shape[1], E)
        self._apply(buf, config)
        idx = topk_idx
        if idx is None:  # route by is_token_in_rank: the first expert of every destination stands in
            first = torch.arange(W, dtype=torch.int64, device=data.device) * (E // W)
            idx = torch.where(is_token_in_rank, first, torch.full_like(first, -1)).contiguous()
        weights = topk_weights.float().contiguous() if topk_weights is not None else None
        res = buf.dispatch(rows, idx.contiguous(), weights, async_op=async_finish)
        if num_worst_tokens > 0:
            n, counts = num_worst_tokens, []
        else:
            n = sum(res.handle.recv_counts)  # the host waits for the counts, as DeepEP's dispatch does
            if bad.is_cuda:
                checks.raise_mismatch(bad.tolist())  # computed before the dispatch: no further wait
            if topk_idx is not None:
                per_expert = list(res.tokens_per_expert)
            else:  # routed by rank only: this rank's experts' counts from every rank's layout
                total = num_tokens_per_expert.to(torch.int64).clone()
                dist.all_reduce(total, group=self.group)
                per_expert = total.view(W, -1)[self.rank].tolist()
            counts = padded(per_expert, max(int(expert_alignment), 1))
        recv_x = self._rows(res, n)
        recv_idx = _cut(res.topk_idx, n, -1) if topk_idx is not None else None
        recv_w = _cut(res.topk_weights, n, 0) if topk_weights is not None else None
        recv_src = getattr(res.handle.state, "recv_src", None)
        h = DeepEPHandle(res.handle, self._rank_prefix_matrix(num_tokens_per_rank),
                         _cut(recv_src, n, -1) if recv_src is not None else None, is_token_in_rank, n)
        h.buffer = buf
        h = as_internode(self, h, num_tokens_per_rdma_rank)  # DeepEP's internode handle layout (internode.py)
        return recv_x, recv_idx, recv_w, counts, h, EventOverlap(res.event)

    @staticmethod
    def _rows(res, n: int):
        if res.event is not None and res.x is not None:
            data = res.x[0] if isinstance(res.x, tuple) else res.x
            if data.shape[0] < n:  # padding copies the rows: they must have landed
                res.event.current_stream_wait()
        if isinstance(res.x, tuple):
            return _cut(res.x[0], n), _cut(res.x[1], n)
        return _cut(res.x, n)

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """(combined_x [T, H], combined_topk_weights [T, K] or None, event): the rows every rank sends
        back, summed per token (no weights applied); topk_weights summed the same way (every entry)."""
        self._live()
        if not isinstance(handle, DeepEPHandle):
            raise TypeError("handle must come from this module's dispatch")
        if previous_event is not None:
            previous_event.current_stream_wait()
        buf = handle.buffer
        self._apply(buf, config)
        cap = handle.inner.num_recv  # rows past it (num_worst_tokens padding) were never received
        x = x[:cap].contiguous()
        w = topk_weights[:cap].float().contiguous() if topk_weights is not None else None
        out = buf.combine(x, handle.inner, w, async_op=async_finish, weights_local_only=False)
        out = out if isinstance(out, tuple) else (out,)
        y, rest = out[0], list(out[1:])
        event = rest.pop() if async_finish else None
        combined_w = rest[0] if w is not None else None
        biases = bias if isinstance(bias, tuple) else (bias,)
        if any(b is not None for b in biases):
            if event is not None:  # the bias is added to the combined rows: they must have landed
                event.current_stream_wait()
                event = None
            for b in biases:
                if b is not None:
                    y = y + b
        return y, combined_w, EventOverlap(event)

    # ------------------------------------------------------------------ internode (internode.py)
    internode_dispatch = internode_dispatch
    internode_combine = internode_combine

    # ------------------------------------------------------------------ lifetime
    def destroy(self) -> None:
        """Close the EPBuffers (collective: every rank calls it)."""
        if self._destroyed:
            return
        self._destroyed = True
        closed = []
        for buf in list(self._buffers.values()) + list(self._ll_buffers.values()):
            if all(buf is not c for c in closed):
                buf.close()
                closed.append(buf)
        self._buffers.clear()
        self._ll_buffers.clear()
        self._ll_staging.clear()
        self._ll_dispatch_forms.clear()
        self._ll_combine_forms.clear()


__all__ = ["Buffer"]
