"""The ``"ep_plugin"`` section of a DeepSpeed JSON config, and the ep_plugin YAML it names.

    "ep_plugin": {"enabled": true, "config": "ep_plugin.yaml", "overrides": {"comm.backend": "torch"}}

A DeepSpeed config arrives as a dict, a path to a (h)JSON file, a base64 JSON string or a
``DeepSpeedConfig``; a relative YAML path is tried against the working directory, then the JSON
file's directory. Every problem is a :class:`~ep_plugin.ConfigError` naming the section key.
"""
from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from ...config import EPConfig, list_presets, load_config
from ...errors import ConfigError

logger = logging.getLogger("ep_plugin.deepspeed")

SECTION = "ep_plugin"
SECTION_KEYS = {
    "enabled": "true | false: run DeepSpeed MoE layers through ep_plugin",
    "config": "path to an ep_plugin YAML file, a preset name, or an inline dict",
    "overrides": "dict of ep_plugin config overrides, e.g. {\"comm.backend\": \"torch\"}",
}
# deepspeed.runtime.constants spells it this way; we read it to create groups as the engine would.
USE_DATA_BEFORE_EP = "use_data_before_expert_parallelism"


def read_ds_config(ds_config) -> Tuple[Dict[str, Any], Optional[Path]]:
    """The DeepSpeed config as a dict, and the directory of its file (for relative YAML paths)."""
    if ds_config is None:
        return {}, None
    if isinstance(ds_config, Mapping):
        return dict(ds_config), None
    pd = getattr(ds_config, "_param_dict", None)  # a deepspeed.runtime.config.DeepSpeedConfig
    if isinstance(pd, Mapping):
        return dict(pd), None
    if isinstance(ds_config, (str, os.PathLike)):
        path = Path(os.fspath(ds_config)).expanduser()
        if path.is_file():
            import hjson  # DeepSpeed reads its JSON configs with hjson (comments allowed)
            with open(path, "r", encoding="utf-8") as f:
                try:
                    return dict(hjson.load(f)), path.resolve().parent
                except Exception as exc:  # hjson raises its own HjsonDecodeError
                    raise ConfigError(f"{path}: not a valid DeepSpeed JSON config: {exc}") from exc
        from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
        try:  # DeepSpeed also accepts a base64-encoded JSON string
            return dict(load_ds_config(os.fspath(ds_config))), None
        except ValueError as exc:
            raise ConfigError(f"DeepSpeed config {os.fspath(ds_config)!r}: file not found and not "
                              f"base64-encoded JSON") from exc
    raise ConfigError(f"DeepSpeed config must be a dict, a path to a JSON file or a DeepSpeedConfig, "
                      f"got {type(ds_config).__name__}")


def _resolve_yaml(src, base_dir: Optional[Path]):
    """Resolve a relative YAML path against the working directory, then the DeepSpeed config's."""
    if not isinstance(src, (str, os.PathLike)):
        return src
    s = os.fspath(src)
    p = Path(s).expanduser()
    if p.is_file():
        return str(p)
    if base_dir is not None and not p.is_absolute() and (base_dir / p).is_file():
        return str(base_dir / p)
    looks_like_file = "/" in s or os.sep in s or s.endswith((".yaml", ".yml"))
    if looks_like_file:
        where = f"the working directory {os.getcwd()}"
        if base_dir is not None and not p.is_absolute():
            where += f" or next to the DeepSpeed config ({base_dir})"
        raise ConfigError(f"DeepSpeed config '{SECTION}.config': file not found: {s!r} (looked in {where}); "
                          f"give a path to an ep_plugin YAML file, a preset name "
                          f"({', '.join(list_presets()) or 'none found'}) or an inline dict")
    return s  # a preset name: load_config resolves it (or says which presets exist)


def _section(ds: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    sec = ds.get(SECTION)
    if sec is None:
        return None
    if isinstance(sec, bool):  # "ep_plugin": true -- accept the short form
        return {"enabled": sec}
    if not isinstance(sec, Mapping):
        raise ConfigError(f"DeepSpeed config '{SECTION}' must be an object like "
                          f"{{\"enabled\": true, \"config\": \"<yaml>\"}}, got {type(sec).__name__}: {sec!r}")
    for key in sec:
        if key not in SECTION_KEYS:
            close = difflib.get_close_matches(str(key), list(SECTION_KEYS), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            allowed = "; ".join(f"{k}: {v}" for k, v in SECTION_KEYS.items())
            raise ConfigError(f"DeepSpeed config '{SECTION}': unknown key {key!r}{hint}; allowed keys: {allowed}")
    if "enabled" in sec and not isinstance(sec["enabled"], bool):
        raise ConfigError(f"DeepSpeed config '{SECTION}.enabled' must be true or false, "
                          f"got {sec['enabled']!r} ({type(sec['enabled']).__name__})")
    cfg = sec.get("config")
    if cfg is not None and not isinstance(cfg, (str, os.PathLike, Mapping)):
        raise ConfigError(f"DeepSpeed config '{SECTION}.config' must be a path to an ep_plugin YAML file, "
                          f"a preset name or an inline dict, got {type(cfg).__name__}: {cfg!r}")
    ov = sec.get("overrides")
    if ov is not None and not isinstance(ov, Mapping):
        raise ConfigError(f"DeepSpeed config '{SECTION}.overrides' must be a dict, got {type(ov).__name__}")
    return dict(sec)


def ep_plugin_config(ds_config) -> Optional[EPConfig]:
    """Validate the ``ep_plugin`` section of a DeepSpeed config (dict, JSON path or DeepSpeedConfig).

    Returns the loaded :class:`~ep_plugin.EPConfig` when the flag is on, ``None`` when it is off or
    absent. Raises :class:`~ep_plugin.ConfigError` (a ``ValueError``) for a bad section: unknown
    keys or wrong types (on or off), a missing YAML file or an invalid ep_plugin config (on).
    """
    ds, base_dir = read_ds_config(ds_config)
    sec = _section(ds)
    if sec is None:
        return None
    if not sec.get("enabled", False):  # off: the section's keys are checked, its files are not read
        if "enabled" not in sec:
            logger.warning("DeepSpeed config '%s' has no 'enabled' key: ep_plugin stays off "
                           "(add \"enabled\": true to use it)", SECTION)
        return None
    src = _resolve_yaml(sec.get("config"), base_dir)
    try:
        return load_config(src, sec.get("overrides"))
    except ConfigError as exc:
        raise ConfigError(f"DeepSpeed config '{SECTION}.config': {exc}") from exc


def is_enabled(ds_config) -> bool:
    """Whether a DeepSpeed config turns ep_plugin on (validates the section)."""
    return ep_plugin_config(ds_config) is not None
