"""Environment overrides: the one place ep_plugin reads ``EP_PLUGIN_*`` variables at run time.

variable                     overrides            values
---------------------------  -------------------  ---------------------------------------------
EP_PLUGIN_NVLINK_WORST_CASE  comm.host_sync       1 | true | yes | on: host_sync false (dispatch
                                                  never waits on the host; its outputs are sized
                                                  for the worst case); 0 | false | no | off: true
EP_PLUGIN_NVLINK_COMBINE     comm.combine_kernel  auto | split | fused | pipelined | pull
EP_PLUGIN_NVLINK_DISPATCH    comm.dispatch_kernel auto | split | fused
EP_PLUGIN_NVLINK_SPARES      comm.spare_outputs   1 | true | yes | on | 0 | false | no | off
EP_PLUGIN_LL_COMBINE_REDUCE  comm.low_latency.    source | owner
                             combine_reduce
EP_PLUGIN_CONFIG_DIR         (preset lookup)      a directory searched for <name>.yaml presets
                                                  before the ones shipped in the package

Unset or empty means no override. :func:`load_config` applies the key overrides last, after the
file, dict and ``overrides`` argument: the environment wins, so an operator can switch a mode for
one run without editing YAML or code. A value outside the list is a :class:`ConfigError` that names
the variable. (``EP_PLUGIN_BUILD_C``, ``EP_PLUGIN_CUDA_ARCH`` and ``EP_PLUGIN_CHECK_BUILD`` are build switches of setup.py.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from ..errors import ConfigError
from .schema import COMBINE_KERNELS, COMBINE_REDUCES, DISPATCH_KERNELS
from .validate import fmt_allowed, suggest

WORST_CASE = "EP_PLUGIN_NVLINK_WORST_CASE"
COMBINE = "EP_PLUGIN_NVLINK_COMBINE"
DISPATCH = "EP_PLUGIN_NVLINK_DISPATCH"
SPARES = "EP_PLUGIN_NVLINK_SPARES"
LL_COMBINE_REDUCE = "EP_PLUGIN_LL_COMBINE_REDUCE"
CONFIG_DIR = "EP_PLUGIN_CONFIG_DIR"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _switch(var: str, key: str, on_means: str = "") -> Callable[[str], bool]:
    def parse(text: str) -> bool:
        word = text.lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise ConfigError(f"{var}={text!r} (environment): overrides {key}; allowed: {' | '.join(_TRUE)}{on_means} or "
                          f"{' | '.join(_FALSE)}")
    return parse


_worst_case = _switch(WORST_CASE, "comm.host_sync", " (never wait on the host)")


def _worst_case_to_host_sync(text: str) -> bool:
    return not _worst_case(text)  # worst case = no host sync


def _kernel_choice(var: str, key: str, allowed: Tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text in allowed:
            return text
        raise ConfigError(f"{var}={text!r} (environment): overrides {key}; not an allowed value"
                          f"{suggest(text, allowed)}; allowed: {fmt_allowed(allowed)}")
    return parse


# variable -> (dotted config key, parser of its stripped text)
OVERRIDES: Dict[str, Tuple[str, Callable[[str], Any]]] = {
    WORST_CASE: ("comm.host_sync", _worst_case_to_host_sync),
    COMBINE: ("comm.combine_kernel", _kernel_choice(COMBINE, "comm.combine_kernel", COMBINE_KERNELS)),
    DISPATCH: ("comm.dispatch_kernel", _kernel_choice(DISPATCH, "comm.dispatch_kernel", DISPATCH_KERNELS)),
    SPARES: ("comm.spare_outputs", _switch(SPARES, "comm.spare_outputs")),
    LL_COMBINE_REDUCE: ("comm.low_latency.combine_reduce",
                        _kernel_choice(LL_COMBINE_REDUCE, "comm.low_latency.combine_reduce", COMBINE_REDUCES)),
}


def key_overrides(environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """``{dotted key: value}`` for every override variable that is set; ConfigError on a bad one."""
    environ = os.environ if environ is None else environ
    found = {}
    for var, (key, parse) in OVERRIDES.items():
        text = environ.get(var, "").strip()
        if text:
            found[key] = parse(text)
    return found


def preset_dir(environ: Optional[Mapping[str, str]] = None) -> Optional[Path]:
    """The extra preset directory named by ``EP_PLUGIN_CONFIG_DIR``, or None when unset."""
    environ = os.environ if environ is None else environ
    text = environ.get(CONFIG_DIR, "").strip()
    return Path(text).expanduser() if text else None
