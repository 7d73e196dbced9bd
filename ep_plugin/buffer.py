"""EPBuffer: the one dispatch/combine contract (DESIGN.md, "The core contract") over every backend.

The path of a token: EPBuffer.dispatch checks the call (types, shapes, capacity, the backend's
capabilities; expert ids on the device) -> the backend chosen once at construction moves the row to
every rank owning one of its experts -> the experts run -> EPBuffer.combine -> the backend sends the
rows back and sums them per token. Both directions are differentiable (autograd.py).

No host synchronisation here: `topk_idx` outside [-1, E) is found on the device (by the backend's own
kernel when it declares `checks_expert_ids`, else by a few checks EPBuffer queues), the layouts treat
bad ids as "routed nowhere" so no kernel indexes out of bounds, and the error is raised as a
ValueError at the next synchronising point — a host-synced dispatch (`comm.host_sync: true`),
the next call once the flag's copy has landed, `EPEvent.synchronize()` or `EPBuffer.check()`.
`comm.validate: full` checks on the host before any kernel instead (one sync per dispatch).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .autograd import CombineFn, DispatchFn
from .expert_major import padded
from .backends import make_backend
from .telemetry import CommStats, RecordingBackend
from .types import FP8_BLOCK, FP8_DTYPES, ROW_DTYPES, DispatchResult, ExpertDispatchResult, Handle, XInput

LAYOUTS = ("rank", "expert")


def _need(cond: bool, exc, msg: str):
    if not cond:
        raise exc(msg)


class _IndexCheck:
    """Sticky per-buffer flag: did a dispatch get an expert id outside [-1, E)? Kept on the device and
    copied to pinned memory without blocking, so later calls read it for free. The backends' layout
    code skips such ids (as routed nowhere), so nothing is written out of bounds meanwhile."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self._flag = None   # device bool, sticky until reported
        self._host = None   # its pinned copy

    def record(self, topk_idx: torch.Tensor) -> None:
        bad = torch.ne(topk_idx.clamp(-1, self.num_experts - 1), topk_idx).any()
        if not topk_idx.is_cuda:  # nothing to wait for: report now
            if bool(bad):
                self._raise(topk_idx)
            return
        if self._flag is None or self._flag.device != topk_idx.device:
            self._flag = torch.zeros((), dtype=torch.bool, device=topk_idx.device)
            self._host = torch.zeros((), dtype=torch.bool, pin_memory=True, device="cpu")
        self._flag.logical_or_(bad)
        if not torch.cuda.is_current_stream_capturing():
            self._host.copy_(self._flag, non_blocking=True)

    def raise_if_seen(self) -> None:
        """Raise if a copy that has landed shows a bad id (no waiting)."""
        if self._host is not None and bool(self._host):
            self._raise(None)

    def _raise(self, topk_idx):
        rng = ""
        if topk_idx is not None:
            rng = f", got min {int(topk_idx.min())}, max {int(topk_idx.max())}"
        if self._flag is not None:  # reported once; the buffer stays usable
            self._flag.zero_()
            self._host.zero_()
        raise ValueError(f"topk_idx values must lie in [-1, {self.num_experts}){rng}; ids outside were "
                         "treated as routed nowhere")


