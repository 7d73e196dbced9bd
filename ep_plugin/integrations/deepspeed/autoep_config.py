"""The ep_plugin configuration of a DeepSpeed AutoEP run with ``"comm_backend": "ep_plugin"``.

    "expert_parallel": {"enabled": true, "autoep_size": 2, "comm_backend": "ep_plugin",
                        "comm_num_sm": 24, "comm_max_tokens_per_rank": 4096},     # optional keys
    "ep_plugin": {"enabled": true, "config": "ep_plugin.yaml", "overrides": {...}}  # optional section

Where each setting comes from, last wins:
  1. ep_plugin's defaults, or the YAML (path, preset name or inline dict) of the ``"ep_plugin"``
     section with its ``overrides`` -- the ``comm`` and ``overlap`` sections apply (backend, SMs,
     capacity, timeouts); experts and top-k come from each AutoEP layer;
  2. the ``expert_parallel`` section's own transport keys, when present: ``comm_num_sm`` ->
     ``comm.num_sms``, ``comm_max_tokens_per_rank`` (> 0) -> ``comm.max_tokens_per_rank``.
``comm_qp_margin`` is DeepEP's and is ignored. The ``"ep_plugin"`` section's ``enabled`` key turns on
the conversion of ``deepspeed.moe.layer.MoE`` layers (HF models have none); AutoEP reads the section's
``config`` and ``overrides`` whenever ``comm_backend`` is ``"ep_plugin"``. The engine holds the
config as a dict, so a relative YAML path is resolved against the working directory only.
"""
from __future__ import annotations

from typing import Any, Dict

from ...config import EPConfig, load_config
from ...errors import ConfigError
from .section import SECTION, _resolve_yaml, _section, read_ds_config

EP_PLUGIN_BACKEND = "ep_plugin"
EXPERT_PARALLEL = "expert_parallel"  # deepspeed.runtime.config.EXPERT_PARALLEL
# The expert_parallel keys that configure the transport, and the ep_plugin key each one sets.
SECTION_KEYS = {"comm_num_sm": "comm.num_sms", "comm_max_tokens_per_rank": "comm.max_tokens_per_rank"}


def uses_ep_plugin(ds_config) -> bool:
    """Whether a DeepSpeed config (dict, JSON path or DeepSpeedConfig) asks AutoEP for ep_plugin."""
    ds, _ = read_ds_config(ds_config)
    ep = ds.get(EXPERT_PARALLEL)
    return isinstance(ep, dict) and bool(ep.get("enabled")) and ep.get("comm_backend") == EP_PLUGIN_BACKEND


def autoep_ep_config(ds_config) -> EPConfig:
    """The validated EPConfig of an AutoEP run (see the module docstring for where each key comes
    from). Raises :class:`~ep_plugin.ConfigError` naming the DeepSpeed key at fault."""
    ds, base_dir = read_ds_config(ds_config)
    sec = _section(ds)
    src, overrides = None, None
    if sec is not None:
        src, overrides = _resolve_yaml(sec.get("config"), base_dir), sec.get("overrides")
    try:
        cfg = load_config(src, overrides)
    except ConfigError as exc:
        raise ConfigError(f"DeepSpeed config '{SECTION}.config' (used by expert_parallel.comm_backend="
                          f"\"{EP_PLUGIN_BACKEND}\"): {exc}") from exc
    ep: Dict[str, Any] = ds.get(EXPERT_PARALLEL) or {}
    for ds_key, ep_key in SECTION_KEYS.items():
        if ds_key not in ep or (ds_key == "comm_max_tokens_per_rank" and ep[ds_key] == 0):  # 0: DeepSpeed's unset
            continue
        try:
            cfg = load_config(cfg, {ep_key: ep[ds_key]})
        except ConfigError as exc:
            raise ConfigError(f"DeepSpeed config '{EXPERT_PARALLEL}.{ds_key}' (ep_plugin's {ep_key}): {exc}") from exc
    # AutoEP's layer needs the row count on the host (its autograd checks shapes against it): exact
    # sizes cost no extra sync and save the worst-case rows
    return load_config(cfg, {"comm.host_sync": True})


def check_autoep_options(autoep, tp_size: int) -> None:
    """Refuse the AutoEP options the exchange route cannot honour, naming the key to change.

    ``autoep``: DeepSpeed's parsed AutoEPConfig; ``tp_size``: the engine's AutoTP size."""
    name = f'comm_backend="{EP_PLUGIN_BACKEND}"'
    if autoep.combine_impl == "fused_weighted_sum" and autoep.autoep_size > 1:
        raise ConfigError(f"DeepSpeed config 'expert_parallel.combine_impl': \"fused_weighted_sum\" cannot be used "
                          f"with {name}: the exchange restores and sums the routed rows itself; leave combine_impl "
                          "unset")
    if autoep.expert_tensor_parallel_size > 1 or tp_size > 1:
        raise ConfigError(f"DeepSpeed config 'expert_parallel': {name} does not support folded tensor parallelism "
                          f"(expert_tensor_parallel_size={autoep.expert_tensor_parallel_size}, "
                          f"tensor_parallel.autotp_size={tp_size}); set both to 1, or comm_backend to \"comm\"")
    if autoep.row_weighting_impl == "fused" and autoep.autoep_size == 1:
        raise ConfigError("DeepSpeed config 'expert_parallel.row_weighting_impl': \"fused\" runs inside the "
                          f"exchange, which {name} uses only when autoep_size > 1; leave it unset")


__all__ = ["EP_PLUGIN_BACKEND", "SECTION_KEYS", "uses_ep_plugin", "autoep_ep_config", "check_autoep_options"]
