"""Megatron-LM's launch path: ep_plugin selected in megatron.training's arguments (or its YAML).

Checked against megatron-core 0.19.2 (its megatron/training is that of the core_v0.19.0 tag).

    import ep_plugin.megatron as epm               # installs the hooks (hooks.py)
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=epm.add_ep_plugin_args)
    # torchrun ... --moe-token-dispatcher-type ep_plugin --ep-plugin-config my_ep.yaml
    # or           --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend ep_plugin

Three steps, and why each sits where it does:

1. The choice. megatron.training generates --moe-token-dispatcher-type and
   --moe-flex-dispatcher-backend from the ``Literal`` types of TransformerConfig's dataclass fields
   (argument_utils.ArgumentGroupFactory), so "ep_plugin" is refused there. install() adds
   "ep_plugin" to those two field types (widen_choices below; the Field objects only, not the
   class annotations) and uninstall() puts the originals back. Widening the types rather than one
   parser matters: megatron.training parses sys.argv again with its bare parser, where no
   extra_args_provider reaches: pretrain() itself (ft_integration.setup) and pretrain_gpt.py's
   inprocess_restart.maybe_wrap_for_inprocess_restart; with the choice refused there, they exit.
2. --ep-plugin-config: add_ep_plugin_args(parser), the extra_args_provider, adds it. The value is
   loaded while parsing, so a missing file or an invalid YAML is an argparse error naming the
   option; args keep the string (megatron pickles args into its checkpoints).
3. The TransformerConfig. megatron.training builds TransformerConfigs from its global args in
   several places (core_transformer_config_from_args via gpt_config_from_args, gpt_builders and
   pretrain_gpt's get_batch, which bind it by name at import; core_transformer_config_from_yaml for
   --yaml-cfg). Rather than wrap each, the TransformerConfig.__post_init__ hook that validates
   "ep_plugin" (hooks.py) also attaches, with attach_config, the --ep-plugin-config of
   megatron.training's global args (set by parse_and_validate_args; with --yaml-cfg, a top-level
   ``ep_plugin_config:`` key) to every config that selects ep_plugin and has none attached yet.
   megatron.training is never imported here: its global args are read only when it is loaded.

Megatron's arguments define the model and its routing (--num-experts, --moe-router-topk, ...);
the ep_plugin YAML's comm settings configure the dispatchers (as with attach_config). A YAML that
also carries the ``model:`` and ``train:`` sections of examples/megatron/'s files is accepted; those
two sections are skipped.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
import typing
from typing import Any, Dict, Optional, Tuple

from ...config import EPConfig, load_config
from ...errors import ConfigError
from .config import NAME, attach_config

OPTION = "--ep-plugin-config"
DEST = "ep_plugin_config"
# the TransformerConfig fields megatron.training turns into choices-restricted options
CHOICE_FIELDS = ("moe_token_dispatcher_type", "moe_flex_dispatcher_backend")
# top-level sections of examples/megatron/*.yaml that belong to the example scripts, not to ep_plugin
_FOREIGN_SECTIONS = ("model", "train")

_CACHE: Dict[Tuple[str, int], EPConfig] = {}
_CACHE_LOCK = threading.Lock()


# ------------------------------------------------------------------------------------ 1. choices

def widen_choices(config_cls) -> Dict[str, Any]:
    """Add "ep_plugin" to the Literal types of config_cls's dispatcher fields (CHOICE_FIELDS).
    Returns {field: original type} for restore_choices(); a field that is missing or not a Literal
    (another megatron-core version) is left alone."""
    saved: Dict[str, Any] = {}
    fields = getattr(config_cls, "__dataclass_fields__", {})
    for name in CHOICE_FIELDS:
        f = fields.get(name)
        if f is None or typing.get_origin(f.type) is not typing.Literal:
            continue
        choices = typing.get_args(f.type)
        if NAME in choices:
            continue
        saved[name] = f.type
        f.type = typing.Literal[choices + (NAME,)]
    return saved


def restore_choices(config_cls, saved: Dict[str, Any]) -> None:
    """Undo widen_choices()."""
    fields = getattr(config_cls, "__dataclass_fields__", {})
    for name, original in saved.items():
        if name in fields:
            fields[name].type = original


# ------------------------------------------------------------------------------- 2. the option

def add_ep_plugin_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """megatron.training extra_args_provider: adds --ep-plugin-config YAML (a path or a preset name).

    Pass it to parse_and_validate_args(extra_args_provider=...) (compose with your own provider:
    ``lambda p: add_ep_plugin_args(my_provider(p))``). The dispatcher choices themselves come from
    the hooks that `import ep_plugin.megatron` installs. Idempotent; returns the parser."""
    if any(OPTION in a.option_strings for a in parser._actions):
        return parser
    group = parser.add_argument_group(
        title="ep_plugin",
        description="ep_plugin MoE dispatcher: --moe-token-dispatcher-type ep_plugin, or flex with "
                    "--moe-flex-dispatcher-backend ep_plugin")
    group.add_argument(
        OPTION, dest=DEST, default=None, type=_checked_config, metavar="YAML",
        help="ep_plugin config (YAML path or preset name) attached to the TransformerConfig of "
             "MoE layers whose dispatcher is ep_plugin: its comm section (backend, SMs, "
             "max_tokens_per_rank, timeouts, stats) configures their EPBuffer. Routing comes from "
             "Megatron's own --num-experts/--moe-router-* arguments.")
    return parser


def _checked_config(value: str) -> str:
    """argparse type of --ep-plugin-config: load it now (errors become argparse errors); keep the
    string, made absolute for a file so that it does not depend on a later working directory."""
    try:
        load_training_config(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    p = os.path.expanduser(value)
    return os.path.abspath(p) if os.path.isfile(p) else value


def load_training_config(value) -> EPConfig:
    """The EPConfig of an --ep-plugin-config value: a YAML path or preset name (or anything
    ep_plugin.load_config takes). A file's ``model:``/``train:`` sections (examples/megatron/'s
    files) are skipped; everything else is validated as usual. Cached per path and mtime."""
    if not isinstance(value, (str, os.PathLike)):
        return load_config(value)
    path = os.path.expanduser(os.fspath(value))
    if not os.path.isfile(path):
        return load_config(value)  # a preset name, or ConfigError naming what is missing
    key = (os.path.abspath(path), os.stat(path).st_mtime_ns)
    with _CACHE_LOCK:
        cfg = _CACHE.get(key)
    if cfg is not None:
        return cfg
    cfg = _load_file(path)
    with _CACHE_LOCK:
        _CACHE[key] = cfg
    return cfg


def _load_file(path: str) -> EPConfig:
    import yaml

    try:
        with open(path, "r", encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return load_config(path)  # load_config words the error
    if not (isinstance(raw, dict) and any(k in raw for k in _FOREIGN_SECTIONS)):
        return load_config(path)
    raw = {k: v for k, v in raw.items() if k not in _FOREIGN_SECTIONS}
    try:
        cfg = load_config(raw)
    except ConfigError as exc:  # name the file, not "<dict>"
        msg = str(exc)
        msg = path + msg[len("<dict>"):] if msg.startswith("<dict>") else f"{path}: {msg}"
        raise ConfigError(msg) from None
    return dataclasses.replace(cfg, source=path)


# --------------------------------------------------------------------- 3. the TransformerConfig

def training_args():
    """megatron.training's global args when megatron.training is loaded and they are set (by
    parse_and_validate_args / set_global_variables), else None. Never imports megatron."""
    gv = sys.modules.get("megatron.training.global_vars")
    return getattr(gv, "_GLOBAL_ARGS", None) if gv is not None else None


def config_from_training_args() -> Optional[EPConfig]:
    """The EPConfig named by megatron.training's global args (--ep-plugin-config, or the
    ``ep_plugin_config`` key of a --yaml-cfg file); None when there is none."""
    value = getattr(training_args(), DEST, None)
    return None if value is None else load_training_config(value)


def attach_from_training_args(transformer_config) -> Optional[EPConfig]:
    """Attach config_from_training_args() to a TransformerConfig that has no ep_plugin config yet
    (called by the TransformerConfig.__post_init__ hook for configs that select ep_plugin)."""
    if getattr(transformer_config, "ep_plugin_config", None) is not None:
        return None
    cfg = config_from_training_args()
    if cfg is not None:
        attach_config(transformer_config, cfg)
    return cfg
