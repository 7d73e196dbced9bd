"""DeepEP V1's Python API (tag v1.2.1) over ep_plugin: code written against `deep_ep` runs on
ep_plugin by changing one import, or none after `install()`.

    import ep_plugin.deep_ep as deep_ep                 # explicit
    ep_plugin.deep_ep.install(); import deep_ep         # `import deep_ep` resolves to this module

Supported: Buffer (get_dispatch_layout, dispatch (fresh, cached, FP8 pairs, num_worst_tokens,
expert_alignment), combine (weights, bias), capture, set_num_sms, get_dispatch_config,
get_combine_config, destroy), EventOverlap, Config. Not yet: the low-latency and internode calls
raise NotImplementedError naming the call. See buffer.py for the mapping onto EPBuffer.
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
