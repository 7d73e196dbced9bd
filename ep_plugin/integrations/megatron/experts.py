"""Grouped-GEMM experts without TransformerEngine: megatron's TEGroupedMLP (non-fused path) with
fc1/fc2 as GroupedMMLinear, all local experts of one linear in one parameter run by torch grouped_mm.
Needs megatron-core only for grouped_mm_experts().
"""
from __future__ import annotations

import warnings
from functools import partial

import torch


def torch_grouped_mm():
    """torch's grouped GEMM (torch.nn.functional.grouped_mm, or torch._grouped_mm on older torch),
    or None."""
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


class GroupedMMLinear(torch.nn.Module):
    """All local experts' weights of one linear in one [G, out, in] parameter, run with
    torch grouped_mm on GPU (a per-expert loop elsewhere). Builder-compatible with megatron's
    TEGroupedMLP linear_fc1 / linear_fc2 (forward(x, tokens_per_expert) -> (y, None))."""

    impl = None  # what ran last: "grouped_mm" / "_grouped_mm", or "loop"

    def __init__(self, num_local_experts: int, input_size: int, output_size: int, *, config,
                 init_method=None, bias: bool = False, skip_bias_add: bool = False,
                 is_expert: bool = True, tp_comm_buffer_name=None, pg_collection=None, name=None):
        super().__init__()
        if bias:
            raise ValueError("GroupedMMLinear has no bias (set add_bias_linear=False)")
        if pg_collection is not None and getattr(pg_collection, "expt_tp", None) is not None \
                and pg_collection.expt_tp.size() > 1:
            raise ValueError("GroupedMMLinear supports expert_tensor_parallel_size=1 only")
        dtype = config.params_dtype
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() \
            else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(num_local_experts, output_size, input_size,
                                                     dtype=dtype, device=device))
        init = init_method or torch.nn.init.xavier_normal_
        with torch.no_grad():
            for g in range(num_local_experts):
                init(self.weight[g])
        setattr(self.weight, "allreduce", False)  # expert parameter: not reduced over EP
        self.num_local_experts = num_local_experts

    def forward(self, x: torch.Tensor, tokens_per_expert):
        counts = [int(c) for c in (tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert)
                                   else tokens_per_expert)]
        gmm = torch_grouped_mm()
        w = self.weight.to(x.dtype)
        if x.is_cuda and gmm is not None and x.dtype == torch.bfloat16 and GroupedMMLinear.impl != "loop":
            # grouped_mm wants int32 group ends (cumsum would promote to int64)
            offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            offs = offs.to(x.device, non_blocking=True)
            try:
                out = gmm(x, w.transpose(1, 2), offs=offs)
                GroupedMMLinear.impl = getattr(gmm, "__name__", "grouped_mm")
                return out, None
            except (RuntimeError, TypeError) as exc:  # e.g. a GPU without grouped-GEMM support
                warnings.warn(f"GroupedMMLinear: grouped_mm failed ({exc}); using a per-expert loop")
                GroupedMMLinear.impl = "loop"
        # unbind, not w[g]: indexing would give every expert a full-size weight gradient
        outs = [xi @ wg.t() for wg, xi in zip(w.unbind(0), torch.split(x, counts))]
        out = torch.cat(outs) if outs else x.new_zeros((0, w.shape[1]))
        return out, None

    def backward_dw(self):
        return None


def grouped_mm_experts():
    """Experts builder for MoESubmodules(experts=...): megatron's TEGroupedMLP (which runs without
    TransformerEngine on its non-fused path) with GroupedMMLinear for fc1/fc2."""
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    return partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(linear_fc1=GroupedMMLinear,
                                                                   linear_fc2=GroupedMMLinear))
