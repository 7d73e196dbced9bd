"""EPPluginMOELayer: DeepSpeed's ``MOELayer`` with its two padded all-to-alls replaced by EPBuffer.

gate (DeepSpeed's, sparse routes) -> EPBuffer.dispatch (expert-major: rows grouped by local expert,
each segment padded with zero rows of weight 0 to a multiple of expert_alignment()) -> each local expert
on its segment, times its weight -> EPBuffer.combine (sums each token's rows; padding rows belong to
no token). A route is kept iff DeepSpeed keeps it (capacity-dropped
routes come out of the gate as expert -1), so outputs and gradients equal DeepSpeed's.

Buffers: one EPBuffer per (group, config, hidden) from the shared cache
(``integrations/buffer_cache.py``), sized by ``comm.max_tokens_per_rank`` and reused for every
batch; a batch with more tokens is refused before any communication.

Dtypes: a kernel backend moves only some row dtypes (nvlink: BF16/FP16 rows, BF16 combine). When
the layer's dtype is not among them, the rows travel as BF16 and are cast back around the experts,
so a float32 DeepSpeed model still runs (with BF16 rounding on the wire; a one-time warning says so).

Stats: with comm.stats on, every comm.stats_interval training steps the first converted layer
reports its buffer's stats (ep_plugin.telemetry: tokens/s, communication share, slowest rank,
imbalance, timeouts) to DeepSpeed's monitor when one is attached and enabled (`attach_monitor`),
else to Python logging (logger "ep_plugin.deepspeed").
"""
from __future__ import annotations

import copy
import functools
import logging
import warnings
from typing import Any, Sequence

import torch
from deepspeed.moe.sharded_moe import FIRST_ALLTOALL_TIMER, MOE_TIMER, SECOND_ALLTOALL_TIMER, MOELayer
from deepspeed.utils import groups

from ...config import EPConfig, MoEConfig, load_config
from ...expert_major import padded
from ...telemetry import Report, log_to, training_step
from ..buffer_cache import get_buffer
from .gate_scan import fast_gate_scan

_FALLBACK_DTYPE = torch.bfloat16  # every backend moves and combines BF16 rows
_LOG_REPORT = log_to(logging.getLogger("ep_plugin.deepspeed"))
# Each local expert's rows are padded (zero rows, weight 0) to a multiple of expert_alignment(), so
# that its GEMMs come in a few shapes: the per-expert row count changes every step, and the host picks
# a GEMM algorithm for every new shape (one H200, EP1: a fresh process spent ~2 ms more host time per
# step in aten::mm/addmm over its first 40 steps, the layer step 10.7 ms instead of 6.4 ms once warm).
MAX_EXPERT_ALIGNMENT = 128


