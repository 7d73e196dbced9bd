"""What every check of a call uses: `need`, the call form a check's verdict depends on, the per-buffer
cache of forms that passed, and the sticky device flag for expert ids out of range."""
from __future__ import annotations

import torch


def need(cond: bool, exc, msg: str):
    """Raise exc(msg) unless cond (the argument checks of EPBuffer and ep_plugin.deep_ep)."""
    if not cond:
        raise exc(msg)


# torch.cuda.current_device() minus its lazy-init check: a CUDA tensor in hand means CUDA is initialised
_cuda_device = getattr(torch._C, "_cuda_getDevice", None) or (lambda: torch.cuda.current_device())


def call_form(*args):
    """What the checks depend on, for tensors (dtype, shape, device, contiguity) and plain values (ints,
    bools, None; typed, so True and 1 differ); None when an argument is of another kind (then the full
    checks run and raise). The current CUDA device counts too, for a CUDA first argument."""
    out = []
    append = out.append
    for a in args:
        if isinstance(a, torch.Tensor):
            append((a.dtype, a.shape, a.device, a.is_contiguous()))
        elif a is None or isinstance(a, int):
            append((type(a), a))
        else:
            return None
    if args and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
        append(_cuda_device())
    return tuple(out)


def tensor_form(t):
    """call_form(t) for one tensor, flat (a few tenths of a us less per call); call_form(t) for others."""
    if type(t) is torch.Tensor:
        return t.dtype, t.shape, t.device, t.is_contiguous(), _cuda_device() if t.is_cuda else None
    return call_form(t)


class Forms(set):
    """The forms (kind of call, call_form(...)) whose argument checks passed, for one buffer: the checks
    depend on the form only, so a repeated form skips them (host time before the first kernel). A set,
    so that `key in forms` is the set's own lookup, not a Python call."""

    LIMIT = 256

    def __init__(self, *args):
        set.__init__(self, *args)
        # kind of call (key[0]) -> the key of its last call that passed: seen() compares a key with it before the
        # set lookup, one tuple compare in a steady state (a decode loop repeats one form per kind)
        self.last = {}

    def clear(self) -> None:
        self.last.clear()
        set.clear(self)

    def seen(self, key) -> bool:
        """key (None: a form that cannot be kept) passed before; then it is its kind's last key."""
        if key is None:
            return False
        if key == self.last.get(key[0]):
            return True
        if key in self:
            self.last[key[0]] = key
            return True
        return False

    def add(self, key) -> None:
        """key: (kind of call, call_form(...)); a form call_form could not describe is not kept."""
        if key[1] is not None:
            self.last[key[0]] = key
            if len(self) < self.LIMIT:
                set.add(self, key)


class FormMap(dict):
    """Call form -> what the checks of that form decided (e.g. the buffer it runs on), bounded as Forms:
    for callers that skip more than the checks on a repeated form (ep_plugin.deep_ep's low-latency calls)."""

    LIMIT = Forms.LIMIT
    _NONE = (object(), None)  # no last entry: a key equal to nothing

    def __init__(self, *args):
        dict.__init__(self, *args)
        self._last = self._NONE  # (key, value) last found or kept: one tuple compare in a steady state

    def clear(self) -> None:
        self._last = self._NONE
        dict.clear(self)

    def find(self, key):
        """What `key`'s form decided, or None (a new form, or one that cannot be kept: key None or unhashable)."""
        if key is None:
            return None
        try:
            last, value = self._last
            if key == last:
                return value
            value = self.get(key)
        except (TypeError, RuntimeError):  # an unhashable flag (a tensor: its == is no bool)
            return None
        if value is not None:
            self._last = (key, value)
        return value

    def put(self, key, value) -> None:
        """key None or unhashable: a form the caller could not describe, not kept."""
        try:
            if key is not None and len(self) < self.LIMIT:
                self[key] = value
                self._last = (key, value)
        except TypeError:
            pass


class ExpertIdCheck:
    """Sticky per-buffer flag: did a call get an expert id outside [-1, E)? Kept on the device and copied
    to pinned memory without blocking, so later calls read it for free. The layout code of the backends
    skips such ids (as routed nowhere), so nothing is written out of bounds meanwhile. On CPU the ids
    are checked at once (nothing to wait for)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self._flag = None   # device bool, sticky until reported
        self._host = None   # its pinned copy

    def record(self, topk_idx: torch.Tensor) -> None:
        bad = torch.ne(topk_idx.clamp(-1, self.num_experts - 1), topk_idx).any()
        if not topk_idx.is_cuda:  # nothing to wait for: report now
            if bool(bad):
                self._raise(topk_idx)
            return
        if self._flag is None or self._flag.device != topk_idx.device:
            self._flag = torch.zeros((), dtype=torch.bool, device=topk_idx.device)
            self._host = torch.zeros((), dtype=torch.bool, pin_memory=True, device="cpu")
        self._flag.logical_or_(bad)
        if not torch.cuda.is_current_stream_capturing():
            self._host.copy_(self._flag, non_blocking=True)

    def raise_if_seen(self) -> None:
        """Raise if a copy that has landed shows a bad id (no waiting)."""
        if self._host is not None and bool(self._host):
            self._raise(None)

    def _raise(self, topk_idx):
        rng = ""
        if topk_idx is not None:
            rng = f", got min {int(topk_idx.min())}, max {int(topk_idx.max())}"
        if self._flag is not None:  # reported once; the buffer stays usable
            self._flag.zero_()
            self._host.zero_()
        raise ValueError(f"topk_idx values must lie in [-1, {self.num_experts}){rng}; ids outside were "
                         "treated as routed nowhere")


def dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)
