"""DeepEP V1's Python API (tag v1.2.1) over ep_plugin: code written against `deep_ep` runs on
ep_plugin by changing one import, or none after `install()`.

    import ep_plugin.deep_ep as deep_ep                 # explicit
    ep_plugin.deep_ep.install(); import deep_ep         # `import deep_ep` resolves to this module

Supported: Buffer with
- intranode: get_dispatch_layout, dispatch (fresh, cached, FP8 pairs, num_worst_tokens,
  expert_alignment), combine (weights, bias), capture, set_num_sms, get_dispatch_config,
  get_combine_config, destroy;
- low-latency (Buffer(..., low_latency_mode=True)): low_latency_dispatch (BF16 or FP8, round_scale,
  use_ue8m0, cumulative_local_expert_recv_stats, async_finish, return_recv_hook),
  low_latency_combine (out, zero_copy, async_finish, return_recv_hook),
  get_next_low_latency_combine_buffer, clean_low_latency_buffer (a no-op), get_low_latency_rdma_size_hint,
  and later DeepEP's low_latency_{update,query,clean}_mask_buffer;
- internode (internode.py: nodes from ep_config's comm.ranks_per_node or the hosts, the internode
  backend underneath): get_dispatch_layout's num_tokens_per_rdma_rank, internode_dispatch/combine;
EventOverlap, Config. Not supported (NotImplementedError naming the call or argument): dispatch_wait_recv_cost_stats,
combine_wait_recv_cost_stats, use_logfmt, get_local_buffer_tensor. See buffer.py (intranode),
internode.py and low_latency.py for the mapping onto EPBuffer.
"""
from __future__ import annotations

import sys

from . import utils
from .buffer import Buffer
from .events import Config, EventOverlap

_PREVIOUS = []  # what `deep_ep` was in sys.modules before install()


def install() -> None:
    """Make `import deep_ep` resolve to this module (undone by uninstall())."""
    if sys.modules.get("deep_ep") is sys.modules[__name__]:
        return
    _PREVIOUS.append((sys.modules.get("deep_ep"), sys.modules.get("deep_ep.utils")))
    sys.modules["deep_ep"] = sys.modules[__name__]
    sys.modules["deep_ep.utils"] = utils


def uninstall() -> None:
    if sys.modules.get("deep_ep") is not sys.modules[__name__]:
        return
    prev, prev_utils = _PREVIOUS.pop() if _PREVIOUS else (None, None)
    for name, mod in (("deep_ep", prev), ("deep_ep.utils", prev_utils)):
        if mod is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = mod


__all__ = ["Buffer", "Config", "EventOverlap", "install", "uninstall"]
