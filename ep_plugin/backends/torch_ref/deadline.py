"""Exchanges of the torch backend with a deadline: each one finishes within comm.timeout_s of its
issue, or raises EPTimeoutError naming the ranks of the EP group that did not arrive.

Protocol of one BoundedGroup (one per TorchBackend, built collectively by the EP group's members):
  1. Arrival records. Each rank keeps, in the default store under a prefix of this BoundedGroup,
     the number of the latest step it has started: 1 at construction, one more per dispatch or
     combine call (`arrive`). An exchange belongs to the step that issued it. The record is one
     `store.set` (a round trip to the store's host) per step, made once the step's first exchange
     is in flight.
  2. Construction waits at most timeout_s for every member (a counter in the store), then builds a
     process group of its own over the same ranks and backend, with timeout timeout_s + GRACE_S.
     So a stuck exchange never blocks the caller's group; everyone is present when NCCL builds its
     communicator (eagerly: built lazily, it would block the host, unbounded, in the first
     exchange); and NCCL's watchdog, which acts at the group's own timeout, comes after our error.
  3. Every exchange is issued with async_op=True and must finish by issue + timeout_s: on CPU the
     host waits with work.wait(timeout); on CUDA the counts exchange is polled (work.is_completed(),
     since there wait() only orders streams) because the host needs the counts, and the rows'
     exchanges of a synchronous call only order the stream: their deadline is checked, without
     blocking, at the next call or check() (EPBuffer.check() waits for them, bounded, before it
     synchronises the device).
  4. On expiry, or a transport error (gloo reports a dead peer's closed connection at once), the
     rank reads every member's count: those below its own step did not arrive. It aborts its group
     (on NCCL that ends the stuck kernel) and raises EPTimeoutError. The BoundedGroup is unusable
     from then on: every later call raises the same error. A rank that arrives after the others
     gave up finds nobody missing, and says so.
If the rank that hosts the store dies, the records cannot be read: the error then names every other
rank as not known to have arrived. After a timeout, gloo's half of the exchange may run on in a
worker thread until the group's own timeout: a process that timed out should exit rather than
destroy its process groups.
"""
from __future__ import annotations

import collections
import threading
import time
from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as dist

from ...errors import EPTimeoutError

GRACE_S = 10.0         # the group's own timeout exceeds comm.timeout_s by this much
_POLL_MAX_S = 2e-3     # longest sleep between two polls of a CUDA work
_built = collections.Counter()  # BoundedGroups made per parent group in this process


def _own_group(parent, timeout: timedelta):
    backend = dist.get_backend(parent)
    ranks = dist.get_process_group_ranks(parent)
    if "nccl" not in backend:
        # Local synchronisation: only the parent's members take part, and the group is named after
        # them, so the EP groups of disjoint parents do not share store keys.
        return dist.new_group(ranks, timeout=timeout, backend=backend, use_local_synchronization=True)
    if dist.distributed_c10d._get_default_group().bound_device_id is not None:
        # With a bound default group, new_group would split the world's communicator: a collective
        # over every rank of the world. Splitting the parent's involves its members only.
        return dist.split_group(parent, [list(range(len(ranks)))], timeout=timeout)
    device = torch.device("cuda", torch.cuda.current_device())
    return dist.new_group(ranks, timeout=timeout, backend=backend, use_local_synchronization=True,
                          device_id=device)


