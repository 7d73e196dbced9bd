"""The expert-parallel size rule, apart from validate.py so that schema.EPConfig can use it without an
import circle (validate builds the schema's classes)."""
from __future__ import annotations

from typing import List

from ..errors import ConfigError


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_ep_size(cfg, ep_size: int) -> None:
    """Raise ConfigError unless ``cfg``'s (an EPConfig) experts split evenly over ``ep_size`` ranks."""
    where = cfg.source or "<EPConfig>"
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ConfigError(f"{where}: expert-parallel size must be a positive int, got {ep_size!r}")
    e = cfg.moe.num_experts
    if e % ep_size != 0:
        raise ConfigError(
            f"{where}: moe.num_experts = {e} is not divisible by the expert-parallel size "
            f"{ep_size}; allowed EP sizes for {e} experts: {divisors(e)}"
        )
