"""Host work of the hierarchical (internode) backend per stage, on the CPU: torch ops issued and host
time per stage of a fresh dispatch, a cached one and a combine (the stages of backends/hierarchical/
timeline.py), with the torch parts (TorchRail, the torch backend inside nodes, LocalNode) over gloo.

On the GPU hosts measured (docs/INTERNODE.md, session 7) the fresh dispatch is host-bound: each torch op
costs ~20-40 us of host before its kernel can start, so the op count of a stage is what its host column
follows there. Here the host time is gloo's and the CPU kernels' as well (small shapes keep the kernels
short); the op counts are exact for the code paths the CPU shares with the GPU (the routing mask, the
one-rank node's packing, the counts). Not the same: the rail (NVSHMEM kernels on GPUs) and, with P > 1,
the reorder (the GPU reads the order off the nvlink backend's per-row sources: contract_order, one launch).

    python3 benchmarks/bench_internode_host.py --world 2 --ranks-per-node 1      # 2x1
    python3 benchmarks/bench_internode_host.py --world 4 --ranks-per-node 2      # 2x2
    EP_BENCH_ROOT=/path/to/other/tree python3 benchmarks/bench_internode_host.py  # that tree's code

"ops" counts every aten op dispatched (views included), "launches" the ops that are not views (a kernel
launch each on the GPU, or an allocation).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.environ.get("EP_BENCH_ROOT") or os.path.dirname(HERE)  # another tree's code (a before/after A/B)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

_VIEWS = {"view", "_unsafe_view", "slice", "select", "t", "alias", "expand", "as_strided", "unsqueeze",
          "squeeze", "reshape", "detach", "transpose", "permute", "_reshape_alias", "split", "unbind", "narrow",
          "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty"}


def _counting_timeline():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from ep_plugin.backends.hierarchical.timeline import StageTimeline

    class _Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    class CountingTimeline(StageTimeline):
        """Per call and stage, the aten ops dispatched (instead of times)."""

        def __init__(self):
            super().__init__()
            self.rows = []
            self._mode = None

        def begin(self, kind):
            self._mode = _Count()
            self._mode.__enter__()
            self._kind, self._seen, self._stages = kind, 0, {}

        def mark(self, stage):
            if self._mode is None:
                return
            ops = self._mode.ops[self._seen:]
            self._seen = len(self._mode.ops)
            launches = [o for o in ops if o not in _VIEWS]
            self._stages[stage] = {"ops": len(ops), "launches": len(launches), "names": launches}

        def end(self, stage):
            if self._mode is None:
                return
            self.mark(stage)
            self._mode.__exit__(None, None, None)
            self._mode = None
            self.rows.append({"kind": self._kind, "stages": self._stages})

    return CountingTimeline()


def body(rank, world, P, tokens, hidden, iters, out_dir):
    import torch

    from ep_plugin.backends.hierarchical.timeline import NO_TIMELINE, StageTimeline
    from tests._dist import write_rank_result
    from tests.reference import make_inputs
    from tests.test_hierarchical import E, K, hierarchical_buffer

    buf = hierarchical_buffer(hidden, P, max_tokens=tokens)
    be = buf._backend
    xs, idxs, ws = make_inputs(world, tokens, hidden, E, K, 3, torch.bfloat16)
    x, idx, w = xs[rank], idxs[rank], ws[rank]

    def calls():
        a = buf.dispatch(x, idx, w)
        buf.dispatch(x, handle=a.handle)
        buf.combine(a.x, a.handle)

    for _ in range(2):
        calls()
    ct = _counting_timeline()
    be.timeline = ct
    calls()
    tl = StageTimeline()
    be.timeline = tl
    for _ in range(iters):
        calls()
    be.timeline = NO_TIMELINE
    host = {}
    for call in tl.per_call():
        for st, (_, h) in call["stages"].items():
            host.setdefault(call["kind"], {}).setdefault(st, []).append(h)
    res = {}
    for row in ct.rows:
        kind = row["kind"]
        res[kind] = {st: dict(v, host_us=round(statistics.median(host[kind][st]), 1))
                     for st, v in row["stages"].items()}
    write_rank_result(out_dir, rank, res)
    buf.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--names", action="store_true", help="list the non-view ops of each stage")
    ap.add_argument("--json", default=None, help="write rank 0's rows here")
    a = ap.parse_args(argv)
    from tests._dist import read_rank_results, spawn

    with tempfile.TemporaryDirectory() as d:
        spawn(body, a.world, a.ranks_per_node, a.tokens, a.hidden, a.iters, d, timeout=600)
        r0 = read_rank_results(d, a.world)[0]
    print(f"{a.world // a.ranks_per_node}x{a.ranks_per_node} (torch parts, CPU), {a.tokens} tokens, hidden "
          f"{a.hidden}, rank 0: stage ops/launches (median host us over {a.iters})")
    for kind, stages in r0.items():
        cells = " | ".join(f"{st} {v['ops']}/{v['launches']} ({v['host_us']:.0f})" for st, v in stages.items())
        tot = sum(v["launches"] for v in stages.values())
        print(f"  {kind:16s} {cells} | launches {tot}")
        if a.names:
            for st, v in stages.items():
                print(f"      {st}: {' '.join(v['names'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r0, f, indent=1)


if __name__ == "__main__":
    main()
