"""The argument checks of EPBuffer's high-throughput calls: dispatch (fresh or cached, rank- or
expert-major) and combine. Every check of a tensor's dtype, shape, device or contiguity runs once per
call form (core.Forms); what depends on values (expert ids, handles) runs every call and costs no sync.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..types import FP8_BLOCK, FP8_DTYPES, ROW_DTYPES, Handle, padded
from .core import ExpertIdCheck, Forms, _cuda_device, call_form, dtype_names, need, tensor_form

LAYOUTS = ("rank", "expert")


class CallChecks:
    """The checks of one buffer's calls, with what they compare against (hidden, experts, the backend's
    capabilities) and the forms that passed. EPBuffer owns one; the low-latency checks share it."""

    def __init__(self, *, hidden: int, num_experts: int, world: int, max_tokens: int, backend: str, caps,
                 device_problem, full_validation: bool, buffer_id: int):
        self.hidden, self.num_experts, self.world = hidden, num_experts, world
        self.max_tokens, self.backend, self.caps = max_tokens, backend, caps
        self.device_problem = device_problem  # the backend's answer: why it cannot move a device's tensors
        self.full_validation = full_validation
        self.buffer_id = buffer_id
        self.forms = Forms()
        self.expert_ids_flag = ExpertIdCheck(num_experts)

    # ---------------------------------------------------------------- dispatch
    def rows(self, x):
        """x (a tensor or an FP8 (data, scales) pair) -> (data, scales or None)."""
        if isinstance(x, torch.Tensor):
            key = ("rows", tensor_form(x))
            if self.forms.seen(key):
                return x, None
        elif isinstance(x, (tuple, list)) and len(x) == 2:
            key = ("rows", call_form(*x))
            if key[1] is not None and self.forms.seen(key):
                return x[0], x[1]
        caps, name = self.caps, self.backend
        if isinstance(x, (tuple, list)):
            need(len(x) == 2, TypeError, "x must be a tensor or a (x_fp8, scales) pair")
            data, scales = x
            need(isinstance(data, torch.Tensor) and data.dtype in FP8_DTYPES, TypeError,
                 f"x[0] (FP8 data) must be a float8 tensor, got {getattr(data, 'dtype', type(data))}")
            need(caps.fp8, TypeError, f"the {name} backend does not take FP8 rows")
            need(isinstance(scales, torch.Tensor) and scales.dtype == torch.float32, TypeError,
                 f"x[1] (FP8 scales) must be a float32 tensor, got {getattr(scales, 'dtype', type(scales))}")
            need(self.hidden % FP8_BLOCK == 0, ValueError,
                 f"FP8 dispatch needs hidden divisible by {FP8_BLOCK}, got hidden={self.hidden}")
            need(scales.dim() == 2 and scales.shape == (data.shape[0], self.hidden // FP8_BLOCK), ValueError,
                 f"x[1] (FP8 scales) must have shape [{data.shape[0]}, {self.hidden // FP8_BLOCK}], "
                 f"got {tuple(scales.shape)}")
            need(scales.is_contiguous(), ValueError, "x[1] (FP8 scales) must be contiguous")
            need(scales.device == data.device, ValueError, "x[1] (FP8 scales) must be on x's device")
        else:
            data, scales = x, None
            need(isinstance(data, torch.Tensor), TypeError, f"x must be a torch.Tensor, got {type(data).__name__}")
            need(data.dtype in ROW_DTYPES, TypeError,
                 f"x must be float32, bfloat16 or float16 (or an FP8 (data, scales) pair), got {data.dtype}")
            need(data.dtype in caps.row_dtypes, TypeError,
                 f"the {name} backend moves rows of {dtype_names(caps.row_dtypes)} (or FP8 pairs), got "
                 f"{data.dtype}: cast x, or use comm.backend: torch for other dtypes")
        need(data.dim() == 2 and data.shape[1] == self.hidden, ValueError,
             f"x must have shape [num_tokens, {self.hidden}], got {tuple(data.shape)}")
        need(data.is_contiguous(), ValueError, "x must be contiguous")
        problem = self.device_problem(data.device)
        need(problem is None, ValueError, f"x {problem} (the {self.backend} backend of this buffer)")
        need(data.shape[0] <= self.max_tokens, ValueError,
             f"x has {data.shape[0]} tokens, more than comm.max_tokens_per_rank={self.max_tokens} "
             "the buffer was sized for")
        self.forms.add(("rows", tensor_form(data) if scales is None else call_form(data, scales)))
        return data, scales

    def layout(self, layout: Optional[str], expert_alignment, handle: Optional[Handle]):
        """-> the expert-major alignment, or None for a rank-major dispatch. A cached dispatch keeps its
        handle's layout."""
        # `if not ...: raise` rather than need(): need's message is formatted on every call, passing or not
        if handle is not None:
            made = "expert" if handle.expert is not None else "rank"
            if layout is not None and layout != made:
                raise ValueError(f"the handle comes from a {made}-major dispatch; a cached dispatch keeps its "
                                 f"layout, got layout={layout!r}")
            layout = made
        layout = layout or "rank"
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if not (isinstance(expert_alignment, int) and expert_alignment >= 1):
            raise ValueError(f"expert_alignment must be a positive int, got {expert_alignment!r}")
        if layout == "rank":
            return None
        return handle.expert.alignment if handle is not None else expert_alignment

    def fresh(self, x, topk_idx, topk_weights, layout, expert_alignment):
        """A fresh dispatch's arguments (rows, then layout, then routing, each as below) -> (data, scales,
        alignment or None). A form that passed before costs one call_form and one lookup."""
        key = _fresh_key(x, topk_idx, topk_weights, layout, expert_alignment)
        if self.forms.seen(key):
            if self.full_validation or not self.caps.checks_expert_ids:
                self.expert_ids(topk_idx, self.caps.checks_expert_ids)
            alignment = None if layout is None or layout == "rank" else expert_alignment
            if isinstance(x, torch.Tensor):
                return x, None, alignment
            return x[0], x[1], alignment
        data, scales = self.rows(x)
        alignment = self.layout(layout, expert_alignment, None)
        self.routing(data, topk_idx, topk_weights)
        if key is not None:
            self.forms.add(key)
        return data, scales, alignment

    def routing(self, data, topk_idx, topk_weights) -> None:
        """A fresh dispatch's topk_idx [T, K] int64 and topk_weights [T, K] float32 (or None)."""
        need(topk_idx is not None, ValueError, "topk_idx is required unless a handle is given")
        key = ("routing", call_form(data, topk_idx, topk_weights))
        if key not in self.forms:
            self._routing_args(data, topk_idx, topk_weights)
            self.forms.add(key)
        self.expert_ids(topk_idx, self.caps.checks_expert_ids)

    def _routing_args(self, data, topk_idx, topk_weights):
        T = data.shape[0]
        need(isinstance(topk_idx, torch.Tensor), TypeError, "topk_idx must be a torch.Tensor")
        need(topk_idx.dtype == torch.int64, TypeError, f"topk_idx must be int64, got {topk_idx.dtype}")
        need(topk_idx.dim() == 2 and topk_idx.shape[0] == T, ValueError,
             f"topk_idx must have shape [{T}, K], got {tuple(topk_idx.shape)}")
        need(topk_idx.device == data.device, ValueError, f"topk_idx is on {topk_idx.device}, x on {data.device}")
        need(topk_idx.is_contiguous(), ValueError, "topk_idx must be contiguous")
        K = topk_idx.shape[1]
        need(K >= 1, ValueError,
             f"topk_idx must have K >= 1 columns (-1 marks an unused pick), got shape {tuple(topk_idx.shape)}")
        need(self.caps.max_topk is None or K <= self.caps.max_topk, ValueError,
             f"the {self.backend} backend supports topk <= {self.caps.max_topk}, got {K}")
        if topk_weights is not None:
            need(isinstance(topk_weights, torch.Tensor), TypeError, "topk_weights must be a torch.Tensor")
            need(topk_weights.dtype == torch.float32, TypeError,
                 f"topk_weights must be float32, got {topk_weights.dtype}")
            need(topk_weights.shape == topk_idx.shape, ValueError,
                 f"topk_weights must have topk_idx's shape {tuple(topk_idx.shape)}, got {tuple(topk_weights.shape)}")
            need(topk_weights.device == data.device, ValueError, "topk_weights must be on x's device")
            need(topk_weights.is_contiguous(), ValueError, "topk_weights must be contiguous")

    def cached(self, data, topk_idx, topk_weights, handle: Handle) -> torch.Tensor:
        """A cached dispatch (handle checked already): topk_idx omitted or that dispatch's own tensor,
        topk_weights [T, K] float32 (K the handle's) or None. -> the ids the backend takes."""
        own = handle.topk_idx
        if not (topk_idx is None or topk_idx is own or topk_idx is handle.given_topk_idx):
            raise ValueError("a cached dispatch (handle given) reuses its dispatch's routing: omit topk_idx, or pass "
                             "that dispatch's own topk_idx tensor, got another tensor")
        if topk_weights is not None:
            K = own.shape[1]
            key = ("cached", call_form(data, topk_weights), K, handle.is_token_in_rank.device)
            if key not in self.forms:
                T = data.shape[0]
                need(isinstance(topk_weights, torch.Tensor), TypeError,
                     f"topk_weights must be a torch.Tensor, got {type(topk_weights).__name__}")
                need(topk_weights.dtype == torch.float32, TypeError,
                     f"topk_weights must be float32, got {topk_weights.dtype}")
                need(tuple(topk_weights.shape) == (T, K), ValueError,
                     f"topk_weights must have the handle's shape [{T}, {K}] (tokens, top-k of its dispatch), "
                     f"got {tuple(topk_weights.shape)}")
                need(topk_weights.device == handle.is_token_in_rank.device == data.device, ValueError,
                     f"topk_weights is on {topk_weights.device}, x on {data.device}, the handle's dispatch ran "
                     f"on {handle.is_token_in_rank.device}")
                need(topk_weights.is_contiguous(), ValueError, "topk_weights must be contiguous")
                self.forms.add(key)
        return own

    def expert_ids(self, topk_idx: torch.Tensor, checked_by_engine: bool) -> None:
        """Ids outside [-1, E): on the host with comm.validate: full (one sync), else queued on the device
        (on CPU: raised now) unless the engine checks them itself."""
        if self.full_validation and topk_idx.numel():
            lo, hi = torch.stack(torch.aminmax(topk_idx)).tolist()  # opt-in: one host sync
            need(lo >= -1 and hi < self.num_experts, ValueError,
                 f"topk_idx values must lie in [-1, {self.num_experts}), got min {lo}, max {hi}")
        elif not checked_by_engine:
            self.expert_ids_flag.record(topk_idx)

    def handle(self, handle, num_tokens=None) -> None:
        # every call (values, not forms): `if not ...: raise`, so that no message is formatted on success
        if not isinstance(handle, Handle):
            raise TypeError(f"handle must be a Handle from dispatch, got {type(handle).__name__}")
        if handle.backend != self.backend:
            raise TypeError(f"handle was made by the {handle.backend} backend, this buffer uses {self.backend}")
        if handle.num_experts != self.num_experts:
            raise ValueError("handle comes from a buffer with another expert count")
        if handle.buffer_id != self.buffer_id:
            raise ValueError("handle comes from another EPBuffer's dispatch: combine, and dispatch again with it, "
                             "on the buffer that dispatched")
        if num_tokens is not None and handle.num_tokens != num_tokens:
            raise ValueError(f"handle was made for {handle.num_tokens} tokens, x has {num_tokens}")

    # ---------------------------------------------------------------- combine
    def combine(self, x, handle, topk_weights) -> bool:
        """-> whether the handle is expert-major."""
        key = ("combine", tensor_form(x))
        if not self.forms.seen(key):
            need(isinstance(x, torch.Tensor), TypeError, f"x must be a torch.Tensor, got {type(x).__name__}")
            need(x.dtype in ROW_DTYPES, TypeError, f"combine's x must be float32, bfloat16 or float16, got {x.dtype}")
            need(x.dtype in self.caps.combine_dtypes, TypeError,
                 f"the {self.backend} backend combines rows of {dtype_names(self.caps.combine_dtypes)}, got "
                 f"{x.dtype}: cast the expert output, or use comm.backend: torch")
            need(x.dim() == 2 and x.shape[1] == self.hidden, ValueError,
                 f"x must have shape [num_rows, {self.hidden}], got {tuple(x.shape)}")
            need(x.is_contiguous(), ValueError, "x must be contiguous")
            self.forms.add(key)
        self.handle(handle)
        expert = handle.expert is not None
        rows = x.shape[0]
        if not expert and rows != handle.num_recv:
            used = sum(handle.recv_counts) if not handle.exact else handle.num_recv
            need(used <= rows <= handle.num_recv, ValueError,
                 f"x must have the {handle.num_recv} rows that dispatch delivered (or at least the {used} valid "
                 f"ones), got {rows}")
        if expert and rows != handle.expert.num_rows:
            # rows may be cut to the segments in use (a worst-case-sized dispatch): never fewer, as the
            # kernels read every segment row (the host counts: waits for their pinned copy only)
            used = sum(padded(handle.tokens_per_expert, handle.expert.alignment))
            need(used <= rows <= handle.expert.num_rows, ValueError,
                 f"x must have the {handle.expert.num_rows} expert-major rows that dispatch delivered (or at "
                 f"least the {used} its expert segments use), got {rows}")
        if handle.is_token_in_rank.device != x.device:
            raise ValueError(f"x is on {x.device} but the handle's dispatch ran on {handle.is_token_in_rank.device}")
        if topk_weights is not None:
            need(isinstance(topk_weights, torch.Tensor) and topk_weights.dtype == torch.float32, TypeError,
                 "combine's topk_weights must be a float32 tensor")
            want = (rows,) if expert else (rows, handle.recv_topk_idx.shape[1])
            need(tuple(topk_weights.shape) == want, ValueError,
                 f"combine's topk_weights must have shape {want}, got {tuple(topk_weights.shape)}")
            need(topk_weights.device == x.device, ValueError, "combine's topk_weights must be on x's device")
        return expert


