"""Pretrain a small MoE language model whose expert layers exchange tokens through ep_plugin.

Plain PyTorch: attention and embeddings are data-parallel (gradients all-reduced), each rank holds
E/world experts, tokens are routed with ep_plugin.routing and moved with EPBuffer.dispatch/combine.
The corpus is byte-level text of Python's own standard-library sources, built locally.

    torchrun --nproc-per-node 2 examples/train_moe.py                 # CPU: gloo, torch backend
    torchrun --nproc-per-node 4 examples/train_moe.py --config configs/deepseek_v3.yaml \
        --hidden 1024 --batch 16 --seq 512                            # GPUs: NCCL, backend auto

On GPUs the rows travel in BF16 (--dtype auto), the form the nvlink kernels move; the rest of the
model stays float32. Every --log-every steps rank 0 prints one line: the loss, tokens/s and what the
exchanges cost (comm.stats: time share with the slowest rank, time per call, imbalance).
"""
from __future__ import annotations

import argparse
import math
import os
import pathlib
import sysconfig
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ep_plugin
from ep_plugin.routing import route
from ep_plugin.telemetry import collect
from ep_plugin.testing.launch import check_world_size, config_path, require_torchrun, stop


def local_corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    """Bytes of the standard library's Python sources: real text that needs no download."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


class MoEFeedForward(nn.Module):
    """Router + this rank's experts; tokens travel to the ranks of their experts and back."""

    def __init__(self, buf: ep_plugin.EPBuffer, hidden: int, ffn: int, row_dtype: torch.dtype):
        super().__init__()
        self.buf, self.moe, self.row_dtype = buf, buf.cfg.moe, row_dtype
        self.router = nn.Linear(hidden, self.moe.num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(self.moe.num_experts), persistent=False)
        n = buf.num_local_experts
        self.w_in = nn.Parameter(torch.randn(n, hidden, 2 * ffn) / math.sqrt(hidden))
        self.w_out = nn.Parameter(torch.randn(n, ffn, hidden) / math.sqrt(ffn))
        for p in (self.w_in, self.w_out):
            p.expert_local = True  # not averaged across ranks

    def forward(self, x: torch.Tensor):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x).float()
        weights, idx = route(logits, self.moe, self.expert_bias if self.moe.expert_bias else None)
        res = self.buf.dispatch(x.to(self.row_dtype).contiguous(), idx, weights)
        out = torch.zeros_like(res.x)
        for e in range(self.buf.num_local_experts):
            rows, slot = (res.topk_idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            gate, up = (res.x[rows] @ self.w_in[e].to(res.x.dtype)).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.w_out[e].to(res.x.dtype)
            out = out.index_add(0, rows, y * res.topk_weights[rows, slot].unsqueeze(1).to(y.dtype))
        if self.moe.expert_bias:  # aux-loss-free balancing (DeepSeek-V3): nudge the selection bias
            counts = torch.bincount(idx[idx >= 0], minlength=self.moe.num_experts).float()
            dist.all_reduce(counts, group=self.buf.group)
            self.expert_bias += 1e-3 * torch.sign(counts.mean() - counts)
        return self.buf.combine(out, res.handle).to(x.dtype).reshape(shape)


class Block(nn.Module):
    def __init__(self, buf, hidden, heads, ffn, row_dtype):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.moe = MoEFeedForward(buf, hidden, ffn, row_dtype)

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.moe(self.ln2(x))


class MoELM(nn.Module):
    def __init__(self, buf, layers, hidden, heads, ffn, seq, row_dtype=torch.float32):
        super().__init__()
        self.embed = nn.Embedding(256, hidden)
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(buf, hidden, heads, ffn, row_dtype) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, 256, bias=False)

    def forward(self, tokens):
        T = tokens.shape[1]
        mask = torch.triu(torch.full((T, T), float("-inf"), device=tokens.device), 1)
        x = self.embed(tokens) + self.pos[:T]
        for blk in self.blocks:
            x = blk(x, mask)
        return self.head(self.ln(x))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny", help="ep_plugin YAML (path or preset name)")
    ap.add_argument("--backend", default=None, choices=["auto", "torch", "nvlink", "nvshmem"],
                    help="override the YAML's comm.backend (the tiny preset says torch)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                    help="dtype of the dispatched rows and the expert matmuls (auto: bf16 on GPUs, fp32 on CPU)")
    ap.add_argument("--log-every", type=int, default=50, help="steps between summary lines")
    args = ap.parse_args()

    # launch mistakes end here with one line each, before torch gets to raise
    tokens_per_rank = args.batch * args.seq
    overrides = {"comm.stats": True}
    if args.backend:
        overrides["comm.backend"] = args.backend
    try:
        cfg = ep_plugin.load_config(config_path(args.config, script=__file__), overrides)
    except ep_plugin.ConfigError as exc:
        stop(exc)
    require_torchrun(cfg)
    check_world_size(cfg)  # each rank holds num_experts / world experts

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)  # same replicated weights everywhere; experts differ per rank below

    try:
        cfg.comm.max_tokens_per_rank = max(cfg.comm.max_tokens_per_rank, tokens_per_rank)
        buf = ep_plugin.EPBuffer(dist.group.WORLD, cfg, hidden=args.hidden)
    except (ep_plugin.BackendUnavailableError, ep_plugin.ConfigError) as exc:
        stop(exc, rank)
    row_dtype = torch.bfloat16 if args.dtype == "bf16" or (args.dtype == "auto" and cuda) else torch.float32
    model = MoELM(buf, args.layers, args.hidden, args.heads, args.ffn, args.seq, row_dtype).to(device)
    with torch.no_grad():
        g = torch.Generator().manual_seed(rank + 1)  # a CPU stream: the same draws on any device
        for p in model.parameters():
            if getattr(p, "expert_local", False):
                p.copy_(torch.randn(p.shape, generator=g).to(p.device) * p.std())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = local_corpus().to(device)
    gen = torch.Generator(device="cpu").manual_seed(1000 + rank)  # each rank reads its own batches
    shared = [p for p in model.parameters() if not getattr(p, "expert_local", False)]

    first = last = None
    if rank == 0:
        print(f"train_moe: {args.steps} steps, EP{world}, backend {buf.backend_name}, "
              f"{args.layers} MoE layers, hidden {args.hidden}", flush=True)
    t0 = t_log = time.perf_counter()
    for step in range(1, args.steps + 1):
        start = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=gen).to(device)
        offs = start.unsqueeze(1) + torch.arange(args.seq + 1, device=device)
        batch = data[offs]
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in shared])  # data-parallel part: average
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p in shared:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
            off += p.numel()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        avg = avg.item() / world
        first = avg if first is None else first
        last = avg
        if step % args.log_every == 0 or step == args.steps:
            done = (step - 1) % args.log_every + 1
            report = collect([buf], tokens=done * tokens_per_rank, wall_s=time.perf_counter() - t_log)
            if rank == 0:
                print(f"step {step:4d}  loss {avg:.3f}  {report.text()}", flush=True)
            t_log = time.perf_counter()
    secs = time.perf_counter() - t0
    if rank == 0:
        tps = args.steps * tokens_per_rank * world / secs
        print(f"done: {args.steps} steps, loss {first:.3f} -> {last:.3f}, {tps:,.0f} tokens/s, "
              f"backend {buf.backend_name}, rows {str(row_dtype).replace('torch.', '')}")
    buf.close()
    dist.barrier()  # no rank tears the group down while a peer still uses it (gloo aborts then)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
