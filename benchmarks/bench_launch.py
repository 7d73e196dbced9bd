"""Start one process per rank and follow rank 0's reports, so that a rank that dies or hangs (a DeepEP
kernel timing out, say) costs the run at most --timeout seconds and never the rows measured before it.
"""
from __future__ import annotations

import os
import queue
import socket
import tempfile
import time

import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def store_path(port: int) -> str:
    """The rendezvous file of a run: the ranks meet in a FileStore, not on a TCP port -- a port free when
    chosen can be taken by another socket in the seconds the spawned ranks take to import torch
    (EADDRINUSE at rank 0's listen, seen on the device machine); `port` only names the run."""
    return os.path.join(tempfile.gettempdir(), f"ep_plugin_bench_{port}.store")


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def run_world(target, world: int, args, on_partial):
    """Spawn target(rank, world, port, args, q) per rank and follow the queue: ("partial", report) goes to
    on_partial, ("done", report) ends the run, ("err", text) is printed. Returns (last report, finished?)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    _remove(store_path(port))  # a FileStore must start from no file
    procs = [ctx.Process(target=target, args=(r, world, port, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.time() + args.timeout
    last, complete, failed_at = None, False, None
    while True:
        try:
            kind, body = q.get(timeout=1.0)
        except queue.Empty:
            now = time.time()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            if all(not p.is_alive() for p in procs):
                break
            if now > deadline:
                print(f"EP{world}: --timeout {args.timeout:.0f} s reached; killing the ranks", flush=True)
                break
            if failed_at is not None and now - failed_at > 20:  # the others wait in a collective forever
                print(f"EP{world}: a rank failed; stopping the others", flush=True)
                break
            continue
        except (EOFError, OSError):
            break
        if kind == "err":
            print(body, flush=True)
            failed_at = failed_at or time.time()
        else:
            last = body
            if kind == "done":
                complete = True
                break
            on_partial(body)
    grace = time.time() + (30 if complete else 0)
    for p in procs:  # only the processes started here
        p.join(max(0.0, grace - time.time()))
        if p.is_alive():
            p.kill()
            p.join(5)
    _remove(store_path(port))
    return last, complete


def _physical_cores(cpus) -> list:
    """The allowed CPUs grouped by physical core (hyperthread siblings together), in core order."""
    cores = {}
    for c in sorted(cpus):
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as f:
                key = f.read().strip()
        except OSError:
            key = str(c)
        cores.setdefault(key, []).append(c)
    return list(cores.values())


def pin_rank(rank: int, world: int) -> list:
    """EP_BENCH_PIN=1: this rank's process (and every thread it starts from now on) on its own share of the
    allowed physical cores, hyperthread siblings included, so that no two ranks share a core. Returns the CPUs."""
    cores = _physical_cores(os.sched_getaffinity(0))
    share = max(1, len(cores) // world)
    mine = [c for core in cores[rank * share:(rank + 1) * share] for c in core] or sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, mine)
    return mine


def init_rank(rank: int, world: int, port: int) -> None:
    """A spawned rank's NCCL group on GPU `rank` (device_id binds NCCL, and its barrier, to that GPU
    where torch takes it). EP_BENCH_PIN=1 pins the rank first (pin_rank)."""
    import inspect
    import os

    if os.environ.get("EP_BENCH_PIN") == "1":
        print(f"rank {rank}: pinned to CPUs {pin_rank(rank, world)}", flush=True)
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    kw = {}
    if "device_id" in inspect.signature(dist.init_process_group).parameters:
        kw["device_id"] = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method="file://" + store_path(port), rank=rank, world_size=world, **kw)
