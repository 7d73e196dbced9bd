"""Helpers for ep_plugin's tests and examples (not part of the library's API)."""
from .cpu import cpu_stand_ins, remove_cpu_stand_ins
from .deepspeed_cpu import deepspeed_without_shm_op

__all__ = ["cpu_stand_ins", "deepspeed_without_shm_op", "remove_cpu_stand_ins"]
