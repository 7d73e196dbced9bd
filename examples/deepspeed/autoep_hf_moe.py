"""Pretrain a Hugging Face MoE model with DeepSpeed AutoEP, its expert all-to-all through ep_plugin.

No model code changes: AutoEP finds the MoE blocks of the HF model and makes them expert-parallel;
``"comm_backend": "ep_plugin"`` in the ``expert_parallel`` section (after ``import ep_plugin.deepspeed``)
moves their tokens with EPBuffer instead of NCCL all-to-all or DeepEP.

    "expert_parallel": {"enabled": true, "autoep_size": <EP>, "comm_backend": "ep_plugin",
                        "comm_max_tokens_per_rank": <micro batch x sequence>},
    "ep_plugin": {"enabled": true, "config": "ep_plugin.yaml"}      # backend, SMs, timeouts

CPU (gloo, 2 processes; the torch backend):
    torchrun --nproc-per-node 2 examples/deepspeed/autoep_hf_moe.py --steps 40
GPUs (NCCL, one process per GPU; nvlink backend inside a node, BF16):
    torchrun --nproc-per-node 2 examples/deepspeed/autoep_hf_moe.py --preset deepseek_v3 --hidden 1024 \\
        --layers 4 --experts 16 --seq-len 1024 --micro-batch 4 --steps 100
Other models: --preset mixtral | qwen3_moe | deepseek_v2 | deepseek_v3 (tiny, random weights), or
--hf-config DIR_OR_JSON for any AutoEP-supported HF config (random weights, nothing downloaded).
DeepSpeed's own collective path, for comparison: --comm-backend comm.

Data: synthetic arithmetic sequences x_t = (a + d*t) mod vocab, a random start a and step d per
sequence; the next token needs the previous two, so the loss falls from log(vocab) as the model learns.

Output: a tqdm bar (--no-progress: none), a line every --log-every steps with the loss and tokens/s;
with --stats (comm.stats on, comm.stats_interval = --log-every; ep_plugin only) the AutoEP layers
themselves report every interval, through DeepSpeed's monitor when one is enabled, else through the
"ep_plugin.deepspeed" logger, which this script prints with its own lines (CPU, 2 processes):

    ep_plugin stats [torch, EP2] steps 1-10: 3,821 tokens/s, comm 47% (slowest rank 1: 50%), dispatch
    4.88 ms, combine 2.91 ms per call, max/mean rows per rank 1.03, per expert 1.35, timeouts 0, sent
    per step 425 KB remote + 417 KB local

(what the exchanges cost: time share with the slowest rank, time per call, imbalance, bytes sent per
step to other ranks and to itself, summed over the ranks, forward and backward).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import sys
import time

import torch

import deepspeed
from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

import ep_plugin.deepspeed as epds
from ep_plugin.testing import deepspeed_without_shm_op
from ep_plugin.testing.launch import config_path, require_torchrun, stop

HERE = os.path.dirname(os.path.abspath(__file__))


def tiny_config(preset: str, a):
    """A small HF config of one AutoEP preset family (``a``: the parsed arguments)."""
    import transformers as tf

    common = dict(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
                  num_attention_heads=a.heads, max_position_embeddings=max(a.seq_len, 64))
    ffn = a.ffn or 2 * a.hidden
    if preset == "mixtral":
        return tf.MixtralConfig(intermediate_size=ffn, num_key_value_heads=a.heads, num_local_experts=a.experts,
                                num_experts_per_tok=a.topk, **common)
    if preset == "qwen3_moe":
        return tf.Qwen3MoeConfig(intermediate_size=ffn, moe_intermediate_size=ffn, num_key_value_heads=a.heads,
                                 num_experts=a.experts, num_experts_per_tok=a.topk, norm_topk_prob=True, **common)
    # DeepSeek: multi-head latent attention, one shared expert, the first layer dense
    mla = dict(q_lora_rank=a.hidden // 2, kv_lora_rank=a.hidden // 2, qk_rope_head_dim=8, qk_nope_head_dim=8,
               v_head_dim=16, num_key_value_heads=a.heads, first_k_dense_replace=1, n_shared_experts=1,
               n_routed_experts=a.experts, moe_intermediate_size=ffn, intermediate_size=2 * ffn)
    if preset == "deepseek_v2":
        return tf.DeepseekV2Config(num_experts_per_tok=a.topk, **mla, **common)
    if preset == "deepseek_v3":  # sigmoid scores, group-limited top-k: best topk_group of n_group groups
        return tf.DeepseekV3Config(num_experts_per_tok=a.topk, n_group=a.groups, topk_group=a.group_topk,
                                   routed_scaling_factor=2.5, **mla, **common)
    raise SystemExit(f"unknown --preset {preset!r}; choose from {', '.join(PRESETS)}")


PRESETS = ("mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3")


def build_model(a):
    import transformers as tf

    if a.hf_config:
        cfg = tf.AutoConfig.from_pretrained(a.hf_config)  # a local directory or config.json
        a.vocab = cfg.vocab_size
    else:
        cfg = tiny_config(a.preset, a)
    torch.manual_seed(a.seed)  # the same random weights on every rank
    return tf.AutoModelForCausalLM.from_config(cfg)


def ds_config(a, world: int, cuda: bool):
    """The DeepSpeed config: AutoEP over all ranks (or --ep-size), the ep_plugin transport."""
    ep = {"enabled": True, "autoep_size": a.ep_size or world, "comm_backend": a.comm_backend,
          # CPU has no grouped GEMM fast path: AutoEP's per-expert loop
          "use_grouped_mm": cuda}
    cfg = {"train_micro_batch_size_per_gpu": a.micro_batch, "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0, "steps_per_print": 10**9, "expert_parallel": ep,
           "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "weight_decay": 0.0, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": a.lr,
                                                        "warmup_num_steps": max(1, a.steps // 10)}}}
    if cuda and not a.fp32:
        cfg["bf16"] = {"enabled": True}
    if a.comm_backend == "ep_plugin":
        # the exchange's capacity: every token of one micro batch on one rank
        ep["comm_max_tokens_per_rank"] = a.micro_batch * a.seq_len
        cfg["ep_plugin"] = {"enabled": True, "config": a.ep_config}
        overrides = {}
        if a.ep_backend:
            overrides["comm.backend"] = a.ep_backend
        if a.stats:  # the AutoEP layers report every --log-every steps (see print_reports)
            overrides.update({"comm.stats": True, "comm.stats_interval": a.log_every})
        if overrides:
            cfg["ep_plugin"]["overrides"] = overrides
    return cfg


class _Say(logging.Handler):
    """Prints the records of the "ep_plugin.deepspeed" logger -- the AutoEP layers' stats lines among
    them -- with this script's lines (through the tqdm bar's write when there is one)."""

    def __init__(self, say):
        super().__init__(logging.INFO)
        self.say = say

    def emit(self, record: logging.LogRecord) -> None:
        self.say(record.getMessage())


def print_reports(say) -> None:
    """Print the AutoEP layers' comm.stats reports (made by rank 0 every comm.stats_interval steps)
    here rather than on stderr, where ep_plugin's logging would print them otherwise."""
    log = logging.getLogger("ep_plugin.deepspeed")
    log.addHandler(_Say(say))
    log.propagate = False
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)


