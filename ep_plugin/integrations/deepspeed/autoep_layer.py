"""EPPluginAutoEPLayer: DeepSpeed AutoEP's MoE layer, its exchange route run over EPBuffer.

router (DeepSpeed's) -> EPPluginExchange.dispatch (expert-grouped rows) -> grouped experts
(DeepSpeed's) -> routing weights (before or after the experts, as the preset says) ->
EPPluginExchange.combine -> shared experts and output tail (DeepSpeed's).

AutoEP's layer has two routes and picks one by comparing its ``comm_backend`` with
``auto_ep_comm.DEEPEP_BACKEND``: the collective all-to-all, or the exchange route, where DeepEP
dispatches, groups by expert and combines. An ep_plugin layer is built by AutoEP for the exchange
route (the hook validates and builds ``"ep_plugin"`` with ``"deepep"``'s rules) and keeps
``comm_backend == "deepep"`` so that DeepSpeed's forward takes that route with everything around it
(router, expert-count statistics, shared experts, router-logit capture) unchanged; ``exchange_backend``
names what runs it. This class replaces only ``_deepep_route``: the same steps as DeepSpeed's, with an
``EPPluginExchange`` in place of ``DeepEPExchange`` and without DeepEP's BF16-only rule and
communicator barrier. Made by :func:`adopt_layers` by swapping the class of a layer AutoEP built
(parameters, names and tags stay DeepSpeed's); never constructed directly.

Stats: with comm.stats on, every comm.stats_interval training steps the exchange's buffer reports
(ep_plugin.telemetry: tokens/s, communication share, slowest rank, imbalance, timeouts, bytes sent
per step) as the DeepSpeed MoE layer does: to the DeepSpeed monitor when enabled (the engine's, or
one set as ``layer._ep_monitor``), else to Python logging (logger "ep_plugin.deepspeed"). The layers
of a model share one exchange and its buffer, and only the first of them counts the steps: one
report per interval, not one per layer.
"""
from __future__ import annotations

import logging
import weakref

import torch
from deepspeed.module_inject.auto_ep_comm import DEEPEP_BACKEND, deepep_combine, deepep_dispatch
from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer, apply_deepep_row_weights

from ...config import EPConfig
from ...telemetry import Report, log_to, training_step
from .autoep_config import EP_PLUGIN_BACKEND
from .autoep_exchange import EPPluginExchange, shared_exchange
from .layer import layer_config

_LOG_REPORT = log_to(logging.getLogger("ep_plugin.deepspeed"))


class EPPluginAutoEPLayer(AutoEPMoELayer):
    """AutoEP's ``AutoEPMoELayer`` whose exchange is an :class:`EPPluginExchange` over EPBuffer."""

    exchange_backend = EP_PLUGIN_BACKEND
    _ep_plugin_cfg: EPConfig  # the run's comm/overlap settings; the layer adds its experts and top-k
    _ep_monitor = None        # a DeepSpeed monitor for the stats reports (default: the engine's)
    _ep_engine = None         # weak reference to the engine that built the layer (its monitor comes later)

    def ep_plugin_exchange(self, hidden: int) -> EPPluginExchange:
        """This layer's exchange, shared with the layers of its model that fit it; built on first use
        (collective: every rank runs the same layers in the same order)."""
        exchange = self._deepep_exchange
        if exchange is None or exchange.destroyed:
            if self.ep_group is None:
                raise RuntimeError("this AutoEP layer has no expert-parallel group yet: it gets one from "
                                   "deepspeed.initialize (set_deepspeed_parallelism)")
            cfg = layer_config(self._ep_plugin_cfg, self.num_experts, self.top_k)
            cfg.check_ep_size(self.ep_size)
            # engine.destroy() releases whatever sits in _deepep_exchange (auto_ep_comm.destroy_exchanges)
            exchange = shared_exchange(self.deepep_scope, self.ep_group, cfg, hidden, self.top_k)
            self._deepep_exchange = exchange
        return exchange

    def _check_capacity(self, num_tokens: int, capacity: int) -> None:
        # Every rank with the same batch shape stops here together, before any communication.
        if num_tokens > capacity:
            raise ValueError(
                f"ep_plugin AutoEP: this MoE layer got {num_tokens} tokens (batch x sequence) on this rank, more "
                f"than comm.max_tokens_per_rank={capacity} that its EPBuffer is sized for; set "
                f"\"expert_parallel\": {{\"comm_max_tokens_per_rank\": {num_tokens}}} (normally "
                "train_micro_batch_size_per_gpu x the longest padded sequence), or comm.max_tokens_per_rank "
                "in the ep_plugin YAML")

    def _deepep_route(self, tokens: torch.Tensor, ro) -> torch.Tensor:
        """tokens [T, H] and the router's output -> [T, H] routed-expert output (DeepSpeed's
        ``_deepep_route`` contract)."""
        exchange = self.ep_plugin_exchange(tokens.shape[1])
        self._check_capacity(tokens.shape[0], exchange.num_max_tokens_per_rank)
        # every comm.stats_interval steps; the layers sharing the exchange's buffer report once per step
        training_step(self, exchange.buffer, tokens.shape[0], self._ep_report)
        # DeepSpeed's autograd functions around the exchange: dispatch's backward is a combine with the
        # weights' gradient, combine's a dispatch on the handle, and a checkpoint recompute replays
        # the forward's handle (self._deepep_replay).
        received, recv_weights, exchange = deepep_dispatch(exchange, tokens, ro.selected_experts, ro.top_scores,
                                                           replay=self._deepep_replay)
        handle = exchange.last_handle
        # SwiGLU does not commute with the weight: it goes on the side the collective path puts it.
        weights = recv_weights.reshape(-1, 1)
        if self.score_apply == "pre":
            received = apply_deepep_row_weights(received, weights, self.row_weighting_impl)
            weights = None
        expert_output = self.experts(received, handle.num_recv_tokens_per_expert)
        if weights is not None:
            expert_output = apply_deepep_row_weights(expert_output, weights, self.row_weighting_impl)
        return deepep_combine(exchange, expert_output, handle)

    def _ep_report(self, report: Report) -> None:
        monitor = self._ep_monitor
        if monitor is None and self._ep_engine is not None:
            monitor = getattr(self._ep_engine(), "monitor", None)
        if monitor is not None and getattr(monitor, "enabled", False):
            monitor.write_events(report.events(report.steps[1]))
        else:
            _LOG_REPORT(report)

    def extra_repr(self) -> str:
        return f"exchange_backend={self.exchange_backend}, ep_size={self.ep_size}, experts={self.num_experts}"


def adopt_layers(model: torch.nn.Module, cfg: EPConfig, engine=None) -> int:
    """Turn the AutoEP layers of ``model`` that AutoEP just built for the exchange route into
    :class:`EPPluginAutoEPLayer` (class swap, in place). Returns how many. ``engine``: the
    DeepSpeed engine building them, whose monitor (when enabled) receives the stats reports."""
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, AutoEPMoELayer) or isinstance(module, EPPluginAutoEPLayer):
            continue
        if module.comm_backend != DEEPEP_BACKEND:
            raise RuntimeError(f"AutoEP layer '{name}' was built for comm_backend={module.comm_backend!r}, not "
                               f"for the exchange route ({DEEPEP_BACKEND!r}) that ep_plugin runs")
        module.__class__ = EPPluginAutoEPLayer
        module._ep_plugin_cfg = cfg
        if engine is not None:
            module._ep_engine = weakref.ref(engine)
        count += 1
    return count


__all__ = ["EPPluginAutoEPLayer", "adopt_layers"]
