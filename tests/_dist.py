"""Run a test body in a real multi-process torch.distributed group (gloo on CPU, NCCL on GPU)."""
from __future__ import annotations

import faulthandler
import gc
import os
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A port that was free when asked: whoever binds it later may find it taken (prefer a store on port 0,
    as spawn() does, or torchrun_cmd's --standalone)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(nproc: int, script, *args) -> list:
    """``python -m torch.distributed.run --nproc-per-node nproc --standalone script args``: the launcher's
    rendezvous store listens on a port the OS picks as it binds (localhost:0) and the ranks meet there, where
    ``--master-port $(free_port())`` left the seconds of torchrun's start-up for another process (the other
    xdist worker's ranks or launch) to take that port or connect to it."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
            str(script), *map(str, args)]


def run_launch(cmd, *, timeout: float, **kw):
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw) for a launch whose children
    hold its output pipes (torchrun's ranks): subprocess.run kills only the launcher at the timeout and then
    waits for the pipes' end, forever while a rank lives on. Here the launch is a session of its own and the
    whole session is killed, so a stuck launch fails the test at the timeout with what it printed."""
    import subprocess

    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        out, err = p.communicate()
        raise AssertionError(f"{_current_test()}: {' '.join(map(str, cmd))} still running after {timeout:g}s; "
                             f"stdout: {out[-2000:]}\nstderr: {err[-3000:]}") from None
    finally:
        try:  # a rank the launcher left behind
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
    done = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    guard = sys.modules.get("tests.conftest") or sys.modules.get("conftest")
    if guard is not None and hasattr(guard, "note_output"):  # the "terminate called" guard sees it too
        guard.note_output(cmd, out, err)
    return done


# ---------------------------------------------------------------------------- the rendezvous, bounded
# The ranks meet in a TCPStore that spawn() holds in the test's own process, listening on a port the OS
# chose (port 0) before any rank starts: no port is picked, freed and bound later (free_port()'s window,
# in which another process, e.g. the other xdist worker's ranks or a torchrun launch, could take or
# connect to it), and no rank's death takes the store with it. Each rank marks its arrival and waits for
# the others at most RENDEZVOUS_S; the rank that waits in vain raises, naming the test and the ranks that
# never came, and spawn() stops the rest: a rank that never starts is a failure in seconds, not a hang.
RENDEZVOUS_S = float(os.environ.get("EP_TEST_RDZV_S", 90))
# After a rank has failed, how long the others get to finish (or fail and say why) before they are killed:
# peers of a failed rank often wait in a collective that will never complete.
FAILED_RANK_GRACE_S = 60.0


def _arrived(rank: int) -> str:
    return f"ep_test/arrived/{rank}"


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "(no test)").rsplit(" ", 1)[0]


class RendezvousTimeout(RuntimeError):
    pass


def _rendezvous(store, rank, world_size, wait_s, test):
    store.set(_arrived(rank), "1")
    try:
        store.wait([_arrived(r) for r in range(world_size)], timedelta(seconds=wait_s))
    except Exception:  # noqa: BLE001  (the store's timeout: say who is missing)
        missing = [r for r in range(world_size) if not store.check([_arrived(r)])]
        raise RendezvousTimeout(f"{test}: rank {rank} waited {wait_s:g}s at the rendezvous; rank(s) {missing} of "
                                f"{world_size} never arrived") from None


