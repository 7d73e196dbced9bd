"""DeepSpeed integration: run every ``deepspeed.moe.layer.MoE`` through EPBuffer dispatch/combine.

Users import :mod:`ep_plugin.deepspeed` (the documented entry point, which re-exports this).

    section.py   the "ep_plugin" section of the DeepSpeed JSON config and the YAML it names
    layer.py     EPPluginMOELayer: DeepSpeed's gate and experts, ep_plugin's dispatch/combine
    gate_scan.py the gate's capacity scan (cumsum over tokens) computed along rows on CUDA, same numbers
    convert.py   convert_moe_layers (class swap in place) and initialize (deepspeed.initialize + flag)
    autoep.py    install / uninstall: the one hook that gives DeepSpeed AutoEP comm_backend="ep_plugin"
    autoep_config.py, autoep_exchange.py, autoep_layer.py   its config, exchange and layer

EPBuffers come from the cache both integrations share (``integrations/buffer_cache.py``);
``release_buffers`` is its ``clear_buffers`` and closes every cached buffer, Megatron's included.
"""
from ..buffer_cache import clear_buffers as release_buffers
from .autoep import CHECKED_DEEPSPEED_VERSIONS, install, is_installed, uninstall
from .autoep_config import EP_PLUGIN_BACKEND, autoep_ep_config, uses_ep_plugin
from .convert import convert_moe_layers, initialize
from .layer import EPPluginMOELayer
from .section import SECTION, ep_plugin_config, is_enabled

__all__ = ["SECTION", "initialize", "convert_moe_layers", "ep_plugin_config", "is_enabled",
           "EPPluginMOELayer", "release_buffers", "install", "uninstall", "is_installed",
           "CHECKED_DEEPSPEED_VERSIONS", "EP_PLUGIN_BACKEND", "autoep_ep_config", "uses_ep_plugin"]
