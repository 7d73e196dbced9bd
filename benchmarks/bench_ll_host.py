"""HOST OVERHEAD ONLY: the Python time of one low-latency call, per layer, on a machine with no GPU.

    python3 benchmarks/bench_ll_host.py                   # every layer, BF16/FP8, output_buffers 0 and 2
    python3 benchmarks/bench_ll_host.py --profile deep_ep  # cProfile of one layer's dispatch+combine pairs
    python3 benchmarks/bench_ll_host.py --fused off        # the send and receive halves as two launches
    python3 benchmarks/bench_ll_host.py --hook --layers shim --held  # per half, as DeepEP's test_low_latency

What runs: the NVSHMEM engine's Python (ep_plugin/backends/nvshmem/low_latency.py), EPBuffer's
low-latency calls and the deep_ep compat layer, exactly as shipped, over stand-ins for what needs a GPU:
- `_C.LowLatencyRuntime` is FakeRuntime: its dispatch/combine take the same ints and do nothing
  (a pybind call with ~15 ints and a real kernel launch cost more: several us on the GPU host);
- tensors live on the meta device (torch.empty there is torch's per-tensor host cost without an
  allocator behind it; data_ptr() is 0), so the [E_l, W*M, H] outputs cost no CPU memory;
- torch.cuda.current_device(), the raw-stream accessor and get_device_properties are stubs, and
  EPBuffer's device check (once per form of call) is skipped: meta is no device it takes.
A one-rank gloo group stands in for the EP group; E_l = 144 local experts, M = 128 tokens, H = 7168,
top-8: the 2x H200 case of docs/LOW_LATENCY.md as seen by one rank. Times are
time.perf_counter_ns around each call, after a warm-up (the first calls check and cache each form);
reported: median us per call (min of --repeats medians). This measures Python, not the GPU path:
on the GPU host add the launches and the CUDA allocator.

Layers:
  engine   NvshmemLowLatency.dispatch/combine(hook=False)
  EPBuffer EPBuffer.low_latency_dispatch/combine
  deep_ep  ep_plugin.deep_ep.Buffer.low_latency_dispatch/combine as DeepEP's test bench calls them
           (use_fp8, cumulative stats, async_finish=False, return_recv_hook=False)
  shim     the same with no ep_config (what `import deep_ep` users get: output sets of torch tensors,
           comm.low_latency.heap_outputs false; --output-buffers does not apply, the default 2 does)

--hook: return_recv_hook=True, and each half timed on its own: the dispatch call (send), its hook()
(receive), the combine call, its hook() -- the four halves DeepEP's test_low_latency profiles.
--held: one dispatch's outputs stay bound through the timing, as DeepEP's test_low_latency keeps its
check loop's names through its bench (a set of torch tensors then gives way to the other one).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional

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
from ep_plugin.backends.nvshmem import low_latency as nv_ll  # noqa: E402

E_L, M, H, K = 144, 128, 7168, 8
SMS = 132


class FakeRuntime:
    """Stands in for ep_plugin._C.LowLatencyRuntime: the same methods, no work. `calls` (when a list)
    records ("dispatch"|"combine", phases, args) of each launch, for the tests; `heap_sets`: output sets
    in (host) memory the fake owns, as the real one has them in the heap, and `out_sets` (when a list)
    records each dispatch launch's set."""

    calls: Optional[list] = None
    heap_sets = False
    out_sets: Optional[list] = None
    self_pos_log: Optional[list] = None  # (kind, phases, self_pos) of each launch

    def __init__(self, rank, world, num_experts, max_tokens, max_topk, hidden, timeout_s, num_blocks, output_sets=0):
        self.max_tokens, self.max_topk = max_tokens, max_topk
        rows = num_experts * max_tokens  # EL * W*M, the layout of ll_runtime.cu's sets (on 256-byte bounds)
        up = lambda n: (n + 255) // 256 * 256  # noqa: E731
        slot = 2 * rows * hidden + up(4 * rows)
        # + the int2 info region after row_slot (kPackedInfo), then kOwnerReduce's records; the row-major FP8
        # scales sit in the data bytes
        rec = slot + up(4 * rows) + up(8 * rows)
        self._offsets = (0, rows * hidden, 2 * rows * hidden, slot, rec)
        nbytes = rec + 4 * world * (1 + max_tokens * max_topk)
        self._sets = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(output_sets if self.heap_sets else 0)]
        self.sets = len(self._sets)

    @staticmethod
    def heap_bytes(world, num_experts, max_tokens, max_topk, hidden, output_sets=0):
        return 0

    def set_pointers(self, i):
        return [self._sets[i].data_ptr() + o for o in self._offsets]

    def dispatch(self, x, topk_idx, T, K, use_fp8, round_scale, phases, out_x, out_scales, recv_count, src_info,
                 layout_range, row_slot, recv_stats, stream, out_set=-1, self_pos=0):
        if self.calls is not None:
            self.calls.append(("dispatch", phases, (x, topk_idx, T, K, use_fp8, round_scale, out_x, out_scales,
                                                    recv_count, src_info, layout_range, row_slot, recv_stats)))
        if self.out_sets is not None:
            self.out_sets.append(out_set)
        if self.self_pos_log is not None:
            self.self_pos_log.append(("dispatch", phases, self_pos))

    def combine(self, x, row_slot, recv_count, topk_idx, weights, T, K, phases, y, stream, self_pos=0, rec=0):
        if self.calls is not None:
            self.calls.append(("combine", phases, (x, row_slot, recv_count, topk_idx, weights, T, K, y)))
        if self.self_pos_log is not None:
            self.self_pos_log.append(("combine", phases, self_pos))

    def take_bad_expert_ids(self):
        return 0

    def error(self):
        return 0

    def set_mask(self, ranks):
        pass

    def destroy(self, collective=True):
        pass