class EPBuffer:
    """Dispatch tokens to the ranks owning their top-k experts, and combine the results back.

    group: the expert-parallel ProcessGroup (None = WORLD). cfg: EPConfig, dict, YAML path or preset
    name. hidden: row width H. Rank r owns experts [r*E/W, (r+1)*E/W). The buffer owns the backend's
    communication memory: call close() (or use it as a context manager) before destroying the group;
    handles must not be used after close().
    """

    def __init__(self, group=None, cfg=None, hidden: int = None, *, num_experts: Optional[int] = None):
        from .config import load_config

        _need(dist.is_available() and dist.is_initialized(), RuntimeError,
              "torch.distributed must be initialized before creating an EPBuffer")
        _need(isinstance(hidden, int) and hidden > 0, ValueError, f"hidden must be a positive int, got {hidden!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.cfg = load_config(cfg, {"moe.num_experts": num_experts} if num_experts is not None else None)
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.num_experts = self.cfg.moe.num_experts
        self.cfg.check_ep_size(self.world)
        self.hidden = hidden
        self.num_local_experts = self.num_experts // self.world
        self._backend = make_backend(self.group, self.cfg, hidden, self.num_experts)
        self._stats = None
        if self.cfg.comm.stats:  # off: the backend itself, nothing added to a call
            self._stats = CommStats(self.rank, self.world, self.num_local_experts, self._backend.name)
            self._backend = RecordingBackend(self._backend, self._stats)
        self._caps = self._backend.capabilities
        self._index_check = _IndexCheck(self.num_experts)
        self._full_validation = self.cfg.comm.validate == "full"

    @property
    def backend_name(self) -> str:
        return self._backend.name

    @property
    def capabilities(self):
        """What the chosen backend takes (backends.base.Capabilities): row and combine dtypes, FP8, top-k."""
        return self._caps

    # ---------------------------------------------------------------- validation
    def _check_rows(self, x: XInput):
        caps, name = self._caps, self._backend.name
        if isinstance(x, (tuple, list)):
            _need(len(x) == 2, TypeError, "x must be a tensor or a (x_fp8, scales) pair")
            data, scales = x
            _need(isinstance(data, torch.Tensor) and data.dtype in FP8_DTYPES, TypeError,
                  f"x[0] (FP8 data) must be a float8 tensor, got {getattr(data, 'dtype', type(data))}")
            _need(caps.fp8, TypeError, f"the {name} backend does not take FP8 rows")
            _need(isinstance(scales, torch.Tensor) and scales.dtype == torch.float32, TypeError,
                  f"x[1] (FP8 scales) must be a float32 tensor, got {getattr(scales, 'dtype', type(scales))}")
            _need(self.hidden % FP8_BLOCK == 0, ValueError,
                  f"FP8 dispatch needs hidden divisible by {FP8_BLOCK}, got hidden={self.hidden}")
            _need(scales.dim() == 2 and scales.shape == (data.shape[0], self.hidden // FP8_BLOCK), ValueError,
                  f"x[1] (FP8 scales) must have shape [{data.shape[0]}, {self.hidden // FP8_BLOCK}], got {tuple(scales.shape)}")
            _need(scales.is_contiguous(), ValueError, "x[1] (FP8 scales) must be contiguous")
            _need(scales.device == data.device, ValueError, "x[1] (FP8 scales) must be on x's device")
        else:
            data, scales = x, None
            _need(isinstance(data, torch.Tensor), TypeError, f"x must be a torch.Tensor, got {type(data).__name__}")
            _need(data.dtype in ROW_DTYPES, TypeError,
                  f"x must be float32, bfloat16 or float16 (or an FP8 (data, scales) pair), got {data.dtype}")
            _need(data.dtype in caps.row_dtypes, TypeError,
                  f"the {name} backend moves rows of {_names(caps.row_dtypes)} (or FP8 pairs), got {data.dtype}: "
                  "cast x, or use comm.backend: torch for other dtypes")
        _need(data.dim() == 2 and data.shape[1] == self.hidden, ValueError,
              f"x must have shape [num_tokens, {self.hidden}], got {tuple(data.shape)}")
        _need(data.is_contiguous(), ValueError, "x must be contiguous")
        _need(data.shape[0] <= self.cfg.comm.max_tokens_per_rank, ValueError,
              f"x has {data.shape[0]} tokens, more than comm.max_tokens_per_rank={self.cfg.comm.max_tokens_per_rank} "
              "the buffer was sized for")
        return data, scales

    def _check_routing(self, data, topk_idx, topk_weights):
        T = data.shape[0]
        _need(isinstance(topk_idx, torch.Tensor), TypeError, "topk_idx must be a torch.Tensor")
        _need(topk_idx.dtype == torch.int64, TypeError, f"topk_idx must be int64, got {topk_idx.dtype}")
        _need(topk_idx.dim() == 2 and topk_idx.shape[0] == T, ValueError,
              f"topk_idx must have shape [{T}, K], got {tuple(topk_idx.shape)}")
        _need(topk_idx.device == data.device, ValueError, f"topk_idx is on {topk_idx.device}, x on {data.device}")
        _need(topk_idx.is_contiguous(), ValueError, "topk_idx must be contiguous")
        K = topk_idx.shape[1]
        _need(self._caps.max_topk is None or K <= self._caps.max_topk, ValueError,
              f"the {self._backend.name} backend supports topk <= {self._caps.max_topk}, got {K}")
        if topk_weights is not None:
            _need(isinstance(topk_weights, torch.Tensor), TypeError, "topk_weights must be a torch.Tensor")
            _need(topk_weights.dtype == torch.float32, TypeError, f"topk_weights must be float32, got {topk_weights.dtype}")
            _need(topk_weights.shape == topk_idx.shape, ValueError,
                  f"topk_weights must have topk_idx's shape {tuple(topk_idx.shape)}, got {tuple(topk_weights.shape)}")
            _need(topk_weights.device == data.device, ValueError, "topk_weights must be on x's device")
            _need(topk_weights.is_contiguous(), ValueError, "topk_weights must be contiguous")
        if self._full_validation and topk_idx.numel():
            lo, hi = torch.stack(torch.aminmax(topk_idx)).tolist()  # opt-in: one host sync
            _need(lo >= -1 and hi < self.num_experts, ValueError,
                  f"topk_idx values must lie in [-1, {self.num_experts}), got min {lo}, max {hi}")
        elif not self._caps.checks_expert_ids:
            self._index_check.record(topk_idx)

    def _check_handle(self, handle, num_tokens=None, num_rows=None):
        _need(isinstance(handle, Handle), TypeError, f"handle must be a Handle from dispatch, got {type(handle).__name__}")
        _need(handle.backend == self._backend.name, TypeError,
              f"handle was made by the {handle.backend} backend, this buffer uses {self._backend.name}")
        _need(handle.num_experts == self.num_experts, ValueError, "handle comes from a buffer with another expert count")
        if num_tokens is not None:
            _need(handle.num_tokens == num_tokens, ValueError,
                  f"handle was made for {handle.num_tokens} tokens, x has {num_tokens}")
        if num_rows is not None:
            _need(handle.num_recv == num_rows, ValueError,
                  f"x must have the {handle.num_recv} rows that dispatch delivered, got {num_rows}")

    def _async(self, async_op):
        return self.cfg.overlap.async_dispatch if async_op is None else bool(async_op)

    # ---------------------------------------------------------------- API
    def dispatch(self, x: XInput, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, *, handle: Optional[Handle] = None,
                 async_op: Optional[bool] = None, layout: Optional[str] = None,
                 expert_alignment: int = 1):
        """Send each token to the ranks that own its experts. With `handle`, reuse that dispatch's
        layout (cached mode; topk_idx may be omitted). With async_op, outputs are valid once
        `result.event.current_stream_wait()` has been called.

        layout "rank" (the default): one row per (token, destination rank), ordered by source rank ->
        DispatchResult. layout "expert": one row per (token, local expert), grouped by expert, each
        segment padded to a multiple of `expert_alignment` -> ExpertDispatchResult (what a grouped
        GEMM takes; combine then takes rows in the same layout). A cached dispatch uses its handle's."""
        self._raise_pending()
        data, scales = self._check_rows(x)
        cached = handle is not None
        if cached:
            self._check_handle(handle, num_tokens=data.shape[0])
            topk_idx = handle.topk_idx if topk_idx is None else topk_idx
            made = "expert" if handle.expert is not None else "rank"
            _need(layout in (None, made), ValueError,
                  f"the handle comes from a {made}-major dispatch; a cached dispatch keeps its layout, got layout={layout!r}")
            layout = made
        layout = layout or "rank"
        _need(layout in LAYOUTS, ValueError, f"layout must be one of {LAYOUTS}, got {layout!r}")
        _need(isinstance(expert_alignment, int) and expert_alignment >= 1, ValueError,
              f"expert_alignment must be a positive int, got {expert_alignment!r}")
        alignment = None
        if layout == "expert":
            alignment = handle.expert.alignment if cached else expert_alignment
        _need(topk_idx is not None, ValueError, "topk_idx is required unless a handle is given")
        if not cached:
            self._check_routing(data, topk_idx, topk_weights)
        async_op = self._async(async_op)
        grad = torch.is_grad_enabled() and (data.requires_grad or (topk_weights is not None and topk_weights.requires_grad))
        if grad:
            _need(scales is None, TypeError, "FP8 dispatch is not differentiable: pass a BF16/float32 x for training")
            rx, rw, out = DispatchFn.apply(self._backend, data, topk_weights, topk_idx, handle, async_op, alignment)
        else:
            with torch.no_grad():
                if alignment is None:
                    out = self._backend.dispatch(data, scales, topk_idx, topk_weights, handle, async_op)
                else:
                    out = self._backend.dispatch_expert(data, scales, topk_idx, topk_weights, handle, async_op,
                                                        alignment)
            rx, rw = out.x, out.topk_weights
        if out.handle.exact and not cached:  # the host has waited already: surface a bad id now
            self._raise_pending()
        rows = (rx, out.scales) if scales is not None else rx
        if out.event is not None:
            out.event._check = self.check_finished
        if alignment is not None:
            return ExpertDispatchResult(x=rows, topk_weights=rw, handle=out.handle, event=out.event)
        return DispatchResult(x=rows, topk_idx=out.topk_idx, topk_weights=rw, handle=out.handle, event=out.event)

    def combine(self, x: torch.Tensor, handle: Handle, topk_weights: Optional[torch.Tensor] = None, *,
                async_op: Optional[bool] = None, weights_local_only: bool = True):
        """Sum, for each original token, the rows the ranks it reached send back: [T, H]. x is laid out
        as the handle's dispatch delivered it (rank-major [R, H] or expert-major [N, H]).

        With topk_weights ([R, K] float32, e.g. the dispatched weights after the experts changed
        them), also returns their per-token sum over ranks, [T, K]: (y, weights). Each (token, k) counts
        on the rank owning expert k only, unless weights_local_only=False (then every entry sent back is
        summed, as DeepEP's combine does). Async calls append the event: (y, event) or (y, weights, event).

        A rank-major x may also be cut to the valid rows of a worst-case-sized dispatch (at least
        sum(handle.recv_counts): that host count is read, waiting for its pinned copy only)."""
        self._raise_pending()
        _need(isinstance(x, torch.Tensor), TypeError, f"x must be a torch.Tensor, got {type(x).__name__}")
        _need(x.dtype in ROW_DTYPES, TypeError, f"combine's x must be float32, bfloat16 or float16, got {x.dtype}")
        _need(x.dtype in self._caps.combine_dtypes, TypeError,
              f"the {self._backend.name} backend combines rows of {_names(self._caps.combine_dtypes)}, got {x.dtype}: "
              "cast the expert output, or use comm.backend: torch")
        _need(x.dim() == 2 and x.shape[1] == self.hidden, ValueError,
              f"x must have shape [num_rows, {self.hidden}], got {tuple(x.shape)}")
        _need(x.is_contiguous(), ValueError, "x must be contiguous")
        expert = handle.expert is not None if isinstance(handle, Handle) else False
        self._check_handle(handle)
        if not expert and x.shape[0] != handle.num_recv:
            used = sum(handle.recv_counts) if not handle.exact else handle.num_recv
            _need(used <= x.shape[0] <= handle.num_recv, ValueError,
                  f"x must have the {handle.num_recv} rows that dispatch delivered (or at least the {used} valid "
                  f"ones), got {x.shape[0]}")
        if expert and x.shape[0] != handle.expert.num_rows:
            # rows may be cut to the segments in use (a worst-case-sized dispatch): never fewer, as the
            # kernels read every segment row (the host counts: waits for their pinned copy only)
            used = sum(padded(handle.tokens_per_expert, handle.expert.alignment))
            _need(used <= x.shape[0] <= handle.expert.num_rows, ValueError,
                  f"x must have the {handle.expert.num_rows} expert-major rows that dispatch delivered (or at "
                  f"least the {used} its expert segments use), got {x.shape[0]}")
        _need(handle.is_token_in_rank.device == x.device, ValueError,
              f"x is on {x.device} but the handle's dispatch ran on {handle.is_token_in_rank.device}")
        if topk_weights is not None:
            _need(isinstance(topk_weights, torch.Tensor) and topk_weights.dtype == torch.float32, TypeError,
                  "combine's topk_weights must be a float32 tensor")
            want = (x.shape[0],) if expert else (x.shape[0], handle.recv_topk_idx.shape[1])
            _need(tuple(topk_weights.shape) == want, ValueError,
                  f"combine's topk_weights must have shape {want}, got {tuple(topk_weights.shape)}")
            _need(topk_weights.device == x.device, ValueError, "combine's topk_weights must be on x's device")
        is_async = self._async(async_op)
        if torch.is_grad_enabled() and x.requires_grad:
            y, event = CombineFn.apply(self._backend, x, handle, is_async)
        else:
            with torch.no_grad():
                combine = self._backend.combine_expert if expert else self._backend.combine
                y, event = combine(x, handle, is_async)
        out = (y,)
        if topk_weights is not None:
            if event is not None:  # the weights' exchange goes after the rows', as on one stream
                event.current_stream_wait()
                event = None
            with torch.no_grad():
                if expert:
                    _need(weights_local_only, ValueError,
                          "weights_local_only=False takes rank-major weights; an expert-major row has one weight")
                    weights, event = self._backend.combine_weights_expert(topk_weights, handle, is_async)
                else:
                    weights, event = self._backend.combine_weights(topk_weights, handle, is_async,
                                                                   weights_local_only)
            out += (weights,)
        if event is not None:
            event._check = self.check_finished
        if is_async:
            out += (event,)
        return out if len(out) > 1 else y

    def stats(self, reset: bool = False) -> dict:
        """What this buffer's exchanges cost and moved since the last reset (comm.stats: true): per op
        calls and times (device times from CUDA events, host times on CPU), bytes sent and received
        per domain (local = to itself, remote = to other ranks), rows per destination rank and per
        local expert with their max/mean imbalance, and timeouts. Waits for the exchanges still in
        flight, so call it at report time, not per step. See ep_plugin.telemetry."""
        _need(self._stats is not None, RuntimeError,
              "stats are off for this buffer: set comm.stats: true in its config")
        return self._stats.summary(reset=reset)

    # ---------------------------------------------------------------- errors
    def _raise_pending(self) -> None:
        self._backend.check()
        self._index_check.raise_if_seen()

    def check_finished(self) -> None:
        """Raise what finished work reported (EPTimeoutError naming the missing ranks, or ValueError for
        expert ids out of range), without waiting."""
        self._backend.check()
        self._index_check.raise_if_seen()

    def check(self) -> None:
        """Wait for this rank's queued work on the current stream, then raise what it reported."""
        self._backend.wait_pending()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()
        self.check_finished()

    synchronize = check

    def close(self) -> None:
        self._backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)
