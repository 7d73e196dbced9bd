"""Turning a DeepSpeed model's MoE layers into EPPluginMOELayer, and ``initialize`` that does it.

The conversion swaps the class of each ``MOELayer`` instance (a subclass), so ``isinstance``
checks, ``state_dict`` keys, parameter tags (``allreduce``, ``group_name``) and the module tree are
DeepSpeed's. Everything is checked before the first layer changes.
"""
from __future__ import annotations

import functools
import inspect
import logging

import torch
import torch.distributed as tdist

import deepspeed
from deepspeed.moe.experts import Experts
from deepspeed.moe.layer import MoE
from deepspeed.moe.sharded_moe import MOELayer
from deepspeed.utils import groups

from ...config import EPConfig
from .layer import EPPluginMOELayer, attach_monitor, layer_config
from .section import USE_DATA_BEFORE_EP, ep_plugin_config, read_ds_config

logger = logging.getLogger("ep_plugin.deepspeed")


def _convert(model: torch.nn.Module, ep_cfg: EPConfig, *, create_groups: bool,
             use_data_before_expert_parallel: bool = False) -> int:
    parents = {}
    for _, mod in model.named_modules():
        if isinstance(mod, MoE):
            parents[id(mod.deepspeed_moe)] = mod
    # Check everything before touching anything.
    todo = []
    for name, mod in model.named_modules():
        if not isinstance(mod, MOELayer) or isinstance(mod, EPPluginMOELayer):
            continue
        experts = getattr(mod, "experts", None)
        if not hasattr(experts, "deepspeed_experts"):
            raise TypeError(f"MoE layer '{name}': its experts ({type(experts).__name__}) are not "
                            "deepspeed.moe.experts.Experts; ep_plugin needs the per-expert modules")
        if type(experts).forward is not Experts.forward:
            logger.warning("MoE layer '%s': %s.forward is bypassed; ep_plugin runs each of its "
                           "deepspeed_experts on its own rows", name, type(experts).__name__)
        parent = parents.get(id(mod))
        if parent is not None and getattr(parent, "enable_expert_tensor_parallelism", False) and groups.mpu is not None:
            raise NotImplementedError(f"MoE layer '{name}': expert tensor parallelism is not supported by "
                                      "ep_plugin's DeepSpeed path; turn 'ep_plugin' off")
        num_experts = mod.num_local_experts * mod.ep_size
        todo.append((name, mod, parent, layer_config(ep_cfg, num_experts, int(mod.gate.k))))
    for name, mod, parent, cfg in todo:
        cfg.check_ep_size(mod.ep_size)
        if getattr(mod, "use_tutel", False):
            logger.warning("MoE layer '%s': use_tutel is ignored on the ep_plugin path", name)
        mod.__class__ = EPPluginMOELayer
        mod._ep_cfg = cfg
        if create_groups and mod.ep_group is None and parent is not None and tdist.is_initialized():
            _ensure_ds_comm()
            parent.set_deepspeed_parallelism(use_data_before_expert_parallel)
    if todo:
        logger.info("ep_plugin: %d DeepSpeed MoE layer(s) now dispatch/combine through ep_plugin (backend %s)",
                    len(todo), ep_cfg.comm.backend)
    return len(todo)


def _ensure_ds_comm() -> None:
    """DeepSpeed's comm layer wraps an already initialized torch.distributed (no new init)."""
    import deepspeed.comm as dscomm
    if not dscomm.is_initialized():
        deepspeed.init_distributed(dist_backend=tdist.get_backend(), dist_init_required=False)


def convert_moe_layers(model: torch.nn.Module, ds_config) -> int:
    """Make every DeepSpeed MoE layer of ``model`` exchange tokens through ep_plugin, in place.

    ``ds_config``: the DeepSpeed config (dict, JSON path or DeepSpeedConfig) with the ``ep_plugin``
    section. Returns how many layers were converted now: 0 when the flag is off or absent (the
    model is then untouched), or when they were converted before. If torch.distributed is
    initialized and a layer has no expert-parallel group yet, its groups are created here (as
    ``MoE.set_deepspeed_parallelism`` does); otherwise ``deepspeed.initialize`` creates them later.
    """
    ep_cfg = ep_plugin_config(ds_config)
    if ep_cfg is None:
        return 0
    ds, _ = read_ds_config(ds_config)
    return _convert(model, ep_cfg, create_groups=True,
                    use_data_before_expert_parallel=bool(ds.get(USE_DATA_BEFORE_EP, False)))


def _config_source(bound_args: dict):
    """Where ``deepspeed.initialize`` would read its config from: ``config``, ``config_params``, or
    ``args.deepspeed_config`` (``args.deepscale_config`` in old scripts)."""
    src = bound_args.get("config")
    if src is None:
        src = bound_args.get("config_params")
    ns = bound_args.get("args")
    if src is None and ns is not None:
        src = getattr(ns, "deepspeed_config", None) or getattr(ns, "deepscale_config", None)
    return src


@functools.wraps(deepspeed.initialize)
def initialize(*args, **kwargs):
    """``deepspeed.initialize`` with the ``ep_plugin`` flag honoured: same arguments, same return
    value. With ``"ep_plugin": {"enabled": true, ...}`` in the config, the model's MoE layers are
    converted (see :func:`convert_moe_layers`) before the engine is built; otherwise this is exactly
    ``deepspeed.initialize``. DeepSpeed ignores the extra top-level key, so the config is passed on
    unchanged."""
    try:
        bound = inspect.signature(deepspeed.initialize).bind_partial(*args, **kwargs)
    except TypeError:
        return deepspeed.initialize(*args, **kwargs)  # let DeepSpeed report the bad call
    src = _config_source(bound.arguments)
    model = bound.arguments.get("model")
    ep_cfg = ep_plugin_config(src) if src is not None else None
    if ep_cfg is not None and model is not None:
        # Groups are left to the engine: it knows the mpu and creates them for every MoE layer.
        _convert(model, ep_cfg, create_groups=False)
    out = deepspeed.initialize(*args, **kwargs)
    monitor = getattr(out[0], "monitor", None)
    if ep_cfg is not None and model is not None and getattr(monitor, "enabled", False):
        attach_monitor(model, monitor)  # comm.stats reports go to DeepSpeed's monitor, else to logging
    return out
