"""Top-k gating for MoE layers: softmax or sigmoid scores, group-limited top-k (DeepSeek-V3),
top-k scaling and aux-loss-free expert-bias selection.

The results equal megatron-core 0.19.2's ``topk_routing_with_score_function`` (non-fused path,
``dense_output=True``) and ``group_limited_topk`` numerically: the same selections, the same column
order and the same float32 weights (Megatron casts its weights to the logits' dtype at the end;
ours stay float32, so ``ours.to(logits.dtype)`` is what Megatron returns).

    w, idx = topk_routing(logits, 8, score_function="sigmoid", num_groups=8, group_topk=4,
                          scaling_factor=2.5, expert_bias=bias)
    w, idx = route(logits, cfg.moe, expert_bias=bias)          # the same, from an MoEConfig
    probs, routing_map = to_dense(w, idx, num_experts)         # Megatron's sparse [T, E] form
"""

from __future__ import annotations

import numbers
from typing import Optional, Tuple

import torch

from .config import SCORE_FUNCTIONS  # the one list of score functions; topk_routing implements each

__all__ = [
    "SCORE_FUNCTIONS",
    "topk_routing",
    "group_limited_topk",
    "route",
    "to_dense",
    "update_expert_bias",
]


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def group_limited_topk(
    scores: torch.Tensor, topk: int, num_groups: int, group_topk: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k inside each token's best ``group_topk`` of ``num_groups`` contiguous expert groups.

    A group's score is the sum of its ``topk // group_topk`` highest expert scores. Returns the
    selected scores and expert indices, ``[T, topk]`` each, highest first (as Megatron does).
    """
    num_tokens, num_experts = scores.shape
    per_group = num_experts // num_groups
    grouped = scores.reshape(num_tokens, num_groups, per_group)
    group_score = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)  # [T, G]
    best = group_score.topk(group_topk, dim=-1, sorted=False).indices  # [T, group_topk]
    keep = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, best, True)
    outside = ~keep.unsqueeze(-1).expand(num_tokens, num_groups, per_group)
    masked = grouped.masked_fill(outside, float("-inf")).reshape(num_tokens, num_experts)
    return masked.topk(topk, dim=-1)


def _check_args(logits, topk, score_function, num_groups, group_topk, scaling_factor,
                expert_bias, use_pre_softmax):
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [num_tokens, num_experts], got shape "
                         f"{tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
    num_experts = logits.shape[1]
    if not _is_int(topk):
        raise TypeError(f"topk must be an int, got {type(topk).__name__}")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be in 1..{num_experts} (num_experts), got {topk}")
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function must be one of {', '.join(SCORE_FUNCTIONS)}, "
                         f"got {score_function!r}")
    if (num_groups is None) != (group_topk is None):
        raise ValueError("num_groups and group_topk must be given together (group-limited "
                         f"routing) or both be None, got num_groups={num_groups!r}, "
                         f"group_topk={group_topk!r}")
    if num_groups is not None:
        for name, v in (("num_groups", num_groups), ("group_topk", group_topk)):
            if not _is_int(v):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if num_groups < 1 or num_experts % num_groups != 0:
            raise ValueError(f"num_groups must divide num_experts ({num_experts}), got "
                             f"{num_groups}")
        if not 1 <= group_topk <= num_groups:
            raise ValueError(f"group_topk must be in 1..{num_groups} (num_groups), got "
                             f"{group_topk}")
        per_group = num_experts // num_groups
        if topk < group_topk or topk // group_topk > per_group:
            raise ValueError(f"topk // group_topk must be in 1..{per_group} (experts per group), "
                             f"got topk={topk}, group_topk={group_topk}")
        if topk > group_topk * per_group:
            raise ValueError(f"topk must be at most group_topk * experts per group "
                             f"({group_topk * per_group}), got {topk}")
    if scaling_factor is not None:
        if isinstance(scaling_factor, bool) or not isinstance(scaling_factor, numbers.Real):
            raise TypeError(f"scaling_factor must be a float or None, got "
                            f"{type(scaling_factor).__name__}")
    if expert_bias is not None:
        if score_function == "softmax":
            raise ValueError("expert_bias needs score_function 'sigmoid' or 'sqrtsoftplus' "
                             "(Megatron ignores the bias with softmax and refuses the config)")
        if not isinstance(expert_bias, torch.Tensor):
            raise TypeError(f"expert_bias must be a torch.Tensor, got "
                            f"{type(expert_bias).__name__}")
        if tuple(expert_bias.shape) != (num_experts,):
            raise ValueError(f"expert_bias must have shape ({num_experts},), got "
                             f"{tuple(expert_bias.shape)}")
        if expert_bias.device != logits.device:
            raise ValueError(f"expert_bias must be on {logits.device} like logits, got "
                             f"{expert_bias.device}")


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    *,
    score_function: str = "softmax",
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
    expert_bias: Optional[torch.Tensor] = None,
    use_pre_softmax: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Select ``topk`` experts per token from router ``logits`` ``[T, E]``.

    - ``softmax``: with ``use_pre_softmax`` the softmax runs over all experts and the top-k
      probabilities are kept as they are; otherwise top-k runs on the logits and the softmax over
      the k selected ones (weights sum to 1).
    - ``sigmoid`` / ``sqrtsoftplus``: scores are ``sigmoid(logits)`` / ``sqrt(softplus(logits))``;
      with ``expert_bias`` the experts are chosen on ``score + bias`` but weighted by the unbiased
      score; for ``topk > 1`` the k weights are divided by their sum.
    - ``num_groups`` / ``group_topk``: group-limited top-k (see :func:`group_limited_topk`), on the
      same values the plain top-k would use.
    - ``scaling_factor``: the weights are multiplied by it (a falsy value means none).

    Returns ``(topk_weights float32 [T, K], topk_idx int64 [T, K])``. As in Megatron, the columns
    are ordered highest first, except the plain (non-group) top-k under ``torch.no_grad`` where
    Megatron (and so this function) asks ``torch.topk`` for an unsorted result.
    """
    _check_args(logits, topk, score_function, num_groups, group_topk, scaling_factor,
                expert_bias, use_pre_softmax)

    def select(values: torch.Tensor):
        if group_topk:
            return group_limited_topk(values, topk, num_groups, group_topk)
        return torch.topk(values, k=topk, dim=1, sorted=torch.is_grad_enabled())

    # All score arithmetic in float32, as Megatron does.
    if score_function == "softmax":
        if use_pre_softmax:
            weights, idx = select(torch.softmax(logits, dim=-1, dtype=torch.float32))
        else:
            top_logits, idx = select(logits)
            weights = torch.softmax(top_logits, dim=-1, dtype=torch.float32)
    else:
        x = logits.float()
        if score_function == "sigmoid":
            scores = torch.sigmoid(x)
        else:
            scores = torch.nn.functional.softplus(x).sqrt()
        if expert_bias is None:
            weights, idx = select(scores)
        else:
            _, idx = select(scores + expert_bias.float())
            weights = scores.gather(1, idx)
        if topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)

    if scaling_factor:
        weights = weights * scaling_factor
    return weights.float(), idx.long()