@contextlib.contextmanager
def fake_gpu(device: str = "meta", calls: Optional[list] = None, out_sets: Optional[list] = None,
             self_pos_log: Optional[list] = None):
    """Patch what the NVSHMEM engine and EPBuffer need from a GPU (module docstring); EPBuffer's low-latency
    engine becomes an NvshmemLowLatency over FakeRuntime (with output sets when `out_sets` is a list, which
    then records each dispatch launch's set). Restores everything on exit."""
    rt_cls = type("FakeRuntimeRec", (FakeRuntime,), {"calls": calls, "out_sets": out_sets,
                                                      "heap_sets": out_sets is not None,
                                                      "self_pos_log": self_pos_log})
    fake_c = SimpleNamespace(HAS_NVSHMEM=True, LowLatencyRuntime=rt_cls)
    fake_runtime_mod = SimpleNamespace(join=lambda *a, **k: None, mark_fault=lambda: None, faulted=lambda: False)
    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    patch(nv_ll, "get_c", lambda: fake_c)
    patch(nv_ll, "runtime", fake_runtime_mod)
    patch(nv_ll, "_current_stream", lambda: 0)  # no CUDA here: the raw stream accessor would fail
    patch(torch.cuda, "current_device", lambda: 0)
    patch(torch.cuda, "get_device_properties", lambda d=None: SimpleNamespace(multi_processor_count=SMS))
    patch(torch.cuda, "synchronize", lambda d=None: None)
    patch(ep_buffer, "make_low_latency", lambda group, cfg, hidden, E: nv_ll.NvshmemLowLatency(group, cfg, hidden, E))
    if device != "cpu":
        patch(ep_buffer.EPBuffer, "_check_low_latency_device", lambda self, x: None)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def one_rank_group() -> bool:
    """A one-rank gloo group in this process unless one exists; True if made here."""
    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    return True


def config(output_buffers: int) -> Dict:
    return {"moe": {"num_experts": E_L, "topk": K},
            "comm": {"backend": "torch", "max_tokens_per_rank": M,
                     "low_latency": {"max_tokens_per_rank": M, "output_buffers": output_buffers}}}


def inputs(device: str, T: int = M) -> SimpleNamespace:
    return SimpleNamespace(
        x=torch.empty((T, H), dtype=torch.bfloat16, device=device),
        idx=torch.zeros((T, K), dtype=torch.int64, device=device),
        w=torch.empty((T, K), dtype=torch.float32, device=device),
        stats=torch.zeros((E_L,), dtype=torch.int32, device=device),
        rows=torch.empty((E_L, M, H), dtype=torch.bfloat16, device=device))


