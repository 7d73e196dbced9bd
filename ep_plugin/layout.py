"""Dispatch layout: from topk_idx, how many tokens go to each rank and expert, and which ranks each
token reaches. The torch version is the reference; the CUDA version runs ep_plugin._C's kernel."""
from __future__ import annotations

from typing import Tuple

import torch

from ._ext import get_c


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (tokens_per_rank [W] int32, tokens_per_expert [E] int32, is_token_in_rank [T, W] bool)."""
    experts_per_rank = num_experts // num_ranks
    valid = (topk_idx >= 0) & (topk_idx < num_experts)  # ids out of range count as routed nowhere
    tokens_per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
    dest = torch.where(valid, topk_idx // experts_per_rank, num_ranks)  # num_ranks = routed nowhere
    hits = torch.zeros(topk_idx.shape[0], num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    hits.scatter_(1, dest, True)
    is_token_in_rank = hits[:, :num_ranks].contiguous()
    tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
    return tokens_per_rank, tokens_per_expert, is_token_in_rank


def dispatch_layout_cuda(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same as dispatch_layout, computed by the compiled kernel on topk_idx's CUDA device."""
    if not topk_idx.is_cuda or topk_idx.dtype != torch.int64 or topk_idx.dim() != 2:
        raise TypeError("topk_idx must be a 2-D int64 CUDA tensor")
    topk_idx = topk_idx.contiguous()
    dev = topk_idx.device
    tokens_per_rank = torch.empty(num_ranks, dtype=torch.int32, device=dev)
    tokens_per_expert = torch.empty(num_experts, dtype=torch.int32, device=dev)
    is_token_in_rank = torch.empty(topk_idx.shape[0], num_ranks, dtype=torch.bool, device=dev)
    get_c().dispatch_layout(topk_idx.data_ptr(), topk_idx.shape[0], topk_idx.shape[1], num_ranks,
                            num_experts, tokens_per_rank.data_ptr(), tokens_per_expert.data_ptr(),
                            is_token_in_rank.data_ptr(), torch.cuda.current_stream(dev).cuda_stream)
    return tokens_per_rank, tokens_per_expert, is_token_in_rank
