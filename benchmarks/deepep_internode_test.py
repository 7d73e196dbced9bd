"""DeepEP v1.2.1's own tests/test_internode.py on ep_plugin.deep_ep, as virtual nodes of one host.

    python3 benchmarks/deepep_internode_test.py --tests .deepep/DeepEP/tests --nodes 2 --gpus-per-node 2

DeepEP's sources are not part of ep_plugin: `--tests` is a checkout of DeepEP's tests/ directory
(../shared/gpu/deepep_reference.sh prepare puts v1.2.1 under .deepep/DeepEP). This launcher starts
nodes x gpus-per-node processes and in each one:

- makes `import deep_ep` resolve to ep_plugin.deep_ep, with Buffer's ep_config defaulting to
  {comm: {backend: nvshmem, ranks_per_node: gpus-per-node, max_tokens_per_rank: num-tokens}} (the
  node environment: DeepEP reads its nodes from the job layout, ep_plugin from comm.ranks_per_node);
- replaces utils.init_dist, which DeepEP's own comment invites ("you may rewrite this function with
  your own cluster settings"): node n's local rank l is global rank n*P + l on GPU n*P + l of this
  host (DeepEP's uses GPU l of each node's host); everything else it does is kept (NCCL group,
  bf16 default dtype, cuda default device, the group of all ranks);
- runs test_internode.test_main(..., skip_benchmark=True) once, as test_loop does with one seed,
  then buffer.destroy().

Where the test file itself has to change (applied to its text at load, printed at start):
- test_main's `assert num_experts % num_ranks == 0 and num_local_ranks == 8` and test_loop's
  `assert num_local_ranks == 8 and num_ranks > 8`: DeepEP's internode kernels are written for 8 GPUs
  per node (NUM_MAX_NVL_PEERS); ep_plugin's take any comm.ranks_per_node, and the only host here has 4
  GPUs. The num_experts check is kept; the 8-GPU clauses are dropped (test_loop is not called).
- Not a change, but a choice: the tuning part (skip_benchmark=False) is not run. It times DeepEP's
  kernels by name with the profiler (bench_kineto asserts exactly one profiler row containing
  'dispatch' and one containing 'notify'); ep_plugin's calls are made of other kernels, so that part
  would fail on kernel names, not on results. bench_internode.py times ep_plugin's internode calls.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
import traceback
import types

PATCHES = (  # (DeepEP's text, what runs instead, why)
    ("assert num_experts % num_ranks == 0 and num_local_ranks == 8",
     "assert num_experts % num_ranks == 0",
     "8 GPUs per node is DeepEP's kernel layout, not the contract"),
    ("assert num_local_ranks == 8 and num_ranks > 8",
     "assert num_ranks > num_local_ranks",
     "as above; more than one node is what the test needs"),
)


def patched_source(path: str) -> str:
    text = open(path).read()
    for old, new, why in PATCHES:
        if old not in text:
            raise SystemExit(f"{path}: expected line not found (another DeepEP version?): {old!r}")
        text = text.replace(old, new)
    return text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deep_ep_module(ep_config: dict) -> types.ModuleType:
    """A `deep_ep` module: ep_plugin.deep_ep's names, with Buffer's ep_config defaulting to ep_config."""
    import ep_plugin.deep_ep as ours

    class Buffer(ours.Buffer):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("ep_config", ep_config)
            super().__init__(*args, **kwargs)

    mod = types.ModuleType("deep_ep")
    for name in dir(ours):
        if not name.startswith("__"):
            setattr(mod, name, getattr(ours, name))
    mod.Buffer = Buffer
    return mod


def _init_dist(nodes: int, per_node: int, port: int):
    """utils.init_dist for virtual nodes of this host (see the module docstring)."""
    import inspect

    import torch
    import torch.distributed as dist

    def init_dist(local_rank: int, num_local_ranks: int):
        node = int(os.environ["RANK"])
        rank = node * num_local_ranks + local_rank
        params = {"backend": "nccl", "init_method": f"tcp://127.0.0.1:{port}", "world_size": nodes * num_local_ranks,
                  "rank": rank}
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            params["device_id"] = torch.device(f"cuda:{rank}")
        torch.cuda.set_device(rank)
        dist.init_process_group(**params)
        torch.set_default_dtype(torch.bfloat16)
        torch.set_default_device("cuda")
        return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_local_ranks * nodes)))

    return init_dist


def worker(index: int, args, port: int, errq) -> None:
    try:
        node, local_rank = divmod(index, args.gpus_per_node)
        os.environ.update(WORLD_SIZE=str(args.nodes), RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        sys.path.insert(0, os.path.abspath(args.tests))
        ep_config = {"comm": {"backend": args.backend, "ranks_per_node": args.gpus_per_node,
                              "max_tokens_per_rank": args.num_tokens, "timeout_s": args.timeout_s}}
        sys.modules["deep_ep"] = _deep_ep_module(ep_config)
        import utils  # DeepEP's tests/utils.py

        utils.init_dist = _init_dist(args.nodes, args.gpus_per_node, port)
        path = os.path.join(args.tests, "test_internode.py")
        mod = types.ModuleType("test_internode")
        mod.__file__ = path
        sys.modules["test_internode"] = mod
        exec(compile(patched_source(path), path, "exec"), mod.__dict__)

        import torch.distributed as dist

        rank, num_ranks, group = utils.init_dist(local_rank, args.gpus_per_node)
        deep_ep = sys.modules["deep_ep"]
        num_sms = 24
        buffer = deep_ep.Buffer(group, int(2e9), int(1e9), low_latency_mode=False, num_qps_per_rank=num_sms,
                                explicitly_destroy=True)
        import torch

        torch.manual_seed(rank)
        test_args = argparse.Namespace(num_tokens=args.num_tokens, hidden=args.hidden, num_topk=args.num_topk,
                                       num_experts=args.num_experts, num_topk_groups=args.num_topk_groups,
                                       pressure_test_mode=0, test_ll_compatibility=False)
        mod.test_main(test_args, num_sms, local_rank, args.gpus_per_node, num_ranks, args.nodes, rank, buffer, group,
                      skip_benchmark=True)
        buffer.destroy()
        dist.barrier()
        if rank == 0:
            print("deepep_internode_test: DeepEP's test_main passed on every rank", flush=True)
        dist.destroy_process_group()
    except BaseException:
        errq.put((index, traceback.format_exc()))
        raise


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tests", required=True, help="DeepEP's tests/ directory (test_internode.py, utils.py, ...)")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--gpus-per-node", type=int, default=2)
    ap.add_argument("--num-tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--num-topk", type=int, default=8)
    ap.add_argument("--num-experts", type=int, default=256)
    ap.add_argument("--num-topk-groups", type=int, default=None, help="default: min(nodes, 4), as DeepEP's")
    ap.add_argument("--backend", default="nvshmem", help="comm.backend of the EPBuffers (default nvshmem)")
    ap.add_argument("--timeout-s", type=float, default=30.0, help="comm.timeout_s")
    ap.add_argument("--grace-s", type=float, default=20.0, help="after a rank failed, seconds before the rest are killed")
    ap.add_argument("--dry-run", action="store_true", help="check the arguments and the test file's patches only")
    args = ap.parse_args(argv)
    if args.num_topk_groups is None:
        args.num_topk_groups = min(args.nodes, 4)
    path = os.path.join(args.tests, "test_internode.py")
    for f in ("test_internode.py", "utils.py", "test_low_latency.py"):
        if not os.path.exists(os.path.join(args.tests, f)):
            print(f"deepep_internode_test: {os.path.join(args.tests, f)} is missing", flush=True)
            return 2
    patched_source(path)
    for old, new, why in PATCHES:
        print(f"deepep_internode_test: test_internode.py: {old!r} -> {new!r} ({why})", flush=True)
    if args.dry_run:
        return 0
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"),
                 ("NVSHMEM_SYMMETRIC_SIZE", str(4 << 30))):
        os.environ.setdefault(k, v)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    port = _free_port()
    world = args.nodes * args.gpus_per_node
    procs = [ctx.Process(target=worker, args=(i, args, port, errq)) for i in range(world)]
    for p in procs:
        p.start()
    import time

    failed_at = None
    while any(p.is_alive() for p in procs):  # a rank that failed leaves the others in a collective: stop them
        time.sleep(1.0)
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.time()
        if failed_at is not None and time.time() - failed_at > args.grace_s:
            for p in procs:
                if p.is_alive():
                    p.kill()
            break
    for p in procs:
        p.join(5)
    failed = False
    while not errq.empty():
        index, text = errq.get()
        print(f"--- process {index} (node {index // args.gpus_per_node}, local rank {index % args.gpus_per_node}):\n"
              f"{text}", flush=True)
        failed = True
    failed |= any(p.exitcode != 0 for p in procs)
    print(f"deepep_internode_test: {'FAILED' if failed else 'passed'} ({args.nodes} nodes x {args.gpus_per_node})",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