def expert_alignment(tokens: int, k: int, ep_size: int, num_experts: int) -> int:
    """The padding multiple of a local expert's rows: a power of two at most MAX_EXPERT_ALIGNMENT and at
    most an eighth of the rows an expert gets on average (tokens * k * ep_size / num_experts), so the
    padding stays a small share of the work; 1 for small batches."""
    per_expert = tokens * k * ep_size // max(1, num_experts)
    a = 1
    while a * 2 <= min(MAX_EXPERT_ALIGNMENT, per_expert // 8):
        a *= 2
    return a


def layer_config(base: EPConfig, num_experts: int, k: int) -> EPConfig:
    """The EPBuffer config of one layer: communication and overlap from the user's YAML, the expert
    count and top-k from the DeepSpeed layer (DeepSpeed's gate does the routing, so the YAML's
    routing keys -- groups, score function, bias -- do not apply)."""
    cfg = copy.deepcopy(base)
    cfg.moe = MoEConfig(num_experts=num_experts, topk=min(k, num_experts))
    # the experts split their rows by host counts, so the host waits for them anyway: exact sizes
    # cost no extra sync and save the worst-case rows
    cfg.comm.host_sync = True
    return load_config(cfg)


def wire_dtype(dtype: torch.dtype, allowed: Sequence[torch.dtype]) -> torch.dtype:
    """``dtype`` if the backend takes it (``allowed``: a Capabilities dtype tuple), else BF16."""
    if dtype in allowed:
        return dtype
    return _FALLBACK_DTYPE if _FALLBACK_DTYPE in allowed else allowed[0]


@functools.lru_cache(maxsize=None)
def _warn_cast(backend: str, dtype: torch.dtype, sent: torch.dtype, combined: torch.dtype) -> None:
    # lru_cache makes this once per (backend, dtype) pair for the whole process, not once per layer
    warnings.warn(f"ep_plugin.deepspeed: the {backend} backend does not move {dtype} rows; the MoE layers "
                  f"send them as {sent} and combine as {combined} (the experts still run in {dtype}). "
                  "Use comm.backend: torch for exact float32 exchange.", stacklevel=2)


def _tp_world_size() -> int:
    if groups.mpu is None:
        return 1
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size
    return bwc_tensor_model_parallel_world_size(groups.mpu)


def attach_monitor(model: torch.nn.Module, monitor) -> int:
    """Send the stats reports of ``model``'s converted MoE layers to a DeepSpeed monitor (e.g.
    ``engine.monitor``; used when its ``enabled`` is true). Returns how many layers now do."""
    layers = [m for m in model.modules() if isinstance(m, EPPluginMOELayer)]
    for m in layers:
        m._ep_monitor = monitor
    return len(layers)


class EPPluginMOELayer(MOELayer):
    """DeepSpeed's ``MOELayer`` with its two capacity-padded all-to-alls replaced by EPBuffer
    dispatch/combine. Made by :func:`convert_moe_layers` by swapping an instance's class; never
    constructed directly. Gate, experts, parameters and attributes are DeepSpeed's."""

    _ep_cfg: EPConfig
    _ep_monitor = None  # a DeepSpeed monitor for the stats reports (attach_monitor)
    _ep_counts: list = []  # rows per local expert of the last forward (host ints, before padding)

    def _set_ep_group(self, ep_group):
        # convert_moe_layers may have created the groups already; the engine then sets them again.
        if self.ep_group is not None and ep_group is self.ep_group:
            return
        super()._set_ep_group(ep_group)

    def ep_buffer(self, hidden: int):
        """The shared EPBuffer of this layer's group, config and row width ``hidden``."""
        if self.ep_group is None:
            raise RuntimeError("this MoE layer has no expert-parallel group yet: call deepspeed.initialize / "
                               "ep_plugin.deepspeed.initialize first, or convert_moe_layers after "
                               "torch.distributed is initialized")
        return get_buffer(self.ep_group, self._ep_cfg, hidden)

    def _check_capacity(self, num_tokens: int) -> None:
        # Checked before the gate (a collective when drop_tokens is off) and before dispatch, so that
        # ranks with the same batch shape all stop here together instead of some inside a collective.
        cap = self._ep_cfg.comm.max_tokens_per_rank
        if num_tokens > cap:
            raise ValueError(
                f"ep_plugin.deepspeed: this MoE layer got {num_tokens} tokens (batch x sequence) on this rank, "
                f"more than comm.max_tokens_per_rank={cap} that its EPBuffer is sized for; set "
                f"comm.max_tokens_per_rank to at least {num_tokens} in the ep_plugin YAML, or in the DeepSpeed "
                f"config: \"ep_plugin\": {{..., \"overrides\": {{\"comm.max_tokens_per_rank\": {num_tokens}}}}}")

    def forward(self, *input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if _tp_world_size() > 1:
            raise NotImplementedError("ep_plugin's DeepSpeed path does not support tensor-parallel non-expert "
                                      "layers (mpu with tensor-parallel size > 1); turn 'ep_plugin' off")
        timed = self.wall_clock_breakdown
        if timed:
            self.timers(MOE_TIMER).start()
        x = input[0]
        used_token = input[1] if len(input) > 1 else None
        d_model = x.shape[-1]
        tokens = x.reshape(-1, d_model)
        self._check_capacity(tokens.shape[0])

        # DeepSpeed's own gate, in its sparse form: per route (k, token) the expert (-1 when the
        # capacity limit or used_token drops it) and the normalised combine weight.
        # (its capacity scan run by gate_scan: the same numbers, without torch's one-thread-per-column kernel)
        with fast_gate_scan():
            self.l_aux, _, num_experts, indices_, _, gates_, self.exp_counts = self.gate(tokens, used_token, True,
                                                                                         False)
        topk_idx = indices_.t().to(torch.int64).contiguous()  # [S, K]
        topk_weights = gates_.t().float().contiguous()        # [S, K]

        buf = self.ep_buffer(d_model)
        training_step(self, buf, tokens.shape[0], self._ep_report)  # every comm.stats_interval steps
        caps = buf.capabilities
        sent = wire_dtype(tokens.dtype, caps.row_dtypes)
        combined = wire_dtype(tokens.dtype, caps.combine_dtypes)
        if sent != tokens.dtype or combined != tokens.dtype:
            _warn_cast(buf.backend_name, tokens.dtype, sent, combined)

        if timed:
            self.timers(FIRST_ALLTOALL_TIMER).start()
        # Synchronous: the experts need the rows right away, so an async dispatch (overlap.async_dispatch)
        # would only add an event to wait on.
        # Expert-major: one row per (token, local expert), grouped by expert, with its weight.
        align = expert_alignment(tokens.shape[0], topk_idx.shape[1], buf.world, num_experts)
        res = buf.dispatch(tokens.to(sent).contiguous(), topk_idx, topk_weights, async_op=False, layout="expert",
                           expert_alignment=align)
        if timed:
            self.timers(FIRST_ALLTOALL_TIMER).stop()
            self.time_falltoall = self.timers(FIRST_ALLTOALL_TIMER).elapsed(reset=False)

        # host values (splitting needs no device sync): rows per local expert, and its padded segment
        self._ep_counts = [int(c) for c in res.tokens_per_expert]
        counts = padded(self._ep_counts, align)
        n = sum(counts)  # the rows in use (all of them: the layer's buffer waits for exact sizes)
        rows = res.x[:n].to(tokens.dtype)  # the experts' parameters are in the layer's dtype
        expert_out = self._ep_run_experts(rows, res.topk_weights[:n], counts)

        if timed:
            self.timers(SECOND_ALLTOALL_TIMER).start()
        y = buf.combine(expert_out.to(combined).contiguous(), res.handle, async_op=False)
        if timed:
            self.timers(SECOND_ALLTOALL_TIMER).stop()
            self.time_salltoall = self.timers(SECOND_ALLTOALL_TIMER).elapsed(reset=False)
            self.timers(MOE_TIMER).stop()
            self.time_moe = self.timers(MOE_TIMER).elapsed(reset=False)
        return y.to(x.dtype).reshape(x.shape)

    def _ep_report(self, report: Report) -> None:
        monitor = self._ep_monitor
        if monitor is not None and getattr(monitor, "enabled", False):
            monitor.write_events(report.events(report.steps[1]))
        else:
            _LOG_REPORT(report)

    def _ep_run_experts(self, rows: torch.Tensor, weights: torch.Tensor, counts) -> torch.Tensor:
        """Run each local expert on its segment of rows; return weight * expert(row) per row.

        rows [N, H] grouped by local expert (counts: rows per expert segment, padding included, host ints;
        a padding row is zero with weight 0, so it adds nothing to outputs or gradients); weights [N] float32.
        Multiplies in float32 and returns rows' dtype; the combine sums each token's rows (float32).
        """
        outs = []
        for chunk, expert in zip(rows.split(counts), self.experts.deepspeed_experts):
            out = expert(chunk)  # runs on an empty chunk too, so every expert param gets a grad
            if isinstance(out, tuple):
                out = out[0]  # DeepSpeed ignores a returned bias the same way
            outs.append(out)
        y = torch.cat(outs) if outs else rows
        return (y.float() * weights.unsqueeze(1)).to(rows.dtype)
