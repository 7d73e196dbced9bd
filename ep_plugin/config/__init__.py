"""YAML configuration of ep_plugin: schema, validation, presets and environment overrides.

One file describes routing (``moe``), communication (``comm``) and overlap (``overlap``)::

    cfg = load_config("configs/deepseek_v3.yaml")       # a path
    cfg = load_config("deepseek_v3")                    # a preset name (shipped in presets/)
    cfg = load_config({"moe": {"num_experts": 16}})     # a dict; defaults fill the rest
    cfg = load_config("tiny", {"comm.backend": "torch"})  # overrides: dotted or nested keys
    cfg.check_ep_size(4)                                # num_experts must split evenly over EP

Everything is validated at load time: unknown keys, wrong types (a bool is not an int; an int is
accepted where a float is expected), values outside their enum or range, and impossible
combinations. Failures raise :class:`ep_plugin.errors.ConfigError` (a ``ValueError``) whose message
names the source (file path, ``<dict>`` or environment variable), the dotted key and the allowed
values.

``schema.py`` the dataclasses and every list of choices; ``validate.py`` the rules and messages;
``problems.py`` how problems are collected, every one of a source reported in one ConfigError;
``io.py`` sources, overrides and presets; ``env.py`` the documented environment overrides.
"""

from ..errors import ConfigError
from .io import list_presets, load_config, preset_path, read_yaml
from .schema import (
    AUTO, BACKEND_NAMES, COMBINE_DTYPES, COMBINE_KERNELS, DISPATCH_DTYPES, DISPATCH_KERNELS, SCORE_FUNCTIONS,
    VALIDATE_MODES, CommConfig, EPConfig, MoEConfig, OverlapConfig,
)

__all__ = [
    "MoEConfig",
    "CommConfig",
    "OverlapConfig",
    "EPConfig",
    "ConfigError",
    "load_config",
    "list_presets",
    "preset_path",
    "read_yaml",
    "AUTO",
    "SCORE_FUNCTIONS",
    "BACKEND_NAMES",
    "DISPATCH_DTYPES",
    "COMBINE_DTYPES",
    "COMBINE_KERNELS",
    "DISPATCH_KERNELS",
    "VALIDATE_MODES",
]
