"""Loading: sources (path, preset name, dict, EPConfig), YAML reading, overrides, preset lookup.

Precedence, lowest first: schema defaults, the source, the ``overrides`` argument, the documented
environment variables (``env.py``).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import yaml

from ..errors import ConfigError
from . import env
from .schema import SECTIONS, EPConfig
from .problems import Context, Problem, config_error
from .validate import validate

# Shipped inside the package (setup.py package_data) so a wheel has them; configs/ in the
# repository holds links to these files.
PRESET_DIR = Path(__file__).resolve().parent / "presets"


def _preset_dirs() -> List[Path]:
    extra = env.preset_dir()
    return [d for d in ([extra] if extra else []) + [PRESET_DIR] if d.is_dir()]


def list_presets() -> List[str]:
    """Names of the presets (``EP_PLUGIN_CONFIG_DIR`` first, then the shipped ones)."""
    names = set()
    for d in _preset_dirs():
        names.update(p.stem for p in d.glob("*.yaml"))
        names.update(p.stem for p in d.glob("*.yml"))
    return sorted(names)


def _searched() -> str:
    where = [str(PRESET_DIR)]
    extra = env.preset_dir()
    if extra:  # a mistyped directory should show up here rather than as a missing preset
        missing = "" if extra.is_dir() else " (not a directory)"
        where.insert(0, f"{env.CONFIG_DIR}={extra}{missing}")
    return ", ".join(where)


def preset_path(name: str) -> Path:
    """Path of preset ``name`` (with or without ``.yaml``); ConfigError if there is none."""
    stem = name[:-5] if name.endswith(".yaml") else name[:-4] if name.endswith(".yml") else name
    for d in _preset_dirs():
        for ext in (".yaml", ".yml"):
            p = d / (stem + ext)
            if p.is_file():
                return p
    raise ConfigError(
        f"{name}: no such config file or preset; presets: {', '.join(list_presets()) or '(none)'} "
        f"(searched {_searched()})"
    )


def _resolve_path(src: Union[str, os.PathLike]) -> Path:
    p = Path(os.fspath(src)).expanduser()
    if p.is_file():
        return p
    s = os.fspath(src)
    if os.sep not in s and "/" not in s:  # a bare name: a preset (with or without .yaml)
        return preset_path(s)
    raise ConfigError(
        f"{s}: config file not found; give a path to a YAML file or a preset name "
        f"({', '.join(list_presets()) or 'no presets found'})"
    )


def _duplicate_keys(node: Any, path: str = "") -> List[Problem]:
    """Every key written twice in one mapping of a composed YAML tree: (dotted key, both lines)."""
    found: List[Problem] = []
    if isinstance(node, yaml.MappingNode):
        seen: Dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges, it is not a key
                continue
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else repr(key_node.value)
            dotted = f"{path}.{key}" if path else key
            line = key_node.start_mark.line + 1
            if key in seen:
                found.append(Problem("", dotted, f"written twice (lines {seen[key]} and {line}); YAML would "
                                                 f"keep the second silently: keep one"))
            else:
                seen[key] = line
            found += _duplicate_keys(value_node, dotted)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found += _duplicate_keys(item, f"{path}[{i}]")
    return found


def read_with_problems(path: Union[str, os.PathLike]) -> Tuple[Any, List[Problem]]:
    """(the data, a Problem for each key written twice) of the YAML file at ``path``; ConfigError if it
    cannot be read or is not YAML. For callers that report these with the file's other problems."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from exc
    try:
        dups = _duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader))
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return data, [Problem(str(path), p.key, p.msg) for p in dups]


def read_yaml(path: Union[str, os.PathLike]) -> Any:
    """The YAML file at ``path`` as Python data (yaml.safe_load), or ConfigError naming the file: not
    readable, not valid YAML, or a key written twice in one mapping (every such key, with both lines;
    PyYAML alone keeps the last one silently)."""
    data, dups = read_with_problems(path)
    if dups:
        raise config_error(str(path), dups)
    return data


