"""HOST OVERHEAD ONLY: the Python time of EPBuffer.dispatch/combine on the nvlink backend, on a machine
with no GPU.

    python3 benchmarks/bench_nvlink_host.py               # the table (4096 and 128 tokens, each mode),
                                                          # then a cProfile top-20 (BF16, 4096 tokens)
    python3 benchmarks/bench_nvlink_host.py -v --no-profile   # + torch.cuda stand-in calls per row
    python3 benchmarks/bench_nvlink_host.py --compare OLD_BACKEND.py   # A/B against another backend.py
    (the same path on the GPU host, real kernels, each launch stamped: bench_nvlink_host_gpu.py)

What runs: EPBuffer (ep_plugin/buffer.py), the nvlink backend (ep_plugin/backends/nvlink/backend.py),
HostCounts/PinnedRing/Handle (ep_plugin/types.py), exactly as shipped, over stand-ins for the GPU:
- `_C.NvlinkRuntime` is FakeRuntime: the same methods taking the same ints, doing nothing (on the GPU
  host each is a pybind call plus a kernel launch, not timed here);
- torch.cuda's streams, events, current_stream, is_current_stream_capturing, stream() and the raw-stream
  accessor are small Python fakes; they cost less than the real ones (torch.cuda.current_stream() alone
  is a few us of Python and C++ on a GPU host), so the table UNDER-states what calling them costs;
  the counts of calls per op are printed so they can be priced on the GPU host;
- tensors are CPU tensors (torch.empty on CPU: glibc malloc, made to keep freed blocks as the CUDA
  caching allocator does; a CUDA torch.empty costs more); pinned memory is plain CPU memory;
- one process is rank 0 of a 2-rank group (dist.get_world_size says 2; the construction's all-gather
  and barrier are stubs): the 2x H200 case of issue 13, E 256, top-8, H 7168, max_tokens 4096,
  24 SMs, comm.host_sync false (worst-case outputs) unless the row says otherwise.
Times: time.perf_counter_ns; per row the median us per call over -n calls, best of --repeats medians.
"to notify" is from entering EPBuffer.dispatch to the fake notify being called (the host's share of the
time before the first kernel can start); "dispatch" the whole call; "cached" a dispatch with the
handle; "to combine" from entering EPBuffer.combine to the fake combine launch; "combine" the whole
EPBuffer.combine. This is Python on a CPU box, not the GPU path.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import importlib.util
import itertools
import os
import pstats
import statistics
import sys
import time
from collections import Counter
from types import SimpleNamespace
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_report import cpu_name  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
try:  # an ep_plugin on PYTHONPATH wins over this tree
    import ep_plugin
except ImportError:
    sys.path.append(os.path.dirname(HERE))
    import ep_plugin

import ep_plugin.buffer as ep_buffer  # noqa: E402
from ep_plugin.backends.nvlink import backend as nvl  # noqa: E402

W, E, K, H, MAX_TOKENS, SMS = 2, 256, 8, 7168, 4096, 24
GPU_SMS = 132
clock = time.perf_counter_ns


class FakeRuntime:
    """Stands in for ep_plugin._C.NvlinkRuntime: the same methods, no work. Each launch stamps the
    clock (`stamps`, name -> ns of the last call); `calls`, when a list, records (name, args)."""

    calls: Optional[list] = None
    out_rows = 0  # the out_rows (DispatchRoute) of the last pull / stage_pull: not in `calls`, whose tuples tests unpack

    def __init__(self, device, rank, world, max_tokens, hidden, num_experts, timeout_s):
        self.world, self.max_tokens, self.local = world, max_tokens, num_experts // world
        self.stamps: Dict[str, int] = {}
        self.buffer_bytes = 0
        self.bad_ids = 0
        self.err = 0

    def _log(self, name, args):
        self.stamps[name] = clock()
        if self.calls is not None:
            self.calls.append((name, args))

    def ipc_handle(self):
        return bytes(64)

    def open_peers(self, handles):
        pass

    def close(self):
        pass

    def notify(self, topk_idx, T, K, send_pos, is_in, recv_off, tpe, stream, host_tpe=0, host_recv_off=0,
               merge_repeats=0):
        # logged with the stream last, as every other launch
        self._log("notify", (topk_idx, T, K, send_pos, is_in, recv_off, tpe, host_tpe, host_recv_off, merge_repeats,
                             stream))

    def stage(self, x, T, row_bytes, scales, nscales, topk_idx, weights, K, num_sms, stream, merge_repeats=0):
        self._log("stage", (x, T, row_bytes, scales, nscales, topk_idx, weights, K, num_sms, merge_repeats, stream))

    def pull(self, out_x, row_bytes, out_scales, nscales, out_idx, out_w, K, recv_off, recv_src, cached, R_alloc,
             num_sms, stream, out_rows=0):
        self.out_rows = out_rows
        self._log("pull", (out_x, row_bytes, out_scales, nscales, out_idx, out_w, K, recv_off, recv_src, cached,
                           R_alloc, num_sms, stream))

    def stage_pull(self, x, T, row_bytes, scales, nscales, topk_idx, weights, K, out_x, out_scales, out_idx, out_w,
                   recv_off, recv_src, cached, R_alloc, num_sms, stream, out_rows=0):
        self.out_rows = out_rows
        self._log("stage_pull", (x, T, row_bytes, scales, nscales, topk_idx, weights, K, out_x, out_scales, out_idx,
                                 out_w, recv_off, recv_src, cached, R_alloc, num_sms, stream))

    def notify_stage_pull(self, topk_idx, T, K, send_pos, is_in, recv_off, tpe, host_tpe, host_recv_off, x,
                          row_bytes, scales, nscales, weights, out_x, out_scales, out_idx, out_w, recv_src, R_alloc,
                          num_sms, stream):
        # logged as the notify and the stage_pull it stands for (one launch on the GPU: notify inside)
        self.inside_launches += 1
        self.notify(topk_idx, T, K, send_pos, is_in, recv_off, tpe, stream, host_tpe, host_recv_off, 0)
        self.stage_pull(x, T, row_bytes, scales, nscales, topk_idx, weights, K, out_x, out_scales, out_idx, out_w,
                        recv_off, recv_src, 0, R_alloc, num_sms, stream)

    def stage_fork(self, stream):
        self._log("stage_fork", (stream,))

    def stage_begin(self, x, T, row_bytes, scales, nscales, topk_idx, weights, K, stream):
        self._log("stage_begin", (x, T, row_bytes, scales, nscales, topk_idx, weights, K, stream))

    def stage_end(self, stream):
        self._log("stage_end", (stream,))

    tma = True  # Runtime.tma: the bulk-copy kernels (stage_pull_contract runs only with them)
    inside_launches = 0  # notify_stage_pull calls (the tests count them)
    stage_copy_engine = True  # Runtime.stage_copy_engine: inside the runtime's stage, unseen by the backend

    def stage_pull_contract_fits(self, row_bytes, nodes):  # the runtime's rule, less the GPU's (sm_90+)
        return self.tma and nodes >= 1 and nodes * self.world <= 256 and self.max_tokens % nodes == 0

    def stage_pull_contract(self, x, T, row_bytes, scales, nscales, topk_idx, weights, K, out_x, out_scales, out_idx,
                            out_w, recv_off, recv_src, R_alloc, nodes, to_contract, counts, num_sms, stream,
                            send_pos=0, is_in=0, tpe=0, host_tpe=0, host_recv_off=0):
        if tpe:  # notify inside: logged as the notify it stands for, then the launch (as notify_stage_pull)
            self.inside_launches += 1
            self.notify(topk_idx, T, K, send_pos, is_in, recv_off, tpe, stream, host_tpe, host_recv_off, 0)
        self._log("stage_pull_contract", (x, T, row_bytes, scales, nscales, topk_idx, weights, K, out_x, out_scales,
                                          out_idx, out_w, recv_off, recv_src, R_alloc, nodes, to_contract, counts,
                                          num_sms, stream))

    def expert_pull(self, out_x, row_bytes, out_scales, nscales, out_idx, out_w, K, recv_off, recv_src, positions,
                    cached, R_alloc, alignment, scratch, offsets, counts, num_sms, stream):
        self._log("expert_pull", (out_x, row_bytes, out_scales, nscales, out_idx, out_w, K, recv_off, recv_src,
                                  positions, cached, R_alloc, alignment, scratch, offsets, counts, num_sms, stream))

    def expert_scratch_ints(self, num_sms):
        return 2 * num_sms * self.local + 2 * self.local

    def combine(self, x, send_pos, recv_off, recv_src, y, T, num_sms, fused, stream, x_rows=0, y_blocks=0,
                block_tokens=0):
        self._log("combine", (x, send_pos, recv_off, recv_src, y, T, num_sms, fused, stream))

    combine_copy_engine_fits = True

    def combine_copy_engine(self, x, send_pos, recv_off, y, T, num_sms, stream, recv_off_host):
        self._log("combine_copy_engine", (x, send_pos, recv_off, y, T, num_sms, stream, list(recv_off_host)))

    def combine_expert(self, x, positions, K, send_pos, recv_off, y, T, num_sms, stream):
        self._log("combine_expert", (x, positions, K, send_pos, recv_off, y, T, num_sms, stream))

    def combine_expert_staged(self, x, positions, K, send_pos, recv_off, y, T, num_sms, stream):
        self._log("combine_expert_staged", (x, positions, K, send_pos, recv_off, y, T, num_sms, stream))

    def expert_sum(self, x, positions, K, recv_off, rows, blocks, stream):
        self._log("expert_sum", (x, positions, K, recv_off, rows, blocks, stream))

    def results(self):  # host_sync: what a finished notify left in host-mapped memory (T rows, all local)
        T = self.max_tokens // 2
        return T, [T] + [0] * (self.world - 1), [T] + [0] * (self.world - 1), [T // self.local] * self.local, 0

    def error(self):
        return self.err

    def error_kernel(self):
        return 1

    def missing_ranks(self):
        return [1]

    def take_bad_expert_ids(self):
        bad, self.bad_ids = self.bad_ids, 0
        return bad


class FakeStream:
    """A stream: `cuda_stream` is its raw pointer (a new one per stream made); waits are recorded."""

    _ptrs = itertools.count(0x10000, 0x100)

    def __init__(self, device=None, priority=0, ptr=None):
        self.device = device
        self.cuda_stream = next(self._ptrs) if ptr is None else ptr
        self.waited_events: list = []

    def __eq__(self, other):  # torch's Stream compares the raw streams
        return isinstance(other, FakeStream) and other.cuda_stream == self.cuda_stream

    __hash__ = object.__hash__

    def wait_stream(self, other):
        pass

    def wait_event(self, ev):
        self.waited_events.append(ev)

    def synchronize(self):
        pass


class FakeEvent:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.recorded = None

    def record(self, stream=None):
        self.recorded = stream

    def synchronize(self):
        pass

    def query(self):
        return True

    def wait(self, stream=None):
        pass


class FakeStreamContext:
    entered: Optional[list] = None  # when a list, the streams made current, in order

    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        if self.entered is not None:
            self.entered.append(self.stream)
        return self.stream

    def __exit__(self, *exc):
        return False


class _NoPinRing(nvl.PinnedRing):
    """PinnedRing without pinned memory (this torch has no pinned allocator); take() is the real one."""

    def __init__(self, shapes, size: int = 32):
        self._slots = [({n: torch.empty(shape, dtype=dt) for n, (shape, dt) in shapes.items()}, torch.cuda.Event())
                       for _ in range(size)]
        self._owners = [None] * size
        self._next = 0


class _HostBytes(torch.Tensor):
    """The IPC handle's bytes: `.to("cuda:N")` stays on the host (the all-gather is a stub)."""

    def to(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor).clone()


