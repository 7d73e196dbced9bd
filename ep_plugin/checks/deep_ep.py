"""The checks of ep_plugin.deep_ep's intranode layout tensors (DeepEP's get_dispatch_layout outputs that
its dispatch takes back): their form once per call form, their values on the device against the
layout of topk_idx (raised with no extra host wait: see LayoutCheck)."""
from __future__ import annotations

from typing import Optional

import torch

from .core import call_form, need

LAYOUT_NAMES = ("num_tokens_per_rank", "is_token_in_rank", "num_tokens_per_expert")
_INTS = (torch.int32, torch.int64)


def layout_args(topk_idx, num_experts, world: int) -> None:
    """get_dispatch_layout's arguments: topk_idx [T, K] int64, num_experts a multiple of the ranks."""
    need(isinstance(topk_idx, torch.Tensor) and topk_idx.dtype == torch.int64 and topk_idx.dim() == 2, TypeError,
         f"topk_idx must be a [num_tokens, num_topk] int64 tensor, got "
         f"{getattr(topk_idx, 'dtype', type(topk_idx).__name__)} of shape {tuple(getattr(topk_idx, 'shape', ()))}")
    need(isinstance(num_experts, int) and not isinstance(num_experts, bool) and num_experts > 0, ValueError,
         f"num_experts must be a positive int, got {num_experts!r}")
    need(num_experts % world == 0, ValueError,
         f"num_experts ({num_experts}) must be divisible by the number of ranks ({world}): rank r owns experts "
         f"[r*E/W, (r+1)*E/W)")


def dispatch_args(forms, data, topk_idx, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                  world: int) -> None:
    """A fresh dispatch's layout tensors: num_tokens_per_rank [W] int, is_token_in_rank [T, W] bool,
    num_tokens_per_expert [E] int with E a multiple of W, all on x's device. Once per call form."""
    key = ("deep_ep_dispatch", call_form(data, topk_idx, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert))
    if key in forms:
        return
    T = data.shape[0]
    if topk_idx is not None:  # its layout is recomputed below, before EPBuffer's own checks
        need(isinstance(topk_idx, torch.Tensor) and topk_idx.dtype == torch.int64, TypeError,
             f"topk_idx must be an int64 tensor, got {getattr(topk_idx, 'dtype', type(topk_idx).__name__)}")
        need(topk_idx.dim() == 2 and topk_idx.shape[0] == T, ValueError,
             f"topk_idx must have shape [{T}, num_topk], got {tuple(topk_idx.shape)}")
        need(topk_idx.device == data.device, ValueError, f"topk_idx is on {topk_idx.device}, x on {data.device}")
    for name, t in zip(LAYOUT_NAMES, (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert)):
        need(t is not None, ValueError, f"dispatch without a handle needs {name} (from get_dispatch_layout)")
        need(isinstance(t, torch.Tensor), TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")
        need(t.device == data.device, ValueError, f"{name} is on {t.device}, x on {data.device}")
    need(num_tokens_per_rank.dtype in _INTS, TypeError,
         f"num_tokens_per_rank must be an int32 tensor, got {num_tokens_per_rank.dtype}")
    need(tuple(num_tokens_per_rank.shape) == (world,), ValueError,
         f"num_tokens_per_rank must have shape [{world}] (the ranks), got {tuple(num_tokens_per_rank.shape)}")
    need(is_token_in_rank.dtype == torch.bool, TypeError,
         f"is_token_in_rank must be a bool tensor, got {is_token_in_rank.dtype}")
    need(tuple(is_token_in_rank.shape) == (T, world), ValueError,
         f"is_token_in_rank must have shape [{T}, {world}] (tokens, ranks), got {tuple(is_token_in_rank.shape)}")
    need(num_tokens_per_expert.dtype in _INTS, TypeError,
         f"num_tokens_per_expert must be an int32 tensor, got {num_tokens_per_expert.dtype}")
    E = num_tokens_per_expert.numel()
    need(num_tokens_per_expert.dim() == 1 and E > 0 and E % world == 0, ValueError,
         f"num_tokens_per_expert must have shape [num_experts] with num_experts a multiple of the {world} ranks "
         f"(its length is the expert count), got {tuple(num_tokens_per_expert.shape)}")
    forms.add(key)


def layout_mismatch(topk_idx: Optional[torch.Tensor], num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                    world: int) -> torch.Tensor:
    """[3] bool on the device: which layout tensor (LAYOUT_NAMES) disagrees with topk_idx's layout (E the
    length of num_tokens_per_expert). Without topk_idx, num_tokens_per_rank is compared with
    is_token_in_rank only."""
    if topk_idx is None:
        per_rank = is_token_in_rank.sum(0)
        return torch.stack([torch.ne(per_rank, num_tokens_per_rank).any(), per_rank.new_zeros((), dtype=torch.bool),
                            per_rank.new_zeros((), dtype=torch.bool)])
    from .._ext import has_c
    from ..layout import dispatch_layout, dispatch_layout_cuda

    fn = dispatch_layout_cuda if topk_idx.is_cuda and has_c() else dispatch_layout
    per_rank, per_expert, in_rank = fn(topk_idx, num_tokens_per_expert.numel(), world)
    return torch.stack([torch.ne(per_rank, num_tokens_per_rank).any(), torch.ne(in_rank, is_token_in_rank).any(),
                        torch.ne(per_expert, num_tokens_per_expert).any()])


def raise_mismatch(bad) -> None:
    """Raise naming the layout tensors flagged in `bad` (host bools, LAYOUT_NAMES order), if any."""
    names = [n for n, b in zip(LAYOUT_NAMES, bad) if b]
    need(not names, ValueError,
         f"{', '.join(names)} disagree{'s' if len(names) == 1 else ''} with the layout of topk_idx, what "
         "get_dispatch_layout(topk_idx, num_experts=len(num_tokens_per_expert)) returns: pass that call's outputs")


class LayoutCheck:
    """Sticky flags of a deep_ep.Buffer for a dispatch that did not wait on the host (num_worst_tokens):
    kept on the device, copied to pinned memory without blocking, raised by the Buffer's next call."""

    def __init__(self):
        self._flag = None
        self._host = None

    def record(self, bad: torch.Tensor) -> None:
        if not bad.is_cuda:
            raise_mismatch(bad.tolist())
            return
        if self._flag is None or self._flag.device != bad.device:
            self._flag = torch.zeros(3, dtype=torch.bool, device=bad.device)
            self._host = torch.zeros(3, dtype=torch.bool, pin_memory=True, device="cpu")
        self._flag.logical_or_(bad)
        if not torch.cuda.is_current_stream_capturing():
            self._host.copy_(self._flag, non_blocking=True)

    def raise_if_seen(self) -> None:
        if self._host is not None and bool(self._host.any()):
            bad = self._host.tolist()
            self._flag.zero_()
            self._host.zero_()
            raise_mismatch(bad)
