"""Grouped-GEMM experts without TransformerEngine.

    GroupedMMLinear      all local experts' weights of one linear in one [G, out, in] parameter, run by
                         torch grouped_mm on GPU (a per-expert loop elsewhere), from host split sizes
                         (what megatron's TEGroupedMLP hands it) or from group ends on the device
    grouped_mm_experts() megatron's TEGroupedMLP (non-fused path) with GroupedMMLinear fc1/fc2: host counts

EPGroupedMLP (grouped_mlp.py) is the same module and weights with a forward that reads no count on
the host. Needs megatron-core only for grouped_mm_experts(), so importing this module (and
ep_plugin.megatron) works without it.
"""
from __future__ import annotations

import warnings
from functools import partial

import torch

from ep_plugin._ext import c_op, raw_stream


def torch_grouped_mm():
    """torch's grouped GEMM (torch.nn.functional.grouped_mm, or torch._grouped_mm on older torch),
    or None."""
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


def group_ends(tokens_per_expert: torch.Tensor, device) -> torch.Tensor:
    """[G] counts (a tensor, on any device) -> [G] int32 end row of each expert's rows, on `device`,
    computed there: what grouped_mm takes as offs. No host read."""
    # int32 from the cumsum itself: casting an int64 cumsum would be a second pass
    return tokens_per_expert.to(device, non_blocking=True).cumsum(0, dtype=torch.int32)


