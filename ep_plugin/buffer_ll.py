"""EPBuffer's low-latency calls (docs/LOW_LATENCY.md): low_latency_dispatch / low_latency_combine
through an engine of their own, built at the first such call (a collective) by `make_low_latency`.
Their arguments go through ep_plugin.checks.low_latency, once per call form; the handle every call."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .checks import need
from .checks import low_latency as ll_checks
from .types import EPEvent, LowLatencyHandle


class _RecvHook:
    """The receive half of a low-latency call, handed to the caller: enqueues it on the current stream
    the first time it is called; a second call is an error (the engine's receive runs once)."""

    __slots__ = ("_recv", "_what")

    def __init__(self, recv, what: str):
        self._recv, self._what = recv, what

    def __call__(self) -> None:
        if self._recv is None:
            raise RuntimeError(f"this {self._what} receive hook has run already: each hook runs once")
        recv, self._recv = self._recv, None
        recv()


_STRAY_HOOK = "the low-latency engine returned a receive hook for a call without one"


def _hooked(recv, what: str) -> _RecvHook:
    """The engine's receive half of a call with a hook, as the caller gets it."""
    assert callable(recv), f"the low-latency engine returned no receive hook for {what}"
    return _RecvHook(recv, what)


class LowLatencyCalls:
    """Mixed into EPBuffer: the low-latency calls and their engine."""

    @property
    def low_latency_backend_name(self) -> Optional[str]:
        """The low-latency engine's name ("nvshmem" or "torch"), None until the first low-latency call
        builds it."""
        return self._low_latency.name if self._low_latency is not None else None

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
        # Flat on purpose: a call of a form that passed its checks costs this frame, its key's, the pending
        # errors', the launch's and the engine's (a cold call's host time is on the critical path:
        # benchmarks/bench_ll_host.py).
        engine, checks = self._ll_pending()
        key = ll_checks.dispatch_key(x, topk_idx, recv_stats, use_fp8, round_scale)
        # bool is final: `type(v) is bool` is isinstance, without a call on the hot path
        hook = return_recv_hook if type(return_recv_hook) is bool else self._recv_hook_wanted(return_recv_hook)
        if type(async_op) is not bool:
            raise TypeError("async_op must be a bool")
        if engine is None:
            engine = self._low_latency_engine()
        if not checks.forms.seen(key):
            self._check_low_latency_dispatch(x, topk_idx, use_fp8, round_scale, recv_stats)
            limit = engine.max_topk  # an engine sized for a top-k when it was built (None: any)
            need(limit is None or topk_idx.shape[1] <= limit, ValueError,
                 f"the {engine.name} low-latency engine of this buffer takes topk <= {limit} (sized from "
                 f"moe.topk), got {topk_idx.shape[1]}")
            if key is not None:
                checks.forms.add(key)
        return self._ll_dispatch_launch(engine, checks, x, topk_idx, use_fp8, round_scale, async_op, hook, recv_stats)

    def _ll_dispatch_run(self, x, topk_idx, use_fp8: bool, round_scale: bool, async_op: bool, hook: bool, recv_stats):
        """low_latency_dispatch of a call whose form passed its checks: the pending errors, then the launch.
        ep_plugin.deep_ep calls it for a form it checked: its own form covers every input the checks read, so
        checking again would only cost host time."""
        engine, checks = self._ll_pending()
        return self._ll_dispatch_launch(engine, checks, x, topk_idx, use_fp8, round_scale, async_op, hook, recv_stats)

    def _ll_pending(self):
        """(engine or None before the first call, checks), after the pending errors: a closed buffer, a timeout
        the engine recorded, expert ids it flagged."""
        if self._closed:
            raise RuntimeError("this EPBuffer is closed")
        engine, checks = self._low_latency, self._checks
        if engine is not None:
            engine.check()
        checks.expert_ids_flag.raise_if_seen()
        return engine, checks

    def _ll_dispatch_launch(self, engine, checks, x, topk_idx, use_fp8, round_scale, async_op, hook, recv_stats):
        """The dispatch of a checked call: the expert ids where the engine does not flag them, the engine, the
        handle's buffer, the hook and the event."""
        if checks.full_validation or not engine.checks_expert_ids:
            checks.expert_ids(topk_idx, engine.checks_expert_ids)
        if x.requires_grad:  # the engines' outputs never track gradients
            with torch.no_grad():
                recv_x, recv_count, handle, recv = engine.dispatch(
                    x, topk_idx, use_fp8=use_fp8, round_scale=round_scale, recv_stats=recv_stats, hook=hook)
        else:
            recv_x, recv_count, handle, recv = engine.dispatch(
                x, topk_idx, use_fp8=use_fp8, round_scale=round_scale, recv_stats=recv_stats, hook=hook)
        handle.buffer_id = self._id
        if hook:
            recv = _hooked(recv, "low_latency_dispatch")
        else:
            assert recv is None, _STRAY_HOOK
        return recv_x, recv_count, handle, self._low_latency_event(x) if async_op else None, recv

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, *, async_op: bool = False,
                            return_recv_hook: Optional[bool] = None, out: Optional[torch.Tensor] = None):
        """Send the expert outputs back and sum them per token, weighted: -> (y, event, hook).

        x: BF16 [E_l, W*M, H] in the layout of `handle`'s dispatch (only rows below recv_count[e] are
        read); topk_idx and topk_weights (float32): that dispatch's [T, K]. y [T, H] BF16 (or `out`), per
        comm.low_latency.combine_reduce: owner (the default) -- each rank's picks of token t summed, w[t, k] *
        row(t, k) over k ascending in float32 (unfused multiply, then add), rounded to BF16, and those sums
        added in float32 in the order of each rank's first pick, cast to BF16; source -- every pick summed
        that way at once, cast to BF16 at the end (DeepEP's numbers). ids -1 and left-out ranks contribute
        nothing. return_recv_hook and async_op as for low_latency_dispatch."""
        # flat, as low_latency_dispatch
        engine, checks = self._ll_pending()
        # the handle is checked on every call (its type, buffer and sizes: combine_key); the tensors' checks
        # once per form of call
        key = ll_checks.combine_key(self._id, x, topk_idx, topk_weights, out, handle)
        if not checks.forms.seen(key):
            self._check_low_latency_combine(x, topk_idx, topk_weights, handle, out)
            if key is not None:
                checks.forms.add(key)
        hook = return_recv_hook if type(return_recv_hook) is bool else self._recv_hook_wanted(return_recv_hook)
        if type(async_op) is not bool:
            raise TypeError("async_op must be a bool")
        return self._ll_combine_launch(engine, checks, x, topk_idx, topk_weights, handle, out, async_op, hook)

    def _ll_combine_run(self, x, topk_idx, topk_weights, handle, out, async_op: bool, hook: bool):
        """low_latency_combine of a call whose form and handle passed its checks: the pending errors, then the
        launch; see _ll_dispatch_run."""
        engine, checks = self._ll_pending()
        return self._ll_combine_launch(engine, checks, x, topk_idx, topk_weights, handle, out, async_op, hook)

    def _ll_combine_launch(self, engine, checks, x, topk_idx, topk_weights, handle, out, async_op, hook):
        """The combine of a checked call: the expert ids where the engine does not flag them, the engine, the
        hook and the event."""
        if checks.full_validation or not engine.checks_expert_ids:
            checks.expert_ids(topk_idx, engine.checks_expert_ids)
        if x.requires_grad:
            with torch.no_grad():
                y, recv = engine.combine(x, topk_idx, topk_weights, handle, out=out, hook=hook)
        else:
            y, recv = engine.combine(x, topk_idx, topk_weights, handle, out=out, hook=hook)
        if hook:
            recv = _hooked(recv, "low_latency_combine")
        else:
            assert recv is None, _STRAY_HOOK
        return y, self._low_latency_event(x) if async_op else None, recv

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

    # the checks (ep_plugin.checks.low_latency), as methods: what a test or a benchmark instruments
    def _check_low_latency_dispatch(self, x, topk_idx, use_fp8, round_scale, recv_stats) -> None:
        ll_checks.dispatch(self._checks, self.cfg.comm.low_latency.max_tokens_per_rank, self.num_local_experts,
                           x, topk_idx, use_fp8, round_scale, recv_stats, self._check_low_latency_device)

    def _check_low_latency_combine(self, x, topk_idx, topk_weights, handle, out) -> None:
        ll_checks.combine(self._checks, self.num_local_experts, x, topk_idx, topk_weights, handle, out)

    def _check_low_latency_device(self, x) -> None:
        ll_checks.device(self.group, x)

    def _raise_pending_low_latency(self) -> None:
        self._ll_pending()

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