def layer_calls(layer: str, output_buffers: int, fp8: bool, device: str, fused: Optional[bool], hook: bool = False,
                held: Optional[list] = None):
    """(dispatch(), combine(handle), close(), engine) of one layer; dispatch returns the handle combine takes
    (with `hook`: dispatch returns (handle, hook) and combine the hook, which the caller runs). `held`: a
    list that gets the first dispatch's outputs (kept by the caller, as DeepEP's test keeps them)."""
    inp = inputs(device)
    if layer in ("deep_ep", "shim"):
        from ep_plugin.deep_ep import Buffer
        dbuf = Buffer(dist.group.WORLD, low_latency_mode=True,
                      ep_config=config(output_buffers) if layer == "deep_ep" else None)

        def dispatch():
            out = dbuf.low_latency_dispatch(inp.x, inp.idx, M, E_L, cumulative_local_expert_recv_stats=inp.stats,
                                            use_fp8=fp8, async_finish=False, return_recv_hook=hook)
            return (out[2], out[4]) if hook else out[2]

        def combine(handle):
            return dbuf.low_latency_combine(inp.rows, inp.idx, inp.w, handle, async_finish=False,
                                            return_recv_hook=hook)[2]

        first = dbuf.low_latency_dispatch(inp.x, inp.idx, M, E_L, cumulative_local_expert_recv_stats=inp.stats,
                                          use_fp8=fp8, return_recv_hook=hook)  # builds the EPBuffer and its engine
        if hook:
            first[4]()
        if held is not None:
            held.extend(first[:3])
        del first
        eng = next(iter(dbuf._ll_buffers.values()))._low_latency
        _set_fused(eng, fused)
        return dispatch, combine, dbuf.destroy, eng
    buf = ep_plugin.EPBuffer(None, config(output_buffers), hidden=H)
    first = buf.low_latency_dispatch(inp.x, inp.idx, use_fp8=fp8, recv_stats=inp.stats, return_recv_hook=hook)
    if hook:
        first[4]()
    if held is not None:
        held.extend(first[:3])
    del first
    eng = buf._low_latency
    _set_fused(eng, fused)
    if layer == "engine":
        def dispatch():
            out = eng.dispatch(inp.x, inp.idx, use_fp8=fp8, round_scale=False, recv_stats=inp.stats, hook=hook)
            return (out[2], out[3]) if hook else out[2]

        def combine(handle):
            return eng.combine(inp.rows, inp.idx, inp.w, handle, out=None, hook=hook)[1]
    else:
        def dispatch():
            out = buf.low_latency_dispatch(inp.x, inp.idx, use_fp8=fp8, recv_stats=inp.stats, return_recv_hook=hook)
            return (out[2], out[4]) if hook else out[2]

        def combine(handle):
            return buf.low_latency_combine(inp.rows, inp.idx, inp.w, handle, return_recv_hook=hook)[2]
    return dispatch, combine, buf.close, eng


def _set_fused(eng, fused: Optional[bool]) -> None:
    if fused is not None and hasattr(eng, "fused_launch"):
        eng.fused_launch = fused


def time_pairs(dispatch: Callable, combine: Callable, n: int, warmup: int = 200):
    """Median us per dispatch and per combine over n alternating calls (as the contract orders them)."""
    clock = time.perf_counter_ns
    for _ in range(warmup):
        combine(dispatch())
    td: List[int] = []
    tc: List[int] = []
    for _ in range(n):
        t0 = clock()
        h = dispatch()
        t1 = clock()
        combine(h)
        t2 = clock()
        del h  # a call's outputs go before the next call (as in DeepEP's test_func), not while it runs
        td.append(t1 - t0)
        tc.append(t2 - t1)
    return statistics.median(td) / 1e3, statistics.median(tc) / 1e3


def time_halves(dispatch: Callable, combine: Callable, n: int, warmup: int = 200):
    """With receive hooks: median us of the dispatch call, its hook(), the combine call, its hook()."""
    clock = time.perf_counter_ns
    for _ in range(warmup):
        h, recv = dispatch()
        recv()
        combine(h)()
    ts: List[List[int]] = [[], [], [], []]
    for _ in range(n):
        t0 = clock()
        h, recv = dispatch()
        t1 = clock()
        recv()
        t2 = clock()
        crecv = combine(h)
        t3 = clock()
        crecv()
        t4 = clock()
        del h, recv, crecv
        for lst, a, b in zip(ts, (t0, t1, t2, t3), (t1, t2, t3, t4)):
            lst.append(b - a)
    return tuple(statistics.median(t) / 1e3 for t in ts)