def batch(gen, n, seq_len, vocab, device):
    start = torch.randint(0, vocab, (n, 1), generator=gen)
    step = torch.randint(1, 5, (n, 1), generator=gen)
    return ((start + step * torch.arange(seq_len)) % vocab).to(device)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mixtral", choices=PRESETS, help="tiny model family (default mixtral)")
    p.add_argument("--hf-config", default="", help="an HF config (directory or JSON) instead of --preset")
    p.add_argument("--comm-backend", default="ep_plugin", choices=("ep_plugin", "comm"),
                   help="AutoEP's expert all-to-all: ep_plugin, or DeepSpeed's collective path")
    p.add_argument("--ep-config", default=os.path.join(HERE, "ep_plugin.yaml"), help="ep_plugin YAML")
    p.add_argument("--ep-backend", default="", help="override comm.backend (auto | torch | nvlink | nvshmem)")
    p.add_argument("--ep-size", type=int, default=0, help="AutoEP size (default: world size)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=0, help="expert FFN width (default 2*hidden)")
    p.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer")
    p.add_argument("--topk", type=int, default=0, help="experts per token (default 2; deepseek_v3: 4)")
    p.add_argument("--groups", type=int, default=4, help="deepseek_v3: expert groups (n_group)")
    p.add_argument("--group-topk", type=int, default=2, help="deepseek_v3: groups kept per token (topk_group)")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--fp32", action="store_true", help="on GPUs: float32 instead of BF16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write the loss curve and tokens/s here (rank 0)")
    p.add_argument("--log-every", type=int, default=10, help="steps between summary lines")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar (the summary lines stay)")
    p.add_argument("--stats", action="store_true",
                   help="comm.stats on: the AutoEP layers print what the exchanges cost every --log-every "
                        "steps (ep_plugin only)")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    a = p.parse_args()
    a.topk = a.topk or (4 if a.preset == "deepseek_v3" else 2)
    return a


def main():
    a = parse_args()
    # launch mistakes end here with one line each, before DeepSpeed or torch gets to raise
    a.ep_config = config_path(a.ep_config, script=__file__)
    require_torchrun()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ep = a.ep_size or world
    if world % ep or a.experts % ep:
        ok = [n for n in range(1, a.experts + 1) if a.experts % n == 0]
        stop(f"--experts {a.experts} over an AutoEP size of {ep} on {world} processes: the experts must split "
             f"evenly over the AutoEP size, which must divide the processes; start it with torchrun "
             f"--nproc-per-node N for N in {ok} (or pass --ep-size)")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(a.local_rank)
    else:  # DeepSpeed would compile a CPU all-reduce op (~2 minutes) that no MoE training uses
        deepspeed_without_shm_op()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = torch.device("cuda", a.local_rank) if cuda else torch.device("cpu")

    model = build_model(a)
    config = ds_config(a, world, cuda)
    # deepspeed.initialize works the same once ep_plugin.deepspeed is imported
    engine, _, _, _ = epds.initialize(model=model, model_parameters=model.parameters(), config=config)
    layers = [m for m in engine.module.modules() if isinstance(m, AutoEPMoELayer)]
    ours = [m for m in layers if isinstance(m, epds.EPPluginAutoEPLayer)]

    gen = torch.Generator().manual_seed(a.seed * 1000 + rank)
    tokens_per_step = a.micro_batch * a.seq_len * world
    bar = None
    if rank == 0:
        name = a.hf_config or a.preset
        path = f"ep_plugin ({len(ours)} layers)" if ours else "DeepSpeed collective all-to-all"
        print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters on rank 0, "
              f"{len(layers)} AutoEP MoE layers, world {world}, "
              f"autoep_size {config['expert_parallel']['autoep_size']}, "
              f"{'bf16' if 'bf16' in config else 'float32'}; expert all-to-all: {path}", flush=True)
        if not a.no_progress:
            from tqdm import tqdm
            bar = tqdm(total=a.steps, desc="pretrain", dynamic_ncols=True, file=sys.stdout)
    say = bar.write if bar is not None else print
    if a.stats and ours and rank == 0:
        print_reports(say)
    losses, t0, t_start, tok_s = [], None, time.perf_counter(), float("nan")
    for step in range(a.steps):
        if step == 2:  # warm-up steps (buffer builds, allocator) stay out of the throughput
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        ids = batch(gen, a.micro_batch, a.seq_len, a.vocab, device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        loss = loss.detach().float().clone()
        torch.distributed.all_reduce(loss)
        losses.append(loss.item() / world)
        if t0 is not None and step > 2:
            tok_s = tokens_per_step * (step - 2) / (time.perf_counter() - t0)
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tok_s:,.0f}")
            bar.update(1)
        if rank == 0 and ((step + 1) % a.log_every == 0 or step == a.steps - 1):
            line = f"step {step + 1:4d}  loss {losses[-1]:.4f}"
            if tok_s == tok_s:  # not NaN: past the warm-up steps
                line += f"  {tok_s:,.0f} tokens/s"
            say(line)
    backend = ours[0]._deepep_exchange.buffer.backend_name if ours and ours[0]._deepep_exchange else None
    if bar is not None:
        bar.close()
    if rank == 0:
        first, last = sum(losses[:5]) / min(5, len(losses)), sum(losses[-5:]) / min(5, len(losses))
        print(f"loss {first:.3f} -> {last:.3f} (log vocab = {math.log(a.vocab):.3f}); {tok_s:,.0f} tokens/s; "
              f"ep_plugin backend: {backend}; {time.perf_counter() - t_start:.1f} s", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"comm_backend": a.comm_backend, "ep_plugin_layers": len(ours), "backend": backend,
                           "world": world, "losses": losses, "tokens_per_s": tok_s, "args": vars(a)}, f, indent=1)
    engine.destroy()  # releases the AutoEP exchanges (DeepSpeed's destroy_exchanges)
    epds.release_buffers()  # closes the EPBuffers (collective)
    torch.distributed.barrier()
    # Every process group goes before the interpreter does: gloo's threads, left to interpreter exit,
    # can abort the process after a good run ("terminate called without an active exception").
    # DeepSpeed's own destroy also drops the groups its module globals hold (expert/data parallel).
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main()
    gc.collect()  # groups that reference cycles (DeepSpeed's engine, the model) still hold go now, not at exit
