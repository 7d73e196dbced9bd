"""tests/_dist.spawn itself: a rank that raises while its peer waits for it in a collective ends the test in
about FAILED_RANK_GRACE_S with that rank's traceback, instead of hanging until the join timeout; the ranks
meet on a store the parent bound before starting them (no port picked free and bound later)."""
import time

import pytest
import torch.distributed as dist

import tests._dist as _dist


def _one_rank_raises(rank, world):
    if rank == 0:
        raise RuntimeError("rank 0 gives up before the barrier")
    # waits for rank 0, which never comes: on the store, which the parent holds (a gloo barrier would see rank 0's
    # connections close as its process ends, and fail at once)
    dist.distributed_c10d._get_default_store().wait(["rank 0 never sets this"])


def test_a_failed_rank_stops_its_stuck_peers(monkeypatch):
    monkeypatch.setattr(_dist, "FAILED_RANK_GRACE_S", 2.0)
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as err:
        _dist.spawn(_one_rank_raises, 2, timeout=240)
    took = time.monotonic() - t0
    text = str(err.value)
    assert "rank 0 failed" in text and "gives up before the barrier" in text
    assert "were stopped 2 s after rank 0 failed" in text
    assert took < 120, took  # the join timeout (240 s) was not waited out


def _meet(rank, world):
    dist.barrier()


def test_ranks_meet_on_the_parents_store():
    _dist.spawn(_meet, 3, timeout=240)
