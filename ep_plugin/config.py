"""YAML configuration of ep_plugin: schema, validation and presets.

One file describes routing (``moe``), communication (``comm``) and overlap (``overlap``)::

    cfg = load_config("configs/deepseek_v3.yaml")       # a path
    cfg = load_config("deepseek_v3")                    # a preset name (configs/<name>.yaml)
    cfg = load_config({"moe": {"num_experts": 16}})     # a dict; defaults fill the rest
    cfg = load_config("tiny", {"comm.backend": "torch"})  # overrides: dotted or nested keys
    cfg.check_ep_size(4)                                # num_experts must split evenly over EP

Everything is validated at load time: unknown keys, wrong types (a bool is not an int; an int is
accepted where a float is expected), values outside their enum or range, and impossible
combinations. Failures raise :class:`ep_plugin.errors.ConfigError` (a ``ValueError``) whose message
names the source (file path or ``<dict>``), the dotted key and the allowed values.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import yaml

from .errors import ConfigError

__all__ = [
    "MoEConfig",
    "CommConfig",
    "OverlapConfig",
    "EPConfig",
    "load_config",
    "list_presets",
    "preset_path",
    "SCORE_FUNCTIONS",
    "BACKENDS",
    "DISPATCH_DTYPES",
    "COMBINE_DTYPES",
]

SCORE_FUNCTIONS = ("softmax", "sigmoid")
BACKENDS = ("auto", "torch", "nvlink", "nvshmem")
DISPATCH_DTYPES = ("bf16", "fp8")
COMBINE_DTYPES = ("bf16",)


# --------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------


@dataclass
class MoEConfig:
    """Routing: how many experts, how many per token, and how they are scored."""

    num_experts: int = 8
    topk: int = 2
    num_groups: Optional[int] = None  # group-limited routing: experts form num_groups groups
    group_topk: Optional[int] = None  # ... and each token keeps its best group_topk groups
    score_function: str = "softmax"  # softmax | sigmoid
    topk_scaling_factor: Optional[float] = None  # multiply the top-k weights by this
    expert_bias: bool = False  # aux-loss-free balancing: select on score + bias (sigmoid only)
    use_pre_softmax: bool = False  # softmax over all experts before top-k (no renormalisation)


@dataclass
class CommConfig:
    """Communication: which transport, how many SMs, dtypes, buffer sizing, timeouts."""

    backend: str = "auto"  # auto | torch | nvlink | nvshmem
    num_sms: int = 24
    dispatch_dtype: str = "bf16"  # bf16 | fp8
    combine_dtype: str = "bf16"  # bf16
    max_tokens_per_rank: int = 4096
    timeout_s: float = 60.0


@dataclass
class OverlapConfig:
    """Overlap of communication with compute."""

    async_dispatch: bool = False
    shared_expert_overlap: bool = False
    recv_hook: bool = False


@dataclass
class EPConfig:
    """A whole, validated ep_plugin configuration (build it with :func:`load_config`)."""

    moe: MoEConfig = field(default_factory=MoEConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    source: Optional[str] = None  # file it was read from, or "<dict>" / "<defaults>"

    def to_dict(self) -> Dict[str, Dict[str, Any]]:
        """Plain nested dict of the schema keys (no ``source``); ``load_config`` accepts it back."""
        return {name: dataclasses.asdict(getattr(self, name)) for name in _SECTIONS}

    def check_ep_size(self, ep_size: int) -> None:
        """Raise ConfigError unless the experts split evenly and contiguously over ``ep_size`` ranks."""
        where = self.source or "<EPConfig>"
        if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
            raise ConfigError(
                f"{where}: expert-parallel size must be a positive int, got {ep_size!r}"
            )
        e = self.moe.num_experts
        if e % ep_size != 0:
            raise ConfigError(
                f"{where}: moe.num_experts = {e} is not divisible by the expert-parallel size "
                f"{ep_size}; allowed EP sizes for {e} experts: {_divisors(e)}"
            )

    def num_local_experts(self, ep_size: int) -> int:
        """Experts held by each rank of an EP group of ``ep_size`` (validated)."""
        self.check_ep_size(ep_size)
        return self.moe.num_experts // ep_size


_SECTIONS: Dict[str, type] = {"moe": MoEConfig, "comm": CommConfig, "overlap": OverlapConfig}


# --------------------------------------------------------------------------------------------
# Per-key rules: (kind, allowed) where kind is "int", "float", "bool", "enum"
# --------------------------------------------------------------------------------------------

_POS_INT = ("int", "a positive int (>= 1)")
_OPT_POS_INT = ("opt_int", "null or a positive int (>= 1)")
_BOOL = ("bool", "true | false")

_RULES: Dict[str, Dict[str, Tuple[str, Any]]] = {
    "moe": {
        "num_experts": _POS_INT,
        "topk": _POS_INT,
        "num_groups": _OPT_POS_INT,
        "group_topk": _OPT_POS_INT,
        "score_function": ("enum", SCORE_FUNCTIONS),
        "topk_scaling_factor": ("opt_float", "null or a float > 0"),
        "expert_bias": _BOOL,
        "use_pre_softmax": _BOOL,
    },
    "comm": {
        "backend": ("enum", BACKENDS),
        "num_sms": _POS_INT,
        "dispatch_dtype": ("enum", DISPATCH_DTYPES),
        "combine_dtype": ("enum", COMBINE_DTYPES),
        "max_tokens_per_rank": _POS_INT,
        "timeout_s": ("float", "a float > 0 (seconds)"),
    },
    "overlap": {
        "async_dispatch": _BOOL,
        "shared_expert_overlap": _BOOL,
        "recv_hook": _BOOL,
    },
}

# Keep the rule table and the dataclasses in step.
for _s, _cls in _SECTIONS.items():
    assert set(_RULES[_s]) == {f.name for f in dataclasses.fields(_cls)}, _s


def _divisors(n: int):
    return [d for d in range(1, n + 1) if n % d == 0]


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _suggest(key: str, allowed) -> str:
    close = difflib.get_close_matches(key, list(allowed), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


class _Ctx:
    """Where values come from, for error messages."""

    def __init__(self, source: str, override_keys=()):
        self.source = source
        self.override_keys = set(override_keys)

    def where(self, dotted: str) -> str:
        if dotted in self.override_keys or dotted.split(".")[0] in self.override_keys:
            return f"{self.source} (overrides)"
        return self.source

    def fail(self, dotted: str, msg: str) -> "ConfigError":
        return ConfigError(f"{self.where(dotted)}: {dotted}: {msg}")


def _fmt_allowed(allowed) -> str:
    if isinstance(allowed, (tuple, list)):
        return " | ".join(str(a) for a in allowed)
    return str(allowed)


def _check_value(ctx: _Ctx, dotted: str, kind: str, allowed, value):
    """Type/range check one value; return it normalised (ints to floats where floats expected)."""
    bad = lambda what: ctx.fail(  # noqa: E731
        dotted, f"{what}, got {value!r} ({type(value).__name__}); allowed: {_fmt_allowed(allowed)}"
    )
    if kind in ("opt_int", "opt_float") and value is None:
        return None
    if kind in ("int", "opt_int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("wrong type")
        if value < 1:
            raise bad("out of range")
        return value
    if kind in ("float", "opt_float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            hint = ""
            if isinstance(value, str) and _looks_numeric(value):
                hint = " (YAML reads '1e3' and quoted numbers as strings; write '1.0e3')"
            raise bad("wrong type" + hint)
        value = float(value)
        if not value > 0 or value != value or value == float("inf"):
            raise bad("out of range")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise bad("wrong type")
        return value
    if kind == "enum":
        if not isinstance(value, str):
            raise bad("wrong type")
        if value not in allowed:
            raise bad("not an allowed value")
        return value
    raise AssertionError(kind)


def _check_moe(ctx: _Ctx, m: Dict[str, Any]) -> None:
    e, k, g, gk = m["num_experts"], m["topk"], m["num_groups"], m["group_topk"]
    if k > e:
        raise ctx.fail("moe.topk", f"{k} is larger than moe.num_experts ({e}); allowed: 1..{e}")
    if (g is None) != (gk is None):
        given, missing = ("moe.num_groups", "moe.group_topk") if g is not None else (
            "moe.group_topk", "moe.num_groups")
        raise ctx.fail(
            missing,
            f"must be given together with {given} (group-limited routing needs both); "
            f"allowed: set both moe.num_groups and moe.group_topk, or neither",
        )
    if g is not None:
        if e % g != 0:
            raise ctx.fail(
                "moe.num_groups",
                f"moe.num_experts ({e}) is not divisible by moe.num_groups ({g}); "
                f"allowed: a divisor of {e}: {_divisors(e)}",
            )
        if gk > g:
            raise ctx.fail(
                "moe.group_topk",
                f"{gk} is larger than moe.num_groups ({g}); allowed: 1..{g}",
            )
        per_group = e // g
        if k % gk != 0:
            ok = [d for d in _divisors(k) if d <= g]
            raise ctx.fail(
                "moe.group_topk",
                f"moe.topk ({k}) is not divisible by moe.group_topk ({gk}) (group scores sum the "
                f"top topk/group_topk experts of each group); allowed: a divisor of {k} "
                f"that is <= num_groups: {ok}",
            )
        if k > gk * per_group:
            raise ctx.fail(
                "moe.topk",
                f"{k} is larger than the experts in the selected groups (group_topk {gk} x "
                f"{per_group} experts per group = {gk * per_group}); allowed: 1..{gk * per_group}",
            )
    if m["expert_bias"] and m["score_function"] != "sigmoid":
        raise ctx.fail(
            "moe.expert_bias",
            f"expert bias (aux-loss-free balancing) needs moe.score_function: sigmoid, got "
            f"{m['score_function']!r}; allowed: false with softmax, true|false with sigmoid",
        )
    if m["use_pre_softmax"] and m["score_function"] != "softmax":
        raise ctx.fail(
            "moe.use_pre_softmax",
            f"only applies to moe.score_function: softmax, got {m['score_function']!r}; "
            f"allowed: false with sigmoid, true|false with softmax",
        )


def _validate(raw: Any, ctx: _Ctx) -> EPConfig:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{ctx.source}: the top level must be a mapping with sections "
            f"{', '.join(_SECTIONS)}, got {type(raw).__name__}"
        )
    for key in raw:
        if key not in _SECTIONS:
            raise ctx.fail(
                str(key),
                f"unknown key{_suggest(str(key), _SECTIONS)}; allowed top-level keys: "
                f"{', '.join(_SECTIONS)}",
            )
    built = {}
    for sec, cls in _SECTIONS.items():
        body = raw.get(sec)
        if body is None:
            body = {}
        if not isinstance(body, Mapping):
            raise ctx.fail(
                sec, f"must be a mapping of keys, got {type(body).__name__}; allowed keys: "
                f"{', '.join(_RULES[sec])}"
            )
        rules = _RULES[sec]
        for key in body:
            if key not in rules:
                raise ctx.fail(
                    f"{sec}.{key}",
                    f"unknown key{_suggest(str(key), rules)}; allowed keys in '{sec}': "
                    f"{', '.join(rules)}",
                )
        values = {f.name: copy.deepcopy(f.default) for f in dataclasses.fields(cls)}
        for key, value in body.items():
            kind, allowed = rules[key]
            values[key] = _check_value(ctx, f"{sec}.{key}", kind, allowed, value)
        if sec == "moe":
            _check_moe(ctx, values)
        built[sec] = cls(**values)
    return EPConfig(source=ctx.source, **built)


# --------------------------------------------------------------------------------------------
# Presets and loading
# --------------------------------------------------------------------------------------------


def _preset_dirs():
    here = Path(__file__).resolve().parent
    env = os.environ.get("EP_PLUGIN_CONFIG_DIR")
    dirs = [Path(env)] if env else []
    dirs += [here / "configs", here.parent / "configs"]
    return [d for d in dirs if d.is_dir()]


def list_presets():
    """Names of the shipped presets (``configs/<name>.yaml``)."""
    names = set()
    for d in _preset_dirs():
        names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def preset_path(name: str) -> Path:
    """Path of preset ``name`` (with or without ``.yaml``); ConfigError if there is none."""
    stem = name[:-5] if name.endswith(".yaml") else name[:-4] if name.endswith(".yml") else name
    for d in _preset_dirs():
        for ext in (".yaml", ".yml"):
            p = d / (stem + ext)
            if p.is_file():
                return p
    raise ConfigError(
        f"{name}: no such config file or preset; presets: {', '.join(list_presets()) or '(none)'}"
    )


def _resolve_path(src: Union[str, os.PathLike]) -> Path:
    p = Path(os.fspath(src)).expanduser()
    if p.is_file():
        return p
    s = os.fspath(src)
    if os.sep not in s and "/" not in s:  # a bare name: preset (with or without .yaml)
        return preset_path(s)
    raise ConfigError(
        f"{s}: config file not found; give a path to a YAML file or a preset name "
        f"({', '.join(list_presets()) or 'no presets found'})"
    )


def _read_yaml(path: Path) -> Any:
    try:
        with open(path, "r", encoding="utf-8") as f:
            return yaml.safe_load(f)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from exc


def _apply_overrides(raw: Dict[str, Any], overrides: Mapping, source: str):
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
                    f"allowed sections: {', '.join(_SECTIONS)}"
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


def load_config(
    src: Union[str, os.PathLike, Mapping, EPConfig, None] = None,
    overrides: Optional[Mapping] = None,
) -> EPConfig:
    """Load and validate a configuration.

    ``src``: a YAML path, a preset name (``"deepseek_v3"``: ``configs/deepseek_v3.yaml``), a dict
    with the schema's sections, an :class:`EPConfig` (re-validated), or ``None`` for defaults.
    ``overrides``: nested (``{"comm": {"backend": "torch"}}``) or dotted (``{"comm.backend":
    "torch"}``) keys applied on top. Raises :class:`ConfigError` on any problem.
    """
    if isinstance(src, EPConfig):
        source = src.source or "<EPConfig>"
        raw: Any = src.to_dict()
    elif src is None:
        source, raw = "<defaults>", {}
    elif isinstance(src, Mapping):
        source, raw = "<dict>", copy.deepcopy(dict(src))
    elif isinstance(src, (str, os.PathLike)):
        path = _resolve_path(src)
        source, raw = str(path), _read_yaml(path)
    else:
        raise ConfigError(
            f"<{type(src).__name__}>: cannot load a config from {type(src).__name__}; allowed: "
            f"a YAML path, a preset name ({', '.join(list_presets())}), a dict, an EPConfig or None"
        )
    touched = []
    if overrides:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{source}: the top level must be a mapping, got {type(raw).__name__}")
        raw = dict(raw)
        touched = _apply_overrides(raw, overrides, source)
    return _validate(raw, _Ctx(source, touched))