def _keep_freed_blocks() -> None:
    """Make glibc keep freed blocks (as the CUDA caching allocator does) instead of mmap/munmap per
    [R, H] output, which would add a syscall a CUDA allocation does not pay."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, (1 << 31) - 1)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 31)  # M_TRIM_THRESHOLD
    except OSError:
        pass


@contextlib.contextmanager
def fake_gpu(backend_module=nvl, calls: Optional[list] = None, count: Optional[Counter] = None,
             runtime: type = FakeRuntime, stream: Optional[FakeStream] = None):
    """Patch what the nvlink backend and EPBuffer need from a GPU (module docstring); EPBuffer's backend
    becomes backend_module.NvlinkBackend over `runtime` (FakeRuntime or a subclass), rank 0 of W.
    Restores everything on exit. calls: a list the runtime appends its launches to; count: a Counter of
    the torch.cuda stand-ins' calls; stream: the current stream (its cuda_stream may be changed)."""
    rt_cls = type("FakeRuntimeRec", (runtime,), {"calls": calls})
    fake_c = SimpleNamespace(NvlinkRuntime=rt_cls)
    saved = []
    tally = count if count is not None else Counter()

    def patch(owner, name, value):  # restored on exit; an inherited attribute (Tensor's) by deleting ours
        own = name in vars(owner)
        saved.append((owner, name, vars(owner).get(name), own))
        setattr(owner, name, value)

    def counted(name, fn):  # counting costs time: only when asked
        if count is None:
            return fn

        def f(*a, **k):
            tally[name] += 1
            return fn(*a, **k)
        return f

    cur = stream if stream is not None else FakeStream(device=0, ptr=0x1000)
    mod = backend_module
    patch(mod, "get_c", lambda: fake_c)
    patch(mod, "PinnedRing", _NoPinRing)
    if hasattr(mod, "_raw_stream"):  # the raw-stream accessor a backend may cache at import
        patch(mod, "_raw_stream", counted("raw_stream", lambda device: cur.cuda_stream))
    if hasattr(mod, "_get_device"):  # the current device is the tensors' (CPU tensors: index None)
        patch(mod, "_get_device", counted("get_device", lambda: None))
    if hasattr(mod, "_is_capturing"):
        patch(mod, "_is_capturing", counted("is_current_stream_capturing", lambda: False))
    patch(mod.torch, "frombuffer", lambda buf, dtype: _REAL_FROMBUFFER(buf, dtype=dtype).as_subclass(_HostBytes))
    patch(torch.cuda, "is_available", lambda: True)
    patch(torch.cuda, "current_device", counted("current_device", lambda: 0))
    patch(torch.cuda, "get_device_properties", lambda d=None: SimpleNamespace(multi_processor_count=GPU_SMS))
    patch(torch.cuda, "synchronize", lambda d=None: None)
    patch(torch.cuda, "Stream", counted("Stream", FakeStream))
    patch(torch.cuda, "Event", counted("Event", FakeEvent))
    patch(torch.cuda, "current_stream",
          counted("current_stream", lambda device=None: FakeStream(0, 0, cur.cuda_stream)))
    patch(torch.cuda, "is_current_stream_capturing", counted("is_current_stream_capturing", lambda: False))
    patch(torch.cuda, "stream", counted("stream", FakeStreamContext))
    patch(torch.Tensor, "record_stream", counted("record_stream", lambda self, s: None))
    patch(dist, "get_world_size", lambda group=None: W)
    patch(dist, "get_rank", lambda group=None: 0)
    patch(dist, "all_gather_into_tensor", lambda out, inp, group=None: out.copy_(inp.repeat(W)))
    patch(dist, "barrier", lambda group=None: None)
    patch(ep_buffer, "make_backend", lambda group, cfg, hidden, num_experts:
          mod.NvlinkBackend(group, cfg, hidden, num_experts))
    try:
        yield tally
    finally:
        for owner, name, value, own in reversed(saved):
            if own:
                setattr(owner, name, value)
            else:
                delattr(owner, name)


