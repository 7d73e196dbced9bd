"""The one place ep_plugin hooks DeepSpeed AutoEP, and how to undo it (checked against DeepSpeed 0.19.8).

    "expert_parallel": {"enabled": true, "autoep_size": 2, "comm_backend": "ep_plugin"}

AutoEP (``deepspeed/module_inject/auto_ep*.py``) accepts ``comm_backend`` "comm" or "deepep" and
validates that list inside ``validate_autoep_config``; each MoE layer it builds copies the name and
picks its route by it. There is no registry to add a transport to, so :func:`install` wraps one
method, ``DeepSpeedEngine._configure_expert_parallel`` (where the engine validates the section,
creates the expert groups and replaces the MoE blocks):

  - flag off (AutoEP off, or another comm_backend): the original runs, untouched;
  - ``"ep_plugin"``: our checks and the ep_plugin config first (``autoep_config.py``), then the
    original with the section presented as ``"deepep"`` -- AutoEP's exchange route, whose rules
    (``comm_max_tokens_per_rank`` > 0, no ``fused_weighted_sum``) are the ones that route needs --
    and the name restored afterwards; last, the layers AutoEP built become ``EPPluginAutoEPLayer``
    (``autoep_layer.py``), whose exchange is an ``EPPluginExchange`` over EPBuffer
    (``autoep_exchange.py``), and which report comm.stats to this engine's monitor (else logging).

:func:`uninstall` puts the original method back. Nothing else in DeepSpeed is modified: DeepSpeed's
own autograd functions, checkpoint replay and ``engine.destroy()`` (which releases each layer's
exchange) drive ours through DeepEPExchange's contract.

What the hook relies on (DeepSpeed 0.19.8): ``_configure_expert_parallel(model, collect_sources)``,
``engine._config.expert_parallel_config`` (``comm_backend``, ``comm_max_tokens_per_rank``),
``auto_ep_comm.DEEPEP_BACKEND`` / ``deepep_dispatch`` / ``deepep_combine``, and
``AutoEPMoELayer._deepep_route(tokens, router_output)``. Another version gets a warning once.
"""
from __future__ import annotations

import functools
import logging
import threading
import warnings
from typing import Callable, Optional

from .autoep_config import EP_PLUGIN_BACKEND, autoep_ep_config, check_autoep_options

logger = logging.getLogger("ep_plugin.deepspeed")

CHECKED_DEEPSPEED_VERSIONS = ("0.19.8",)

_original: Optional[Callable] = None
_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def _check_version(version: str) -> None:
    if version not in CHECKED_DEEPSPEED_VERSIONS:
        warnings.warn(f"ep_plugin's AutoEP hook was checked against DeepSpeed {', '.join(CHECKED_DEEPSPEED_VERSIONS)}; "
                      f"this is DeepSpeed {version}. If AutoEP's exchange contract changed, "
                      "comm_backend=\"ep_plugin\" may fail: compare with comm_backend=\"comm\".", stacklevel=3)


def _configure_expert_parallel(self, model, *args, **kwargs):
    """DeepSpeedEngine._configure_expert_parallel, with comm_backend="ep_plugin" (see the module)."""
    original = _configure_expert_parallel.__wrapped__
    autoep = getattr(self._config, "expert_parallel_config", None)
    if autoep is None or not autoep.enabled or autoep.comm_backend != EP_PLUGIN_BACKEND:
        return original(self, model, *args, **kwargs)

    import deepspeed
    from deepspeed.module_inject.auto_ep_comm import DEEPEP_BACKEND

    from .autoep_layer import adopt_layers

    _check_version(deepspeed.__version__)
    check_autoep_options(autoep, tp_size=self.autotp_size())
    ep_cfg = autoep_ep_config(self._config._param_dict)
    user_capacity = autoep.comm_max_tokens_per_rank
    autoep.comm_backend = DEEPEP_BACKEND
    autoep.comm_max_tokens_per_rank = ep_cfg.comm.max_tokens_per_rank
    try:
        sources = original(self, model, *args, **kwargs)
    finally:
        autoep.comm_backend = EP_PLUGIN_BACKEND
        autoep.comm_max_tokens_per_rank = user_capacity
    count = adopt_layers(model, ep_cfg, engine=self)  # comm.stats reports: the engine's monitor, else logging
    logger.info("ep_plugin: %d AutoEP MoE layer(s) exchange tokens through ep_plugin (backend %s, "
                "max_tokens_per_rank %d)", count, ep_cfg.comm.backend, ep_cfg.comm.max_tokens_per_rank)
    return sources


def install() -> bool:
    """Hook DeepSpeed so that ``"expert_parallel": {"comm_backend": "ep_plugin"}`` works. Idempotent;
    done on import of ``ep_plugin.deepspeed``. False (and nothing changed) when this DeepSpeed has
    no AutoEP."""
    global _original
    with _LOCK:
        if _original is not None:
            return True
        from deepspeed.runtime.engine import DeepSpeedEngine

        original = DeepSpeedEngine.__dict__.get("_configure_expert_parallel")
        if original is None:
            logger.debug("DeepSpeed has no AutoEP (DeepSpeedEngine._configure_expert_parallel): nothing to hook")
            return False
        _configure_expert_parallel.__wrapped__ = original
        _original = original
        DeepSpeedEngine._configure_expert_parallel = _configure_expert_parallel
        return True


def uninstall() -> None:
    """Put DeepSpeed's ``_configure_expert_parallel`` back. Layers already converted keep running
    through ep_plugin; engines built afterwards reject ``comm_backend="ep_plugin"`` as DeepSpeed does."""
    global _original
    with _LOCK:
        if _original is None:
            return
        from deepspeed.runtime.engine import DeepSpeedEngine

        DeepSpeedEngine._configure_expert_parallel = _original
        _original = None


def is_installed() -> bool:
    return _original is not None


__all__ = ["CHECKED_DEEPSPEED_VERSIONS", "install", "uninstall", "is_installed"]
