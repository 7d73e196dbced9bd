"""EPBuffer.dispatch / combine as torch.library custom ops, so that torch.compile traces through them.

    from ep_plugin import ops
    bid = ops.register(buf)                   # once, outside the compiled region: an int id
    @torch.compile(fullgraph=True)
    def step(x, topk_idx, topk_weights):
        d = ops.dispatch(bid, x, topk_idx, topk_weights, layout="expert")
        y = experts(d.x, d.offsets, d.topk_weights)  # device offsets: no host read
        return ops.combine(y, d.handle)

Ops (namespace ``ep_plugin``; all differentiable where EPBuffer's calls are):

    dispatch(x, topk_idx, topk_weights, buffer) -> rows [R, H], recv_topk_idx [R, K], recv_weights
        [R, K], tokens_per_expert [E_l], num_recv [], handle            (layout "rank")
    dispatch_expert(x, topk_idx, topk_weights, buffer, alignment) -> rows [N, H], weights [N],
        tokens_per_expert [E_l], offsets [E_l + 1], handle               (layout "expert")
    combine(x, handle, num_tokens) -> [T, H]
    and, for the backward passes only: dispatch_cached(x, handle, num_rows) (combine's backward)
    and combine_with_weights(x, w, handle, num_tokens, topk) (dispatch's backward).

Shapes. A compiled graph takes its output shapes from the ops' fake implementations, so every shape
must follow from the inputs' shapes and the buffer's configuration, never from the routing. The ops
therefore always return the worst-case size of the no-host-sync mode (`comm.host_sync: false`,
DESIGN.md "Async use"): R = world * comm.max_tokens_per_rank rows rank-major, and
N = R * min(K, E_l) + E_l * (alignment - 1) expert-major (expert_major.capacity). Valid rows come
first (rank-major: `num_recv` of them; expert-major: expert e's rows at offsets[e] ..
offsets[e] + tokens_per_expert[e]); what follows is padding: topk_idx -1 and weight 0 rank-major;
expert-major rows past offsets[-1] are zero where the backend returns exact sizes (the torch
reference backend, which always syncs: the op pads its result) and unspecified on the kernel
backends (never written) — consume them through the offsets, as a grouped GEMM with device offsets
does. A buffer built with `comm.host_sync: true` is refused (ValueError, at trace time too): its
dispatch waits on the host to size its outputs exactly, which a compiled graph cannot use.
Counts come back on the device (tokens_per_expert, offsets, num_recv) and the ops read none on the
host. EPBuffer does, inside them, in two cases: combine given fewer rows than the dispatch delivered
(a prefix, e.g. cut to the valid rows) checks that prefix against the host counts (a wait for their
pinned copy only), and the weights' combine of dispatch's backward exchanges by host counts
(backends.base.Backend.combine_weights).

Buffers: a registry of int ids. An op cannot take an EPBuffer (not a tensor, int, float, bool or
string), so `register(buf)` gives a live buffer an id (held weakly: the registry does not keep a
buffer alive), and `register_factory(...)` gives one to a buffer built at first use — what the
Megatron dispatcher does, so that building the buffer (a collective) happens when the op first
runs, in program order on every rank, rather than while tracing. The fake implementations read the
config of the id (world, experts, max_tokens_per_rank, hidden), never the buffer itself.

Handles: a side table keyed by an int token, returned as a 0-d int64 CPU tensor. A Handle holds
backend-private state (torch: the send index; nvlink: device offsets and pinned host counts;
expert-major: the ExpertLayout) whose form differs per backend, so flattening it into tensors
would make this module know every backend's internals, and any new field would change the ops'
signatures; a token keeps the Handle opaque and the ops' schemas fixed. The token is an ordinary
tensor of the graph: combine depends on the dispatch that made it (so the two cannot be
reordered), and autograd saves it for the backward passes like any other tensor. The table entry
lives exactly as long as the token tensor does (weakref.finalize on it): once the forward's
consumers and the backward (which saved it) are done with it, the Handle and the memory it refers
to go. Being a CPU tensor, reading it costs no device sync.

Semantics are EPBuffer's: the ops call EPBuffer.dispatch / combine (async_op=False: outputs are
ready in stream order when the op returns), with their validation. Every rank must run the same
ops in the same order, as with the eager calls: compile the same function on every rank.
Not covered: FP8 pairs, cached dispatch by the caller, async events, the low-latency calls.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .expert_major import capacity

__all__ = ["register", "register_factory", "live_handles", "dispatch", "combine", "OpHandle",
           "RankDispatch", "ExpertDispatch", "output_rows"]


# ---------------------------------------------------------------------------------------- buffers
@dataclass(frozen=True)
class BufferSpec:
    """What the fake implementations need to know of a buffer: its output shapes follow from these."""

    world: int
    num_experts: int
    max_tokens_per_rank: int
    hidden: int
    host_sync: bool

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.world

    @property
    def rank_rows(self) -> int:
        return self.world * self.max_tokens_per_rank

    def expert_rows(self, topk: int, alignment: int) -> int:
        return capacity(self.rank_rows, topk, self.num_local_experts, alignment)

    @classmethod
    def of(cls, cfg, world: int, hidden: int) -> "BufferSpec":
        return cls(world=int(world), num_experts=int(cfg.moe.num_experts),
                   max_tokens_per_rank=int(cfg.comm.max_tokens_per_rank), hidden=int(hidden),
                   host_sync=bool(cfg.comm.host_sync))


class _Slot:
    def __init__(self, spec: BufferSpec, buffer=None, factory: Optional[Callable] = None):
        self.spec = spec
        self.factory = factory
        self.ref = weakref.ref(buffer) if buffer is not None else None

    def get(self):
        buf = self.ref() if self.ref is not None else None
        if buf is None or (self.factory is not None and getattr(buf, "_closed", False)):
            if self.factory is None:
                raise RuntimeError("ep_plugin.ops: the EPBuffer of this id has been garbage-collected; "
                                   "register a live buffer (ep_plugin.ops.register)")
            buf = self.factory()  # building an EPBuffer is collective: it runs inside the op, in order
            got = BufferSpec.of(buf.cfg, buf.world, buf.hidden)
            if got != self.spec:
                raise RuntimeError(f"ep_plugin.ops: the factory built a buffer of {got}, registered as {self.spec}")
            self.ref = weakref.ref(buf)
        return buf


_LOCK = threading.Lock()
_IDS = itertools.count(1)
_SLOTS = {}                           # id -> _Slot
_BY_BUFFER = weakref.WeakKeyDictionary()  # EPBuffer -> id (register is idempotent)
_BY_KEY = {}                          # factory key -> id (register_factory is idempotent per key)


def register(buf) -> int:
    """The op id of a live EPBuffer (the same id on every call for one buffer). Call it outside the
    compiled region and pass the int to dispatch(). The registry holds the buffer weakly."""
    with _LOCK:
        bid = _BY_BUFFER.get(buf)
        if bid is None:
            bid = next(_IDS)
            _SLOTS[bid] = _Slot(BufferSpec.of(buf.cfg, buf.world, buf.hidden), buffer=buf)
            _BY_BUFFER[buf] = bid
        return bid


def register_factory(factory: Callable, cfg, world: int, hidden: int, key=None) -> int:
    """An op id for a buffer that `factory()` builds (or finds) when an op first needs it; `cfg`
    (an EPConfig), `world` and `hidden` must be what that buffer will have (they give the fake
    implementations their shapes). With `key`, the same key gives the same id."""
    spec = BufferSpec.of(cfg, world, hidden)
    with _LOCK:
        if key is not None and key in _BY_KEY:
            bid = _BY_KEY[key]
            if _SLOTS[bid].spec != spec:
                raise ValueError(f"ep_plugin.ops: key {key!r} was registered for {_SLOTS[bid].spec}, not {spec}")
            return bid
        bid = next(_IDS)
        _SLOTS[bid] = _Slot(spec, factory=factory)
        if key is not None:
            _BY_KEY[key] = bid
        return bid


def _slot(bid: int) -> _Slot:
    slot = _SLOTS.get(int(bid))
    if slot is None:
        raise ValueError(f"ep_plugin.ops: no buffer is registered as id {bid} (ep_plugin.ops.register)")
    if slot.spec.host_sync:
        raise ValueError(
            "ep_plugin.ops take buffers of the no-host-sync mode (comm.host_sync: false): their outputs are "
            "sized for the worst case that comm.max_tokens_per_rank allows, so that their shapes (what a "
            "compiled graph needs) follow from the config alone; this buffer has comm.host_sync: true "
            "(exact sizes after a host sync per dispatch). Build it with comm.host_sync: false, or call "
            "EPBuffer.dispatch/combine outside the compiled region")
    return slot



# ---------------------------------------------------------------------------------------- handles
@dataclass
class _Entry:
    buffer: object
    handle: object      # types.Handle
    rows: int           # rows of the backend's own dispatch output (exact or worst case)


_HANDLES = {}
_TOKENS = itertools.count(1)


def _new_token(buf, handle, rows: int) -> Tensor:
    key = next(_TOKENS)
    _HANDLES[key] = _Entry(buf, handle, rows)
    token = torch.tensor(key, dtype=torch.int64)
    weakref.finalize(token, _HANDLES.pop, key, None)  # the entry lives as long as the token tensor
    return token


def _entry(token: Tensor) -> _Entry:
    key = int(token)
    e = _HANDLES.get(key)
    if e is None:
        raise RuntimeError(f"ep_plugin.ops: handle {key} is gone (its token tensor was freed) or was never made "
                           "by ep_plugin.ops.dispatch in this process")
    return e


def live_handles() -> int:
    """Handles whose token tensor is still alive (for tests and leak checks)."""
    return len(_HANDLES)


# ---------------------------------------------------------------------------------------- helpers
def _cut(t: Tensor, rows: int) -> Tensor:
    """t without the rows past `rows` (a view). Fewer rows are left as they are: EPBuffer.combine takes
    any prefix holding every valid row, so a worst-case buffer is never padded back to full size."""
    return t[:rows] if t.shape[0] > rows else t


def _fit(t: Tensor, rows: int, fill) -> Tensor:
    """t cut or padded (with `fill`) to `rows` rows; a fresh tensor when padded."""
    n = t.shape[0]
    if n == rows:
        return t
    if n > rows:
        return t[:rows]
    out = t.new_full((rows,) + tuple(t.shape[1:]), fill)
    out[:n] = t
    return out


def _check_dispatch_args(spec: BufferSpec, x: Tensor, topk_idx: Tensor, topk_weights: Tensor) -> int:
    if x.dim() != 2 or x.shape[1] != spec.hidden:
        raise ValueError(f"x must have shape [num_tokens, {spec.hidden}], got {tuple(x.shape)}")
    if topk_idx.dim() != 2 or topk_weights.shape != topk_idx.shape:
        raise ValueError(f"topk_idx and topk_weights must both be [num_tokens, K], got {tuple(topk_idx.shape)} "
                         f"and {tuple(topk_weights.shape)}")
    if topk_idx.dtype != torch.int64 or topk_weights.dtype != torch.float32:
        raise TypeError(f"topk_idx must be int64 and topk_weights float32, got {topk_idx.dtype}, {topk_weights.dtype}")
    return topk_idx.shape[1]


# ---------------------------------------------------------------------------------------- the ops
@torch.library.custom_op("ep_plugin::dispatch", mutates_args=())
def _dispatch(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, buffer: int
              ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    slot = _slot(buffer)
    spec, buf = slot.spec, slot.get()
    _check_dispatch_args(spec, x, topk_idx, topk_weights)
    R = spec.rank_rows
    with torch.no_grad():
        res = buf.dispatch(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous(), async_op=False)
    n = res.x.shape[0]
    rows = _fit(res.x, R, 0)
    idx = _fit(res.topk_idx, R, -1)
    w = _fit(res.topk_weights, R, 0.0)
    if idx is res.topk_idx:  # the handle keeps it (combine's weights use it): hand out a copy
        idx = idx.clone()
    tpe = res.num_tokens_per_expert.to(torch.int64, copy=True)
    num_recv = res.num_recv.to(torch.int64, copy=True).reshape(())
    return rows, idx, w, tpe, num_recv, _new_token(buf, res.handle, n)


@_dispatch.register_fake
def _(x, topk_idx, topk_weights, buffer):
    spec = _slot(buffer).spec
    K = _check_dispatch_args(spec, x, topk_idx, topk_weights)
    R, dev = spec.rank_rows, x.device
    return (x.new_empty((R, spec.hidden)), topk_idx.new_empty((R, K)), topk_weights.new_empty((R, K)),
            torch.empty((spec.num_local_experts,), dtype=torch.int64, device=dev),
            torch.empty((), dtype=torch.int64, device=dev), torch.empty((), dtype=torch.int64, device="cpu"))


@torch.library.custom_op("ep_plugin::dispatch_expert", mutates_args=())
def _dispatch_expert(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, buffer: int, alignment: int
                     ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    slot = _slot(buffer)
    spec, buf = slot.spec, slot.get()
    K = _check_dispatch_args(spec, x, topk_idx, topk_weights)
    N = spec.expert_rows(K, alignment)
    with torch.no_grad():
        res = buf.dispatch(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous(), layout="expert",
                           expert_alignment=alignment, async_op=False)
    n = res.x.shape[0]
    tpe = res.num_tokens_per_expert.to(torch.int64, copy=True)
    offsets = res.expert_offsets.to(torch.int64, copy=True)
    return (_fit(res.x, N, 0), _fit(res.topk_weights, N, 0.0), tpe, offsets, _new_token(buf, res.handle, n))


@_dispatch_expert.register_fake
def _(x, topk_idx, topk_weights, buffer, alignment):
    spec = _slot(buffer).spec
    K = _check_dispatch_args(spec, x, topk_idx, topk_weights)
    N, E, dev = spec.expert_rows(K, alignment), spec.num_local_experts, x.device
    return (x.new_empty((N, spec.hidden)), topk_weights.new_empty((N,)),
            torch.empty((E,), dtype=torch.int64, device=dev), torch.empty((E + 1,), dtype=torch.int64, device=dev),
            torch.empty((), dtype=torch.int64, device="cpu"))


@torch.library.custom_op("ep_plugin::combine", mutates_args=())
def _combine(x: Tensor, handle: Tensor, num_tokens: int) -> Tensor:
    e = _entry(handle)
    with torch.no_grad():
        y = e.buffer.combine(_cut(x, e.rows).contiguous(), e.handle, async_op=False)
    if y.shape[0] != num_tokens:
        raise ValueError(f"ep_plugin.ops.combine: the handle's dispatch had {y.shape[0]} tokens, "
                         f"num_tokens={num_tokens}")
    return y


@_combine.register_fake
def _(x, handle, num_tokens):
    return x.new_empty((num_tokens, x.shape[1]))


@torch.library.custom_op("ep_plugin::combine_with_weights", mutates_args=())
def _combine_with_weights(x: Tensor, w: Tensor, handle: Tensor, num_tokens: int, topk: int) -> Tuple[Tensor, Tensor]:
    """combine of rows and of per-row weights together (dispatch's backward)."""
    e = _entry(handle)
    x = _cut(x, e.rows)
    with torch.no_grad():
        y, wt = e.buffer.combine(x.contiguous(), e.handle, topk_weights=_cut(w, x.shape[0]).float().contiguous(),
                                 async_op=False)
    return y, wt


@_combine_with_weights.register_fake
def _(x, w, handle, num_tokens, topk):
    return x.new_empty((num_tokens, x.shape[1])), w.new_empty((num_tokens, topk), dtype=torch.float32)


@torch.library.custom_op("ep_plugin::dispatch_cached", mutates_args=())
def _dispatch_cached(x: Tensor, handle: Tensor, num_rows: int) -> Tensor:
    """Dispatch of x on the handle's layout (combine's backward), `num_rows` rows out."""
    e = _entry(handle)
    with torch.no_grad():
        res = e.buffer.dispatch(x.contiguous(), handle=e.handle, async_op=False)
    return _fit(res.x, num_rows, 0)


@_dispatch_cached.register_fake
def _(x, handle, num_rows):
    return x.new_empty((num_rows, x.shape[1]))


# ---------------------------------------------------------------------------------------- autograd
def _dispatch_setup(ctx, inputs, output):
    x, topk_idx = inputs[0], inputs[1]
    ctx.save_for_backward(output[-1])
    ctx.num_tokens, ctx.topk, ctx.x_dtype = x.shape[0], topk_idx.shape[1], x.dtype


def _dispatch_grads(ctx, grad_rows, grad_w):
    (token,) = ctx.saved_tensors
    gx = gw = None
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    if grad_rows is None:
        need_x = False
    if need_w and grad_w is not None:
        if grad_rows is None:  # the rows went unused: their gradient is zero
            raise RuntimeError("ep_plugin.ops: dispatch's backward got a weights gradient without a rows gradient")
        gx, gw = _combine_with_weights(grad_rows.to(ctx.x_dtype).contiguous(), grad_w.contiguous(), token,
                                       ctx.num_tokens, ctx.topk)
    elif need_x:
        gx = _combine(grad_rows.to(ctx.x_dtype).contiguous(), token, ctx.num_tokens)
    return (gx if need_x else None), (gw if need_w else None)


def _dispatch_backward(ctx, grad_rows, _gi, grad_w, _gt, _gn, _gh):
    gx, gw = _dispatch_grads(ctx, grad_rows, grad_w)
    return gx, None, gw, None


def _dispatch_expert_backward(ctx, grad_rows, grad_w, _gt, _go, _gh):
    gx, gw = _dispatch_grads(ctx, grad_rows, grad_w)
    return gx, None, gw, None, None


def _combine_setup(ctx, inputs, output):
    x, handle = inputs[0], inputs[1]
    ctx.save_for_backward(handle)
    ctx.rows, ctx.x_dtype = x.shape[0], x.dtype


def _combine_backward(ctx, grad_y):
    (token,) = ctx.saved_tensors
    return _dispatch_cached(grad_y.to(ctx.x_dtype).contiguous(), token, ctx.rows), None, None


torch.library.register_autograd("ep_plugin::dispatch", _dispatch_backward, setup_context=_dispatch_setup)
torch.library.register_autograd("ep_plugin::dispatch_expert", _dispatch_expert_backward, setup_context=_dispatch_setup)
torch.library.register_autograd("ep_plugin::combine", _combine_backward, setup_context=_combine_setup)


# ---------------------------------------------------------------------------------------- Python API
class OpHandle(NamedTuple):
    """What combine needs: the handle token (0-d int64 CPU tensor) and the dispatching rank's T."""

    token: Tensor
    num_tokens: int


class RankDispatch(NamedTuple):
    x: Tensor                  # [W * max_tokens_per_rank, H]: valid rows first
    topk_idx: Tensor           # [R, K] local expert ids, -1 where not here (and on padding rows)
    topk_weights: Tensor       # [R, K] float32, 0 where topk_idx is -1
    num_tokens_per_expert: Tensor  # [E_l] int64, device
    num_recv: Tensor           # [] int64, device: valid rows
    handle: OpHandle


class ExpertDispatch(NamedTuple):
    x: Tensor                  # [N, H]: expert e's rows at offsets[e] .. offsets[e] + counts[e]
    topk_weights: Tensor       # [N] float32
    num_tokens_per_expert: Tensor  # [E_l] int64, device (before padding)
    offsets: Tensor            # [E_l + 1] int64, device: aligned segment starts; offsets[-1] = rows used
    handle: OpHandle


def dispatch(buffer: int, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, *, layout: str = "rank",
             expert_alignment: int = 1):
    """EPBuffer.dispatch as a traceable op: `buffer` is an id from register()/register_factory().
    Outputs are sized for the worst case (module docstring); -> RankDispatch or ExpertDispatch."""
    if layout == "rank":
        rows, idx, w, tpe, num_recv, token = _dispatch(x, topk_idx, topk_weights, buffer)
        return RankDispatch(rows, idx, w, tpe, num_recv, OpHandle(token, x.shape[0]))
    if layout == "expert":
        rows, w, tpe, offsets, token = _dispatch_expert(x, topk_idx, topk_weights, buffer, expert_alignment)
        return ExpertDispatch(rows, w, tpe, offsets, OpHandle(token, x.shape[0]))
    raise ValueError(f"layout must be 'rank' or 'expert', got {layout!r}")


def combine(x: Tensor, handle: OpHandle) -> Tensor:
    """EPBuffer.combine as a traceable op: x laid out as the handle's dispatch delivered it (its
    worst-case rows, or any prefix holding every valid row) -> [T, H]."""
    return _combine(x, handle.token, handle.num_tokens)


def output_rows(buffer: int, topk: int, layout: str = "rank", expert_alignment: int = 1) -> int:
    """Rows of dispatch's outputs for this buffer id (the worst case; from the config alone)."""
    spec = _slot(buffer).spec
    return spec.rank_rows if layout == "rank" else spec.expert_rows(topk, expert_alignment)
