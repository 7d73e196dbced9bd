"""The places where ep_plugin hooks megatron-core (0.19.2), and how to undo them.

megatron-core has no dispatcher registry: MoELayer.__init__ picks a class by name. install()
  - wraps MoELayer.__init__, for moe_token_dispatcher_type="ep_plugin";
  - swaps the flex dispatcher class that moe_layer uses for a factory, for
    moe_token_dispatcher_type="flex" + moe_flex_dispatcher_backend="ep_plugin";
  - wraps TransformerConfig.__post_init__: it validates "ep_plugin" with the rules of "alltoall" (so
    shared-expert overlap and overlap_moe_expert_parallel_comm are accepted, as they are for
    alltoall), refuses moe_flex_dispatcher_backend="ep_plugin" without the flex dispatcher, and,
    under Megatron-LM's launcher, attaches the --ep-plugin-config of megatron.training's global
    args to configs that select ep_plugin (training.py);
  - adds "ep_plugin" to the Literal types of TransformerConfig's moe_token_dispatcher_type and
    moe_flex_dispatcher_backend fields, from which megatron.training generates the choices of
    --moe-token-dispatcher-type and --moe-flex-dispatcher-backend (training.py says why there).
uninstall() restores all of them. Nothing else in megatron is touched.
"""
from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from .config import NAME, uses_ep_plugin
from .training import attach_from_training_args, restore_choices, widen_choices


@dataclass(frozen=True)
class _Originals:
    moe_layer_init: Callable
    flex_dispatcher: Any
    config_post_init: Callable
    field_types: Dict[str, Any]  # TransformerConfig dataclass field -> its original Literal type


_installed: Optional[_Originals] = None
_LOCK = threading.Lock()
# set while MoELayer.__init__ builds an "ep_plugin"-named layer through the flex branch
_BUILDING = threading.local()


def _flex_factory(num_local_experts, local_expert_indices, config, pg_collection=None):
    if getattr(_BUILDING, "active", False) or uses_ep_plugin(config):
        from .dispatcher import EPPluginTokenDispatcher

        return EPPluginTokenDispatcher(num_local_experts, local_expert_indices, config=config,
                                       pg_collection=pg_collection)
    return _installed.flex_dispatcher(num_local_experts, local_expert_indices, config=config,
                                      pg_collection=pg_collection)


def _moe_layer_init(self, config, *args, **kwargs):
    original = _installed.moe_layer_init
    if uses_ep_plugin(config) != "name":
        return original(self, config, *args, **kwargs)
    # MoELayer.__init__ chooses the dispatcher with an if/elif on the name: let it take the flex
    # branch (whose class is our factory) while _BUILDING is set, then restore the name.
    _BUILDING.active = True
    object.__setattr__(config, "moe_token_dispatcher_type", "flex")
    try:
        return original(self, config, *args, **kwargs)
    finally:
        object.__setattr__(config, "moe_token_dispatcher_type", NAME)
        _BUILDING.active = False


def _config_post_init(self, *args, **kwargs):
    original = _installed.config_post_init
    if getattr(self, "moe_token_dispatcher_type", None) != NAME:
        result = original(self, *args, **kwargs)
    else:
        # validate "ep_plugin" with alltoall's rules (same capabilities: dropless, overlaps)
        object.__setattr__(self, "moe_token_dispatcher_type", "alltoall")
        try:
            result = original(self, *args, **kwargs)
        finally:
            object.__setattr__(self, "moe_token_dispatcher_type", NAME)
    if (getattr(self, "moe_flex_dispatcher_backend", None) == NAME
            and getattr(self, "moe_token_dispatcher_type", None) not in ("flex", NAME)):
        # megatron would silently run its own dispatcher (as it refuses for its "ncclep" backend)
        raise ValueError(
            f"moe_flex_dispatcher_backend='{NAME}' requires moe_token_dispatcher_type='flex' "
            f"(got {self.moe_token_dispatcher_type!r}); or set moe_token_dispatcher_type='{NAME}'")
    if uses_ep_plugin(self):
        attach_from_training_args(self)  # Megatron-LM's --ep-plugin-config (training.py); else nothing
    return result


def install() -> None:
    """Hook megatron-core so that moe_token_dispatcher_type="ep_plugin" and
    flex + moe_flex_dispatcher_backend="ep_plugin" build EPPluginTokenDispatcher, and so that
    megatron.training's arguments accept both (see the module docstring). Idempotent; done on
    import of ep_plugin.megatron when megatron-core is importable."""
    global _installed
    with _LOCK:
        if _installed is not None:
            return
        from megatron.core.transformer import transformer_config as tc_mod
        from megatron.core.transformer.moe import moe_layer as ml_mod

        from . import dispatcher  # noqa: F401  (megatron is importable: fail here, not in a forward)

        _installed = _Originals(moe_layer_init=ml_mod.MoELayer.__init__,
                                flex_dispatcher=ml_mod.MoEFlexTokenDispatcher,
                                config_post_init=tc_mod.TransformerConfig.__post_init__,
                                field_types=widen_choices(tc_mod.TransformerConfig))
        _moe_layer_init.__wrapped__ = _installed.moe_layer_init
        _config_post_init.__wrapped__ = _installed.config_post_init
        ml_mod.MoELayer.__init__ = _moe_layer_init
        ml_mod.MoEFlexTokenDispatcher = _flex_factory
        tc_mod.TransformerConfig.__post_init__ = _config_post_init


def uninstall() -> None:
    """Restore megatron-core's MoELayer.__init__, flex dispatcher class, config validation and the
    dispatcher fields' Literal types (megatron.training then refuses "ep_plugin" again)."""
    global _installed
    with _LOCK:
        if _installed is None:
            return
        from megatron.core.transformer import transformer_config as tc_mod
        from megatron.core.transformer.moe import moe_layer as ml_mod

        ml_mod.MoELayer.__init__ = _installed.moe_layer_init
        ml_mod.MoEFlexTokenDispatcher = _installed.flex_dispatcher
        tc_mod.TransformerConfig.__post_init__ = _installed.config_post_init
        restore_choices(tc_mod.TransformerConfig, _installed.field_types)
        _installed = None


def is_installed() -> bool:
    return _installed is not None


def install_if_available() -> bool:
    """install() when megatron-core is importable; otherwise warn once and leave megatron alone
    (so that `import ep_plugin.megatron` works without it). True when the hooks are in."""
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        warnings.warn("ep_plugin.megatron: megatron-core is not importable; hooks not installed")
        return False
    install()
    return True
