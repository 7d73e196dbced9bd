#!/usr/bin/env python3
"""Pretrain a small GPT-MoE built from megatron.core, with its expert all-to-all run by ep_plugin.

    torchrun --nproc-per-node 2 examples/megatron/pretrain_gpt_moe.py --steps 50

Runs on CPU (gloo, ep_plugin's torch backend) or GPUs (NCCL; --device cuda, one GPU per rank).
Expert parallelism spans all ranks (EP = world size, TP = PP = 1); dense weights are data-parallel.

The model is megatron-core's GPTModel with the local (no TransformerEngine) layer spec: every layer
is MoE (SwiGLU routed experts, optional shared expert, router from the YAML's moe section). The one
line that switches the dispatcher is `moe_token_dispatcher_type="ep_plugin"`, set by
ep_plugin.megatron.config_from_yaml from the YAML (--dispatcher alltoall compares with megatron's own).

Data: with --data PREFIX, a Megatron indexed dataset (PREFIX.bin/.idx, e.g. from megatron's
preprocess_data.py); otherwise a byte-level corpus built locally, without any download, from the
license texts and Python standard-library sources on this machine (vocabulary: 256 bytes).

Every --log-every steps rank 0 prints one line: the loss, then the interval's stats line of
ep_plugin.telemetry (comm.stats is turned on): tokens/s, what the expert exchanges cost (time share
with the slowest rank, time per call, imbalance) and the bytes they sent per step to other ranks and
to itself, summed over the ranks, forward and backward:

    step   10  loss 4.0182  9,537 tokens/s, comm 45% (slowest rank 0: 45%), dispatch 6.38 ms, combine
    4.40 ms per call, max/mean rows per rank 1.09, per expert 2.22, timeouts 0, sent per step 1.12 MB
    remote + 1.10 MB local
"""
from __future__ import annotations

import argparse
import glob
import logging
import math
import os
import sys
import sysconfig
import time
import warnings

import torch
import torch.distributed as dist

import ep_plugin
from ep_plugin.config.validate import IntRange
from ep_plugin.telemetry import collect
from ep_plugin.testing.launch import (check_world_size, config_path, load_example_config, require_torchrun,
                                      stop)

# Known, harmless notices of megatron-core on a machine without TransformerEngine/Apex (it falls
# back to torch), printed once per rank: hidden so that the example's own lines stay readable.
warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex|Apex) (are|is) not installed",
                        category=UserWarning)
warnings.filterwarnings("ignore", message=r"absl\.logging is not installed", category=UserWarning)
warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)


class _DropKnownNotice(logging.Filter):
    """megatron-core logs a deprecation notice for GPTModel, which this example uses on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("GPTModel IS DEPRECATED")


logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(_DropKnownNotice())

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_YAML = os.path.join(HERE, "gpt_moe_tiny.yaml")

# The YAML's own sections, checked with ep_plugin's rules and messages (did-you-mean, allowed values).
_INT = ("int", "a positive int (>= 1)")
MODEL_RULES = {
    "num_layers": _INT, "hidden_size": _INT, "num_attention_heads": _INT, "ffn_hidden_size": _INT,
    "moe_ffn_hidden_size": _INT, "moe_shared_expert_intermediate_size": ("opt_int", "null or a positive int (>= 1)"),
    "moe_aux_loss_coeff": ("float0", "a float >= 0"), "seq_length": _INT, "vocab_size": _INT,
}
TRAIN_RULES = {
    "steps": _INT, "micro_batch_size": _INT, "lr": ("float", "a float > 0"),
    "weight_decay": ("float0", "a float >= 0"), "warmup_steps": ("int_range", IntRange(0)),
}


def transformer_config_fields() -> list:
    """The other keys `model` may hold: megatron's TransformerConfig fields (imported only when used)."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    return [f.name for f in dataclasses.fields(TransformerConfig)]


