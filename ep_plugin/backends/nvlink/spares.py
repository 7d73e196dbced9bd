"""Output tensors made after a call's launches, for the next call of the same form (comm.spare_outputs).

On an idle GPU a call's kernels wait for its Python: a cold nvlink dispatch at EP2 launched its pull ~111 us
after entry, ~45 us of it the output allocations between notify and the pull (torch.empty: ~4-5 us each on
the GPU host, more on a cold core; benchmarks/bench_nvlink_host_gpu.py). The outputs of a worst-case
dispatch have the same shapes every call (W * max_tokens rows), and a combine's [T, H] repeats with T, so
the backend makes the next call's set after this call's launches, where a host ahead of the GPU hides it,
and hands it out only to a call of the same form: fresh tensors nobody else has seen, as torch.empty gives.

A host-synced dispatch (comm.host_sync) has outputs of its exact, changing size: the backend makes none ahead
for it (nor for a cached dispatch of its handle). A set is made only for a form asked for twice in a row (a one-off
call leaves nothing behind) and one set
per kind of call is kept: memory held is one call's outputs per kind (EP8, 4096 tokens, hidden 7168: ~0.5 GB
for the dispatch's rows, 58 MB for a combine's). The caching allocator gives a block to later work on the
stream that allocated it, so a set serves only while that stream is current (the same Stream object); never
under CUDA-graph capture (a graph's outputs must come from its own pool): the callers skip it there.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, Tuple


class Spares:
    """One set of tensors per kind of call (a name), keyed by the call's form and its stream."""

    __slots__ = ("enabled", "_sets", "_last")

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._sets: Dict[str, Tuple[Hashable, Any, Any]] = {}  # name -> (form, Stream, payload)
        self._last: Dict[str, Hashable] = {}  # name -> form of its last call

    def take(self, name: str, form: Hashable, stream) -> Any:
        """The set made for a call `name` of `form` on `stream`, or None; a set of another form or stream
        is dropped (its memory goes back to the allocator)."""
        got = self._sets.pop(name, None)
        if got is not None and got[1] is stream and got[0] == form:
            return got[2]
        return None

    def refill(self, name: str, form: Hashable, stream, make: Callable[[], Any]) -> None:
        """After a call's launches: make the next call's set when this form came twice in a row."""
        if self.enabled and self._last.get(name) == form:
            self._sets[name] = (form, stream, make())
        self._last[name] = form

    def clear(self) -> None:
        self._sets.clear()
        self._last.clear()

    def __len__(self) -> int:
        return len(self._sets)
