"""Megatron-core (0.19.2) integration: ep_plugin as a MoE token dispatcher.

    import ep_plugin.megatron                      # installs the hooks (see install())
    config = TransformerConfig(..., moe_token_dispatcher_type="ep_plugin")

or, as a backend of megatron's flex dispatcher (what megatron's own scheduling code expects for
shared-expert overlap and overlap_moe_expert_parallel_comm):

    config = TransformerConfig(..., moe_token_dispatcher_type="flex",
                               moe_flex_dispatcher_backend="ep_plugin")

Routing, overlap and communication settings can come from one ep_plugin YAML file:

    fields = ep_plugin.megatron.config_from_yaml("configs/deepseek_v3.yaml", **{"comm.backend": "auto"})
    config = TransformerConfig(num_layers=..., hidden_size=..., **fields)
    ep_plugin.megatron.attach_config(config, "configs/deepseek_v3.yaml")   # comm/overlap for this model

Megatron-LM's launcher (megatron.training, e.g. pretrain_gpt.py): after this import its arguments
accept `--moe-token-dispatcher-type ep_plugin` (and `--moe-flex-dispatcher-backend ep_plugin`); pass
add_ep_plugin_args as extra_args_provider for `--ep-plugin-config YAML`, which is attached to the
TransformerConfigs megatron.training builds:

    args = parse_and_validate_args(extra_args_provider=ep_plugin.megatron.add_ep_plugin_args)

The dispatcher sends each token once to every rank that owns one of its experts (EPBuffer.dispatch),
then sorts the received (row, expert) pairs into the expert-grouped layout megatron's experts take,
with the matching routing probabilities; megatron's experts apply those probabilities exactly as with
the `alltoall` dispatcher. After the experts it sums each row's expert outputs (un-permute) and
combines them back (EPBuffer.combine). Forward and backward match `alltoall` (tests/test_megatron.py).
All layers share one EPBuffer per (EP group, config, hidden), sized by comm.max_tokens_per_rank.

Experts that read no count on the host: EPGroupedMLP (TEGroupedMLP's module and weights, the layout
of grouped_mm_experts(): fc1/fc2 [G, out, in]) takes tokens_per_expert on the device and the rows of
a dispatch sized for the worst case (comm.host_sync: false, the default), so the layer's forward
never waits for the GPU:

    layer = MoELayer(config=config, submodules=MoESubmodules(experts=ep_plugin.megatron.EPGroupedMLP))

This module is the entry point and only re-exports; the code lives in ep_plugin/integrations/:
megatron/config.py (YAML bridge), megatron/dispatcher.py (EPPluginTokenDispatcher; imports
megatron-core, so it is loaded by install() and on first use), megatron/hooks.py (install /
uninstall), megatron/training.py (megatron.training's arguments; never imports megatron.training),
megatron/experts.py (grouped-GEMM experts) and buffer_cache.py (the EPBuffer cache shared with the
DeepSpeed integration). CPU stand-ins for tests and examples: ep_plugin.testing.
"""
from .integrations.buffer_cache import cached_buffers, clear_buffers
from .integrations.megatron.config import (
    NAME, attach_config, config_from_yaml,
)
from .integrations.megatron.experts import GroupedMMLinear, group_ends, grouped_mm_experts, torch_grouped_mm
from .integrations.megatron.hooks import install, install_if_available, is_installed, uninstall
from .integrations.megatron.training import add_ep_plugin_args, load_training_config

__all__ = [
    "NAME",
    "EPPluginTokenDispatcher",
    "install",
    "uninstall",
    "is_installed",
    "config_from_yaml",
    "attach_config",
    "add_ep_plugin_args",
    "load_training_config",
    "cached_buffers",
    "clear_buffers",
    "GroupedMMLinear",
    "EPGroupedMLP",
    "group_ends",
    "grouped_mm_experts",
    "torch_grouped_mm",
]


def __getattr__(name):
    # these classes subclass megatron's: importing them needs megatron-core
    if name == "EPPluginTokenDispatcher":
        from .integrations.megatron.dispatcher import EPPluginTokenDispatcher

        return EPPluginTokenDispatcher
    if name == "EPGroupedMLP":
        from .integrations.megatron.grouped_mlp import EPGroupedMLP

        return EPGroupedMLP
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


install_if_available()