def tail_rows(ends: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[num_rows, 1] bool: rows at or past the last group end (the padding of a worst-case-sized
    dispatch), found on the device."""
    rows = torch.arange(num_rows, device=ends.device, dtype=ends.dtype)
    return (rows >= ends[-1:]).unsqueeze(-1)


# blocks of the row kernels' grid-stride loops (csrc/experts/): enough to keep a GPU busy, a few per SM
_GRID_BLOCKS = 2048


def _rows_kernel_args(x: torch.Tensor, ends: torch.Tensor) -> bool:
    """What every row kernel of csrc/experts/ needs: _C's stream accessor, contiguous 16-byte-aligned CUDA rows x
    [N, C] and the groups' ends as contiguous int32 [G >= 1] on x's device (the kernels read ends[-1] there)."""
    return (raw_stream is not None and x.is_cuda and x.dim() == 2 and x.is_contiguous() and x.data_ptr() % 16 == 0
            and ends.dtype == torch.int32 and ends.dim() == 1 and ends.numel() > 0 and ends.is_contiguous()
            and ends.device == x.device)


def _zero_tail_kernel(out: torch.Tensor, ends: torch.Tensor):
    """_C.zero_rows_from where it applies to out (rows of 16-byte multiples, _rows_kernel_args), else None."""
    kernel = c_op("zero_rows_from")
    if kernel is None or not _rows_kernel_args(out, ends) or (out.shape[1] * out.element_size()) % 16:
        return None
    return kernel


class _ZeroTailRows(torch.autograd.Function):
    """out's rows past ends[-1] set to 0 in place by a kernel that writes those rows only (csrc/experts/
    zero_tail.cu); the gradient passes through unchanged: its tail rows reach only grouped_mm's backward,
    which reads no row past the last end (and the loop form selects rows by expert)."""

    @staticmethod
    def forward(ctx, out, ends, kernel):
        kernel(out.data_ptr(), out.shape[0], out.shape[1] * out.element_size(), ends.data_ptr(), ends.numel(),
               _GRID_BLOCKS, raw_stream(out.device.index))
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def zero_tail_rows_(out: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """out [N, C]'s rows at or past ends[-1] (ends: [G] int32 on out's device) set to 0, in place, reading
    nothing on the host. On CUDA (where _C is built) a kernel writes the tail rows only; elsewhere
    out.masked_fill_(tail_rows(...), 0), a pass over every row (and another over the gradient)."""
    kernel = _zero_tail_kernel(out, ends)
    if kernel is None:
        return out.masked_fill_(tail_rows(ends, out.shape[0]), 0)
    return _ZeroTailRows.apply(out, ends, kernel)


class _BoundedWeightedSwiGLU(torch.autograd.Function):
    """megatron's weighted SwiGLU (fused_bias_swiglu.weighted_swiglu and its backward) over the rows before ends[-1]
    only (csrc/experts/swiglu_rows.cu): y's rows past them and the input gradient's are not written (they reach only
    grouped_mm, which reads no such row), the weight gradient is 0 there."""

    @staticmethod
    def forward(ctx, h, probs, ends, fwd, bwd):
        rows, F = h.shape[0], h.shape[1] // 2
        y = h.new_empty((rows, F))
        fwd(h.data_ptr(), probs.data_ptr(), y.data_ptr(), rows, F, ends.data_ptr(), ends.numel(), _GRID_BLOCKS,
            raw_stream(h.device.index))
        ctx.save_for_backward(h, probs, ends)
        ctx.bwd = bwd
        return y

    @staticmethod
    def backward(ctx, grad):
        h, probs, ends = ctx.saved_tensors
        grad = grad.contiguous()
        if grad.data_ptr() % 16:  # a view at an odd offset: the kernel loads 16 bytes at a time
            grad = grad.clone()
        rows, F = h.shape[0], h.shape[1] // 2
        dh = torch.empty_like(h)
        dw = torch.empty(probs.shape, dtype=torch.float32, device=h.device)
        ctx.bwd(grad.data_ptr(), h.data_ptr(), probs.data_ptr(), dh.data_ptr(), dw.data_ptr(), rows, F,
                ends.data_ptr(), ends.numel(), _GRID_BLOCKS, raw_stream(h.device.index))
        return dh, dw, None, None, None


def bounded_weighted_swiglu(h: torch.Tensor, probs: torch.Tensor, ends: torch.Tensor):
    """silu(gate) * linear * probs of h [N, 2F] (gate | linear), megatron's weighted_swiglu, computed for the rows
    before ends[-1] only (ends: [G] int32 on h's device, read there): [N, F], rows past the end unspecified. None where
    the kernels do not apply (no _C, not CUDA, not BF16 rows with float32 probs [N, 1], F not a multiple of 8): the
    caller then runs megatron's torch form."""
    fwd, bwd = c_op("swiglu_rows_fwd"), c_op("swiglu_rows_bwd")
    if (fwd is None or bwd is None or not _rows_kernel_args(h, ends) or h.dtype != torch.bfloat16 or h.shape[1] % 16
            or probs.dtype != torch.float32 or tuple(probs.shape) != (h.shape[0], 1) or not probs.is_contiguous()
            or probs.device != h.device):
        return None
    return _BoundedWeightedSwiGLU.apply(h, probs, ends, fwd, bwd)


class GroupedMMLinear(torch.nn.Module):
    """All local experts' weights of one linear in one [G, out, in] parameter, run with
    torch grouped_mm on GPU (a per-expert loop elsewhere). Builder-compatible with megatron's
    TEGroupedMLP linear_fc1 / linear_fc2 (forward(x, tokens_per_expert) -> (y, None)).

    tokens_per_expert as a list (megatron's TEGroupedMLP): host split sizes that add up to x's rows.
    As a tensor: counts read only on the device (forward_grouped); x may have rows past their sum,
    whose output rows are unspecified (grouped_mm leaves them unwritten)."""

    impl = None  # what ran last: "grouped_mm" / "_grouped_mm", or "loop"
    _gmm_failed = False  # grouped_mm raised once on this machine: the loop from then on

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

    def _grouped_mm(self, x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor):
        """grouped_mm's output, or None where it does not run (CPU, dtypes other than BF16, no rows, a
        GPU without it: then it warns once and the loop takes over for good)."""
        gmm = torch_grouped_mm()
        if not (x.is_cuda and gmm is not None and x.dtype == torch.bfloat16 and not GroupedMMLinear._gmm_failed):
            return None
        if x.shape[0] == 0:  # a rank that received nothing (exact rows): the loop's empty products
            return None      # keep the weights in the graph, and grouped_mm need not take 0 rows
        try:
            out = gmm(x, w.transpose(1, 2), offs=ends)
        except (RuntimeError, TypeError) as exc:
            warnings.warn(f"GroupedMMLinear: grouped_mm failed ({exc}); using a per-expert loop")
            GroupedMMLinear._gmm_failed = True
            return None
        GroupedMMLinear.impl = getattr(gmm, "__name__", "grouped_mm")
        return out

    def forward(self, x: torch.Tensor, tokens_per_expert):
        if torch.is_tensor(tokens_per_expert):
            return self.forward_grouped(x, group_ends(tokens_per_expert, x.device)), None
        counts = [int(c) for c in tokens_per_expert]
        w = self.weight.to(x.dtype)
        if x.is_cuda:
            # the counts are host values already: this copy waits for nothing
            ends = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            out = self._grouped_mm(x, w, ends.to(x.device, non_blocking=True))
            if out is not None:
                return out, None
        GroupedMMLinear.impl = "loop"
        # unbind, not w[g]: indexing would give every expert a full-size weight gradient
        outs = [xi @ wg.t() for wg, xi in zip(w.unbind(0), torch.split(x, counts))]
        out = torch.cat(outs) if outs else x.new_zeros((0, w.shape[1]))
        return out, None

    def forward_grouped(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """x [N, in] with expert g's rows at [ends[g-1], ends[g]) (ends: [G] int32 on x's device) ->
        [N, out]. Reads nothing on the host; output rows past ends[-1] are unspecified."""
        w = self.weight.to(x.dtype)
        out = self._grouped_mm(x, w, ends)
        if out is not None:
            return out
        GroupedMMLinear.impl = "loop"
        # Without host counts the rows cannot be split: each expert multiplies every row and keeps
        # its own (G times the work; CPU and non-BF16 only). Rows of no expert are zeroed first so that
        # garbage there (a worst-case dispatch leaves them unwritten) cannot reach a weight gradient.
        rows = torch.arange(x.shape[0], device=x.device, dtype=ends.dtype)
        owner = torch.searchsorted(ends, rows, right=True).unsqueeze(-1)  # G past the last end
        x = x.masked_fill(owner == ends.shape[0], 0)
        out = x.new_zeros((x.shape[0], w.shape[1]))
        for g, wg in enumerate(w.unbind(0)):
            out = torch.where(owner == g, x @ wg.t(), out)
        return out

    def backward_dw(self):
        return None


def grouped_mm_experts():
    """Experts builder for MoESubmodules(experts=...): megatron's TEGroupedMLP (which runs without
    TransformerEngine on its non-fused path) with GroupedMMLinear for fc1/fc2. TEGroupedMLP reads
    tokens_per_expert on the host (a sync per forward); EPGroupedMLP, with the same weights, does not."""
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    return partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(linear_fc1=GroupedMMLinear,
                                                                   linear_fc2=GroupedMMLinear))