def _finished(work, deadline: float, cuda: bool) -> bool:
    """True once `work` has ended (well or not), False at the deadline."""
    if cuda:
        delay = 1e-5
        while not work.is_completed():
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(2 * delay, _POLL_MAX_S)
        return True
    try:
        # at least 1 ms: c10d reads a zero timeout as "wait forever"
        work.wait(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
    except RuntimeError:
        pass  # expired, or failed: is_completed tells which
    return work.is_completed()


class BoundedWork:
    """One issued exchange; wait() returns when it is done or raises EPTimeoutError (EPEvent calls it)."""

    def __init__(self, group: "BoundedGroup", work, step: int, what: str, cuda: bool):
        self._group, self._work, self._step, self._what = group, work, step, what
        self._cuda = cuda
        self._deadline = time.monotonic() + group.timeout_s
        self._done = False

    def order_stream(self) -> None:
        """Make the current CUDA stream wait for the exchange (no host wait)."""
        try:
            self._work.wait()
        except RuntimeError as exc:
            self._group.expire(self._step, self._what, exc)

    def poll(self) -> bool:
        """True once done; raises EPTimeoutError past the deadline; never blocks."""
        if self._done or self._work.is_completed():
            self._done = True
            return True
        if time.monotonic() >= self._deadline:
            self._group.expire(self._step, self._what)
        return False

    def wait(self) -> bool:
        if self._done:
            return True
        group = self._group
        if group.failed is not None:
            raise group.failed
        if not _finished(self._work, self._deadline, self._cuda):
            group.expire(self._step, self._what)
        try:
            self._work.wait()  # raises the transport's error; on CUDA orders the current stream after it
        except RuntimeError as exc:
            group.expire(self._step, self._what, exc)
        self._done = True
        return True


class BoundedGroup:
    """The torch backend's own process group over `parent`'s members, with deadline waits.

    Construction is collective over the parent's members (in the same order on each of them)."""

    def __init__(self, parent, timeout_s: float):
        self.timeout_s = float(timeout_s)
        self.rank = dist.get_rank(parent)
        self.size = dist.get_world_size(parent)
        self.global_ranks = dist.get_process_group_ranks(parent)
        _built[parent.group_name] += 1
        prefix = f"ep_plugin/torch/{parent.group_name}/{_built[parent.group_name]}/"
        self._store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
        self.failed: Optional[EPTimeoutError] = None
        self.pg = None
        self._step = 0
        self._pending: List[BoundedWork] = []  # CUDA exchanges the stream waits for, not yet seen done
        self.arrive("construction")
        self._record()
        self._rendezvous()
        self.pg = _own_group(parent, timedelta(seconds=self.timeout_s + GRACE_S))

    def _rendezvous(self) -> None:
        """Wait at most timeout_s until every member has arrived."""
        self._store.add("ready", 1)
        deadline, delay = time.monotonic() + self.timeout_s, 1e-3
        while self._store.add("ready", 0) < self.size:
            if time.monotonic() >= deadline:
                self._store.add("ready", -self.size)  # a rank arriving later must not pass, but time out too
                self.expire(self._step, self._what)
            time.sleep(delay)
            delay = min(2 * delay, 0.05)

    def defer(self, work: "BoundedWork") -> None:
        """A synchronous call's CUDA exchange: order the current stream after it now, check its deadline
        at the next call or check() (no host wait on the hot path)."""
        work.order_stream()
        self._pending.append(work)

    def poll_pending(self, block: bool) -> None:
        """Drop finished deferred exchanges; raise EPTimeoutError for one past its deadline. With block,
        wait for each (bounded), e.g. before the caller synchronises the device."""
        keep = []
        for w in self._pending:
            if block:
                w.wait()
            elif not w.poll():
                keep.append(w)
        self._pending = keep

    def arrive(self, what: str) -> None:
        """Start a step (a dispatch or combine call): its exchanges carry its number."""
        if self.failed is not None:
            raise self.failed
        if self._pending:
            self.poll_pending(block=False)
        self._step += 1
        self._what = what
        self._recorded = False

    def _record(self) -> None:
        if not self._recorded:
            self._store.set(str(self.rank), str(self._step))  # the latest step; add(key, 0) reads it
            self._recorded = True

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: Optional[List[int]] = None,
                   in_splits: Optional[List[int]] = None) -> BoundedWork:
        if self.failed is not None:
            raise self.failed
        if self.pg is None:
            raise RuntimeError("this torch backend is closed")
        work = dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                      group=self.pg, async_op=True)
        self._record()  # while the exchange is in flight: the store's round trip hides behind it
        return BoundedWork(self, work, self._step, self._what, out.is_cuda)

    def expire(self, step: int, what: str, cause: Optional[BaseException] = None):
        """Record the failure of `step` (once), abort the group, raise EPTimeoutError."""
        if self.failed is None:
            late, unread = self._late_ranks(step)
            self.failed = EPTimeoutError(self._message(step, what, late, unread, cause), late)
            if self.pg is not None:
                # Off this thread: the error must reach the caller even if an abort blocks.
                threading.Thread(target=self._abort, daemon=True).start()
        raise self.failed from cause

    def _late_ranks(self, step: int):
        """(ranks whose count is below `step`, or that could not be read; the store's error or None)."""
        late, unread = [], None
        for r in range(self.size):
            if r == self.rank:
                continue
            if unread is None:
                try:
                    arrived = self._store.add(str(r), 0) >= step  # add(0) reads without waiting for a key
                except Exception as exc:  # noqa: BLE001  (the store's host may be the rank that died)
                    unread = exc
            if unread is not None or not arrived:
                late.append(r)
        return late, unread

    def _message(self, step, what, late, unread, cause) -> str:
        where, me = f"step {step} ({what})", f"rank {self.rank}"
        limit = f"comm.timeout_s={self.timeout_s:g}s"
        if unread is not None:
            msg = (f"torch backend: rank(s) {late} of the EP group are not known to have arrived at {where} "
                   f"within {limit} ({me} waited; the arrival records could not be read: {unread})")
        elif late:
            msg = (f"torch backend: rank(s) {late} of the EP group did not arrive at {where} within {limit} "
                   f"({me} waited)")
        else:
            msg = (f"torch backend: every rank of the EP group reached {where}, but {me} could not finish it "
                   f"within {limit}: a peer gave up on it first (and raised its own EPTimeoutError)")
        if late and self.global_ranks != list(range(self.size)):
            msg += f"; global ranks {[self.global_ranks[r] for r in late]}"
        if cause is not None:
            msg += f"; the transport reported: {cause}"
        hint = (": look for the missing rank's own error (a crash, or a stall), or raise comm.timeout_s if it "
                "was only slow") if late else ""
        return f"{msg}. This buffer cannot be used any more{hint}."

    def _abort(self) -> None:
        try:
            self.pg.abort()
        except Exception:  # noqa: BLE001  (nothing more to do for a group that is already broken)
            pass

    def close(self) -> None:
        # The group stays registered until the process group is destroyed: torch names a locally
        # synchronised group after its members and the number of groups, so destroying it here
        # would hand its name, and its stale keys in the store, to the next BoundedGroup.
        self.pg = None
