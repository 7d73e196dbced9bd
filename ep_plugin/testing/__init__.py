"""Helpers for ep_plugin's tests and examples (not part of the library's API)."""
from .cpu import cpu_stand_ins, remove_cpu_stand_ins

__all__ = ["cpu_stand_ins", "remove_cpu_stand_ins"]