def _fresh_key(x, topk_idx, topk_weights, layout, expert_alignment):
    """The form a fresh dispatch's verdict depends on, or None (an argument call_form cannot describe, a
    layout that is not a str: then the checks run in full, and raise)."""
    if (layout is not None and type(layout) is not str) or type(expert_alignment) is not int:
        return None
    Tensor = torch.Tensor
    if type(topk_idx) is Tensor and (topk_weights is None or type(topk_weights) is Tensor):
        # the common calls, one flat tuple: what call_form holds, without its loop and nested tuples (a few
        # us of a cold call's host time on a busy core); the head (pair, no weights, layout, alignment)
        # tells the argument kinds apart (no weights: the ids' form stands in for theirs)
        i, w = topk_idx, topk_weights if topk_weights is not None else topk_idx
        if type(x) is Tensor:
            return ("fresh", False, topk_weights is None, layout, expert_alignment,
                    _cuda_device() if x.is_cuda else None, x.dtype, x.shape, x.device, x.is_contiguous(),
                    i.dtype, i.shape, i.device, i.is_contiguous(), w.dtype, w.shape, w.device, w.is_contiguous())
        if type(x) in (tuple, list) and len(x) == 2 and type(x[0]) is Tensor and type(x[1]) is Tensor:
            d, sc = x
            return ("fresh", True, topk_weights is None, layout, expert_alignment,
                    _cuda_device() if d.is_cuda else None, d.dtype, d.shape, d.device, d.is_contiguous(),
                    sc.dtype, sc.shape, sc.device, sc.is_contiguous(), i.dtype, i.shape, i.device,
                    i.is_contiguous(), w.dtype, w.shape, w.device, w.is_contiguous())
    pair = type(x) in (tuple, list) and len(x) == 2
    if isinstance(x, Tensor):
        form = call_form(x, topk_idx, topk_weights)
    elif pair:
        form = call_form(x[0], x[1], topk_idx, topk_weights)
    else:
        return None
    if form is None:
        return None
    return "fresh", (len(form), form, layout, expert_alignment)
