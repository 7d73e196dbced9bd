#!/usr/bin/env python3
"""DeepSpeed AutoEP: one DeepSeek-V3-like MoE layer, forward + backward, with AutoEP's collective
all-to-all (``"comm_backend": "comm"``) against ep_plugin (``"comm_backend": "ep_plugin"``), in one run.

    torchrun --nproc-per-node 2 benchmarks/bench_autoep.py                      # GPUs: shape "small"
    torchrun --nproc-per-node 2 benchmarks/bench_autoep.py --shape small,v3     # + hidden 7168, 256 experts
    torchrun --nproc-per-node 2 benchmarks/bench_autoep.py --cpu --tiny         # CPU smoke test (gloo)

The layer is what AutoEP builds from a Hugging Face DeepSeek-V3 model (random weights, one decoder
layer, nothing downloaded): DeepSpeed's router (sigmoid, group-limited top-k, scaling 2.5), grouped
SwiGLU experts (torch grouped_mm on GPUs), one shared expert. Every variant builds the same weights
(same seed) through ``deepspeed.initialize``; only the exchange differs. Shapes (tokens per rank):

  tiny   hidden   64,   8 experts, top-4, 4 groups / 2, expert ffn   32,   64 tokens (CPU)
  small  hidden 2048,  64 experts, top-8, 8 groups / 4, expert ffn 1024, 4096 tokens
  v3     hidden 7168, 256 experts, top-8, 8 groups / 4, expert ffn 2048, 4096 tokens (DeepSeek-V3)

Variants (--variants): ``comm`` (AutoEP's all-to-all over NCCL/gloo), ``ep_plugin:<backend>``
(``nvlink``, ``torch``, ``auto``). Per variant, after --warmup steps, over --iters steps (CUDA
events on GPUs, host timers on CPU; medians, then the slowest rank):

  step_ms      the layer's forward + backward (router, exchange, experts, shared expert)
  exchange_ms  the exchanges inside that step, forward and backward. comm: every
               all_to_all_single AutoEP makes (split counts and the expanded rows, one per
               (token, expert)); ep_plugin: the exchange's calls (EPBuffer dispatch/combine plus the
               expert grouping of their rows, as DeepEP does it in-kernel)
  epbuffer_ms  ep_plugin only: the EPBuffer dispatch/combine calls alone
  max_diff     forward output against the first variant's on the same input (relative to its
               largest value): the weights and routing are the same, so BF16 noise only

Prints a table; rank 0 writes JSON (--out, default $OUT/bench_autoep.json, merged by shape) with the
device, date, git commit (EP_COMMIT or git rev-parse), torch / deepspeed / transformers versions.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPES = {
    "tiny": dict(hidden=64, experts=8, topk=4, groups=4, group_topk=2, ffn=32, tokens=64),
    "small": dict(hidden=2048, experts=64, topk=8, groups=8, group_topk=4, ffn=1024, tokens=4096),
    "v3": dict(hidden=7168, experts=256, topk=8, groups=8, group_topk=4, ffn=2048, tokens=4096),
}
OVERRIDES = ("hidden", "experts", "topk", "groups", "group_topk", "ffn", "tokens")


class _DropKnownNotices(logging.Filter):
    """DeepSpeed notices that say nothing here (the HF config's own routed_scaling_factor, the CPU
    accelerator)."""

    KNOWN = ("AutoEP: model.config.routed_scaling_factor", "Setting accelerator to CPU")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.KNOWN)


logging.getLogger("DeepSpeed").addFilter(_DropKnownNotices())


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="", help=f"comma-separated, from {', '.join(SHAPES)} (default: small; "
                                                  "--tiny: tiny)")
    for name in OVERRIDES:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"override the shape's {name}")
    p.add_argument("--variants", default="", help="comma-separated: comm, ep_plugin:<backend> (default: GPUs "
                                                  "comm,ep_plugin:nvlink,ep_plugin:torch; CPU comm,ep_plugin:torch)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="auto: bf16 on GPUs, fp32 on CPU")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even when GPUs are present")
    p.add_argument("--tiny", action="store_true", help="shape tiny, 3 iterations after 1 warm-up (smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT") or "/tmp/ep_out", "bench_autoep.json"))
    a = p.parse_args(argv)
    if a.tiny:
        a.shape = a.shape or "tiny"
        a.iters, a.warmup = min(a.iters, 3), min(a.warmup, 1)
    a.shape = [s for s in (a.shape or "small").split(",") if s]
    for s in a.shape:
        if s not in SHAPES:
            p.error(f"unknown --shape {s!r}; choose from {', '.join(SHAPES)}")
    return a


# ------------------------------------------------------------------------------------------ timing

class Clock:
    """Marks on the current CUDA stream (or host timers) around the exchange calls of one step."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.on = False
        self.marks = []  # (key, start, end)

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else 1e3 * (end - start)

    def wrap(self, fn, key):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = self.mark()
            try:
                return fn(*args, **kwargs)
            finally:
                self.marks.append((key, start, self.mark()))
        timed.__wrapped__ = fn
        return timed

    def take(self) -> dict:
        """ms per key of the marks since the last take (call after a synchronize)."""
        out = {}
        for key, start, end in self.marks:
            out[key] = out.get(key, 0.0) + self.ms(start, end)
        self.marks = []
        return out


