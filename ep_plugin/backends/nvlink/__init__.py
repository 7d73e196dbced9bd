"""The nvlink backend (intranode kernels over CUDA IPC): see backend.py."""
from .backend import NvlinkBackend, NvlinkState
from .limits import MAX_RANKS, MAX_TOPK, check_hidden
from .plan import plan_num_sms

__all__ = ["NvlinkBackend", "NvlinkState", "MAX_RANKS", "MAX_TOPK", "check_hidden", "plan_num_sms"]