def _worker(rank, world_size, port, backend, fn, args, errq, abandon, bind_device, forked=None, rendezvous_s=RENDEZVOUS_S,
            timeout=300.0, test="(no test)", before_rendezvous=None):
    if forked is not None:
        forked.attach()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # A rank stuck past the deadline prints every thread's stack, so a hang shows where it waits; so does
    # one that spawn() is about to kill (SIGUSR1).
    faulthandler.dump_traceback_later(float(os.environ.get("EP_TEST_STACK_DUMP_S", 240)), file=sys.stderr)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    ok = False
    # Several ranks share the machine's cores: torch's intra-op threads per rank would oversubscribe
    # them (small ops measured ~100x slower with two ranks on two cores). A rank gets its share of the
    # cores, so on a GPU host (16 cores, 2 ranks) the CPU-side references of big shapes are not
    # single-threaded, and on the 2-core CI box each rank still has one thread.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
    try:
        if before_rendezvous is not None:
            before_rendezvous(rank, world_size)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        # connecting is part of the rendezvous: a rank whose spawn() is gone gives up within rendezvous_s
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=rendezvous_s))
        _rendezvous(store, rank, world_size, rendezvous_s, test)
        store.set_timeout(timedelta(seconds=timeout))  # every later wait on it: within the spawn's timeout
        init = dict(rank=rank, world_size=world_size, store=store)
        if backend == "gloo":  # a collective never waits longer than the whole spawn may take (gloo's default: 30 min)
            init["timeout"] = timedelta(seconds=timeout)
        if bind_device:
            init["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, **init)
        torch.manual_seed(1234 + rank)
        fn(rank, world_size, *args)
        if not abandon:
            dist.barrier()
        ok = True
    except BaseException:  # reported to the parent, which fails the test with it
        errq.put((rank, traceback.format_exc()))
        raise
    finally:
        if abandon:
            # After a failed collective, barrier or destroy_process_group can wait for the transport's
            # own timeout (30 min on gloo): leave without them.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0 if ok else 1)
        if dist.is_initialized():
            dist.destroy_process_group()
        # A process group held by a reference cycle outlives destroy_process_group; left to the cyclic GC
        # of interpreter exit, its gloo threads can abort the process ("terminate called without an
        # active exception"). Collect now, while the interpreter is whole.
        gc.collect()
        if forked is not None:
            forked.exit_like_spawn()


# ---------------------------------------------------------------------------- ranks forked, not spawned
# A spawned rank is a fresh interpreter that imports torch first (~2 s of CPU), and the CPU suite starts
# dozens of spawns of 2 to 8 ranks (on the 2-core CI box, forking took the suite from 539 s to 421 s). On
# a machine without CUDA the gloo ranks are forked instead, from multiprocessing's fork server, which has
# imported torch, megatron-core, pytest and ep_plugin once (tests/_forkserver_preload.py; the test module and
# the other frameworks are imported by each rank, fresh, as a spawned rank does). The fork server is a fresh
# interpreter of its own, never the pytest
# process (whose gloo and OpenMP threads a fork would copy half-alive). GPU hosts keep "spawn": CUDA and
# NCCL are never initialised after a fork there, and their suite runs as before. EP_TEST_START=spawn
# spawns every rank here too (to compare, or to rule the fork out).
FORKSERVER_PRELOAD = ["tests._forkserver_preload"]


def _use_forkserver(backend: str) -> bool:
    return backend == "gloo" and not torch.cuda.is_available() and os.environ.get("EP_TEST_START", "") != "spawn"


def _nothing():
    pass


class _Forked:
    """What a spawned rank gets for free and a forked one must be handed: the parent's environment as it
    is now (the fork server's is that of its start), the test's stdout and stderr (pytest captures the
    test's file descriptors; a forked rank would otherwise write into the fork server's, and the
    "terminate called" guard in conftest.py would not see it), and the interpreter's normal exit."""

    def __init__(self):
        if not getattr(_Forked, "_started", False):
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
            # Started, and its imports done (~7 s), before spawn() starts the ranks: otherwise the first
            # spawn's ranks would spend those seconds of their rendezvous_s waiting for the server.
            warm = ctx.Process(target=_nothing)
            warm.start()
            warm.join()
            _Forked._started = True
        self.env = dict(os.environ)

    def __reduce__(self):  # pickled while the rank's process is being launched: the fds go with it
        from multiprocessing import reduction

        sys.stdout.flush()
        sys.stderr.flush()
        return _Forked._child, (self.env, reduction.DupFd(1), reduction.DupFd(2))

    @staticmethod
    def _child(env, out, err):
        me = object.__new__(_Forked)
        me.env, me.fds = env, (out.detach(), err.detach())
        return me

    def attach(self):
        preloaded = sys.modules.get("tests._forkserver_preload")  # None: the server could not import it
        server_env = preloaded.SERVER_ENV if preloaded else os.environ
        added = {k: v for k, v in os.environ.items() if k not in server_env}
        os.environ.clear()
        os.environ.update(added)
        os.environ.update(self.env)
        for fd, passed in zip((1, 2), self.fds):
            os.dup2(passed, fd)
            os.close(passed)

    @staticmethod
    def exit_like_spawn():
        """A forked rank ends with os._exit (multiprocessing's fork server calls it once the rank's function
        returns), which skips the interpreter's shutdown, and with it the destructors that abort a process
        still holding gloo threads ("terminate called without an active exception"). A spawned rank goes
        through that shutdown, so this one does too: the fork server's os._exit(code) becomes SystemExit,
        which unwinds to the top of the forked interpreter and exits it normally, with that code."""

        real_exit = os._exit

        def shutdown_exit(code):
            os._exit = real_exit  # once: an os._exit during the shutdown (an atexit hook's) is the real one
            raise SystemExit(code)

        os._exit = shutdown_exit


def spawn(fn, world_size: int, *args, backend: str = "gloo", timeout: float = 300.0, abandon: bool = False,
          bind_device: bool = False, rendezvous_s: float = None, before_rendezvous=None) -> None:
    """Run fn(rank, world_size, *args) in world_size processes; re-raise the first failure.

    fn must be a module-level function (it is pickled into spawned processes). abandon: the group may
    break on purpose (a rank stalls, or leaves with os._exit(0)): the workers exit without the closing
    barrier and destroy_process_group (the store lives in this process, so any rank may die).
    bind_device: NCCL only, bind each rank's GPU at init (eager communicators; torch then makes
    new groups by splitting the world's communicator).
    Bounded everywhere: the ranks meet within rendezvous_s (RENDEZVOUS_S), all of them finish within
    timeout, and once one has failed the others get FAILED_RANK_GRACE_S; a rank left running is killed (its
    stacks printed first), and the failure names the test and the ranks that never arrived or never ended.
    before_rendezvous(rank, world_size): module-level, run by each rank before it meets the others
    (tests of the rendezvous itself).
    """
    test = _current_test()
    rendezvous_s = min(RENDEZVOUS_S if rendezvous_s is None else rendezvous_s, timeout)
    forked = _Forked() if _use_forkserver(backend) else None
    ctx = mp.get_context("forkserver" if forked else "spawn")
    errq = ctx.SimpleQueue()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    procs = [ctx.Process(target=_worker, args=(r, world_size, store.port, backend, fn, args, errq, abandon, bind_device,
                                               forked, rendezvous_s, timeout, test, before_rendezvous))
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        errors = []
        why = _watch(procs, store, world_size, timeout, rendezvous_s, errq, errors, abandon)
    finally:
        left = [p for p in procs if p.pid is not None and p.exitcode is None]
        if left:
            for p in left:  # every thread's stack into the test's output, then gone
                _signal(p, signal.SIGUSR1)
            time.sleep(1.0)
            for p in left:
                p.kill()
            for p in left:
                p.join(10)
    arrived = [r for r in range(world_size) if store.check([_arrived(r)])]
    del store
    while not errq.empty():
        errors.append(errq.get())
    never = [r for r in range(world_size) if r not in arrived]
    stopped = [procs.index(p) for p in left]
    notes = []
    if never:
        how = ", ".join(f"rank {r}: " + ("killed while starting" if procs[r] in left
                                          else f"exit code {procs[r].exitcode}") for r in never)
        notes.append(f"rank(s) {never} never reached the rendezvous ({how})")
    if stopped:
        notes.append(f"ranks {stopped} were stopped {why}")
    if errors:
        # Every rank's traceback: the first to fail is often not the first reported.
        raise AssertionError(f"{test}: " + "; ".join(notes) + ("\n" if notes else "")
                             + "\n".join(f"rank {r} failed:\n{tb}" for r, tb in sorted(errors)))
    if notes:
        raise AssertionError(f"{test}: " + "; ".join(notes))
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"{test}: processes exited with errors: {bad}")


def _signal(p, sig):
    try:
        os.kill(p.pid, sig)
    except OSError:
        pass


def _watch(procs, store, world_size, timeout, rendezvous_s, errq, errors, abandon=False) -> str:
    """Wait for the ranks; return early (with the reason) where waiting longer cannot help: the deadline
    passed, a rank ended before it reached the rendezvous (the others would wait for it in vain), the
    rendezvous is overdue, or (unless the group may break on purpose) a rank failed FAILED_RANK_GRACE_S ago. Reads errq into errors as it goes,
    so that a long traceback never blocks its rank's exit."""
    from multiprocessing.connection import wait

    start = time.monotonic()
    failed_at = None
    all_arrived = False
    while True:
        while not errq.empty():
            errors.append(errq.get())
        running = [p for p in procs if p.exitcode is None]
        if not running:
            return ""
        now = time.monotonic()
        if now - start > timeout:
            return f"at the spawn's timeout ({timeout:g} s)"
        if not all_arrived:
            arrived = [store.check([_arrived(r)]) for r in range(world_size)]
            all_arrived = all(arrived)
            gone = [r for r, p in enumerate(procs) if not arrived[r] and p.exitcode is not None]
            if gone:
                return f"as rank(s) {gone} ended before the rendezvous"
            gave_up = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if not all_arrived and gave_up:  # the rendezvous cannot complete any more
                return f"as rank(s) {gave_up} gave up waiting at the rendezvous"
            if not all_arrived and now - start > rendezvous_s + 10.0:  # the ranks raise at rendezvous_s themselves
                return f"with the rendezvous still incomplete after {now - start:.0f} s"
        failed = [r for r, _ in errors] + [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed_at is None and failed and not abandon:
            failed_at, first = now, failed[0]
        if failed_at is not None and now - failed_at > FAILED_RANK_GRACE_S:
            return f"{FAILED_RANK_GRACE_S:.0f} s after rank {first} failed"
        wait([p.sentinel for p in running], timeout=0.5)


def write_rank_result(out_dir, rank: int, result) -> None:
    """What a spawned rank hands back to the test: JSON in out_dir/rank{rank}.json."""
    import json

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, default=str)


def read_rank_results(out_dir, world_size: int) -> list:
    """Every rank's write_rank_result, in rank order."""
    import json

    out = []
    for r in range(world_size):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            out.append(json.load(f))
    return out


PART_AGREE_S = 60.0  # how long ranks wait for each other between two parts of spawn_parts


def _parts_body(rank, world, out_dir, parts, abandon=False):
    import json
    import time
    from datetime import timedelta

    store = dist.distributed_c10d._get_default_store()
    for i, (name, fn, args) in enumerate(parts):
        t0 = time.monotonic()
        try:
            fn(rank, world, *args)
            error = None
        except BaseException:  # noqa: BLE001  (recorded for this part's test; the others go on if all agree)
            error = traceback.format_exc()
        with open(os.path.join(out_dir, f"{name}.rank{rank}.json"), "w") as f:
            json.dump({"error": error, "seconds": time.monotonic() - t0}, f)
        if abandon and i == len(parts) - 1:
            return  # nothing follows and the worker leaves without the closing barrier: no need to agree
        # Every rank's outcome before the next part: a rank that failed may have left a collective half done,
        # so after a failure nobody goes on (the parts not run fail with that reason).
        store.set(f"ep_parts/{name}/{rank}", "ok" if error is None else "failed")
        keys = [f"ep_parts/{name}/{r}" for r in range(world)]
        try:
            store.wait(keys, timedelta(seconds=PART_AGREE_S))
            agreed = all(store.get(k) == b"ok" for k in keys)
        except Exception:  # noqa: BLE001  (a rank stuck in the part, or rank 0 (the store) gone after a failure)
            os._exit(3)
        if not agreed:
            os._exit(3)  # skip the closing barrier: a peer may be stuck in a broken collective


def spawn_parts(parts, world_size: int, out_dir, **kw) -> dict:
    """Run several test bodies in ONE set of world_size processes (one process start, one NCCL/gloo init,
    one framework import for all of them), in order. parts: [(name, fn, args)], fn(rank, world, *args)
    module-level. Returns {name: PartResult}; each test asserts its own part with PartResult.check(), so a
    failure is reported by the test it belongs to and the parts after it say they did not run.
    Parts that leave the group usable; with abandon=True the last part may break it (a rank that stalls,
    or ends its process: its test then passes that rank to PartResult.check(exited=...))."""
    os.makedirs(out_dir, exist_ok=True)
    failure = None
    try:
        spawn(_parts_body, world_size, str(out_dir), list(parts), kw.get("abandon", False), **kw)
    except AssertionError as exc:
        failure = str(exc)
    return {name: PartResult(name, out_dir, world_size, failure) for name, _, _ in parts}


class PartResult:
    def __init__(self, name, out_dir, world, spawn_failure):
        import json

        self.name, self.spawn_failure = name, spawn_failure
        self.ranks = {}
        for r in range(world):
            path = os.path.join(out_dir, f"{name}.rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    self.ranks[r] = json.load(f)
        self.world = world

    def check(self, exited=()) -> None:
        """exited: ranks that end their process in this part on purpose (their result is never written)."""
        errors = [f"rank {r} failed:\n{v['error']}" for r, v in sorted(self.ranks.items()) if v["error"]]
        if errors:
            raise AssertionError(f"part {self.name}:\n" + "\n".join(errors))
        came_back = [r for r in exited if r in self.ranks]
        if came_back:
            raise AssertionError(f"part {self.name}: ranks {came_back} were to end their process, yet finished it")
        missing = [r for r in range(self.world) if r not in self.ranks and r not in exited]
        if missing:
            raise AssertionError(f"part {self.name} did not finish on ranks {missing} (an earlier part failed, or "
                                 f"this one hung): {self.spawn_failure or 'no error reported'}")


def parts_per_world(tmp_path_factory, tag: str, table: dict, **kw):
    """For a module fixture: table maps a world size to its parts [(name, fn, args)]; returns
    run(world, name) -> PartResult, spawning each world's parts together (spawn_parts) on first use, so
    a module's tests of one world size share one process start-up and group init."""
    runs = {}

    def run(world, name):
        if world not in runs:
            runs[world] = spawn_parts(table[world], world, str(tmp_path_factory.mktemp(f"{tag}{world}")), **kw)
        return runs[world][name]
    return run