class _TimedComm:
    """deepspeed.comm as auto_ep_layer sees it, with all_to_all_single timed."""

    def __init__(self, inner, clock):
        self._inner = inner
        self.all_to_all_single = clock.wrap(inner.all_to_all_single, "exchange")

    def __getattr__(self, name):
        return getattr(self._inner, name)


def instrument(clock):
    """Time AutoEP's all-to-alls, the ep_plugin exchange's calls and EPBuffer's calls. Returns undo."""
    from deepspeed.module_inject import auto_ep_layer

    from ep_plugin.buffer import EPBuffer
    from ep_plugin.integrations.deepspeed.autoep_exchange import EPPluginExchange

    undo = [(auto_ep_layer, "dist", auto_ep_layer.dist)]
    auto_ep_layer.dist = _TimedComm(auto_ep_layer.dist, clock)
    for name in ("dispatch", "replay_dispatch", "dispatch_with_handle", "combine", "combine_with_weight_grad"):
        undo.append((EPPluginExchange, name, EPPluginExchange.__dict__[name]))
        setattr(EPPluginExchange, name, clock.wrap(EPPluginExchange.__dict__[name], "exchange"))
    for name in ("dispatch", "combine"):
        undo.append((EPBuffer, name, EPBuffer.__dict__[name]))
        setattr(EPBuffer, name, clock.wrap(EPBuffer.__dict__[name], "epbuffer"))

    def restore():
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)
    return restore


# ---------------------------------------------------------------------------------------- building

def hf_model(shape, device, dtype, seed):
    """A one-layer DeepSeek-V3 causal LM (every layer MoE) with random weights, the same on every rank."""
    import transformers as tf

    cfg = tf.DeepseekV3Config(
        vocab_size=256, hidden_size=shape["hidden"], num_hidden_layers=1, first_k_dense_replace=0,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=32, max_position_embeddings=64, intermediate_size=2 * shape["ffn"],
        moe_intermediate_size=shape["ffn"], n_routed_experts=shape["experts"], n_shared_experts=1,
        num_experts_per_tok=shape["topk"], n_group=shape["groups"], topk_group=shape["group_topk"],
        routed_scaling_factor=2.5)
    torch.manual_seed(seed)
    with torch.device(device):  # built in place: the full expert weights of "v3" are 22 GB in BF16
        try:
            return tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        except TypeError:  # transformers < 4.56
            return tf.AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)


def ds_config(variant, world, shape, cuda):
    name, _, backend = variant.partition(":")
    ep = {"enabled": True, "autoep_size": world, "comm_backend": name, "use_grouped_mm": cuda}
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "expert_parallel": ep}
    if name == "ep_plugin":
        ep["comm_max_tokens_per_rank"] = shape["tokens"]
        cfg["ep_plugin"] = {"enabled": True, "config": {"comm": {"backend": backend or "auto",
                                                                 "max_tokens_per_rank": shape["tokens"]}}}
    return cfg


