"""Megatron-core integration. Users import :mod:`ep_plugin.megatron` (the documented entry point,
which re-exports these and installs the hooks).

    config.py      ep_plugin YAML -> TransformerConfig fields; the EPConfig each dispatcher uses
    dispatcher.py  EPPluginTokenDispatcher (imports megatron-core; loaded by hooks.install()); under
                   torch.compile its dispatch/combine are ep_plugin.ops' custom ops
    hooks.py       install / uninstall: how megatron-core builds the dispatcher by name or as flex backend
    experts.py     GroupedMMLinear and grouped_mm_experts: grouped-GEMM experts without TransformerEngine
    grouped_mlp.py EPGroupedMLP: the same experts reading no count on the host (imports megatron-core;
                   loaded by ep_plugin.megatron on first use)
    training.py    Megatron-LM's launch path: --moe-token-dispatcher-type ep_plugin, --ep-plugin-config
                   (megatron.training's arguments; add_ep_plugin_args is its extra_args_provider)

EPBuffers come from the cache both integrations share (``integrations/buffer_cache.py``).
Importing this package does not import megatron-core.
"""
