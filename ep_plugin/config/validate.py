"""Validation: per-key rules, cross-key rules, and the messages that name source, key and fix.

Every failure is a :class:`ConfigError` reading ``<source>: <section.key>: <what>, got <value>;
allowed: <values>``, with a did-you-mean for misspelt keys and choices.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

from ..errors import ConfigError
from .ep_size import check_ep_size, divisors  # noqa: F401 (check_ep_size re-exported)
from .problems import Context, Problem, config_error, suggest  # noqa: F401 (re-exported: the rules' messages)
from .schema import (
    AUTO, BACKEND_NAMES, COMBINE_DTYPES, COMBINE_KERNELS, DISPATCH_DTYPES, DISPATCH_KERNELS, HELD_OUTPUTS,
    SCORE_FUNCTIONS, SECTIONS, SOURCE_ORDERS, COMBINE_REDUCES, VALIDATE_MODES, EPConfig, LowLatencyConfig, RdmaConfig,
)


class IntRange:
    """Rule data of kind ``int_range``: an int in ``lo..hi`` (``hi`` None: no upper bound), and with
    ``auto`` also the word auto. ``str()`` is what a message offers as allowed."""

    def __init__(self, lo: int, hi: Optional[int] = None, auto: bool = False):
        self.lo, self.hi, self.auto = lo, hi, auto

    def __str__(self) -> str:
        ints = f"an int {self.lo}..{self.hi}" if self.hi is not None else f"an int >= {self.lo}"
        return f"{AUTO} or {ints}" if self.auto else ints


# One NVSHMEM HCA entry: a device name, optionally ":port" (NVSHMEM_HCA_LIST syntax; names <= 63 chars).
_HCA_ENTRY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}(:[1-9][0-9]*)?")
_NIC_ALLOWED = (f"{AUTO}; a device[:port] string for every rank, e.g. 'mlx5_0:1' (an NVSHMEM_HCA_LIST: "
                f"comma-separated entries, a leading ^ excludes them); a list of such strings indexed "
                f"by local rank; or a mapping {{local rank: 'device[:port]'}}")

# (kind, allowed): kind picks the check in check_value, allowed is what the message offers. A rule
# that is a dict instead is a nested section (a dataclass field of the section), with its own rules.
_POS_INT = ("int", "a positive int (>= 1)")
_OPT_POS_INT = ("opt_int", "null or a positive int (>= 1)")
_BOOL = ("bool", "true | false")

RULES: Dict[str, Dict[str, Tuple[str, Any]]] = {
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
        "backend": ("enum", BACKEND_NAMES),
        "num_sms": ("int_or_auto", f"a positive int (>= 1) or {AUTO}"),
        "ranks_per_node": ("int_or_auto", f"a positive int (>= 1) or {AUTO}"),
        "dispatch_dtype": ("enum", DISPATCH_DTYPES),
        "combine_dtype": ("enum", COMBINE_DTYPES),
        "max_tokens_per_rank": _POS_INT,
        "timeout_s": ("float", "a float > 0 (seconds)"),
        "host_sync": _BOOL,
        "spare_outputs": _BOOL,
        "combine_kernel": ("enum", COMBINE_KERNELS),
        "dispatch_kernel": ("enum", DISPATCH_KERNELS),
        "validate": ("enum", VALIDATE_MODES),
        "stats": _BOOL,
        "stats_interval": _OPT_POS_INT,
        "low_latency": {
            "max_tokens_per_rank": _POS_INT,
            "output_buffers": ("int_range", IntRange(0, None)),
            "heap_outputs": _BOOL,
            "held_outputs": ("enum", HELD_OUTPUTS),
            "source_order": ("enum", SOURCE_ORDERS),
            "combine_reduce": ("enum", COMBINE_REDUCES),
        },
        "rdma": {
            "qps_per_peer": ("int_or_auto", f"a positive int (>= 1) or {AUTO}"),
            "traffic_class": ("int_range", IntRange(0, 255)),
            "service_level": ("int_range", IntRange(0, 15)),
            "ibgda": ("bool_or_auto", f"true | false | {AUTO}"),
            "nic": ("nic", _NIC_ALLOWED),
            "gid_index": ("int_range", IntRange(0, None, auto=True)),
            "roce_version": ("int_range", IntRange(1, 2, auto=True)),
        },
    },
    "overlap": {
        "async_dispatch": _BOOL,
        "shared_expert_overlap": _BOOL,
        "recv_hook": _BOOL,
    },
}



def _nested_class(cls: type, key: str) -> type:
    """The dataclass of nested section ``key`` of ``cls`` (its field's default_factory)."""
    return next(f.default_factory for f in dataclasses.fields(cls) if f.name == key)


def _check_rules(path: str, cls: type, rules: Dict[str, Any]) -> None:
    # A key added to a dataclass but not here (or the reverse) must fail at import, not at a user.
    assert set(rules) == {f.name for f in dataclasses.fields(cls)}, path
    for key, rule in rules.items():
        if isinstance(rule, dict):
            _check_rules(f"{path}.{key}", _nested_class(cls, key), rule)


for _sec, _cls in SECTIONS.items():
    _check_rules(_sec, _cls, RULES[_sec])

# Selection on score + bias needs scores that are not renormalised over the selection.
_BIAS_SCORE_FUNCTIONS = tuple(f for f in SCORE_FUNCTIONS if f != "softmax")




def fmt_allowed(allowed) -> str:
    if isinstance(allowed, (tuple, list)):
        return " | ".join(str(a) for a in allowed)
    return str(allowed)


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _hca_list(text: str) -> Optional[str]:
    """``text`` as a normalised NVSHMEM_HCA_LIST (``[^]dev[:port][,dev[:port]...]``), or None if it
    is not one."""
    body = text.strip()
    exclude = body.startswith("^")
    entries = [e.strip() for e in (body[1:] if exclude else body).split(",")]
    if not entries or not all(_HCA_ENTRY.fullmatch(e) for e in entries):
        return None
    return ("^" if exclude else "") + ",".join(entries)


def _check_nic(ctx: Context, dotted: str, value):
    """``comm.rdma.nic``: auto | HCA list string | list per local rank | {local rank: HCA list}."""

    def bad(what: str) -> ConfigError:
        return ctx.fail(dotted, f"{what}, got {value!r} ({type(value).__name__}); allowed: {_NIC_ALLOWED}")

    def entry(where: str, item):
        if not isinstance(item, str):
            raise bad(f"{where} is not a string ({item!r})")
        hca = _hca_list(item)
        if hca is None or item.strip() == AUTO:
            raise bad(f"{where} {item!r} is not a device[:port] list such as 'mlx5_0:1'")
        return hca

    if isinstance(value, str):
        if value == AUTO:
            return value
        if _hca_list(value) is None:
            raise bad("not a device[:port] list such as 'mlx5_0:1'" + suggest(value, [AUTO]))
        return _hca_list(value)
    if isinstance(value, (list, tuple)):
        if not value:
            raise bad("an empty list")
        return [entry(f"entry [{i}]", item) for i, item in enumerate(value)]
    if isinstance(value, Mapping):
        if not value:
            raise bad("an empty mapping")
        out: Dict[int, str] = {}
        for key, item in value.items():
            rank = key
            if isinstance(key, str) and key.strip().isdigit():  # JSON keys are strings
                rank = int(key)
            if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
                raise bad(f"key {key!r} is not a local rank (an int >= 0)")
            if rank in out:
                raise bad(f"local rank {rank} is given twice")
            out[rank] = entry(f"local rank {rank}:", item)
        return dict(sorted(out.items()))
    raise bad("wrong type")


def check_value(ctx: Context, dotted: str, kind: str, allowed, value):
    """Type/range check one value; return it normalised (ints to floats where floats expected)."""

    def bad(what: str) -> ConfigError:
        return ctx.fail(dotted, f"{what}, got {value!r} ({type(value).__name__}); "
                                f"allowed: {fmt_allowed(allowed)}")

    if kind in ("opt_int", "opt_float") and value is None:
        return None
    if kind == "nic":
        return _check_nic(ctx, dotted, value)
    if kind == "bool_or_auto":
        if isinstance(value, bool) or value == AUTO:
            return value
        raise bad("not an allowed value" + (suggest(value, [AUTO, "true", "false"])
                                            if isinstance(value, str) else ""))
    if kind == "int_range":
        if allowed.auto and isinstance(value, str):
            if value != AUTO:
                raise bad("not an allowed value" + suggest(value, [AUTO]))
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("wrong type")
        if value < allowed.lo or (allowed.hi is not None and value > allowed.hi):
            raise bad("out of range")
        return value
    if kind == "int_or_auto" and isinstance(value, str):
        if value != AUTO:
            raise bad("not an allowed value" + suggest(value, [AUTO]))
        return value
    if kind in ("int", "opt_int", "int_or_auto"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("wrong type")
        if value < 1:
            raise bad("out of range")
        return value
    if kind in ("float", "opt_float", "float0"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            hint = ""
            if isinstance(value, str) and _looks_numeric(value):
                hint = " (YAML reads '1e3' and quoted numbers as strings; write '1.0e3')"
            raise bad("wrong type" + hint)
        value = float(value)
        low_ok = value >= 0 if kind == "float0" else value > 0
        if not low_ok or value != value or value == float("inf"):
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
            raise bad("not an allowed value" + suggest(value, allowed))
        return value
    raise AssertionError(kind)


def _check_groups(ctx: Context, e: int, k: int, g: int, gk: int) -> None:
    if e % g != 0:
        raise ctx.fail(
            "moe.num_groups",
            f"moe.num_experts ({e}) is not divisible by moe.num_groups ({g}); "
            f"allowed: a divisor of {e}: {divisors(e)}",
        )
    if gk > g:
        raise ctx.fail("moe.group_topk", f"{gk} is larger than moe.num_groups ({g}); allowed: 1..{g}")
    per_group = e // g
    if k % gk != 0:
        ok = [d for d in divisors(k) if d <= g]
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


def check_moe(ctx: Context, m: Dict[str, Any]) -> None:
    """The rules that tie routing keys together (m: the section's values, already type-checked)."""
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
        _check_groups(ctx, e, k, g, gk)
    sf = m["score_function"]
    if m["expert_bias"] and sf not in _BIAS_SCORE_FUNCTIONS:
        with_bias = " or ".join(_BIAS_SCORE_FUNCTIONS)
        raise ctx.fail(
            "moe.expert_bias",
            f"expert bias (aux-loss-free balancing) needs moe.score_function: {with_bias}, got "
            f"{sf!r}; allowed: false with {sf}, true|false with {with_bias}",
        )
    if m["use_pre_softmax"] and sf != "softmax":
        raise ctx.fail(
            "moe.use_pre_softmax",
            f"only applies to moe.score_function: softmax, got {sf!r}; "
            f"allowed: false with {sf}, true|false with softmax",
        )


def check_low_latency(ctx: Context, ll: LowLatencyConfig) -> None:
    """The rule between ``comm.low_latency`` keys (values already type-checked)."""
    if ll.held_outputs == "copy" and 0 < ll.output_buffers < 3:
        raise ctx.fail(
            "comm.low_latency.held_outputs",
            f"copy needs output_buffers >= 3, got output_buffers {ll.output_buffers}: a held set is moved one "
            "dispatch before its turn, when with 2 sets the caller still holds the previous dispatch's outputs "
            "(every call would copy them); allowed: raise with any output_buffers, copy with 0 or >= 3",
        )


def check_rdma(ctx: Context, r: RdmaConfig) -> None:
    """The rules that tie ``comm.rdma`` keys together (values already type-checked)."""
    if r.roce_version != AUTO and r.gid_index != AUTO:
        raise ctx.fail(
            "comm.rdma.roce_version",
            f"only applies when comm.rdma.gid_index is {AUTO} (NVSHMEM then picks a GID of this RoCE "
            f"version), got roce_version {r.roce_version} with gid_index {r.gid_index}; allowed: "
            f"{AUTO} with a gid_index, 1 | 2 | {AUTO} with gid_index: {AUTO}",
        )


def _section_values(ctx: Context, sec: str, cls: type, body: Any,
                    rules: Dict[str, Any] = None) -> Dict[str, Any]:
    """The checked values of section ``sec`` (a dotted path for a nested one), defaults filled in;
    a key that fails its check keeps its default and the problem is noted in ``ctx``."""
    if body is None:
        body = {}
    rules = RULES[sec] if rules is None else rules
    if not isinstance(body, Mapping):
        ctx.note(ctx.fail(sec, f"must be a mapping of keys, got {type(body).__name__}; allowed keys: "
                               f"{', '.join(rules)}"))
        body = {}
    for key in body:
        if key not in rules:
            ctx.note(ctx.fail(
                f"{sec}.{key}",
                f"unknown key{suggest(str(key), rules)}; allowed keys in '{sec}': {', '.join(rules)}",
            ))
    values = {}
    for f in dataclasses.fields(cls):
        values[f.name] = copy.deepcopy(f.default) if f.default is not dataclasses.MISSING else None
        try:
            if isinstance(rules[f.name], dict):
                sub = _nested_class(cls, f.name)
                values[f.name] = sub(**_section_values(ctx, f"{sec}.{f.name}", sub, body.get(f.name),
                                                       rules[f.name]))
            elif f.name in body:
                kind, allowed = rules[f.name]
                values[f.name] = check_value(ctx, f"{sec}.{f.name}", kind, allowed, body[f.name])
        except ConfigError as exc:
            ctx.note(exc)
    return values


def validate(raw: Any, ctx: Context) -> EPConfig:
    """Build an :class:`EPConfig` from a nested dict (``None`` = all defaults), or raise one
    ConfigError naming every problem found (``.problems`` lists them)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{ctx.source}: the top level must be a mapping with sections "
            f"{', '.join(SECTIONS)}, got {type(raw).__name__}"
        )
    for key in raw:
        if key not in SECTIONS:
            ctx.note(ctx.fail(
                str(key),
                f"unknown key{suggest(str(key), SECTIONS)}; allowed top-level keys: "
                f"{', '.join(SECTIONS)}",
            ))
    built = {}
    for sec, cls in SECTIONS.items():
        before = len(ctx.problems)
        values = _section_values(ctx, sec, cls, raw.get(sec))
        if len(ctx.problems) == before:  # the rules between keys only hold meaning for valid keys
            try:
                if sec == "moe":
                    check_moe(ctx, values)
                if sec == "comm":
                    check_rdma(ctx, values["rdma"])
                    check_low_latency(ctx, values["low_latency"])
            except ConfigError as exc:
                ctx.note(exc)
        built[sec] = cls(**values)
    ctx.check()
    return EPConfig(source=ctx.source, **built)


def check_section(ctx: Context, sec: str, body: Any, rules: Mapping[str, Tuple[str, Any]],
                  other_keys: Iterable[str] = (), other_keys_are: str = "") -> Dict[str, Any]:
    """Check a section that is not ep_plugin's own (an example's ``model`` or ``train``) with the
    same rules and messages: ``rules`` maps key -> (kind, allowed) as in RULES; keys in
    ``other_keys`` (or in what it returns, a callable called only when a key is not in ``rules``)
    pass unchecked (``other_keys_are`` says what they are, for the message). Returns
    the checked values of the keys given; every problem is noted in ``ctx``."""
    if body is None:
        return {}
    if not isinstance(body, Mapping):
        ctx.note(ctx.fail(sec, f"must be a mapping of keys, got {type(body).__name__}; allowed keys: "
                               f"{', '.join(rules)}"))
        return {}
    if callable(other_keys):
        other_keys = other_keys() if set(body) - set(rules) else ()
    other = set(other_keys)
    out = {}
    for key, value in body.items():
        dotted = f"{sec}.{key}"
        if key in rules:
            kind, allowed = rules[key]
            try:
                out[key] = check_value(ctx, dotted, kind, allowed, value)
            except ConfigError as exc:
                ctx.note(exc)
        elif key in other:
            out[key] = value
        else:
            also = f" and {other_keys_are}" if other_keys_are else ""
            ctx.note(ctx.fail(dotted, f"unknown key{suggest(str(key), list(rules) + sorted(other))}; "
                                      f"allowed keys in '{sec}': {', '.join(rules)}{also}"))
    return out