def _apply_overrides(raw: Dict[str, Any], overrides: Mapping, source: str) -> List[str]:
    """Merge ``overrides`` (nested or dotted keys) into ``raw``; return the dotted keys touched."""
    if not isinstance(overrides, Mapping):
        raise ConfigError(
            f"{source} (overrides): overrides must be a dict, got {type(overrides).__name__}"
        )
    touched = []
    for key, value in overrides.items():
        if not isinstance(key, str):
            raise ConfigError(f"{source} (overrides): keys must be strings, got {key!r}")
        if "." in key:
            sec, _, sub = key.partition(".")
            if "." in sub or not sub:
                raise ConfigError(
                    f"{source} (overrides): {key}: dotted keys have the form section.key; "
                    f"allowed sections: {', '.join(SECTIONS)}"
                )
            items = [(sec, {sub: value})]
        else:
            items = [(key, value)]
        for sec, body in items:
            if isinstance(body, Mapping) and isinstance(raw.get(sec, {}) or {}, Mapping):
                merged = dict(raw.get(sec) or {})
                merged.update(body)
                raw[sec] = merged
                touched += [f"{sec}.{k}" for k in body]
            else:
                raw[sec] = body
                touched.append(sec)
    return touched


def _apply_env(raw: Any, found: Mapping[str, Any]) -> Any:
    """``raw`` with the environment's (already checked) values; a malformed ``raw`` is left for
    validate() to report against its own source."""
    if not found or not (raw is None or isinstance(raw, Mapping)):
        return raw
    raw = dict(raw or {})
    for dotted, value in found.items():
        *path, key = dotted.split(".")  # section.key, or section.subsection.key
        node = raw
        for part in path:
            body = node.get(part)
            if not (body is None or isinstance(body, Mapping)):
                break  # malformed: validate() reports it
            node[part] = node = dict(body or {})
        else:
            node[key] = value
    return raw


def load_config(
    src: Union[str, os.PathLike, Mapping, EPConfig, None] = None,
    overrides: Optional[Mapping] = None,
    *,
    source: Optional[str] = None,
) -> EPConfig:
    """Load and validate a configuration.

    ``src``: a YAML path, a preset name (``"deepseek_v3"``: ``configs/deepseek_v3.yaml``), a dict
    with the schema's sections, an :class:`EPConfig` (re-validated), or ``None`` for defaults.
    ``overrides``: nested (``{"comm": {"backend": "torch"}}``) or dotted (``{"comm.backend":
    "torch"}``) keys applied on top. The environment variables of ``ep_plugin.config.env`` are
    applied last and win. ``source``: what the messages name as the origin of a dict (e.g. the file
    it was read from; ``<dict>`` when not given). Raises one :class:`ConfigError` naming every problem
    of the source (its ``.problems`` lists them).
    """
    dups: List[Problem] = []
    if isinstance(src, EPConfig):
        source = source or src.source or "<EPConfig>"
        raw: Any = src.to_dict()
    elif src is None:
        source, raw = source or "<defaults>", {}
    elif isinstance(src, Mapping):
        source, raw = source or "<dict>", copy.deepcopy(dict(src))
    elif isinstance(src, (str, os.PathLike)):
        path = _resolve_path(src)
        source = str(path)
        raw, dups = read_with_problems(path)  # keys written twice: reported with the file's other problems
    else:
        raise ConfigError(
            f"<{type(src).__name__}>: cannot load a config from {type(src).__name__}; allowed: "
            f"a YAML path, a preset name ({', '.join(list_presets())}), a dict, an EPConfig or None"
        )
    touched: List[str] = []
    if overrides:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{source}: the top level must be a mapping, got {type(raw).__name__}")
        raw = dict(raw)
        touched = _apply_overrides(raw, overrides, source)
    raw = _apply_env(raw, env.key_overrides())
    ctx = Context(source, touched)
    ctx.problems += dups
    return validate(raw, ctx)
