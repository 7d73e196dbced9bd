"""tests/_dist.py's spawn() never hangs on a rank that does not come: the ranks meet within a bounded
rendezvous (a TCPStore the test's process holds, on a port the OS chose), and a rank that never arrives,
or dies before it does, fails the spawn within that bound, naming the test and the rank; a rank that raises
while its peers wait for it stops them after FAILED_RANK_GRACE_S instead of the spawn's timeout."""
import os
import time

import pytest
import torch.distributed as dist

import tests._dist as _dist
from tests._dist import spawn

RENDEZVOUS_S = 3.0


def _never_arrives(rank, world):
    if rank == world - 1:
        time.sleep(3600)  # a rank stuck before the rendezvous (importing, starting): killed by spawn()


def _dies_first(rank, world):
    if rank == world - 1:
        os._exit(7)


def _nothing(rank, world):
    pass


def test_a_rank_that_never_arrives_fails_the_rendezvous_within_its_timeout():
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        spawn(_nothing, 3, timeout=120, rendezvous_s=RENDEZVOUS_S, before_rendezvous=_never_arrives)
    elapsed = time.monotonic() - start
    msg = str(info.value)
    assert "test_a_rank_that_never_arrives_fails_the_rendezvous_within_its_timeout" in msg, msg
    assert "rank(s) [2] never reached the rendezvous" in msg, msg
    assert "rank(s) [2] of 3 never arrived" in msg, msg  # what the waiting ranks raised
    # the ranks' start (forked: ~1 s each on the loaded 2-core box), the wait, and the stack dump before the kill
    assert elapsed < RENDEZVOUS_S + 20, f"failed after {elapsed:.1f}s: {msg}"


def test_a_rank_that_dies_before_the_rendezvous_fails_the_spawn_at_once():
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        spawn(_nothing, 3, timeout=120, rendezvous_s=60, before_rendezvous=_dies_first)
    elapsed = time.monotonic() - start
    msg = str(info.value)
    # rank 2 never arrives and the others are stopped as soon as it ends (a slow one may not have arrived yet)
    assert "never reached the rendezvous (" in msg and "rank 2: exit code 7" in msg, msg
    assert "rank(s) [2] ended before the rendezvous" in msg, msg
    assert elapsed < 30, f"failed after {elapsed:.1f}s (the rendezvous waits 60s): {msg}"


def test_a_healthy_spawn_still_passes():
    spawn(_nothing, 3, timeout=120, rendezvous_s=RENDEZVOUS_S)


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
        spawn(_one_rank_raises, 2, timeout=240)
    took = time.monotonic() - t0
    text = str(err.value)
    assert "rank 0 failed" in text and "gives up before the barrier" in text
    assert "were stopped 2 s after rank 0 failed" in text
    assert took < 120, took  # the spawn's timeout (240 s) was not waited out


def test_a_launch_past_its_timeout_is_killed_with_its_children():
    """run_launch (torchrun's launches): at the timeout the launch and the children that hold its output
    pipes are killed (subprocess.run would kill the launcher only, then wait for the pipes' end)."""
    import sys

    from tests._dist import run_launch

    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); " \
            "print('started', flush=True); time.sleep(120)"
    start = time.monotonic()
    with pytest.raises(AssertionError, match="still running after 2s") as info:
        run_launch([sys.executable, "-c", child], timeout=2)
    assert "started" in str(info.value)
    assert time.monotonic() - start < 15
