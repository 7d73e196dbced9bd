"""Train a small MoE transformer with DeepSpeed, its MoE layers running through ep_plugin.

The only changes from a plain DeepSpeed MoE script are the ``"ep_plugin"`` section of
ds_config.json and the call ``ep_plugin.deepspeed.initialize`` in place of ``deepspeed.initialize``.

CPU (gloo, 2 processes):
    torchrun --nproc-per-node 2 examples/deepspeed/train_moe_ds.py --steps 60
GPUs (NCCL, one process per GPU):
    torchrun --nproc-per-node 4 examples/deepspeed/train_moe_ds.py --steps 200 --hidden 512 --seq-len 256
DeepSpeed's own all-to-all, for comparison:  add --no-ep-plugin
The deepspeed launcher works too: deepspeed --num_gpus 4 examples/deepspeed/train_moe_ds.py ...

Data: synthetic arithmetic sequences x_t = (a + d*t) mod vocab with a random start a and step d
per sequence; predicting the next token needs the previous two, so the loss falls from
log(vocab) towards 0 as the model learns.

Every --log-every steps rank 0 prints one line: the loss, then the interval's stats line of
ep_plugin.telemetry (comm.stats is turned on): tokens/s, what the expert exchanges cost (time share
with the slowest rank, time per call, imbalance) and the bytes they sent per step to other ranks and
to itself, summed over the ranks, forward and backward.
--no-progress drops the tqdm bar (for logs).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import re
import sys
import time

import torch
import torch.nn.functional as F


class _DropKnownNotices(logging.Filter):
    """DeepSpeed's notices that are expected here (CPU accelerator, the scheduler's first read)."""

    KNOWN = ("Setting accelerator to CPU", "Attempting to get learning rate from scheduler before it has started")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.KNOWN)


class _DropKnownPrints:
    """A stdout that drops the lines DeepSpeed prints (not logs) while it sets up groups and comm."""

    KNOWN = re.compile(r"^No existing process group found, creating a new group")

    def __init__(self, out):
        self.out, self.partial = out, ""

    def write(self, text: str) -> int:
        *lines, self.partial = (self.partial + text).split("\n")  # print() sends the newline apart
        self.out.write("".join(line + "\n" for line in lines if not self.KNOWN.match(line)))
        return len(text)

    def flush(self) -> None:
        self.out.flush()


logging.getLogger("DeepSpeed").addFilter(_DropKnownNotices())  # before DeepSpeed's import logs anything

import deepspeed  # noqa: E402
from deepspeed.moe.layer import MoE  # noqa: E402

import ep_plugin  # noqa: E402
import ep_plugin.deepspeed as epds  # noqa: E402
from ep_plugin.integrations.buffer_cache import cached_buffers  # noqa: E402
from ep_plugin.telemetry import collect  # noqa: E402
from ep_plugin.testing import deepspeed_without_shm_op  # noqa: E402
from ep_plugin.testing.launch import config_path, require_torchrun, stop  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


class Attention(torch.nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        B, S, H = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, S, H))


class Block(torch.nn.Module):
    def __init__(self, hidden, heads, ffn, num_experts, ep_size, k, capacity_factor, drop_tokens):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln2 = torch.nn.LayerNorm(hidden)
        expert = torch.nn.Sequential(torch.nn.Linear(hidden, ffn), torch.nn.GELU(), torch.nn.Linear(ffn, hidden))
        self.moe = MoE(hidden, expert, num_experts=num_experts, ep_size=ep_size, k=k,
                       capacity_factor=capacity_factor, eval_capacity_factor=capacity_factor,
                       min_capacity=4, drop_tokens=drop_tokens)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        out, l_aux, _ = self.moe(self.ln2(x))
        return x + out, l_aux


class MoETransformer(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        self.emb = torch.nn.Embedding(a.vocab, a.hidden)
        self.pos = torch.nn.Embedding(a.seq_len, a.hidden)
        self.blocks = torch.nn.ModuleList(
            Block(a.hidden, a.heads, a.ffn or 2 * a.hidden, a.experts, a.ep_size, a.k, a.capacity_factor,
                  not a.no_drop_tokens) for _ in range(a.layers))
        self.ln = torch.nn.LayerNorm(a.hidden)
        self.head = torch.nn.Linear(a.hidden, a.vocab)
        self.aux_coef = a.aux_coef

    def forward(self, ids, labels):
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        aux = 0.0
        for blk in self.blocks:
            x, l_aux = blk(x)
            aux = aux + l_aux
        logits = self.head(self.ln(x)).float()
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return lm + self.aux_coef * aux, lm


def batch(gen, n, seq_len, vocab, device):
    start = torch.randint(0, vocab, (n, 1), generator=gen)
    step = torch.randint(1, 5, (n, 1), generator=gen)
    seq = (start + step * torch.arange(seq_len + 1)) % vocab
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", default=os.path.join(HERE, "ds_config.json"))
    p.add_argument("--no-ep-plugin", action="store_true", help="turn the ep_plugin flag off (DeepSpeed's all-to-all)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=0, help="expert FFN width (default 2*hidden)")
    p.add_argument("--experts", type=int, default=0, help="experts per MoE layer (default 2*ep_size)")
    p.add_argument("--ep-size", type=int, default=0, help="expert-parallel size (default: world size)")
    p.add_argument("--k", type=int, default=2, help="experts per token")
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--no-drop-tokens", action="store_true", help="DeepSpeed drop_tokens=False (no capacity limit)")
    p.add_argument("--aux-coef", type=float, default=0.01)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write the loss curve and tokens/s here (rank 0)")
    p.add_argument("--log-every", type=int, default=10, help="steps between summary lines")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar (the summary lines stay)")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    a = p.parse_args()
    # launch mistakes end here with one line each, before DeepSpeed or torch gets to raise
    a.deepspeed_config = config_path(a.deepspeed_config, script=__file__, presets=False)
    require_torchrun()
    if a.ep_size and int(os.environ.get("WORLD_SIZE", a.ep_size)) % a.ep_size:
        stop(f"--ep-size {a.ep_size} does not divide the {os.environ['WORLD_SIZE']} processes (DeepSpeed "
             f"replicates each expert-parallel group): pick an --ep-size that divides them, or start it with "
             f"torchrun --nproc-per-node {a.ep_size}")

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(a.local_rank)
    else:  # DeepSpeed would compile a CPU all-reduce op (~2 minutes) that no MoE training uses
        deepspeed_without_shm_op()
    with contextlib.redirect_stdout(_DropKnownPrints(sys.stdout)):
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    a.ep_size = a.ep_size or world
    a.experts = a.experts or 2 * a.ep_size
    device = torch.device("cuda", a.local_rank) if cuda else torch.device("cpu")

    with open(a.deepspeed_config) as f:
        ds_config = json.load(f)
    sec = ds_config.setdefault("ep_plugin", {})
    if a.no_ep_plugin:
        sec["enabled"] = False
    if isinstance(sec.get("config"), str) and not os.path.isabs(sec["config"]):  # relative to the JSON file
        sec["config"] = os.path.join(os.path.dirname(os.path.abspath(a.deepspeed_config)), sec["config"])
    # stats on, reported by this script (not by the integration's own log lines: interval null)
    sec["overrides"] = {**sec.get("overrides", {}), "comm.stats": True, "comm.stats_interval": None}
    micro = ds_config["train_micro_batch_size_per_gpu"]

    torch.manual_seed(a.seed)
    model = MoETransformer(a)

    # The one call that differs from plain DeepSpeed.
    try:
        with contextlib.redirect_stdout(_DropKnownPrints(sys.stdout)):
            engine, _, _, _ = epds.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    except ep_plugin.ConfigError as exc:
        stop(exc, rank)
    ep_on = any(isinstance(m, epds.EPPluginMOELayer) for m in model.modules())

    gen = torch.Generator().manual_seed(a.seed * 1000 + rank)
    tokens_per_step = micro * a.seq_len * engine.dp_world_size * engine.gradient_accumulation_steps()
    bar = None
    if rank == 0:
        path = "ep_plugin" if ep_on else "DeepSpeed all-to-all"
        print(f"world {world}, ep_size {a.ep_size}, {a.experts} experts, top-{a.k}, {a.layers} MoE layers, "
              f"hidden {a.hidden}, MoE path: {path}", flush=True)
        if not a.no_progress:
            from tqdm import tqdm
            bar = tqdm(total=a.steps, desc="train", dynamic_ncols=True, file=sys.stdout)
    losses, t0, t_start, tok_s = [], None, time.perf_counter(), float("nan")
    t_log = t_start
    say = bar.write if bar is not None else print
    for step in range(a.steps):
        if step == 2:  # skip warm-up steps in the throughput
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        for _ in range(engine.gradient_accumulation_steps()):
            ids, labels = batch(gen, micro, a.seq_len, a.vocab, device)
            try:
                loss, lm = engine(ids, labels)
            except (ep_plugin.BackendUnavailableError, ep_plugin.ConfigError) as exc:
                stop(exc, rank)  # the first forward builds the EPBuffer: a backend that cannot run stops here
            engine.backward(loss)
            engine.step()
        lm = lm.detach().clone()
        torch.distributed.all_reduce(lm)
        lm = lm.item() / world
        losses.append(lm)
        if t0 is not None and step > 2:
            tok_s = tokens_per_step * (step - 2) / (time.perf_counter() - t0)
        if bar is not None:
            bar.set_postfix(loss=f"{lm:.3f}", tok_s=f"{tok_s:,.0f}")
            bar.update(1)
        if (step + 1) % a.log_every == 0 or step == a.steps - 1:
            done = step % a.log_every + 1
            mine = done * micro * a.seq_len * engine.gradient_accumulation_steps()
            # collective: every rank, the same steps; bytes per step over the interval's `done` steps
            report = collect(cached_buffers(), tokens=mine, wall_s=time.perf_counter() - t_log,
                             steps=(step + 2 - done, step + 1))
            if rank == 0:
                say(f"step {step + 1:4d}  loss {lm:.3f}  {report.text()}")
            t_log = time.perf_counter()
    if bar is not None:
        bar.close()
    if rank == 0:
        first = sum(losses[:5]) / min(5, len(losses))
        last = sum(losses[-5:]) / min(5, len(losses))
        print(f"loss {first:.3f} -> {last:.3f} (log vocab = {math.log(a.vocab):.3f}); {tok_s:,.0f} tokens/s; "
              f"{time.perf_counter() - t_start:.1f} s", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"ep_plugin": ep_on, "world": world, "losses": losses, "tokens_per_s": tok_s,
                           "args": vars(a)}, f, indent=1)
    torch.distributed.barrier()
    # Every process group goes before the interpreter does: gloo's threads, left to interpreter exit,
    # can abort the process after a good run ("terminate called without an active exception").
    # DeepSpeed's own destroy also drops the groups its module globals hold (expert/data parallel).
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main()
    gc.collect()  # groups that reference cycles (DeepSpeed's engine, the model) still hold go now, not at exit