def load_yaml(path, overrides):
    """(EPConfig, model section, train section) of the example's YAML: one ConfigError for every
    problem of the file, ep_plugin's sections and the example's alike."""
    sections = {"model": (MODEL_RULES, transformer_config_fields, "megatron TransformerConfig fields"),
                "train": (TRAIN_RULES, (), "")}
    cfg, own = load_example_config(path, sections, overrides)
    return cfg, own["model"], own["train"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_YAML, help="YAML with model/train + ep_plugin sections")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: YAML train.steps)")
    p.add_argument("--micro-batch-size", type=int, default=None)
    p.add_argument("--seq-length", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--data", default=None, help="Megatron indexed dataset prefix (PREFIX.bin/.idx)")
    p.add_argument("--vocab-size", type=int, default=None, help="vocabulary of --data (default: max id + 1)")
    p.add_argument("--corpus-mb", type=float, default=4.0, help="size cap of the local byte corpus (MB)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="parameter/activation dtype (auto: bf16 on GPUs, fp32 on CPU)")
    p.add_argument("--dispatcher", default="ep_plugin", choices=["ep_plugin", "flex", "alltoall"],
                   help="ep_plugin (default), flex (flex + moe_flex_dispatcher_backend=ep_plugin), "
                        "or megatron's alltoall for comparison")
    p.add_argument("--backend", default=None, help="override comm.backend (auto|torch|nvlink|nvshmem)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar (the summary lines stay)")
    p.add_argument("--log-every", type=int, default=10, help="steps between summary lines")
    p.add_argument("--json", default=None, help="write per-step losses and throughput here (rank 0)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------ data

def local_corpus(max_bytes: int) -> bytes:
    """Real text that is on every machine: license texts and Python's own library sources."""
    paths = sorted(glob.glob("/usr/share/common-licenses/*"))
    stdlib = sysconfig.get_paths()["stdlib"]
    for sub in ("", "json", "email", "asyncio", "unittest", "concurrent/futures", "http", "xml/etree",
                "logging", "importlib", "collections", "urllib", "multiprocessing"):
        paths += sorted(glob.glob(os.path.join(stdlib, sub, "*.py")))
    chunks, total = [], 0
    for path in paths:
        if total >= max_bytes:
            break
        try:
            with open(path, "rb") as f:
                data = f.read(max_bytes - total)
        except OSError:
            continue
        if data:
            chunks.append(data)
            total += len(data)
    if total < 1 << 16:
        raise RuntimeError("found too little local text for a corpus; pass --data")
    return b"\n".join(chunks)


def load_tokens(args):
    if args.data:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        ds = IndexedDataset(args.data)
        parts, total = [], 0
        for i in range(len(ds)):
            arr = torch.from_numpy(ds[i].astype("int64"))
            parts.append(arr)
            total += arr.numel()
            if total >= 50_000_000:
                break
        tokens = torch.cat(parts)
        vocab = args.vocab_size or int(tokens.max()) + 1
        return tokens, vocab, f"indexed dataset {args.data} ({tokens.numel():,} tokens)"
    raw = local_corpus(int(args.corpus_mb * 2**20))
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    return tokens, 256, f"local byte corpus ({tokens.numel():,} bytes of license texts and stdlib sources)"


def get_batch(tokens, step, rank, mbs, seq, seed, device):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    starts = torch.randint(0, tokens.numel() - seq - 1, (mbs,), generator=g)
    rows = torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


# ----------------------------------------------------------------------------------------- model

def build_model(args, model_cfg, ep_fields, ep_cfg, world, device):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    import ep_plugin.megatron as epm

    use_bf16 = args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda")
    fields = dict(ep_fields)
    mc = dict(model_cfg)
    mc.pop("seq_length", None)
    mc.pop("vocab_size", None)
    if not mc.get("moe_aux_loss_coeff"):
        mc["moe_aux_loss_coeff"] = 0.0
        fields.setdefault("moe_router_load_balancing_type", "none")
    else:
        fields.setdefault("moe_router_load_balancing_type", "aux_loss")
    if args.dispatcher == "alltoall":
        fields["moe_token_dispatcher_type"] = "alltoall"
    elif args.dispatcher == "flex":
        fields["moe_token_dispatcher_type"] = "flex"
        fields["moe_flex_dispatcher_backend"] = "ep_plugin"
    kw = dict(
        expert_model_parallel_size=world,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        use_cpu_initialization=True,
        moe_router_dtype="fp32",
        bf16=use_bf16,
        params_dtype=torch.bfloat16 if use_bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if use_bf16 else torch.float32,
    )
    kw.update(mc)
    kw.update(fields)
    config = TransformerConfig(**kw)
    epm.attach_config(config, ep_cfg)  # the dispatchers' comm and overlap settings
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, normalization="RMSNorm")
    torch.manual_seed(args.seed)  # same dense weights on every rank; expert weights differ below
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab,
                     max_sequence_length=args.seq_length, position_embedding_type="rope")
    rank = dist.get_rank()
    with torch.no_grad():  # give each rank's experts their own initialisation
        g = torch.Generator().manual_seed(args.seed + 7919 * (rank + 1))
        for p in model.parameters():
            if not getattr(p, "allreduce", True):
                p.copy_(torch.randn(p.shape, generator=g) * p.float().std().clamp_min(1e-3))
    model = model.to(device)
    if use_bf16:
        model = model.bfloat16()
        for m in model.modules():  # router weights, expert bias and token counts stay fp32
            for buf in ("expert_bias", "local_tokens_per_expert"):
                if getattr(m, buf, None) is not None:
                    getattr(m, buf).data = getattr(m, buf).data.float()
            if m.__class__.__name__.endswith("Router") and hasattr(m, "weight"):
                m.weight.data = m.weight.data.float()
    return model, config


def sync_grads(model, world):
    """Data-parallel average of the dense gradients; expert gradients already hold every rank's
    tokens (dispatch's backward brings them home), so they are only scaled to the global mean."""
    dense = [p.grad for p in model.parameters() if p.grad is not None and getattr(p, "allreduce", True)]
    if dense:
        flat = torch.cat([g.reshape(-1).float() for g in dense])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for g in dense:
            n = g.numel()
            g.copy_(flat[off:off + n].view_as(g))
            off += n
    for p in model.parameters():
        if p.grad is not None and not getattr(p, "allreduce", True):
            p.grad /= world


# ------------------------------------------------------------------------------------------ main

def main(argv=None) -> dict:
    args = parse_args(argv)
    own_pg = not dist.is_initialized()
    # launch mistakes end here with one line each, before torch or megatron gets to raise
    path = config_path(args.config, script=__file__)
    # stats on, reported by this script (not by the integration's own log lines: interval null)
    overrides = {"comm.stats": True, "comm.stats_interval": None}
    if args.backend:
        overrides["comm.backend"] = args.backend
    try:
        ep_cfg, model_cfg, train_cfg = load_yaml(path, overrides)
    except ep_plugin.ConfigError as exc:
        stop(exc)
    require_torchrun(ep_cfg)
    check_world_size(ep_cfg)  # EP = world size: the experts must split evenly over the ranks

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if own_pg:
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if rank == 0:  # the imports and the model take ~10 s on 2 CPU cores: say so before they start
        print(f"pretrain_gpt_moe: {world} processes ({'NCCL' if use_cuda else 'gloo'}), config {path}; "
              f"loading megatron-core and building the model ...", flush=True)

    import ep_plugin.megatron as epm  # installs the dispatcher hooks
    if not use_cuda:
        from ep_plugin.testing import cpu_stand_ins

        cpu_stand_ins()  # megatron-core calls a few torch.cuda functions on its MoE path
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

    args.steps = args.steps if args.steps is not None else int(train_cfg.get("steps", 50))
    args.micro_batch_size = args.micro_batch_size or int(train_cfg.get("micro_batch_size", 4))
    args.seq_length = args.seq_length or int(model_cfg.get("seq_length", 64))
    args.lr = args.lr or float(train_cfg.get("lr", 3e-3))
    # the EPBuffer is sized once, by comm.max_tokens_per_rank: make room for one micro-batch
    tokens_per_rank = args.micro_batch_size * args.seq_length  # [S, B, H] per MoE layer (TP = 1)
    if ep_cfg.comm.max_tokens_per_rank < tokens_per_rank:
        ep_cfg = ep_plugin.load_config(ep_cfg, {"comm.max_tokens_per_rank": tokens_per_rank})
    ep_fields = epm.config_from_yaml(ep_cfg)

    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    if use_cuda:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(args.seed)

    tokens, args.vocab, corpus_desc = load_tokens(args)
    args.vocab = max(args.vocab, int(model_cfg.get("vocab_size", 0) or 0)) if not args.data else args.vocab
    model, config = build_model(args, model_cfg, ep_fields, ep_cfg, world, device)
    disp = model.decoder.layers[0].mlp.token_dispatcher
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=float(train_cfg.get("weight_decay", 0.0)))
    warmup = int(train_cfg.get("warmup_steps", 0))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, warmup)) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, args.steps))))))

    seq, mbs = args.seq_length, args.micro_batch_size
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), 1)[None, None]
    pos = torch.arange(seq, device=device)[None].expand(mbs, -1)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"GPT-MoE: {config.num_layers} layers, hidden {config.hidden_size}, "
              f"{config.num_moe_experts} experts top-{config.moe_router_topk}, {n_params:,} params on rank 0; "
              f"EP={world}, dispatcher={config.moe_token_dispatcher_type}"
              f"{'/' + config.moe_flex_dispatcher_backend if config.moe_token_dispatcher_type == 'flex' else ''} "
              f"({type(disp).__name__}), device={device.type}", flush=True)
        print(f"data: {corpus_desc}", flush=True)

    bar = None
    if rank == 0 and not args.no_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=args.steps, desc="pretrain", unit="step", dynamic_ncols=True, file=sys.stdout)
        except ImportError:
            bar = None

    model.train()
    losses, tok_rates = [], []
    t_start = t_log = time.perf_counter()
    say = bar.write if bar is not None else print
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, y = get_batch(tokens, step, rank, mbs, seq, args.seed, device)
        try:
            loss = model(x, pos, mask, labels=y).float().mean()
        except (ep_plugin.BackendUnavailableError, ep_plugin.ConfigError) as exc:
            stop(exc, rank)  # the first forward builds the EPBuffer: a backend that cannot run stops here
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sync_grads(model, world)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # per rank: experts differ anyway
        opt.step()
        sched.step()
        if config.moe_router_enable_expert_bias:
            _update_router_expert_bias([model], config)
        stats = torch.stack([loss.detach().float(), torch.tensor(float(x.numel()), device=device)])
        dist.all_reduce(stats)
        if use_cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        gloss = stats[0].item() / world
        rate = stats[1].item() / dt
        losses.append(gloss)
        tok_rates.append(rate)
        if rank == 0 and bar is not None:
            bar.set_postfix(loss=f"{gloss:.3f}", tok_s=f"{rate:,.0f}")
            bar.update(1)
        if (step + 1) % args.log_every == 0 or step == args.steps - 1:
            done = step % args.log_every + 1
            # collective: every rank, the same steps; bytes per step over the interval's `done` steps
            report = collect(epm.cached_buffers(), tokens=done * x.numel(), wall_s=time.perf_counter() - t_log,
                             steps=(step + 2 - done, step + 1))
            if rank == 0:
                say(f"step {step + 1:4d}  loss {gloss:.4f}  {report.text()}")
            t_log = time.perf_counter()
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t_start
    result = {
        "steps": args.steps, "world": world, "device": device.type,
        "dispatcher": config.moe_token_dispatcher_type,
        "backend": getattr(getattr(disp, "buffer", None), "backend_name", None),
        "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
        "losses": losses,
        "tokens_per_s": (sum(tok_rates[1:]) / max(1, len(tok_rates) - 1)) if len(tok_rates) > 1 else (tok_rates or [0])[0],
        "elapsed_s": elapsed,
    }
    if rank == 0:
        k = min(5, len(losses))
        print(f"done: {args.steps} steps in {elapsed:.1f}s, loss {sum(losses[:k]) / max(1, k):.3f} (first {k}) -> "
              f"{sum(losses[-k:]) / max(1, k):.3f} (last {k}), {result['tokens_per_s']:,.0f} tokens/s "
              f"(all ranks), comm backend: {result['backend']}", flush=True)
        if args.json:
            import json

            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    parallel_state.destroy_model_parallel()
    if own_pg:
        dist.barrier()  # no rank tears the group down while a peer still uses it (gloo aborts then)
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
