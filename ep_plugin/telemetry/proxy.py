"""RecordingBackend: a backend seen through CommStats, so that every exchange is recorded once.

EPBuffer wraps its backend in one only with `comm.stats: true` (off, the buffer holds the backend
itself: nothing is added to a call). Sitting at the backend seam, it sees the exchanges that the
autograd functions make in backward too, and the weight reduction of combine. Everything that is
not an exchange (name, capabilities, close, ...) is the wrapped backend's.
"""
from __future__ import annotations

from ..errors import EPTimeoutError
from .recorder import CommStats


def _dispatch_row_bytes(x, scales) -> int:
    row = x.shape[1] * x.element_size()
    if scales is not None:
        row += scales.shape[1] * scales.element_size()
    return row


class RecordingBackend:
    """`backend` with each dispatch / combine / combine_weights recorded into `stats`."""

    def __init__(self, backend, stats: CommStats):
        self._inner = backend
        self.stats = stats

    def __getattr__(self, name):
        return getattr(self._inner, name)

    @property
    def wrapped(self):
        return self._inner

    def dispatch(self, x, scales, topk_idx, topk_weights, handle=None, async_op=False):
        return self._dispatch(self._inner.dispatch, x, scales, topk_idx, topk_weights, handle, async_op)

    def dispatch_expert(self, x, scales, topk_idx, topk_weights, handle=None, async_op=False, alignment=1):
        return self._dispatch(self._inner.dispatch_expert, x, scales, topk_idx, topk_weights, handle, async_op,
                              alignment)

    def _dispatch(self, fn, x, scales, topk_idx, topk_weights, handle, async_op, *layout):
        st = self.stats
        start = st.begin(x)
        try:
            out = fn(x, scales, topk_idx, topk_weights, handle, async_op, *layout)
        except EPTimeoutError as exc:
            st.timeout(exc)
            raise
        st.end("dispatch", start, x, _dispatch_row_bytes(x, scales), out.handle, out.event,
               fresh=handle is None)
        return out

    def combine(self, x, handle, async_op=False):
        return self._exchange("combine", self._inner.combine, x, handle, async_op)

    def combine_expert(self, x, handle, async_op=False):
        return self._exchange("combine", self._inner.combine_expert, x, handle, async_op)

    def combine_weights_expert(self, weights, handle, async_op=False):
        # [N] per-row weights travel as [R, K] rows of K floats
        return self._exchange("combine_weights", self._inner.combine_weights_expert, weights, handle, async_op,
                              row_bytes=handle.topk_idx.shape[1] * 4)

    def combine_weights(self, weights, handle, async_op=False, local_only=True):
        fn = lambda w, h, a: self._inner.combine_weights(w, h, a, local_only)  # noqa: E731
        return self._exchange("combine_weights", fn, weights, handle, async_op)

    def _exchange(self, op, fn, x, handle, async_op, row_bytes=None):
        st = self.stats
        start = st.begin(x)
        try:
            y, event = fn(x, handle, async_op)
        except EPTimeoutError as exc:
            st.timeout(exc)
            raise
        st.end(op, start, x, row_bytes or x.shape[1] * x.element_size(), handle, event)
        return y, event

    def check(self) -> None:
        try:
            self._inner.check()
        except EPTimeoutError as exc:
            self.stats.timeout(exc)
            raise
