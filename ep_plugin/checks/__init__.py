"""Every argument check of the call forms in one place: EPBuffer's dispatch (fresh or cached, rank- or
expert-major) and combine (calls.py), its low-latency calls (low_latency.py), ep_plugin.deep_ep's
layout tensors (deep_ep.py) and its low-latency calls (deep_ep_ll.py). Each check of a tensor's form runs
once per call form, cached per buffer (core.Forms, core.FormMap); expert ids are checked on the
device (core.ExpertIdCheck) and raised at the next check."""
from .calls import LAYOUTS, CallChecks
from .core import ExpertIdCheck, Forms, call_form, dtype_names, need
from .low_latency import LOW_LATENCY_MAX_TOPK

__all__ = ["CallChecks", "ExpertIdCheck", "Forms", "LAYOUTS", "LOW_LATENCY_MAX_TOPK", "call_form", "dtype_names",
           "need"]
