"""ep_plugin YAML -> megatron-core: TransformerConfig fields, and the EPConfig of each dispatcher.

Routing and shared-expert overlap become TransformerConfig fields (config_from_yaml); the comm and
overlap settings reach the dispatchers through the TransformerConfig itself:

    fields = config_from_yaml("configs/deepseek_v3.yaml")
    config = TransformerConfig(..., **fields)
    attach_config(config, "configs/deepseek_v3.yaml")     # sets config.ep_plugin_config

A dispatcher reads config.ep_plugin_config, the one way its settings enter; without one it uses
ep_plugin's defaults (comm.max_tokens_per_rank: 4096). Needs no megatron-core at import time.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from ...config import EPConfig, load_config

NAME = "ep_plugin"
_SECTIONS = ("moe", "comm", "overlap")

def attach_config(transformer_config, cfg) -> EPConfig:
    """Give one TransformerConfig its ep_plugin settings (comm, overlap; routing comes from its fields).
    Attach before the model is built: a dispatcher reads it once, at its first forward."""
    cfg = load_config(cfg)
    transformer_config.ep_plugin_config = cfg
    return cfg


def config_from_yaml(path_or_cfg, **overrides) -> Dict[str, Any]:
    """Turn an ep_plugin YAML file (path, preset name, dict or EPConfig) into TransformerConfig fields.

    Keyword overrides: keys naming an ep_plugin setting ("comm.backend", "moe.topk", or a whole
    section: comm={"backend": "torch"}) are applied to the YAML before validation; any other key is
    a TransformerConfig field and is put into (or replaces an entry of) the returned dict.

    The fields: num_moe_experts, moe_router_topk, moe_router_num_groups, moe_router_group_topk,
    moe_router_score_function, moe_router_topk_scaling_factor, moe_router_enable_expert_bias,
    moe_router_pre_softmax (the moe section); moe_router_dtype "fp32" when moe.expert_bias is on;
    moe_shared_expert_overlap (overlap.shared_expert_overlap); moe_token_dispatcher_type "ep_plugin"
    (and moe_flex_dispatcher_backend "ep_plugin" when "flex" is passed). To set one of them yourself,
    pass it here as a keyword: beside ``**fields`` in TransformerConfig(...) it would be given twice.
    The comm section is for the dispatchers: pass the same file to attach_config. Nothing else is
    changed (no module state).
    """
    ep_over, tc_over = {}, {}
    for k, v in overrides.items():
        (ep_over if ("." in k or k in _SECTIONS) else tc_over)[k] = v
    cfg = load_config(path_or_cfg, ep_over or None)
    m = cfg.moe
    fields: Dict[str, Any] = {
        "num_moe_experts": m.num_experts,
        "moe_router_topk": m.topk,
        "moe_router_num_groups": m.num_groups,
        "moe_router_group_topk": m.group_topk,
        "moe_router_score_function": m.score_function,
        "moe_router_topk_scaling_factor": m.topk_scaling_factor,
        "moe_router_enable_expert_bias": bool(m.expert_bias),
        "moe_router_pre_softmax": bool(getattr(m, "use_pre_softmax", False)),
        "moe_shared_expert_overlap": bool(cfg.overlap.shared_expert_overlap),
        "moe_token_dispatcher_type": NAME,
    }
    if m.expert_bias:
        # megatron keeps the expert bias in fp32 and needs fp32 routing for it
        fields["moe_router_dtype"] = "fp32"
    fields.update(tc_over)
    if fields.get("moe_token_dispatcher_type") == "flex":
        fields.setdefault("moe_flex_dispatcher_backend", NAME)
    return fields


def resolve_config(transformer_config, num_experts: int, topk: int, compiled: bool = False,
                   device_counts: bool = False) -> EPConfig:
    """The EPConfig of one dispatcher: the attached config, else ep_plugin's defaults, with the
    TransformerConfig's expert count and top-k, and its moe_flex_dispatcher_num_sms as comm.num_sms
    when that is set. Its comm.max_tokens_per_rank is the buffer's
    capacity, never the size of a batch.

    comm.host_sync stays as attached (false by default) for forwards traced by torch.compile
    (compiled=True) and for dispatchers whose experts take device counts (device_counts=True,
    EPGroupedMLP): false sizes the rows for the worst case and reads no count on the host; true
    makes the dispatch wait on the host for exact sizes (and, compiled, the dispatcher calls EPBuffer
    eagerly, with a graph break around each call: dispatcher.py). Other eager forwards feed megatron's
    experts, which need host counts anyway, and always get comm.host_sync on (see below)."""
    attached = load_config(getattr(transformer_config, "ep_plugin_config", None))
    raw = attached.to_dict()
    # routing is megatron's (its router ran already); the buffer needs the expert count and top-k only
    raw["moe"] = {"num_experts": int(num_experts), "topk": int(topk)}
    sms = getattr(transformer_config, "moe_flex_dispatcher_num_sms", None)
    if sms is not None:  # megatron's own SM budget for the flex dispatchers' communication wins
        raw["comm"]["num_sms"] = int(sms)
    if not (compiled or device_counts):
        # megatron's experts split their input by host counts, so the host waits for them anyway: an
        # exact-size dispatch then costs no extra sync and saves the worst-case rows (and their grads)
        raw["comm"]["host_sync"] = True
    return load_config(raw, source=attached.source)  # messages name the attached file, not "<dict>"


def uses_ep_plugin(transformer_config) -> Optional[str]:
    """"name" for moe_token_dispatcher_type="ep_plugin", "flex" for the flex backend form, else None."""
    t = getattr(transformer_config, "moe_token_dispatcher_type", None)
    if t == NAME:
        return "name"
    if t == "flex" and getattr(transformer_config, "moe_flex_dispatcher_backend", None) == NAME:
        return "flex"
    return None
