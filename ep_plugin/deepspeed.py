"""DeepSpeed integration: run every ``deepspeed.moe.layer.MoE`` through EPBuffer dispatch/combine.

Turn it on in the DeepSpeed JSON config and call our ``initialize`` instead of DeepSpeed's::

    "ep_plugin": {"enabled": true, "config": "configs/tiny.yaml"}   # or an inline dict

    engine, optimizer, _, _ = ep_plugin.deepspeed.initialize(model=model, config="ds_config.json",
                                                             model_parameters=model.parameters())

With the flag off or absent, :func:`initialize` is exactly ``deepspeed.initialize``.

What changes, and what does not
-------------------------------
DeepSpeed's ``MOELayer`` packs every expert's tokens into a ``[E, capacity, H]`` buffer and
exchanges it with a dense all-to-all, so padding travels on the wire. A converted layer keeps
DeepSpeed's gate (``TopKGate``: top-1/top-2/top-k, capacity, ``drop_tokens``, random token
selection, ``l_aux``, ``exp_counts``) and DeepSpeed's experts (same modules, parameter names,
``group_name`` and ``allreduce`` flags, so optimizers, ZeRO and checkpoints see the same model), and
replaces only the communication: each (token, expert) route the gate keeps is sent once per rank
with :meth:`ep_plugin.EPBuffer.dispatch`, every local expert runs on exactly its rows, the outputs
are weighted by the gate's combine weights and returned with :meth:`~ep_plugin.EPBuffer.combine`.
A route is kept iff DeepSpeed keeps it (the gate's sparse routes mark capacity-dropped routes with
expert -1), so outputs and gradients equal DeepSpeed's, with ``drop_tokens`` on or off.

The conversion swaps the class of the ``MOELayer`` instance to :class:`EPPluginMOELayer` (a
subclass), so ``isinstance`` checks, ``state_dict`` keys and the module tree are unchanged.

One EPBuffer per (expert group, config, hidden) is shared by the layers and sized by
``comm.max_tokens_per_rank``; a layer call with more tokens on a rank raises a ``ValueError``
saying how to raise it. Kernel backends move BF16 rows: a float32 model's rows travel as BF16 there
(a warning says so once); ``comm.backend: torch`` moves float32 exactly.

Limits: experts must act on each row independently (as MLP experts do: DeepSpeed feeds them
zero-padded rows that never reach the output, we feed them no padding); tensor-parallel
non-expert layers (an ``mpu`` with tensor-parallel size > 1) and Tutel are not supported on the
ep_plugin path (an error says so; Tutel is simply not used).

DeepSpeed AutoEP (Hugging Face MoE models, no model code changes)
-----------------------------------------------------------------
Importing this module (or calling :func:`initialize`) also lets AutoEP use ep_plugin as its expert
all-to-all, next to DeepSpeed's ``"comm"`` and ``"deepep"``::

    "expert_parallel": {"enabled": true, "autoep_size": 2, "comm_backend": "ep_plugin"}

AutoEP's layers then run their exchange route (expert-grouped dispatch, combine, DeepSpeed's own
autograd and checkpoint replay) over EPBuffer, on any backend. SMs, capacity and backend come from
the ``"ep_plugin"`` section's YAML, or the section's ``comm_num_sm`` / ``comm_max_tokens_per_rank``.
:func:`install` is the one hook (checked against DeepSpeed 0.19.8), :func:`uninstall` removes it;
see :mod:`ep_plugin.integrations.deepspeed.autoep`.

The code lives in :mod:`ep_plugin.integrations.deepspeed`; this module is its public face.
"""
from .integrations.deepspeed import (
    CHECKED_DEEPSPEED_VERSIONS, EP_PLUGIN_BACKEND, SECTION, EPPluginMOELayer, autoep_ep_config,
    convert_moe_layers, ep_plugin_config, initialize, install, is_enabled, is_installed, release_buffers,
    uninstall, uses_ep_plugin,
)

__all__ = ["SECTION", "initialize", "convert_moe_layers", "ep_plugin_config", "is_enabled",
           "EPPluginMOELayer", "release_buffers", "install", "uninstall", "is_installed",
           "CHECKED_DEEPSPEED_VERSIONS", "EP_PLUGIN_BACKEND", "autoep_ep_config", "uses_ep_plugin",
           "EPPluginAutoEPLayer"]


def __getattr__(name):
    # a subclass of AutoEP's layer: importing it needs a DeepSpeed with AutoEP
    if name == "EPPluginAutoEPLayer":
        from .integrations.deepspeed.autoep_layer import EPPluginAutoEPLayer

        return EPPluginAutoEPLayer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


install()