def _slowest(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def run_variant(variant, shape, a, clock, device, dtype, reference):
    import deepspeed
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    import ep_plugin.deepspeed as epds

    cuda = device.type == "cuda"
    world, rank = dist.get_world_size(), dist.get_rank()
    model = hf_model(shape, device, dtype, a.seed)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(variant, world, shape, cuda))
    layers = [m for m in engine.module.modules() if isinstance(m, AutoEPMoELayer)]
    assert len(layers) == 1, f"expected one AutoEP layer, found {len(layers)}"
    layer = layers[0]
    is_ours = isinstance(layer, epds.EPPluginAutoEPLayer)
    if variant.startswith("ep_plugin") != is_ours:
        raise RuntimeError(f"{variant}: AutoEP built {type(layer).__name__}")

    T, H = shape["tokens"], shape["hidden"]
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(1, T, H, generator=g).to(device, dtype)
    gy = (torch.randn(1, T, H, generator=g) * 1e-2).to(device, dtype)

    def out_of(y):
        return y[0] if isinstance(y, tuple) else y

    with torch.no_grad():
        y0 = out_of(layer(x)).float()
    diff = None
    if reference is None:
        reference = y0
    else:
        scale = reference.abs().max().clamp_min(1e-6)
        diff = _slowest(((y0 - reference).abs().max() / scale).item(), device)

    def step():
        xx = x.detach().requires_grad_(True)
        out_of(layer(xx)).backward(gy)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    steps, exch, ebuf = [], [], []
    for i in range(a.warmup + a.iters):
        layer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        timed = i >= a.warmup
        clock.on = timed
        clock.marks = []
        t0 = clock.mark()
        step()
        t1 = clock.mark()
        if cuda:
            torch.cuda.synchronize()
        clock.on = False
        parts = clock.take()
        if timed:
            steps.append(clock.ms(t0, t1))
            exch.append(parts.get("exchange", 0.0))
            ebuf.append(parts.get("epbuffer", 0.0))
    backend = layer._deepep_exchange.buffer.backend_name if is_ours and layer._deepep_exchange else None
    row = {
        "variant": variant, "exchange_backend": backend or ("nccl" if cuda else "gloo"),
        "step_ms": _slowest(statistics.median(steps), device),
        "exchange_ms": _slowest(statistics.median(exch), device),
        "epbuffer_ms": _slowest(statistics.median(ebuf), device) if is_ours else None,
        "step_ms_min": _slowest(min(steps), device),
        "max_diff": diff,
        "peak_mem_gib": _slowest(torch.cuda.max_memory_allocated(device) / 2**30, device) if cuda else None,
    }
    row["exchange_share"] = row["exchange_ms"] / row["step_ms"] if row["step_ms"] > 0 else None
    engine.destroy()  # releases the AutoEP exchanges
    epds.release_buffers()  # closes the EPBuffers (collective)
    del engine, model, layer, layers
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row, reference


# --------------------------------------------------------------------------------------- reporting

def commit() -> dict:
    sha = os.environ.get("EP_COMMIT")
    dirty = None
    try:
        if not sha:
            sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                 timeout=10).stdout.strip() or None
        st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                            text=True, timeout=10)
        dirty = bool(st.stdout.strip()) if st.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"commit": sha or "unknown", "dirty": dirty}


def describe(shape) -> str:
    return (f"hidden {shape['hidden']}, {shape['experts']} experts top-{shape['topk']} "
            f"({shape['groups']} groups / {shape['group_topk']}), expert ffn {shape['ffn']} + 1 shared, "
            f"{shape['tokens']} tokens/rank")


def print_table(name, shape, rows, head):
    print(f"\nAutoEP MoE layer [{name}: {describe(shape)}, {head}]", flush=True)
    print(f"{'variant':20} {'backend':8} {'step fwd+bwd':>13} {'exchange':>10} {'share':>6} {'EPBuffer':>10} "
          f"{'max|diff|':>10} {'peak GiB':>9}")
    ok = [r for r in rows if "error" not in r]
    base = rows[0]["step_ms"] if rows and "error" not in rows[0] else None
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:20} FAILED: {r['error'][:200]}", flush=True)
            continue
        eb = "-" if r["epbuffer_ms"] is None else f"{r['epbuffer_ms']:.3f} ms"
        d = "ref" if r["max_diff"] is None else f"{r['max_diff']:.1e}"
        mem = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}"
        speed = f"  x{base / r['step_ms']:.2f}" if base and r is not ok[0] and r["step_ms"] > 0 else ""
        print(f"{r['variant']:20} {r['exchange_backend']:8} {r['step_ms']:10.3f} ms {r['exchange_ms']:7.3f} ms "
              f"{100 * (r['exchange_share'] or 0):5.0f}% {eb:>10} {d:>10} {mem:>9}{speed}", flush=True)