_REAL_FROMBUFFER = torch.frombuffer


def one_rank_group() -> bool:
    """A one-rank gloo group in this process unless one exists; True if made here."""
    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    return True


def config(host_sync: bool = False, max_tokens: int = MAX_TOKENS, num_experts: int = E, topk: int = K,
           **comm) -> Dict:
    return {"moe": {"num_experts": num_experts, "topk": topk},
            "comm": {"backend": "nvlink", "max_tokens_per_rank": max_tokens, "timeout_s": 15.0, "num_sms": SMS,
                     "host_sync": host_sync, **comm}}


def inputs(T: int, fp8: bool = False, hidden: int = H, experts: int = E, topk: int = K) -> SimpleNamespace:
    g = torch.Generator().manual_seed(T)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(min(T, 64))])
    idx = idx.repeat((T + 63) // 64, 1)[:T].contiguous()
    x = torch.empty((T, hidden), dtype=torch.bfloat16)
    xin = (torch.empty((T, hidden), dtype=torch.float8_e4m3fn),
           torch.empty((T, hidden // 128), dtype=torch.float32)) if fp8 else x
    return SimpleNamespace(x=xin, bf16=x, idx=idx, w=torch.rand(T, topk), T=T)


MODES = {  # row name -> (EPBuffer config keys, dispatch kwargs, fp8)
    "bf16": ({}, {}, False),
    "fp8": ({}, {}, True),
    "bf16 async": ({}, {"async_op": True}, False),
    "bf16 host_sync": ({"host_sync": True}, {}, False),
    "bf16 expert": ({}, {"layout": "expert", "expert_alignment": 128}, False),
}


def time_calls(buf, inp, kw: Dict, n: int, warmup: int = 100) -> Dict[str, float]:
    """Median us of each part over n rounds of dispatch, cached dispatch, combine (as a training step
    orders them: the cached dispatch is combine's backward). Results are dropped outside the timed
    calls: freeing them is the caller's time, not the call's."""
    rt = buf._backend._rt
    asyn = bool(kw.get("async_op"))
    parts: Dict[str, List[int]] = {"to notify": [], "dispatch": [], "cached": [], "to combine": [], "combine": []}
    rows = None
    for i in range(warmup + n):
        t0 = clock()
        res = buf.dispatch(inp.x, inp.idx, inp.w, **kw)
        t1 = clock()
        if asyn:
            res.event.current_stream_wait()
        h = res.handle
        t2 = clock()
        again = buf.dispatch(inp.x, handle=h, async_op=asyn)
        t3 = clock()
        if rows is None:  # the expert output: the rows' shape, allocated once
            rows = torch.empty_like(res.x[0] if isinstance(res.x, tuple) else res.x, dtype=torch.bfloat16)
        t4 = clock()
        y = buf.combine(rows, h, async_op=asyn)
        t5 = clock()
        res = h = again = y = None  # held until here: freeing them is not the calls' time
        if i >= warmup:
            parts["to notify"].append(rt.stamps["notify"] - t0)
            parts["dispatch"].append(t1 - t0)
            parts["cached"].append(t3 - t2)
            parts["to combine"].append(rt.stamps["combine"] - t4 if "combine" in rt.stamps else t5 - t4)
            parts["combine"].append(t5 - t4)
    return {k: statistics.median(v) / 1e3 for k, v in parts.items() if v}


def build(mode: str, T: int):
    comm, kw, fp8 = MODES[mode]
    buf = ep_plugin.EPBuffer(None, config(**comm), hidden=H)
    return buf, inputs(T, fp8), kw


def run_table(args, backends) -> None:
    print(f"ep_plugin from {os.path.dirname(ep_plugin.__file__)}")
    print(f"HOST OVERHEAD ONLY, CPU box (Python on {cpu_name()}, torch {torch.__version__}; fake NvlinkRuntime, "
          f"fake torch.cuda, CPU tensors; no launch, no CUDA allocator). Rank 0 of {W}, E {E}, top-{K}, H {H}, "
          f"max_tokens {MAX_TOKENS}, {SMS} SMs; median us of {args.n} calls, best of {args.repeats}.")
    head = (f"{'backend':10} {'T':>5} {'mode':15} {'to notify':>9} {'dispatch':>9} {'cached':>8} {'to combine':>10} "
            f"{'combine':>8}")
    print(head)
    for T in args.tokens:
        for mode in args.modes:
            for label, mod in backends:
                best = None
                with fake_gpu(mod):
                    buf, inp, kw = build(mode, T)
                    for _ in range(args.repeats):
                        r = time_calls(buf, inp, kw, args.n)
                        best = r if best is None else {k: min(best[k], r[k]) for k in r}
                    buf.close()
                print(f"{label:10} {T:5} {mode:15} {best['to notify']:9.2f} {best['dispatch']:9.2f} "
                      f"{best['cached']:8.2f} {best['to combine']:10.2f} {best['combine']:8.2f}", flush=True)
                if args.verbose:  # one round after a warm-up, counted
                    with fake_gpu(mod, count=Counter()) as tally:
                        buf, inp, kw = build(mode, T)
                        time_calls(buf, inp, kw, 0, warmup=3)
                        tally.clear()
                        time_calls(buf, inp, kw, 0, warmup=1)
                        buf.close()
                    print(f"{'':10} torch.cuda stand-in calls per dispatch+cached+combine: {dict(tally)}")


def run_profile(args, mod) -> None:
    T, mode = args.tokens[0], args.modes[0]
    with fake_gpu(mod):
        buf, inp, kw = build(mode, T)
        time_calls(buf, inp, kw, 50)
        prof = cProfile.Profile()
        prof.enable()
        time_calls(buf, inp, kw, args.n, warmup=0)
        prof.disable()
        buf.close()
    print(f"HOST OVERHEAD ONLY, CPU box: cProfile of {args.n} rounds of dispatch + cached dispatch + combine, "
          f"T {T}, {mode} (cProfile inflates Python calls; use it for the ranking, not the times)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


def load_backend(path: str):
    """Another backend.py (e.g. the one before a change) as a module of the nvlink package, for A/B runs."""
    name = "ep_plugin.backends.nvlink._bench_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", nargs="+", type=int, default=[4096, 128])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("-n", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="skip the cProfile top-20 (of the first --tokens and --modes)")
    ap.add_argument("--compare", metavar="BACKEND_PY", help="also time this backend.py, row by row")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the torch.cuda stand-ins' call counts")
    args = ap.parse_args(argv)
    _keep_freed_blocks()
    backends = [("current", nvl)]
    if args.compare:
        backends.insert(0, ("compare", load_backend(args.compare)))
    made = one_rank_group()
    try:
        run_table(args, backends)
        if args.profile:
            run_profile(args, nvl)
    finally:
        if made:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
