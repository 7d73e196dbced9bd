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

The low-latency calls (`low_latency_dispatch`/`low_latency_combine`, docs/LOW_LATENCY.md) go through
an engine of their own, built at the first such call (a collective) by `make_low_latency`; EPBuffer
validates their arguments the same way before the engine sees them.
"""
from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .autograd import CombineFn, DispatchFn
from .expert_major import padded
from .backends import make_backend
from .backends.registry import make_low_latency
from .telemetry import CommStats, RecordingBackend
from .types import (FP8_BLOCK, FP8_DTYPES, ROW_DTYPES, DispatchResult, EPEvent, ExpertDispatchResult, Handle,
                    LowLatencyHandle, XInput)

LAYOUTS = ("rank", "expert")
LOW_LATENCY_MAX_TOPK = 32  # the largest top-k the low-latency calls take (an engine may declare fewer: max_topk)
_buffer_ids = itertools.count(1)  # tells the low-latency handles of one buffer from another's


def need(cond: bool, exc, msg: str):
    """Raise exc(msg) unless cond (the argument checks of EPBuffer and ep_plugin.deep_ep)."""
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


# torch.cuda.current_device() minus its lazy-init check: a CUDA tensor in hand means CUDA is initialised
_cuda_device = getattr(torch._C, "_cuda_getDevice", None) or (lambda: torch.cuda.current_device())


def call_form(*args):
    """What the low-latency checks depend on, for tensors (dtype, shape, device, contiguity) and plain
    values (ints, bools, None; typed, so True and 1 differ); None when an argument is of another kind
    (then the full checks run and raise). The current CUDA device counts too, for a CUDA first argument."""
    out = []
    append = out.append
    for a in args:
        if isinstance(a, torch.Tensor):
            append((a.dtype, a.shape, a.device, a.is_contiguous()))
        elif a is None or isinstance(a, int):
            append((type(a), a))
        else:
            return None
    if args and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
        append(_cuda_device())
    return tuple(out)


class _RecvHook:
    """The receive half of a low-latency call, handed to the caller: enqueues it on the current stream
    the first time it is called; a second call is an error (the engine's receive runs once)."""

    def __init__(self, recv, what: str):
        self._recv, self._what = recv, what

    def __call__(self) -> None:
        if self._recv is None:
            raise RuntimeError(f"this {self._what} receive hook has run already: each hook runs once")
        recv, self._recv = self._recv, None
        recv()


class EPBuffer:
    """Dispatch tokens to the ranks owning their top-k experts, and combine the results back.

    group: the expert-parallel ProcessGroup (None = WORLD). cfg: EPConfig, dict, YAML path or preset
    name. hidden: row width H. Rank r owns experts [r*E/W, (r+1)*E/W). The buffer owns the backend's
    communication memory: call close() (or use it as a context manager) before destroying the group;
    handles must not be used after close().
    """

    def __init__(self, group=None, cfg=None, hidden: int = None, *, num_experts: Optional[int] = None):
        from .config import load_config

        need(dist.is_available() and dist.is_initialized(), RuntimeError,
              "torch.distributed must be initialized before creating an EPBuffer")
        need(isinstance(hidden, int) and hidden > 0, ValueError, f"hidden must be a positive int, got {hidden!r}")
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
        self._id = next(_buffer_ids)
        self._low_latency = None          # the engine, built at the first low-latency call
        # Forms (dtypes, shapes, devices, contiguity, flags: call_form) of the calls whose argument
        # checks passed, per kind of call: the checks depend on the form only, so a repeated form skips
        # them -- host time before the first kernel (the expert-id and handle checks run every call).
        self._checked_forms: set = set()
        self._low_latency_mask: tuple = ()
        self._closed = False

    @property
    def backend_name(self) -> str:
        return self._backend.name

    @property
    def low_latency_backend_name(self) -> Optional[str]:
        """The low-latency engine's name ("nvshmem" or "torch"), None until the first low-latency call
        builds it."""
        return self._low_latency.name if self._low_latency is not None else None

    @property
    def capabilities(self):
        """What the chosen backend takes (backends.base.Capabilities): row and combine dtypes, FP8, top-k."""
        return self._caps

    # ---------------------------------------------------------------- validation
    def _check_rows(self, x: XInput):
        if isinstance(x, torch.Tensor):
            if ("rows", call_form(x)) in self._checked_forms:
                return x, None
        elif isinstance(x, (tuple, list)) and len(x) == 2 and ("rows", call_form(*x)) in self._checked_forms:
            return x[0], x[1]
        caps, name = self._caps, self._backend.name
        if isinstance(x, (tuple, list)):
            need(len(x) == 2, TypeError, "x must be a tensor or a (x_fp8, scales) pair")
            data, scales = x
            need(isinstance(data, torch.Tensor) and data.dtype in FP8_DTYPES, TypeError,
                  f"x[0] (FP8 data) must be a float8 tensor, got {getattr(data, 'dtype', type(data))}")
            need(caps.fp8, TypeError, f"the {name} backend does not take FP8 rows")
            need(isinstance(scales, torch.Tensor) and scales.dtype == torch.float32, TypeError,
                  f"x[1] (FP8 scales) must be a float32 tensor, got {getattr(scales, 'dtype', type(scales))}")
            need(self.hidden % FP8_BLOCK == 0, ValueError,
                  f"FP8 dispatch needs hidden divisible by {FP8_BLOCK}, got hidden={self.hidden}")
            need(scales.dim() == 2 and scales.shape == (data.shape[0], self.hidden // FP8_BLOCK), ValueError,
                  f"x[1] (FP8 scales) must have shape [{data.shape[0]}, {self.hidden // FP8_BLOCK}], got {tuple(scales.shape)}")
            need(scales.is_contiguous(), ValueError, "x[1] (FP8 scales) must be contiguous")
            need(scales.device == data.device, ValueError, "x[1] (FP8 scales) must be on x's device")
        else:
            data, scales = x, None
            need(isinstance(data, torch.Tensor), TypeError, f"x must be a torch.Tensor, got {type(data).__name__}")
            need(data.dtype in ROW_DTYPES, TypeError,
                  f"x must be float32, bfloat16 or float16 (or an FP8 (data, scales) pair), got {data.dtype}")
            need(data.dtype in caps.row_dtypes, TypeError,
                  f"the {name} backend moves rows of {_names(caps.row_dtypes)} (or FP8 pairs), got {data.dtype}: "
                  "cast x, or use comm.backend: torch for other dtypes")
        need(data.dim() == 2 and data.shape[1] == self.hidden, ValueError,
              f"x must have shape [num_tokens, {self.hidden}], got {tuple(data.shape)}")
        need(data.is_contiguous(), ValueError, "x must be contiguous")
        need(data.shape[0] <= self.cfg.comm.max_tokens_per_rank, ValueError,
              f"x has {data.shape[0]} tokens, more than comm.max_tokens_per_rank={self.cfg.comm.max_tokens_per_rank} "
              "the buffer was sized for")
        self._remember_form(("rows", call_form(data) if scales is None else call_form(data, scales)))
        return data, scales

    def _remember_form(self, key) -> None:
        """key: (kind of call, call_form(...)); a form call_form could not describe is not kept."""
        if key[1] is not None and len(self._checked_forms) < 256:
            self._checked_forms.add(key)

    def _check_routing(self, data, topk_idx, topk_weights):
        key = ("routing", call_form(data, topk_idx, topk_weights))
        if key not in self._checked_forms:
            self._check_routing_args(data, topk_idx, topk_weights)
            self._remember_form(key)
        self._check_expert_ids(topk_idx, self._caps.checks_expert_ids)

    def _check_routing_args(self, data, topk_idx, topk_weights):
        T = data.shape[0]
        need(isinstance(topk_idx, torch.Tensor), TypeError, "topk_idx must be a torch.Tensor")
        need(topk_idx.dtype == torch.int64, TypeError, f"topk_idx must be int64, got {topk_idx.dtype}")
        need(topk_idx.dim() == 2 and topk_idx.shape[0] == T, ValueError,
              f"topk_idx must have shape [{T}, K], got {tuple(topk_idx.shape)}")
        need(topk_idx.device == data.device, ValueError, f"topk_idx is on {topk_idx.device}, x on {data.device}")
        need(topk_idx.is_contiguous(), ValueError, "topk_idx must be contiguous")
        K = topk_idx.shape[1]
        need(self._caps.max_topk is None or K <= self._caps.max_topk, ValueError,
              f"the {self._backend.name} backend supports topk <= {self._caps.max_topk}, got {K}")
        if topk_weights is not None:
            need(isinstance(topk_weights, torch.Tensor), TypeError, "topk_weights must be a torch.Tensor")
            need(topk_weights.dtype == torch.float32, TypeError, f"topk_weights must be float32, got {topk_weights.dtype}")
            need(topk_weights.shape == topk_idx.shape, ValueError,
                  f"topk_weights must have topk_idx's shape {tuple(topk_idx.shape)}, got {tuple(topk_weights.shape)}")
            need(topk_weights.device == data.device, ValueError, "topk_weights must be on x's device")
            need(topk_weights.is_contiguous(), ValueError, "topk_weights must be contiguous")

    def _check_expert_ids(self, topk_idx: torch.Tensor, checked_by_engine: bool) -> None:
        """Ids outside [-1, E): on the host with comm.validate: full (one sync), else queued on the device
        (on CPU: raised now) unless the engine checks them itself."""
        if self._full_validation and topk_idx.numel():
            lo, hi = torch.stack(torch.aminmax(topk_idx)).tolist()  # opt-in: one host sync
            need(lo >= -1 and hi < self.num_experts, ValueError,
                  f"topk_idx values must lie in [-1, {self.num_experts}), got min {lo}, max {hi}")
        elif not checked_by_engine:
            self._index_check.record(topk_idx)

    def _check_handle(self, handle, num_tokens=None, num_rows=None):
        need(isinstance(handle, Handle), TypeError, f"handle must be a Handle from dispatch, got {type(handle).__name__}")
        need(handle.backend == self._backend.name, TypeError,
              f"handle was made by the {handle.backend} backend, this buffer uses {self._backend.name}")
        need(handle.num_experts == self.num_experts, ValueError, "handle comes from a buffer with another expert count")
        if num_tokens is not None:
            need(handle.num_tokens == num_tokens, ValueError,
                  f"handle was made for {handle.num_tokens} tokens, x has {num_tokens}")
        if num_rows is not None:
            need(handle.num_recv == num_rows, ValueError,
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
            need(layout in (None, made), ValueError,
                  f"the handle comes from a {made}-major dispatch; a cached dispatch keeps its layout, got layout={layout!r}")
            layout = made
        layout = layout or "rank"
        need(layout in LAYOUTS, ValueError, f"layout must be one of {LAYOUTS}, got {layout!r}")
        need(isinstance(expert_alignment, int) and expert_alignment >= 1, ValueError,
              f"expert_alignment must be a positive int, got {expert_alignment!r}")
        alignment = None
        if layout == "expert":
            alignment = handle.expert.alignment if cached else expert_alignment
        need(topk_idx is not None, ValueError, "topk_idx is required unless a handle is given")
        if not cached:
            self._check_routing(data, topk_idx, topk_weights)
        async_op = self._async(async_op)
        grad = torch.is_grad_enabled() and (data.requires_grad or (topk_weights is not None and topk_weights.requires_grad))
        if grad:
            need(scales is None, TypeError, "FP8 dispatch is not differentiable: pass a BF16/float32 x for training")
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
        key = ("combine", call_form(x))
        if key not in self._checked_forms:
            need(isinstance(x, torch.Tensor), TypeError, f"x must be a torch.Tensor, got {type(x).__name__}")
            need(x.dtype in ROW_DTYPES, TypeError, f"combine's x must be float32, bfloat16 or float16, got {x.dtype}")
            need(x.dtype in self._caps.combine_dtypes, TypeError,
                  f"the {self._backend.name} backend combines rows of {_names(self._caps.combine_dtypes)}, got "
                  f"{x.dtype}: cast the expert output, or use comm.backend: torch")
            need(x.dim() == 2 and x.shape[1] == self.hidden, ValueError,
                  f"x must have shape [num_rows, {self.hidden}], got {tuple(x.shape)}")
            need(x.is_contiguous(), ValueError, "x must be contiguous")
            self._remember_form(key)
        expert = handle.expert is not None if isinstance(handle, Handle) else False
        self._check_handle(handle)
        if not expert and x.shape[0] != handle.num_recv:
            used = sum(handle.recv_counts) if not handle.exact else handle.num_recv
            need(used <= x.shape[0] <= handle.num_recv, ValueError,
                  f"x must have the {handle.num_recv} rows that dispatch delivered (or at least the {used} valid "
                  f"ones), got {x.shape[0]}")
        if expert and x.shape[0] != handle.expert.num_rows:
            # rows may be cut to the segments in use (a worst-case-sized dispatch): never fewer, as the
            # kernels read every segment row (the host counts: waits for their pinned copy only)
            used = sum(padded(handle.tokens_per_expert, handle.expert.alignment))
            need(used <= x.shape[0] <= handle.expert.num_rows, ValueError,
                  f"x must have the {handle.expert.num_rows} expert-major rows that dispatch delivered (or at "
                  f"least the {used} its expert segments use), got {x.shape[0]}")
        need(handle.is_token_in_rank.device == x.device, ValueError,
              f"x is on {x.device} but the handle's dispatch ran on {handle.is_token_in_rank.device}")
        if topk_weights is not None:
            need(isinstance(topk_weights, torch.Tensor) and topk_weights.dtype == torch.float32, TypeError,
                  "combine's topk_weights must be a float32 tensor")
            want = (x.shape[0],) if expert else (x.shape[0], handle.recv_topk_idx.shape[1])
            need(tuple(topk_weights.shape) == want, ValueError,
                  f"combine's topk_weights must have shape {want}, got {tuple(topk_weights.shape)}")
            need(topk_weights.device == x.device, ValueError, "combine's topk_weights must be on x's device")
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
                    need(weights_local_only, ValueError,
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

    # ---------------------------------------------------------------- low-latency calls
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, *, use_fp8: bool = True,
                             round_scale: bool = False, async_op: bool = False,
                             return_recv_hook: Optional[bool] = None,
                             recv_stats: Optional[torch.Tensor] = None):
        """Send a copy of each token to each of its experts, into a fixed expert-major layout
        (docs/LOW_LATENCY.md): -> (recv_x, recv_count, handle, event, hook).

        x [T, H] BF16 with T <= comm.low_latency.max_tokens_per_rank (M); topk_idx [T, K] int64, -1 =
        routed nowhere. recv_x is BF16 [E_l, W*M, H], or with use_fp8 the pair (float8_e4m3fn data
        [E_l, W*M, H], float32 scales [E_l, W*M, H/128], the transpose of a contiguous [E_l, H/128, W*M]),
        cast per 128 channels (round_scale: power-of-two scales). Local expert e's rows are packed from
        row 0, by source rank, then token index; recv_count [E_l] int32 counts them. recv_stats ([E_l]
        int32) gets recv_count added on the device.

        return_recv_hook (default overlap.recv_hook): return before the receive and hand back `hook`,
        which enqueues it on the current stream (once); the outputs and the handle are valid after it.
        async_op: `event` is an EPEvent recorded on the current stream after the call. The first
        low-latency call of a buffer builds its engine: a collective over the group."""
        self._raise_pending_low_latency()
        form = call_form(x, topk_idx, recv_stats, use_fp8, round_scale)
        # bool is final: `type(v) is bool` is isinstance, without a call on the hot path
        hook = return_recv_hook if type(return_recv_hook) is bool else self._recv_hook_wanted(return_recv_hook)
        if type(async_op) is not bool:
            raise TypeError("async_op must be a bool")
        engine = self._low_latency
        if engine is None:
            engine = self._low_latency_engine()
        if form is None or ("ll_dispatch", form) not in self._checked_forms:
            self._check_low_latency_dispatch(x, topk_idx, use_fp8, round_scale, recv_stats)
            limit = engine.max_topk  # an engine sized for a top-k when it was built (None: any)
            need(limit is None or topk_idx.shape[1] <= limit, ValueError,
                  f"the {engine.name} low-latency engine of this buffer takes topk <= {limit} (sized from moe.topk), "
                  f"got {topk_idx.shape[1]}")
            self._remember_form(("ll_dispatch", form))
        return self._ll_dispatch_run(engine, x, topk_idx, use_fp8, round_scale, async_op, hook, recv_stats)

    def _ll_dispatch_run(self, engine, x, topk_idx, use_fp8: bool, round_scale: bool, async_op: bool, hook: bool,
                         recv_stats):
        """low_latency_dispatch after its argument checks. ep_plugin.deep_ep calls it directly for a call of a
        form that passed them, after _raise_pending_low_latency: its own form covers every input the checks
        read, so checking again would only cost host time."""
        if self._full_validation or not engine.checks_expert_ids:
            self._check_expert_ids(topk_idx, engine.checks_expert_ids)
        if x.requires_grad:  # the engines' outputs never track gradients
            with torch.no_grad():
                recv_x, recv_count, handle, recv = engine.dispatch(
                    x, topk_idx, use_fp8=use_fp8, round_scale=round_scale, recv_stats=recv_stats, hook=hook)
        else:
            recv_x, recv_count, handle, recv = engine.dispatch(
                x, topk_idx, use_fp8=use_fp8, round_scale=round_scale, recv_stats=recv_stats, hook=hook)
        handle.buffer_id = self._id
        return (recv_x, recv_count, handle, self._low_latency_event(x) if async_op else None,
                self._wrap_hook(recv, hook, "low_latency_dispatch"))

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, *, async_op: bool = False,
                            return_recv_hook: Optional[bool] = None, out: Optional[torch.Tensor] = None):
        """Send the expert outputs back and sum them per token, weighted: -> (y, event, hook).

        x: BF16 [E_l, W*M, H] in the layout of `handle`'s dispatch (only rows below recv_count[e] are
        read); topk_idx and topk_weights (float32): that dispatch's [T, K]. y [T, H] BF16 (or `out`):
        y[t] = sum over k ascending of w[t, k] * row(t, k) in float32 (unfused multiply, then add), cast
        to BF16 at the end; ids -1 and left-out ranks contribute nothing. return_recv_hook and
        async_op as for low_latency_dispatch."""
        self._raise_pending_low_latency()
        form = call_form(x, topk_idx, topk_weights, out)
        # the handle is checked on every call; the tensors' checks once per form of call
        if (form is None or ("ll_combine", form) not in self._checked_forms
                or not self._same_low_latency_handle(handle, topk_idx)):
            self._check_low_latency_combine(x, topk_idx, topk_weights, handle, out)
            self._remember_form(("ll_combine", form))
        hook = return_recv_hook if type(return_recv_hook) is bool else self._recv_hook_wanted(return_recv_hook)
        if type(async_op) is not bool:
            raise TypeError("async_op must be a bool")
        return self._ll_combine_run(self._low_latency, x, topk_idx, topk_weights, handle, out, async_op, hook)

    def _ll_combine_run(self, engine, x, topk_idx, topk_weights, handle, out, async_op: bool, hook: bool):
        """low_latency_combine after its argument checks (the handle's included); see _ll_dispatch_run."""
        if self._full_validation or not engine.checks_expert_ids:
            self._check_expert_ids(topk_idx, engine.checks_expert_ids)
        if x.requires_grad:
            with torch.no_grad():
                y, recv = engine.combine(x, topk_idx, topk_weights, handle, out=out, hook=hook)
        else:
            y, recv = engine.combine(x, topk_idx, topk_weights, handle, out=out, hook=hook)
        return y, self._low_latency_event(x) if async_op else None, self._wrap_hook(recv, hook, "low_latency_combine")

    def set_low_latency_mask(self, ranks: Sequence[int]) -> None:
        """Leave `ranks` (of this buffer's group) out of the low-latency calls; an empty list clears the
        mask. A left-out rank neither receives from nor is waited for by the others, and rows to it
        count as routed nowhere (docs/LOW_LATENCY.md). Local to this rank: no collective."""
        need(not isinstance(ranks, (str, bytes)) and hasattr(ranks, "__iter__"), TypeError,
              f"ranks must be a list of ints, got {type(ranks).__name__}")
        ranks = list(ranks)
        for r in ranks:
            need(isinstance(r, int) and not isinstance(r, bool), TypeError,
                  f"ranks must be ints (ranks of the EP group), got {r!r}")
            need(0 <= r < self.world, ValueError, f"ranks must lie in [0, {self.world}), got {r}")
        self._low_latency_mask = tuple(sorted(set(ranks)))
        if self._low_latency is not None:
            self._low_latency.set_mask(list(self._low_latency_mask))

    def _same_low_latency_handle(self, handle, topk_idx) -> bool:
        """The handle checks of _check_low_latency_combine, for a call whose tensors kept their form."""
        # one engine per buffer: a handle of this buffer has its engine, hidden, experts and M
        if type(handle) is not LowLatencyHandle or handle.buffer_id != self._id:
            return False
        T, K = topk_idx.shape
        return handle.num_tokens == T and handle.topk == K

    def _low_latency_engine(self):
        if self._low_latency is None:
            self._low_latency = make_low_latency(self.group, self.cfg, self.hidden, self.num_experts)
            if self._low_latency_mask:
                self._low_latency.set_mask(list(self._low_latency_mask))
        return self._low_latency

    def _raise_pending_low_latency(self) -> None:
        if self._closed:
            raise RuntimeError("this EPBuffer is closed")
        if self._low_latency is not None:
            self._low_latency.check()
        self._index_check.raise_if_seen()

    def _recv_hook_wanted(self, return_recv_hook) -> bool:
        if return_recv_hook is None:
            return bool(self.cfg.overlap.recv_hook)
        need(isinstance(return_recv_hook, bool), TypeError,
              f"return_recv_hook must be a bool or None, got {return_recv_hook!r}")
        return return_recv_hook

    def _low_latency_event(self, like: torch.Tensor) -> EPEvent:
        """The event of an async_op call: recorded on the current stream after the call's work."""
        event = None
        if like.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(like.device))
        return EPEvent(cuda_event=event, check=self.check_finished)

    @staticmethod
    def _wrap_hook(recv, hook: bool, what: str):
        if not hook:
            assert recv is None, f"the low-latency engine returned a receive hook for a {what} without one"
            return None
        assert callable(recv), f"the low-latency engine returned no receive hook for {what}"
        return _RecvHook(recv, what)

    def _check_low_latency_device(self, x: torch.Tensor) -> None:
        pg = dist.get_backend(self.group)
        if x.is_cuda:
            need("nccl" in pg, ValueError, f"x is on {x.device}, but the group's backend {pg!r} moves CPU tensors")
            need(x.device.index == torch.cuda.current_device(), ValueError,
                  f"x is on {x.device}, but the current CUDA device is cuda:{torch.cuda.current_device()}")
        else:
            need(x.device.type == "cpu" and pg != "nccl", ValueError,
                  f"x is on {x.device}, but the group's backend {pg!r} moves "
                  f"{'CUDA tensors of the current device' if pg == 'nccl' else 'CPU tensors'}")

    def _check_low_latency_dispatch(self, x, topk_idx, use_fp8, round_scale, recv_stats) -> None:
        M, H = self.cfg.comm.low_latency.max_tokens_per_rank, self.hidden
        need(isinstance(x, torch.Tensor), TypeError, f"x must be a torch.Tensor, got {type(x).__name__}")
        need(x.dtype == torch.bfloat16, TypeError,
              f"low_latency_dispatch takes BF16 x, got {x.dtype} (FP8 is cast inside: use_fp8=True)")
        need(x.dim() == 2 and x.shape[1] == H, ValueError, f"x must have shape [num_tokens, {H}], got {tuple(x.shape)}")
        need(x.is_contiguous(), ValueError, "x must be contiguous")
        need(x.shape[0] <= M, ValueError,
              f"x has {x.shape[0]} tokens, more than comm.low_latency.max_tokens_per_rank={M}")
        need(H % 8 == 0, ValueError,
              f"the low-latency calls need rows of a multiple of 16 bytes (hidden % 8 == 0), got hidden={H}")
        need(isinstance(use_fp8, bool), TypeError, f"use_fp8 must be a bool, got {use_fp8!r}")
        need(isinstance(round_scale, bool), TypeError, f"round_scale must be a bool, got {round_scale!r}")
        need(not use_fp8 or H % FP8_BLOCK == 0, ValueError,
              f"use_fp8 needs hidden divisible by {FP8_BLOCK} (one scale per {FP8_BLOCK} channels), got "
              f"hidden={H}: pass use_fp8=False")
        need(use_fp8 or not round_scale, ValueError, "round_scale applies to the FP8 cast: it needs use_fp8=True")
        self._check_low_latency_device(x)
        self._check_low_latency_topk(topk_idx, x.shape[0], None, x.device)
        if recv_stats is not None:
            E_l = self.num_local_experts
            need(isinstance(recv_stats, torch.Tensor), TypeError,
                  f"recv_stats must be a torch.Tensor, got {type(recv_stats).__name__}")
            need(recv_stats.dtype == torch.int32, TypeError, f"recv_stats must be int32, got {recv_stats.dtype}")
            need(tuple(recv_stats.shape) == (E_l,), ValueError,
                  f"recv_stats must have shape [{E_l}] (the local experts), got {tuple(recv_stats.shape)}")
            need(recv_stats.device == x.device, ValueError, f"recv_stats is on {recv_stats.device}, x on {x.device}")
            need(recv_stats.is_contiguous(), ValueError, "recv_stats must be contiguous")

    def _check_low_latency_topk(self, topk_idx, T: int, K: Optional[int], device) -> None:
        need(isinstance(topk_idx, torch.Tensor), TypeError,
              f"topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}")
        need(topk_idx.dtype == torch.int64, TypeError, f"topk_idx must be int64, got {topk_idx.dtype}")
        need(topk_idx.dim() == 2 and topk_idx.shape[0] == T and (K is None or topk_idx.shape[1] == K),
              ValueError, f"topk_idx must have shape [{T}, {'K' if K is None else K}], got {tuple(topk_idx.shape)}")
        need(1 <= topk_idx.shape[1] <= LOW_LATENCY_MAX_TOPK, ValueError,
              f"the low-latency calls take 1 <= topk <= {LOW_LATENCY_MAX_TOPK}, got {topk_idx.shape[1]}")
        need(topk_idx.device == device, ValueError, f"topk_idx is on {topk_idx.device}, x on {device}")
        need(topk_idx.is_contiguous(), ValueError, "topk_idx must be contiguous")

    def _check_low_latency_combine(self, x, topk_idx, topk_weights, handle, out) -> None:
        need(isinstance(handle, LowLatencyHandle), TypeError,
              f"handle must be the LowLatencyHandle of a low_latency_dispatch, got {type(handle).__name__}")
        # one engine per buffer: a handle of this buffer has its engine, hidden, experts and M
        need(handle.buffer_id == self._id, ValueError,
              "handle comes from another EPBuffer's low_latency_dispatch: combine on the buffer that dispatched")
        E_l, W, M, H, T = self.num_local_experts, self.world, handle.max_tokens, self.hidden, handle.num_tokens
        device = handle.src_info.device
        need(isinstance(x, torch.Tensor), TypeError, f"x must be a torch.Tensor, got {type(x).__name__}")
        need(x.dtype == torch.bfloat16, TypeError, f"low_latency_combine takes BF16 x, got {x.dtype}")
        need(tuple(x.shape) == (E_l, W * M, H), ValueError,
              f"x must have the dispatch's shape [{E_l}, {W * M}, {H}] (local experts, ranks * max tokens, "
              f"hidden), got {tuple(x.shape)}")
        need(x.is_contiguous(), ValueError, "x must be contiguous")
        need(x.device == device, ValueError, f"x is on {x.device}, but the handle's dispatch ran on {device}")
        self._check_low_latency_topk(topk_idx, T, handle.topk, device)
        need(isinstance(topk_weights, torch.Tensor), TypeError,
              f"topk_weights must be a torch.Tensor, got {type(topk_weights).__name__}")
        need(topk_weights.dtype == torch.float32, TypeError, f"topk_weights must be float32, got {topk_weights.dtype}")
        need(tuple(topk_weights.shape) == (T, handle.topk), ValueError,
              f"topk_weights must have shape [{T}, {handle.topk}], got {tuple(topk_weights.shape)}")
        need(topk_weights.device == device, ValueError, f"topk_weights is on {topk_weights.device}, x on {device}")
        need(topk_weights.is_contiguous(), ValueError, "topk_weights must be contiguous")
        if out is not None:
            need(isinstance(out, torch.Tensor), TypeError, f"out must be a torch.Tensor, got {type(out).__name__}")
            need(out.dtype == torch.bfloat16, TypeError, f"out must be BF16, got {out.dtype}")
            need(tuple(out.shape) == (T, H), ValueError, f"out must have shape [{T}, {H}], got {tuple(out.shape)}")
            need(out.device == device, ValueError, f"out is on {out.device}, x on {device}")
            need(out.is_contiguous(), ValueError, "out must be contiguous")

    def stats(self, reset: bool = False) -> dict:
        """What this buffer's exchanges cost and moved since the last reset (comm.stats: true): per op
        calls and times (device times from CUDA events, host times on CPU), bytes sent and received
        per domain (local = to itself, remote = to other ranks), rows per destination rank and per
        local expert with their max/mean imbalance, and timeouts. Waits for the exchanges still in
        flight, so call it at report time, not per step. See ep_plugin.telemetry."""
        need(self._stats is not None, RuntimeError,
              "stats are off for this buffer: set comm.stats: true in its config")
        return self._stats.summary(reset=reset)

    # ---------------------------------------------------------------- errors
    def _raise_pending(self) -> None:
        self._backend.check()
        self._index_check.raise_if_seen()

    def check_finished(self) -> None:
        """Raise what finished work reported (EPTimeoutError naming the missing ranks, or ValueError for
        expert ids out of range), without waiting. Covers the low-latency engine too."""
        self._backend.check()
        if self._low_latency is not None:
            self._low_latency.check()
        self._index_check.raise_if_seen()

    def check(self) -> None:
        """Wait for this rank's queued work on the current stream, then raise what it reported."""
        self._backend.wait_pending()
        if self._low_latency is not None:
            self._low_latency.wait_pending()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()
        self.check_finished()

    synchronize = check

    def close(self) -> None:
        """Release the backend's and the low-latency engine's communication resources; safe to repeat."""
        self._closed = True
        self._backend.close()
        if self._low_latency is not None:
            self._low_latency.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)