def main(argv=None):
    a = parse_args(argv)
    cuda = torch.cuda.is_available() and not a.cpu
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
    import deepspeed
    import transformers

    from ep_plugin.testing import deepspeed_without_shm_op

    deepspeed_without_shm_op()  # without CUDA: no CPU all-reduce op compiled (~2 minutes), none used
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    import ep_plugin.deepspeed  # noqa: F401  (installs the AutoEP hook)

    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(a.dtype, torch.bfloat16 if cuda else torch.float32)
    variants = [v for v in (a.variants or ("comm,ep_plugin:nvlink,ep_plugin:torch" if cuda else
                                           "comm,ep_plugin:torch")).split(",") if v]
    for v in variants:
        if v != "comm" and not v.startswith("ep_plugin"):
            raise SystemExit(f"unknown variant {v!r}: comm or ep_plugin:<backend>")
    dev_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    meta = {"device": dev_name, "world": world, "date": datetime.datetime.now(datetime.timezone.utc)
            .isoformat(timespec="seconds"), **commit(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__, "dtype": str(dtype).replace("torch.", ""),
            "iters": a.iters, "warmup": a.warmup, "timer": "cuda_events" if cuda else "host"}
    if rank == 0:
        print(f"bench_autoep: EP{world} on {dev_name}, {meta['dtype']}, commit {meta['commit']}"
              f"{' (dirty)' if meta['dirty'] else ''}, torch {torch.__version__}, deepspeed {deepspeed.__version__}, "
              f"variants {', '.join(variants)}; medians of {a.iters} steps after {a.warmup}, slowest rank",
              flush=True)
    data = {}
    if rank == 0 and os.path.exists(a.out):
        try:
            with open(a.out) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = {}
    clock = Clock(cuda)
    restore = instrument(clock)
    failures = 0
    try:
        for name in a.shape:
            shape = dict(SHAPES[name])
            for k in OVERRIDES:
                if getattr(a, k) is not None:
                    shape[k] = getattr(a, k)
            if shape["experts"] % world:
                raise SystemExit(f"{shape['experts']} experts do not split over {world} ranks")
            rows, reference = [], None
            for v in variants:
                try:
                    row, reference = run_variant(v, shape, a, clock, device, dtype, reference)
                    error = None
                except Exception as exc:  # noqa: BLE001  (a variant that cannot run: the others still do)
                    clock.on = False
                    error = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
                # every rank learns whether one failed (a failure inside a collective hangs instead:
                # the caller's timeout ends it, and the JSON keeps the variants before it)
                failed = torch.tensor([0.0 if error is None else 1.0], device=device)
                dist.all_reduce(failed, op=dist.ReduceOp.MAX)
                if failed.item():
                    row = {"variant": v, "error": error or "failed on another rank"}
                    with contextlib.suppress(Exception):
                        import ep_plugin.deepspeed as epds
                        epds.release_buffers()
                    gc.collect()
                rows.append(row)
                failures += "error" in row
                if rank == 0:
                    print(f"  {name} {v}: " + (f"step {row['step_ms']:.3f} ms, exchange {row['exchange_ms']:.3f} ms"
                                               if "error" not in row else f"FAILED: {row['error'][:300]}"), flush=True)
                    data.update(meta)
                    data.setdefault("shapes", {})[name] = {**shape, "date": meta["date"], "commit": meta["commit"],
                                                           "results": rows}
                    os.makedirs(os.path.dirname(os.path.abspath(a.out)) or ".", exist_ok=True)
                    with open(a.out, "w") as f:  # after each variant: a later failure keeps these rows
                        json.dump(data, f, indent=1)
            del reference
            if rank == 0:
                print_table(name, shape, rows, f"EP{world}, {meta['dtype']}, {dev_name}")
                print(f"wrote {a.out}", flush=True)
    finally:
        restore()
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0  # a variant that failed shows in the exit status too


if __name__ == "__main__":
    sys.exit(main())
