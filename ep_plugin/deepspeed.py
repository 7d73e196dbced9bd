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

Limits: experts must act on each row independently (as MLP experts do: DeepSpeed feeds them
zero-padded rows that never reach the output, we feed them no padding); tensor-parallel
non-expert layers (an ``mpu`` with tensor-parallel size > 1) and Tutel are not supported on the
ep_plugin path (an error says so; Tutel is simply not used).
"""
from __future__ import annotations

import copy
import difflib
import functools
import inspect
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as tdist

import deepspeed
from deepspeed.moe.layer import MoE
from deepspeed.moe.sharded_moe import (FIRST_ALLTOALL_TIMER, MOE_TIMER, SECOND_ALLTOALL_TIMER, MOELayer)
from deepspeed.utils import groups

from .config import EPConfig, MoEConfig, load_config
from .errors import ConfigError

__all__ = ["SECTION", "initialize", "convert_moe_layers", "ep_plugin_config", "is_enabled",
           "EPPluginMOELayer", "release_buffers"]

logger = logging.getLogger("ep_plugin.deepspeed")

SECTION = "ep_plugin"
_SECTION_KEYS = {
    "enabled": "true | false: run DeepSpeed MoE layers through ep_plugin",
    "config": "path to an ep_plugin YAML file, a preset name, or an inline dict",
    "overrides": "dict of ep_plugin config overrides, e.g. {\"comm.backend\": \"torch\"}",
}
_USE_DATA_BEFORE_EP = "use_data_before_expert_parallelism"  # deepspeed.runtime.constants


# ------------------------------------------------------------------------------------ config
def _read_ds_config(ds_config) -> Tuple[Dict[str, Any], Optional[Path]]:
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
        from .config import list_presets
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
        if key not in _SECTION_KEYS:
            close = difflib.get_close_matches(str(key), list(_SECTION_KEYS), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            allowed = "; ".join(f"{k}: {v}" for k, v in _SECTION_KEYS.items())
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
    ds, base_dir = _read_ds_config(ds_config)
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


def _layer_config(base: EPConfig, num_experts: int, k: int) -> EPConfig:
    """The EPBuffer config of one layer: communication and overlap from the user's YAML, the expert
    count and top-k from the DeepSpeed layer (DeepSpeed's gate does the routing, so the YAML's
    routing keys -- groups, score function, bias -- do not apply)."""
    cfg = copy.deepcopy(base)
    cfg.moe = MoEConfig(num_experts=num_experts, topk=min(k, num_experts))
    return load_config(cfg)


# ------------------------------------------------------------------------------------ buffers
_BUFFERS: Dict[Tuple[Any, ...], Any] = {}


def _get_buffer(group, cfg: EPConfig, hidden: int):
    """One EPBuffer per (group, hidden, config), shared by the layers that match."""
    key = (group, hidden, json.dumps(cfg.to_dict(), sort_keys=True, default=str))
    buf = _BUFFERS.get(key)
    if buf is None:
        from .buffer import EPBuffer
        buf = EPBuffer(group, cfg, hidden=hidden, num_experts=cfg.moe.num_experts)
        _BUFFERS[key] = buf
    return buf


def release_buffers() -> None:
    """Close the EPBuffers the converted layers created (they are re-created on the next forward)."""
    while _BUFFERS:
        _, buf = _BUFFERS.popitem()
        try:
            buf.close()
        except Exception:  # pragma: no cover - best effort at teardown
            pass


# ------------------------------------------------------------------------------------ the layer
def _tp_world_size() -> int:
    if groups.mpu is None:
        return 1
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size
    return bwc_tensor_model_parallel_world_size(groups.mpu)


class EPPluginMOELayer(MOELayer):
    """DeepSpeed's ``MOELayer`` with its two capacity-padded all-to-alls replaced by EPBuffer
    dispatch/combine. Made by :func:`convert_moe_layers` by swapping an instance's class; never
    constructed directly. Gate, experts, parameters and attributes are DeepSpeed's."""

    _ep_cfg: EPConfig

    def _set_ep_group(self, ep_group):
        # convert_moe_layers may have created the groups already; the engine then sets them again.
        if self.ep_group is not None and ep_group is self.ep_group:
            return
        super()._set_ep_group(ep_group)

    def ep_buffer(self, hidden: int):
        if self.ep_group is None:
            raise RuntimeError("this MoE layer has no expert-parallel group yet: call deepspeed.initialize / "
                               "ep_plugin.deepspeed.initialize first, or convert_moe_layers after "
                               "torch.distributed is initialized")
        return _get_buffer(self.ep_group, self._ep_cfg, hidden)

    def forward(self, *input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if _tp_world_size() > 1:
            raise NotImplementedError("ep_plugin's DeepSpeed path does not support tensor-parallel non-expert "
                                      "layers (mpu with tensor-parallel size > 1); turn 'ep_plugin' off")
        timed = self.wall_clock_breakdown
        if timed:
            self.timers(MOE_TIMER).start()
        x = input[0]
        used_token = input[1] if len(input) > 1 else None
        d_model = x.shape[-1]
        tokens = x.reshape(-1, d_model)

        # DeepSpeed's own gate, in its sparse form: per route (k, token) the expert (-1 when the
        # capacity limit or used_token drops it) and the normalised combine weight.
        self.l_aux, _, num_experts, indices_, _, gates_, self.exp_counts = self.gate(tokens, used_token, True, False)
        topk_idx = indices_.t().to(torch.int64).contiguous()  # [S, K]
        topk_weights = gates_.t().float().contiguous()        # [S, K]

        buf = self.ep_buffer(d_model)
        if timed:
            self.timers(FIRST_ALLTOALL_TIMER).start()
        res = buf.dispatch(tokens.contiguous(), topk_idx, topk_weights)
        if timed:
            self.timers(FIRST_ALLTOALL_TIMER).stop()
            self.time_falltoall = self.timers(FIRST_ALLTOALL_TIMER).elapsed(reset=False)

        expert_out = self._ep_run_experts(res.x, res.topk_idx, res.topk_weights, res.tokens_per_expert)

        if timed:
            self.timers(SECOND_ALLTOALL_TIMER).start()
        y = buf.combine(expert_out, res.handle)
        if timed:
            self.timers(SECOND_ALLTOALL_TIMER).stop()
            self.time_salltoall = self.timers(SECOND_ALLTOALL_TIMER).elapsed(reset=False)
            self.timers(MOE_TIMER).stop()
            self.time_moe = self.timers(MOE_TIMER).elapsed(reset=False)
        return y.reshape(x.shape)

    def _ep_run_experts(self, rows: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, counts) -> torch.Tensor:
        """Run each local expert on exactly its rows; return sum_k weight_k * expert_k(row) per row.

        rows [R, H]; idx [R, K] local expert ids (-1: not here); weights [R, K] float32.
        Accumulates in float32 (as DeepSpeed's decode does) and returns rows' dtype.
        """
        R, H = rows.shape
        K = idx.shape[1]
        n_local = self.num_local_experts
        counts = [int(c) for c in counts]
        flat = idx.reshape(-1)
        # Sort the (row, k) routes by local expert; -1 routes go last and are cut off. The counts
        # are host values from dispatch, so splitting needs no device sync.
        key = torch.where(flat >= 0, flat, torch.full_like(flat, n_local))
        order = torch.argsort(key, stable=True)[:sum(counts)]
        src_rows = torch.div(order, K, rounding_mode="floor")
        xin = rows.index_select(0, src_rows)
        outs = []
        for chunk, expert in zip(xin.split(counts), self.experts.deepspeed_experts):
            out = expert(chunk)  # runs on an empty chunk too, so every expert param gets a grad
            if isinstance(out, tuple):
                out = out[0]  # DeepSpeed ignores a returned bias the same way
            outs.append(out)
        y = torch.cat(outs) if outs else xin
        w = weights.reshape(-1).index_select(0, order)
        contrib = y.float() * w.unsqueeze(1)
        acc = torch.zeros(R, y.shape[1], dtype=torch.float32, device=rows.device)
        acc = acc.index_add(0, src_rows, contrib)
        return acc.to(rows.dtype)


# ------------------------------------------------------------------------------------ conversion
def _convert(model: torch.nn.Module, ep_cfg: EPConfig, *, create_groups: bool,
             use_data_before_expert_parallel: bool = False) -> int:
    parents = {}
    for _, mod in model.named_modules():
        if isinstance(mod, MoE):
            parents[id(mod.deepspeed_moe)] = mod
    # Check everything before touching anything.
    todo = []
    for name, mod in model.named_modules():
        if not isinstance(mod, MOELayer) or isinstance(mod, EPPluginMOELayer):
            continue
        experts = getattr(mod, "experts", None)
        if not hasattr(experts, "deepspeed_experts"):
            raise TypeError(f"MoE layer '{name}': its experts ({type(experts).__name__}) are not "
                            "deepspeed.moe.experts.Experts; ep_plugin needs the per-expert modules")
        if type(experts).forward is not deepspeed.moe.experts.Experts.forward:
            logger.warning("MoE layer '%s': %s.forward is bypassed; ep_plugin runs each of its "
                           "deepspeed_experts on its own rows", name, type(experts).__name__)
        parent = parents.get(id(mod))
        if parent is not None and getattr(parent, "enable_expert_tensor_parallelism", False) and groups.mpu is not None:
            raise NotImplementedError(f"MoE layer '{name}': expert tensor parallelism is not supported by "
                                      "ep_plugin's DeepSpeed path; turn 'ep_plugin' off")
        num_experts = mod.num_local_experts * mod.ep_size
        todo.append((name, mod, parent, _layer_config(ep_cfg, num_experts, int(mod.gate.k))))
    for name, mod, parent, cfg in todo:
        cfg.check_ep_size(mod.ep_size)
        if getattr(mod, "use_tutel", False):
            logger.warning("MoE layer '%s': use_tutel is ignored on the ep_plugin path", name)
        mod.__class__ = EPPluginMOELayer
        mod._ep_cfg = cfg
        if create_groups and mod.ep_group is None and parent is not None and tdist.is_initialized():
            _ensure_ds_comm()
            parent.set_deepspeed_parallelism(use_data_before_expert_parallel)
    if todo:
        logger.info("ep_plugin: %d DeepSpeed MoE layer(s) now dispatch/combine through ep_plugin (backend %s)",
                    len(todo), ep_cfg.comm.backend)
    return len(todo)


def _ensure_ds_comm() -> None:
    """DeepSpeed's comm layer wraps an already initialized torch.distributed (no new init)."""
    import deepspeed.comm as dscomm
    if not dscomm.is_initialized():
        deepspeed.init_distributed(dist_backend=tdist.get_backend(), dist_init_required=False)


def convert_moe_layers(model: torch.nn.Module, ds_config) -> int:
    """Make every DeepSpeed MoE layer of ``model`` exchange tokens through ep_plugin, in place.

    ``ds_config``: the DeepSpeed config (dict, JSON path or DeepSpeedConfig) with the ``ep_plugin``
    section. Returns how many layers were converted now: 0 when the flag is off or absent (the
    model is then untouched), or when they were converted before. If torch.distributed is
    initialized and a layer has no expert-parallel group yet, its groups are created here (as
    ``MoE.set_deepspeed_parallelism`` does); otherwise ``deepspeed.initialize`` creates them later.
    """
    ep_cfg = ep_plugin_config(ds_config)
    if ep_cfg is None:
        return 0
    ds, _ = _read_ds_config(ds_config)
    return _convert(model, ep_cfg, create_groups=True,
                    use_data_before_expert_parallel=bool(ds.get(_USE_DATA_BEFORE_EP, False)))


@functools.wraps(deepspeed.initialize)
def initialize(*args, **kwargs):
    """``deepspeed.initialize`` with the ``ep_plugin`` flag honoured: same arguments, same return
    value. With ``"ep_plugin": {"enabled": true, ...}`` in the config, the model's MoE layers are
    converted (see :func:`convert_moe_layers`) before the engine is built; otherwise this is exactly
    ``deepspeed.initialize``. DeepSpeed ignores the extra top-level key, so the config is passed on
    unchanged."""
    try:
        bound = inspect.signature(deepspeed.initialize).bind_partial(*args, **kwargs)
    except TypeError:
        return deepspeed.initialize(*args, **kwargs)  # let DeepSpeed report the bad call
    a = bound.arguments
    src = a.get("config")
    if src is None:
        src = a.get("config_params")
    ns = a.get("args")
    if src is None and ns is not None:
        src = getattr(ns, "deepspeed_config", None) or getattr(ns, "deepscale_config", None)
    model = a.get("model")
    ep_cfg = ep_plugin_config(src) if src is not None else None
    if ep_cfg is not None and model is not None:
        # Groups are left to the engine: it knows the mpu and creates them for every MoE layer.
        _convert(model, ep_cfg, create_groups=False)
    return deepspeed.initialize(*args, **kwargs)
