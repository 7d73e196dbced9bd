"""DeepEP v1.2.1's own tests/test_low_latency.py (or, with --test intranode, tests/test_intranode.py),
unchanged, on DeepEP or on ep_plugin.deep_ep.

    python3 benchmarks/deepep_ll_test.py --tests /tmp/deepep/tests --shim --ranks 2      # through ep_plugin.deep_ep
    python3 benchmarks/deepep_ll_test.py --tests /tmp/deepep/tests --ranks 2             # DeepEP itself
    python3 benchmarks/deepep_ll_test.py --tests /tmp/deepep/tests --test intranode --shim --ranks 4

With --shim, `import deep_ep` resolves to ep_plugin.deep_ep (a one-line module put first on the path of
this process and of the ranks it spawns), with no ep_config: the defaults a DeepEP user gets. The
test's own argument parser sits under `if __name__ == '__main__'`, so its arguments are rebuilt here
with the test's defaults and its test_loop is spawned as the test does (the function imported as a
module: the one runpy defines in __main__ cannot be unpickled by the spawned ranks). Prints what the
test prints; its bench line is "Dispatch + combine bandwidth: ... avg_t=... us".
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

SHIM = "import sys\nimport ep_plugin.deep_ep as _m\nsys.modules['deep_ep'] = _m\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tests", required=True, help="DeepEP's tests/ directory (test_low_latency.py, utils.py)")
    ap.add_argument("--shim", action="store_true", help="import deep_ep = ep_plugin.deep_ep")
    ap.add_argument("--test", choices=("low_latency", "intranode"), default="low_latency",
                    help="which of DeepEP's tests (intranode: 4096 tokens and 256 experts by default, as its own)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--num-tokens", type=int, default=None, help="the test's default (128 / 4096)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--num-topk", type=int, default=8)
    ap.add_argument("--num-experts", type=int, default=None, help="the test's default (288 / 256)")
    ap.add_argument("--port", type=int, default=8361, help="MASTER_PORT of the test's init_dist")
    ap.add_argument("--where", action="store_true",
                    help="low_latency: also print, per rank, the host time of each call of the test's bench loop "
                         "(perf_counter, no sync) and rank 0's profile of 20 of them (kernels and host ops)")
    a = ap.parse_args(argv)
    tests = os.path.abspath(a.tests)
    intra = a.test == "intranode"
    if not os.path.isfile(os.path.join(tests, f"test_{a.test}.py")):
        print(f"deepep_ll_test: no test_{a.test}.py in {tests}", file=sys.stderr)
        return 2
    paths = [tests]
    if a.shim:
        shim_dir = tempfile.mkdtemp(prefix="deep_ep_shim_")
        with open(os.path.join(shim_dir, "deep_ep.py"), "w") as f:
            f.write(SHIM)
        paths.insert(0, shim_dir)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not a.shim:
        paths.append(here)
    else:
        paths.insert(1, here)  # this tree's ep_plugin
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    os.environ.setdefault("MASTER_PORT", str(a.port))
    import importlib

    import torch
    t = importlib.import_module(f"test_{a.test}")
    import deep_ep
    print(f"[deepep_ll_test] deep_ep = {deep_ep.__name__} ({getattr(deep_ep, '__file__', '?')}), {a.ranks} ranks",
          flush=True)
    tokens = a.num_tokens or (4096 if intra else 128)
    experts = a.num_experts or (256 if intra else 288)
    ns = argparse.Namespace(num_processes=a.ranks, num_tokens=tokens, hidden=a.hidden, num_topk=a.num_topk,
                            num_experts=experts, allow_mnnvl=False, disable_nvlink=False, use_logfmt=False,
                            pressure_test=False)
    if a.where:
        torch.multiprocessing.spawn(_where_loop, args=(a.ranks, ns, a.test), nprocs=a.ranks)
    else:
        torch.multiprocessing.spawn(t.test_loop, args=(a.ranks, ns), nprocs=a.ranks)
    print("[deepep_ll_test] passed", flush=True)
    return 0


def _where_loop(local_rank, num_ranks, ns, test):
    """test_loop with the test module's `bench` wrapped (--where): where the bench line's time goes."""
    import contextlib
    import importlib
    import time

    import torch
    t = importlib.import_module(f"test_{test}")
    inner = t.bench

    def bench(fn, *args, **kwargs):
        host = []

        def timed():
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)

        out = inner(timed, *args, **kwargs)
        host = sorted(host[len(host) // 2:])  # the timed half (the warm-up calls come first)
        print(f"[where] rank {local_rank}: host time per bench call median {1e6 * host[len(host) // 2]:.1f} us, "
              f"max {1e6 * host[-1]:.1f} us; bench avg {1e6 * out[0]:.1f} us", flush=True)
        # every rank runs the 20 calls (they are collective); rank 0 profiles them
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if local_rank == 0 else \
                contextlib.nullcontext() as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        if local_rank == 0:
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12), flush=True)
        # the host side by Python function: 200 calls under cProfile on rank 0 (the others run them plain)
        import cProfile
        import io
        import pstats
        prof = cProfile.Profile() if local_rank == 0 else None
        if prof is not None:
            prof.enable()
        for _ in range(200):
            fn()
        if prof is not None:
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            print(text.getvalue(), flush=True)
        torch.cuda.synchronize()
        return out

    t.bench = bench
    t.test_loop(local_rank, num_ranks, ns)


if __name__ == "__main__":
    sys.exit(main())