def route(logits: torch.Tensor, moe, expert_bias: Optional[torch.Tensor] = None):
    """:func:`topk_routing` with the settings of ``moe`` (an ``MoEConfig`` or an ``EPConfig``).

    ``expert_bias`` is the current per-expert bias ``[E]`` when ``moe.expert_bias`` is true (when
    it is not given the selection is unbiased, as with a freshly zero-initialised bias).
    """
    moe = getattr(moe, "moe", moe)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2 or logits.shape[1] != moe.num_experts:
        raise ValueError(f"logits must have shape [num_tokens, {moe.num_experts}] "
                         f"(moe.num_experts), got {tuple(logits.shape)}")
    if expert_bias is not None and not moe.expert_bias:
        raise ValueError("expert_bias was given but the config has moe.expert_bias: false")
    return topk_routing(
        logits,
        moe.topk,
        score_function=moe.score_function,
        num_groups=moe.num_groups,
        group_topk=moe.group_topk,
        scaling_factor=moe.topk_scaling_factor,
        expert_bias=expert_bias,
        use_pre_softmax=getattr(moe, "use_pre_softmax", False),
    )


def to_dense(topk_weights: torch.Tensor, topk_idx: torch.Tensor, num_experts: int):
    """``[T, K]`` weights and indices to Megatron's ``(probs [T, E], routing_map [T, E] bool)``.

    Entries with index -1 (routed nowhere) are dropped. ``probs`` has ``topk_weights``' dtype.
    """
    if topk_weights.shape != topk_idx.shape or topk_idx.dim() != 2:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_idx "
                         f"{tuple(topk_idx.shape)} must both be [T, K]")
    num_tokens = topk_idx.shape[0]
    if topk_idx.numel() and (topk_idx.min() < -1 or topk_idx.max() >= num_experts):
        raise ValueError(f"topk_idx must be in [-1, {num_experts}), got values in "
                         f"[{int(topk_idx.min())}, {int(topk_idx.max())}]")
    idx = torch.where(topk_idx < 0, torch.full_like(topk_idx, num_experts), topk_idx).long()
    probs = topk_weights.new_zeros(num_tokens, num_experts + 1).scatter(1, idx, topk_weights)
    routing_map = torch.zeros(num_tokens, num_experts + 1, dtype=torch.bool,
                              device=topk_idx.device).scatter(1, idx, True)
    return probs[:, :num_experts], routing_map[:, :num_experts]


def update_expert_bias(expert_bias: torch.Tensor, tokens_per_expert: torch.Tensor,
                       update_rate: float = 1e-3) -> torch.Tensor:
    """Aux-loss-free balancing step (DeepSeek-V3): raise the bias of under-loaded experts and
    lower that of over-loaded ones by ``update_rate``. Returns the new bias (same as Megatron's
    ``get_updated_expert_bias`` after its all-reduce: reduce ``tokens_per_expert`` over the
    data-parallel group yourself first if needed)."""
    with torch.no_grad():
        counts = tokens_per_expert.to(expert_bias.device)
        mean = counts.sum(dim=-1, keepdim=True) / counts.shape[-1]
        return expert_bias + torch.sign(mean - counts) * update_rate