def run_halves(args) -> None:
    fused = {"on": True, "off": False, "default": None}[args.fused]
    print(f"{'layer':8} {'rows':5} {'output_buffers':>14} {'held':>4} {'d send':>7} {'d hook':>7} {'c send':>7} "
          f"{'c hook':>7} {'pair us':>8}")
    for layer in args.layers:
        for ob in (args.output_buffers if layer != "shim" else [2]):
            for fp8 in (False, True):
                held = [] if args.held else None
                d, c, close, eng = layer_calls(layer, ob, fp8, args.device, fused, hook=True, held=held)
                best = min((time_halves(d, c, args.n) for _ in range(args.repeats)), key=sum)
                del held
                close()
                print(f"{layer:8} {'fp8' if fp8 else 'bf16':5} {ob:>14} {'yes' if args.held else 'no':>4} "
                      + " ".join(f"{v:7.2f}" for v in best) + f" {sum(best):8.2f}", flush=True)


def run_table(args) -> None:
    print(f"ep_plugin from {os.path.dirname(ep_plugin.__file__)}")
    print(f"HOST OVERHEAD ONLY (Python on {cpu_name()}, torch {torch.__version__}; fake runtime, "
          f"{args.device} tensors; no launch, no CUDA allocator). E_l {E_L}, M {M}, H {H}, top-{K}; "
          f"median of {args.n} calls, best of {args.repeats}.")
    if args.hook:
        run_halves(args)
        return
    print(f"{'layer':8} {'rows':5} {'output_buffers':>14} {'fused':>5} {'dispatch us':>12} {'combine us':>11} "
          f"{'pair us':>8}")
    fused = {"on": True, "off": False, "default": None}[args.fused]
    for layer in args.layers:
        for ob in (args.output_buffers if layer != "shim" else [2]):
            for fp8 in (False, True):
                held = [] if args.held else None
                d, c, close, eng = layer_calls(layer, ob, fp8, args.device, fused, held=held)
                best = min((time_pairs(d, c, args.n) for _ in range(args.repeats)), key=sum)
                del held
                close()
                f = {True: "on", False: "off"}.get(getattr(eng, "fused_launch", None), "n/a")
                print(f"{layer:8} {'fp8' if fp8 else 'bf16':5} {ob:>14} {f:>5} {best[0]:12.2f} {best[1]:11.2f} "
                      f"{sum(best):8.2f}", flush=True)


def run_profile(args) -> None:
    fused = {"on": True, "off": False, "default": None}[args.fused]
    layer = args.profile
    d, c, close, _ = layer_calls(layer, args.output_buffers[-1], True, args.device, fused)
    time_pairs(d, c, 50)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.n):
        c(d())
    prof.disable()
    close()
    print(f"HOST OVERHEAD ONLY: cProfile of {args.n} {layer} FP8 dispatch+combine pairs, output_buffers "
          f"{args.output_buffers[-1]} (cProfile inflates Python calls; use it for the ranking, not the times)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", nargs="+", default=["engine", "EPBuffer", "deep_ep"],
                    choices=["engine", "EPBuffer", "deep_ep", "shim"])
    ap.add_argument("--output-buffers", nargs="+", type=int, default=[0, 2])
    ap.add_argument("--fused", choices=["default", "on", "off"], default="default",
                    help="the engine's fused_launch (one SEND|RECV launch with output_buffers > 0)")
    ap.add_argument("-n", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", choices=["engine", "EPBuffer", "deep_ep", "shim"])
    ap.add_argument("--hook", action="store_true", help="return_recv_hook=True: time each half apart")
    ap.add_argument("--held", action="store_true", help="keep the first dispatch's outputs, as DeepEP's test does")
    args = ap.parse_args(argv)
    args.device = "meta"  # CPU tensors of these sizes would cost ~30 us of page mapping per output
    made = one_rank_group()
    try:
        with fake_gpu(args.device):
            if args.profile:
                run_profile(args)
            else:
                run_table(args)
    finally:
        if made:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
