"""CPU stand-ins for the few torch.cuda calls megatron-core makes on its MoE / GPT path, so that its
models run under gloo on a machine without CUDA. They patch torch globally: tests and examples only.
"""
from __future__ import annotations

import contextlib
from typing import Any, List, Tuple

import torch

# (owner, attribute, original) of every patch, in the order applied
_PATCHED: List[Tuple[Any, str, Any]] = []


class _CpuStream:
    def wait_stream(self, stream): pass
    def wait_event(self, event): pass
    def record_event(self, event=None): return _CpuEvent()
    def synchronize(self): pass
    def query(self): return True


class _CpuEvent:
    def __init__(self, *args, **kwargs): pass
    def record(self, stream=None): pass
    def wait(self, stream=None): pass
    def synchronize(self): pass
    def query(self): return True


class _CpuRngTracker:
    """megatron forks a "CUDA RNG state" around attention dropout: a tracker with no states."""

    def is_initialized(self): return True
    def reset(self): pass
    def get_states(self): return {}
    def set_states(self, states): pass
    def add(self, name, seed): pass

    @contextlib.contextmanager
    def fork(self, name=None):
        yield


_CPU_STREAM = _CpuStream()


def _patch(owner, name: str, value) -> None:
    _PATCHED.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def cpu_stand_ins(eager: bool = True) -> bool:
    """On a machine without CUDA, stand in for the few torch.cuda calls megatron-core makes on its
    MoE / GPT path (streams, events, current_device, the CUDA RNG tracker) with CPU no-ops, and let
    gloo's all_to_all_single take the tensor split sizes megatron passes. With `eager`, megatron's
    torch.compile'd helpers (the router's) run eagerly: compiling them costs ~30 s on a small CPU.
    Does nothing when CUDA is available. True when the stand-ins are active; remove_cpu_stand_ins()
    undoes them."""
    if torch.cuda.is_available():
        return False
    if eager:
        import torch._dynamo as dynamo

        dynamo.config.disable = True
    if _PATCHED:
        return True
    import torch.distributed as dist
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as tp_random

    c = torch.cuda
    _patch(c, "Stream", lambda *a, **k: _CpuStream())
    _patch(c, "Event", _CpuEvent)
    _patch(c, "current_stream", lambda device=None: _CPU_STREAM)
    _patch(c, "stream", lambda stream=None: contextlib.nullcontext())
    _patch(c, "synchronize", lambda device=None: None)
    _patch(c, "current_device", lambda: torch.device("cpu"))

    orig_record = torch.Tensor.record_stream

    def record_stream(self, stream):
        if isinstance(stream, _CpuStream) or not self.is_cuda:
            return None
        return orig_record(self, stream)

    _patch(torch.Tensor, "record_stream", record_stream)

    orig_a2a = dist.all_to_all_single

    def _host(s):
        return s.tolist() if hasattr(s, "tolist") else s

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        return orig_a2a(output, input, _host(output_split_sizes), _host(input_split_sizes),
                        group=group, async_op=async_op)

    _patch(dist, "all_to_all_single", all_to_all_single)

    tracker = _CpuRngTracker()
    _patch(tensor_parallel, "get_cuda_rng_tracker", lambda *a, **k: tracker)
    _patch(tp_random, "get_cuda_rng_tracker", lambda *a, **k: tracker)
    return True


def remove_cpu_stand_ins() -> None:
    """Put back everything cpu_stand_ins() replaced."""
    while _PATCHED:
        owner, name, original = _PATCHED.pop()
        setattr(owner, name, original)
