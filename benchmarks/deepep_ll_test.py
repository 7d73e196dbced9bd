"""DeepEP v1.2.1's own tests/test_low_latency.py, unchanged, on DeepEP or on ep_plugin.deep_ep.

    python3 benchmarks/deepep_ll_test.py --tests /tmp/deepep/tests --shim --ranks 2      # through ep_plugin.deep_ep
    python3 benchmarks/deepep_ll_test.py --tests /tmp/deepep/tests --ranks 2             # DeepEP itself

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
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--num-tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--num-topk", type=int, default=8)
    ap.add_argument("--num-experts", type=int, default=288)
    ap.add_argument("--port", type=int, default=8361, help="MASTER_PORT of the test's init_dist")
    a = ap.parse_args(argv)
    tests = os.path.abspath(a.tests)
    if not os.path.isfile(os.path.join(tests, "test_low_latency.py")):
        print(f"deepep_ll_test: no test_low_latency.py in {tests}", file=sys.stderr)
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
    import torch
    import test_low_latency as t
    import deep_ep
    print(f"[deepep_ll_test] deep_ep = {deep_ep.__name__} ({getattr(deep_ep, '__file__', '?')}), {a.ranks} ranks",
          flush=True)
    ns = argparse.Namespace(num_processes=a.ranks, num_tokens=a.num_tokens, hidden=a.hidden, num_topk=a.num_topk,
                            num_experts=a.num_experts, allow_mnnvl=False, disable_nvlink=False, use_logfmt=False,
                            pressure_test=False)
    torch.multiprocessing.spawn(t.test_loop, args=(a.ranks, ns), nprocs=a.ranks)
    print("[deepep_ll_test] passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
