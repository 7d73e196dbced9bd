"""The Megatron comparison cases shared by test_megatron.py (CPU, gloo) and test_megatron_gpu.py
(NCCL): a MoELayer (or GPT model) with ep_plugin's dispatcher against megatron's `alltoall`, same
weights and inputs; each case returns the largest differences of output and gradients. Also
forbid_host_sync(), the check that a layer's dispatcher and experts read nothing on the host."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import traceback

import torch

H = 16

# name -> (ours: kwargs, reference: kwargs, options); common fields in make_config()
CASES = {
    "topk_softmax": (
        dict(moe_token_dispatcher_type="ep_plugin"),
        dict(moe_token_dispatcher_type="alltoall"), {}),
    "topk_softmax_aux_loss": (
        dict(moe_token_dispatcher_type="ep_plugin", moe_router_load_balancing_type="aux_loss",
             moe_aux_loss_coeff=1e-2),
        dict(moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
             moe_aux_loss_coeff=1e-2), {}),
    "group_limited_sigmoid_expert_bias": (
        dict(moe_token_dispatcher_type="ep_plugin", moe_router_topk=4, moe_router_num_groups=4,
             moe_router_group_topk=2, moe_router_score_function="sigmoid",
             moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
             moe_router_dtype="fp32"),
        dict(moe_token_dispatcher_type="alltoall", moe_router_topk=4, moe_router_num_groups=4,
             moe_router_group_topk=2, moe_router_score_function="sigmoid",
             moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
             moe_router_dtype="fp32"), {"expert_bias": "random"}),
    "skew_rank1_receives_nothing": (
        dict(moe_token_dispatcher_type="ep_plugin", moe_router_score_function="sigmoid",
             moe_router_enable_expert_bias=True, moe_router_dtype="fp32"),
        dict(moe_token_dispatcher_type="alltoall", moe_router_score_function="sigmoid",
             moe_router_enable_expert_bias=True, moe_router_dtype="fp32"), {"expert_bias": "skew"}),
    "capacity_factor_token_drop": (  # dropped (token, expert) pairs become -1 slots
        dict(moe_token_dispatcher_type="ep_plugin", moe_expert_capacity_factor=0.5),
        dict(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=0.5), {}),
    "top1_probs_on_input": (
        dict(moe_token_dispatcher_type="ep_plugin", moe_router_topk=1, moe_apply_probs_on_input=True,
             moe_router_pre_softmax=True),
        dict(moe_token_dispatcher_type="alltoall", moe_router_topk=1, moe_apply_probs_on_input=True,
             moe_router_pre_softmax=True), {}),
    "shared_experts": (
        dict(moe_token_dispatcher_type="ep_plugin", moe_shared_expert_intermediate_size=12),
        dict(moe_token_dispatcher_type="alltoall", moe_shared_expert_intermediate_size=12), {}),
    "shared_expert_overlap_flex": (
        dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="ep_plugin",
             moe_shared_expert_intermediate_size=12, moe_shared_expert_overlap=True,
             moe_shared_expert_gate=True),
        dict(moe_token_dispatcher_type="alltoall", moe_shared_expert_intermediate_size=12,
             moe_shared_expert_overlap=True, moe_shared_expert_gate=True), {}),
    "shared_expert_overlap_by_name": (
        dict(moe_token_dispatcher_type="ep_plugin", moe_shared_expert_intermediate_size=12,
             moe_shared_expert_overlap=True),
        dict(moe_token_dispatcher_type="alltoall", moe_shared_expert_intermediate_size=12,
             moe_shared_expert_overlap=True), {}),
    "grouped_mm_experts": (  # TEGroupedMLP (non-TE path) with ep_plugin's GroupedMMLinear
        dict(moe_token_dispatcher_type="ep_plugin", moe_router_topk=3),
        dict(moe_token_dispatcher_type="alltoall", moe_router_topk=3), {"grouped": True}),
    # EPGroupedMLP (device counts, no host read: the dispatcher hands it the device counts) against
    # alltoall + megatron's own SequentialMLP; weights and gradients compared in the grouped layout
    "ep_experts": (
        dict(moe_token_dispatcher_type="ep_plugin", moe_router_topk=3),
        dict(moe_token_dispatcher_type="alltoall", moe_router_topk=3), {"experts": "ep"}),
    "ep_experts_vs_te_grouped": (  # against megatron's TEGroupedMLP (non-TE path), same state layout
        dict(moe_token_dispatcher_type="ep_plugin", moe_router_topk=3),
        dict(moe_token_dispatcher_type="alltoall", moe_router_topk=3), {"experts": "ep", "ref_experts": "grouped"}),
    "ep_experts_top1_probs_on_input": (
        dict(moe_token_dispatcher_type="ep_plugin", moe_router_topk=1, moe_apply_probs_on_input=True,
             moe_router_pre_softmax=True),
        dict(moe_token_dispatcher_type="alltoall", moe_router_topk=1, moe_apply_probs_on_input=True,
             moe_router_pre_softmax=True), {"experts": "ep"}),
    "ep_experts_gelu_not_gated": (
        dict(moe_token_dispatcher_type="ep_plugin", gated_linear_unit=False,
             activation_func=torch.nn.functional.gelu),
        dict(moe_token_dispatcher_type="alltoall", gated_linear_unit=False,
             activation_func=torch.nn.functional.gelu), {"experts": "ep"}),
    "ep_experts_fused_swiglu": (  # megatron's weighted SwiGLU fusion (bias_activation_fusion)
        dict(moe_token_dispatcher_type="ep_plugin", bias_activation_fusion=True),
        dict(moe_token_dispatcher_type="alltoall", bias_activation_fusion=True),
        {"experts": "ep", "ref_experts": "grouped"}),
    # EPGroupedMLP.bounded_activation (on by default): the weighted SwiGLU by kernels that stop at the last expert's end
    # (BF16 rows and float32 probs on GPUs -- compare_case asserts they ran there; elsewhere megatron's torch form, as
    # without it), fused and unfused forms, under recompute, and switched off (megatron's torch form on GPUs too)
    "ep_experts_bounded_swiglu": (
        dict(moe_token_dispatcher_type="ep_plugin", bias_activation_fusion=True, moe_router_dtype="fp32"),
        dict(moe_token_dispatcher_type="alltoall", bias_activation_fusion=True, moe_router_dtype="fp32"),
        {"experts": "ep", "ref_experts": "grouped", "bounded_activation": True}),
    "ep_experts_bounded_plain": (
        dict(moe_token_dispatcher_type="ep_plugin", moe_router_dtype="fp32"),
        dict(moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32"),
        {"experts": "ep", "bounded_activation": True}),
    "ep_experts_bounded_recompute_act": (
        dict(moe_token_dispatcher_type="ep_plugin", recompute_granularity="selective",
             recompute_modules=["moe_act"], moe_grouped_gemm=True, moe_router_dtype="fp32"),
        dict(moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32"),
        {"experts": "ep", "bounded_activation": True}),
    "ep_experts_torch_act": (
        dict(moe_token_dispatcher_type="ep_plugin", moe_router_dtype="fp32"),
        dict(moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32"),
        {"experts": "ep", "bounded_activation": False}),
    "ep_experts_recompute_act": (  # selective recompute of the activation (moe_act)
        dict(moe_token_dispatcher_type="ep_plugin", recompute_granularity="selective",
             recompute_modules=["moe_act"], moe_grouped_gemm=True),
        dict(moe_token_dispatcher_type="alltoall"), {"experts": "ep"}),
    "ep_experts_recompute_layer": (  # the whole MoE layer recomputed in backward (recompute "moe")
        dict(moe_token_dispatcher_type="ep_plugin", recompute_granularity="selective",
             recompute_modules=["moe"]),
        dict(moe_token_dispatcher_type="alltoall"), {"experts": "ep"}),
    "ep_experts_skew_rank1_receives_nothing": (
        dict(moe_token_dispatcher_type="ep_plugin", moe_router_score_function="sigmoid",
             moe_router_enable_expert_bias=True, moe_router_dtype="fp32"),
        dict(moe_token_dispatcher_type="alltoall", moe_router_score_function="sigmoid",
             moe_router_enable_expert_bias=True, moe_router_dtype="fp32"),
        {"experts": "ep", "expert_bias": "skew"}),
    "ep_experts_shared_overlap_flex": (
        dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="ep_plugin",
             moe_shared_expert_intermediate_size=12, moe_shared_expert_overlap=True),
        dict(moe_token_dispatcher_type="alltoall", moe_shared_expert_intermediate_size=12,
             moe_shared_expert_overlap=True), {"experts": "ep"}),
    "ep_experts_stage_split_flex": (
        dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="ep_plugin",
             moe_shared_expert_intermediate_size=12),
        dict(moe_token_dispatcher_type="alltoall", moe_shared_expert_intermediate_size=12),
        {"experts": "ep", "stage_split": True}),
    "ep_experts_bf16": (  # BF16 weights and rows: equal within BF16 rounding
        dict(moe_token_dispatcher_type="ep_plugin", moe_router_topk=3),
        dict(moe_token_dispatcher_type="alltoall", moe_router_topk=3),
        {"experts": "ep", "dtype": torch.bfloat16}),
    # megatron's overlap_moe_expert_parallel_comm schedule runs route/preprocess, dispatch, experts
    # and combine as separate graph segments (detached in between): emulate that split
    "ep_overlap_stage_split_flex": (
        dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="ep_plugin",
             moe_shared_expert_intermediate_size=12),
        dict(moe_token_dispatcher_type="alltoall", moe_shared_expert_intermediate_size=12),
        {"stage_split": True}),
}


def cpu_recompute_stand_ins() -> None:
    """Without CUDA, megatron's activation checkpoints (CheckpointWithoutOutput, checkpoint) still save
    and restore the CUDA RNG state: let those be no-ops (cpu_stand_ins() covers the RNG tracker only)."""
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *a, **k: None
    tp_random._set_cuda_rng_state = lambda *a, **k: None
    # CheckpointWithoutOutput points each discarded output's storage at its recomputed data with a C++
    # extension that megatron compiles at first use (load_inline: ~50 CPU-s in every fresh venv, the
    # largest single cost of a fresh CPU suite). A storage copy gives those storages the same bytes.
    if hasattr(tp_random, "_get_share_storage"):
        tp_random._get_share_storage = lambda: _copy_storage


def _copy_storage(dst: torch.Tensor, src: torch.Tensor) -> None:
    d, s = dst.untyped_storage(), src.untyped_storage()
    d.resize_(s.nbytes())
    d.copy_(s)


def make_config(world, hidden=H, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=hidden, num_attention_heads=2, num_moe_experts=8,
                moe_router_topk=2, moe_ffn_hidden_size=8, expert_model_parallel_size=world,
                use_cpu_initialization=True, add_bias_linear=False, gated_linear_unit=True,
                activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
                moe_router_load_balancing_type="none")
    base.update(kw)
    return TransformerConfig(**base)


def make_moe_layer(cfg, grouped=False, experts=None):
    """experts: None (megatron's SequentialMLP), "grouped" (TEGroupedMLP + GroupedMMLinear; also
    grouped=True) or "ep" (EPGroupedMLP)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules

    import ep_plugin.megatron as epm

    torch.manual_seed(0)
    experts = "grouped" if grouped else experts
    if experts == "grouped":
        return MoELayer(config=cfg, submodules=MoESubmodules(experts=epm.grouped_mm_experts()))
    if experts == "ep":  # megatron's spec (router, shared experts) with EPGroupedMLP as the experts
        spec = get_moe_module_spec(use_te=False, num_experts=cfg.num_moe_experts)
        subs = dataclasses.replace(spec.keywords["submodules"], experts=epm.EPGroupedMLP)
        return MoELayer(config=cfg, submodules=subs)
    return get_moe_module_spec(use_te=False, num_experts=cfg.num_moe_experts)(config=cfg)


def grouped_layout(tensors, num_local_experts):
    """SequentialMLP's names and shapes -> GroupedMMLinear's: `experts.local_experts.{g}.linear_fcN.weight`
    ([out, in] each) become `experts.linear_fcN.weight` ([G, out, in]); other entries stay."""
    out, stacked = {}, {}
    for n, t in tensors.items():
        if ".local_experts." in n and n.endswith(".weight"):
            head, rest = n.split(".local_experts.", 1)
            g, lin = rest.split(".", 1)
            stacked.setdefault(f"{head}.{lin}", {})[int(g)] = t
        elif "_extra_state" not in n:
            out[n] = t
    for n, per in stacked.items():
        assert sorted(per) == list(range(num_local_experts)), (n, sorted(per))
        out[n] = torch.stack([per[g] for g in range(num_local_experts)])
    return out


def _staged_forward(layer, x):
    """MoELayer.forward cut into the four segments of megatron's EP-overlap (1F1B) schedule."""
    segs = []

    def cut(*ts):
        outs = tuple(t.detach().requires_grad_(t.requires_grad) for t in ts)
        segs.append((ts, outs))
        return outs

    shared = layer.shared_experts_compute(x)
    probs, routing_map = layer.route(x)
    hs, probs = layer.preprocess(x, probs, routing_map)
    hs, probs = cut(hs, probs)
    disp, dprobs = layer.dispatch(hs, probs)
    disp, dprobs = cut(disp, dprobs)
    out, _ = layer.routed_experts_compute(disp, dprobs)
    (out,) = cut(out)
    y = layer.postprocess(layer.combine(out), shared)
    return y, segs


def _staged_backward(y, grad, segs):
    torch.autograd.backward([y], [grad])
    for ins, outs in reversed(segs):
        pairs = [(i, o.grad) for i, o in zip(ins, outs) if i.requires_grad and o.grad is not None]
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])


def compare_case(rank, world, name, device="cpu", comm_backend=None, hidden=H, dtype=torch.float32):
    import ep_plugin.megatron as epm

    ours_kw, ref_kw, opts = CASES[name]
    if "recompute_granularity" in ours_kw:
        cpu_recompute_stand_ins()
    if dtype == torch.float32:
        dtype = opts.get("dtype", dtype)
    if dtype != torch.float32:
        low = dict(params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
        ref_kw, ours_kw = dict(ref_kw, **low), dict(ours_kw, **low)
    ours_experts = "grouped" if opts.get("grouped") else opts.get("experts")
    ref_experts = "grouped" if opts.get("grouped") else opts.get("ref_experts")
    ref = make_moe_layer(make_config(world, hidden, **ref_kw), experts=ref_experts).to(device)
    ours_cfg = make_config(world, hidden, **ours_kw)
    if comm_backend is not None:
        epm.attach_config(ours_cfg, {"comm": {"backend": comm_backend, "max_tokens_per_rank": 64}})
    ours = make_moe_layer(ours_cfg, experts=ours_experts).to(device)
    if "bounded_activation" in opts:
        ours.experts.bounded_activation = opts["bounded_activation"]

    assert isinstance(ours.token_dispatcher, epm.EPPluginTokenDispatcher), type(ours.token_dispatcher)
    # EPGroupedMLP takes device counts from the dispatcher MoELayer built with it; others get host counts
    assert ours.token_dispatcher.device_counts == (ours_experts == "ep"), (name, ours.token_dispatcher.device_counts)
    # SequentialMLP's per-expert weights, compared in GroupedMMLinear's [G, out, in] layout
    regroup = (ours_experts == "ep" and ref_experts is None)
    G = ours.num_local_experts
    with torch.no_grad():
        g = torch.Generator().manual_seed(100 + rank)  # experts differ per rank
        for n, p in ref.named_parameters():
            if "experts.local_experts" in n or ".experts." in n and "shared" not in n:
                p.add_((torch.randn(p.shape, generator=g) * 0.1).to(device))
        eb = getattr(ref.router, "expert_bias", None)
        if opts.get("expert_bias") == "random":
            eb.copy_((torch.randn(eb.shape, generator=torch.Generator().manual_seed(7)) * 0.1).to(device))
        elif opts.get("expert_bias") == "skew":
            eb.zero_()
            eb[:2] = 100.0  # every token picks experts 0 and 1 (rank 0): rank 1 receives nothing
    ref_state = grouped_layout(ref.state_dict(), G) if regroup else ref.state_dict()
    missing, unexpected = ours.load_state_dict(ref_state, strict=False)
    assert not unexpected and all("_extra_state" in m for m in missing), (missing, unexpected)

    S = 5 + 3 * rank  # ranks dispatch different token counts
    g = torch.Generator().manual_seed(1000 + rank)
    x0 = torch.randn(S, 2, hidden, generator=g).to(device, dtype)
    wout = torch.randn(S, 2, hidden, generator=g).to(device, dtype)
    res = {}
    for tag, layer in (("ref", ref), ("ours", ours)):
        x = x0.clone().requires_grad_()
        if opts.get("stage_split") and tag == "ours":
            y, segs = _staged_forward(layer, x)
            _staged_backward(y, wout, segs)
        else:
            y, _ = layer(x)
            (y * wout).sum().backward()
        res[tag] = (y.detach(), x.grad.clone(),
                    {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None})
    (y0, gx0, gp0), (y1, gx1, gp1) = res["ref"], res["ours"]
    if "bounded_activation" in opts and x0.is_cuda and dtype == torch.bfloat16:
        from ep_plugin._ext import has_c
        if has_c():  # BF16 rows, float32 probs: the case is about the kernels, so they ran exactly where asked
            want = opts["bounded_activation"]
            assert (ours.experts.bounded_runs > 0) == want, \
                f"{name}: bounded_activation={want} but the SwiGLU kernels ran {ours.experts.bounded_runs} times"
    if regroup:
        gp0 = grouped_layout(gp0, G)
    assert set(gp0) == set(gp1), (sorted(set(gp0) ^ set(gp1)))
    y0, gx0, y1, gx1 = (t.float() for t in (y0, gx0, y1, gx1))
    gp0, gp1 = ({n: t.float() for n, t in gp.items()} for gp in (gp0, gp1))
    out = {
        "out": (y0 - y1).abs().max().item(),
        "grad_x": (gx0 - gx1).abs().max().item(),
        "grad_params": max(((gp0[n] - gp1[n]).abs().max().item() for n in gp0), default=0.0),
        "rel_out": (y0 - y1).abs().max().item() / max(y0.abs().max().item(), 1e-6),
        "rel_grad_x": (gx0 - gx1).abs().max().item() / max(gx0.abs().max().item(), 1e-6),
        "rel_grad_params": max(((gp0[n] - gp1[n]).abs().max().item() / max(gp0[n].abs().max().item(), 1e-6)
                                for n in gp0), default=0.0),
        # per element: |ours - ref| / (2^-5 (|ref| + rms(ref))), worst element; <= 1 passes. A tensor-wide
        # bound (max diff / max |ref|) lets a wrong small row through; this one does not (a wrong row is
        # off by about its own size, ~16x the bound), while BF16 reordering (a few ulps) stays well inside.
        "elem_out": elem_excess(y0, y1),
        "elem_grad_x": elem_excess(gx0, gx1),
        "elem_grad_params": max((elem_excess(gp0[n], gp1[n]) for n in gp0), default=0.0),
        "scale": max(y0.abs().max().item(), 1e-6),
        "num_param_grads": len(gp0),
        "recv_rows": int(ours.token_dispatcher.num_recv),
        "comm_backend": ours.token_dispatcher.buffer.backend_name,
        "host_sync": ours.token_dispatcher.buffer.cfg.comm.host_sync,
        "dtype": str(dtype).replace("torch.", ""),
    }
    return out


def elem_excess(ref, got, rtol=2 ** -5):
    """max over elements of |got - ref| / (rtol * (|ref| + rms(ref))): <= 1 means every element is within
    rtol of its own size, or of the tensor's typical size where it is near zero (sums that cancel)."""
    ref, got = ref.float(), got.float()
    if ref.numel() == 0:
        return 0.0
    rms = ref.pow(2).mean().sqrt()
    return ((got - ref).abs() / (rtol * (ref.abs() + rms) + 1e-30)).max().item()


# megatron's real EP-overlap (combined 1F1B) schedule: GPTModel.build_schedule_plan +
# TransformerModelChunkSchedulePlan.run interleave one microbatch's forward with the previous one's
# backward, layer by layer, on separate (here: stand-in) streams, freeing stage inputs early.
SCHEDULE_CASES = {
    "ep_overlap_1f1b_flex": dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="ep_plugin"),
    "ep_overlap_1f1b_by_name": dict(moe_token_dispatcher_type="ep_plugin"),
    "ep_overlap_1f1b_ep_experts": dict(moe_token_dispatcher_type="ep_plugin"),
}
SCHEDULE_EXPERTS = {"ep_overlap_1f1b_ep_experts": "ep"}  # else megatron's SequentialMLP


def _gpt_layer_spec(experts):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    import ep_plugin.megatron as epm

    spec = get_gpt_layer_local_spec(num_experts=4)
    if experts == "ep":  # the same spec with EPGroupedMLP as each MoE layer's experts
        mlp = spec.submodules.mlp
        mlp = functools.partial(mlp.func, *mlp.args, **dict(
            mlp.keywords, submodules=dataclasses.replace(mlp.keywords["submodules"], experts=epm.EPGroupedMLP)))
        spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))
    return spec


def _gpt(world, overlap, experts=None, **kw):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=4, moe_router_topk=2,
        moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16, expert_model_parallel_size=world,
        overlap_moe_expert_parallel_comm=overlap, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, use_cpu_initialization=True, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, moe_router_load_balancing_type="none",
        moe_router_dtype="fp32", masked_softmax_fusion=False, bias_dropout_fusion=False, **kw)
    torch.manual_seed(0)
    model = GPTModel(config=cfg, transformer_layer_spec=_gpt_layer_spec(experts),
                     vocab_size=64, max_sequence_length=8, position_embedding_type="rope")
    return model.to(torch.bfloat16)


def compare_schedule(rank, world, name, device="cpu"):
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan

    import ep_plugin.megatron as epm

    cpu_recompute_stand_ins()  # the combined-1F1B schedule checkpoints the pre-MLP norm (CheckpointWithoutOutput)
    if device != "cpu":  # megatron's combined-1F1B schedule creates its comm stream the same way
        from megatron.core.pipeline_parallel.utils import set_streams
        set_streams()
    experts = SCHEDULE_EXPERTS.get(name)
    ref = _gpt(world, False, experts, **SCHEDULE_CASES[name]).to(device)
    ovl = _gpt(world, True, experts, **SCHEDULE_CASES[name]).to(device)
    ovl.load_state_dict(ref.state_dict(), strict=False)
    assert isinstance(ovl.decoder.layers[0].mlp.token_dispatcher, epm.EPPluginTokenDispatcher)
    assert all(layer.mlp.token_dispatcher.device_counts == (experts == "ep") for layer in ovl.decoder.layers)
    g = torch.Generator().manual_seed(rank)
    mbs = [torch.randint(0, 64, (2, 9), generator=g).to(device) for _ in range(3)]
    mask = torch.triu(torch.ones(8, 8, dtype=torch.bool, device=device), 1)[None, None]
    pos = torch.arange(8, device=device)[None].expand(2, -1)
    for d in mbs:  # reference: plain forward/backward per microbatch
        ref(d[:, :-1], pos, mask, labels=d[:, 1:]).float().sum().backward()
    prev = None  # (plan, output) of the microbatch whose backward is pending
    for i in range(len(mbs) + 1):
        plan = (ovl.build_schedule_plan(mbs[i][:, :-1], pos, mask, labels=mbs[i][:, 1:])
                if i < len(mbs) else None)
        out = TransformerModelChunkSchedulePlan.run(
            plan, prev[0] if prev else None, b_grad=torch.ones_like(prev[1]) if prev else None)
        prev = (plan, out) if plan is not None else None
    diffs, scale, n = 0.0, 0.0, 0
    for (na, pa), (nb, pb) in zip(ref.named_parameters(), ovl.named_parameters()):
        assert na == nb
        if pa.grad is None:
            assert pb.grad is None, na
            continue
        assert pb.grad is not None, na
        diffs = max(diffs, (pa.grad.float() - pb.grad.float()).abs().max().item())
        scale = max(scale, pa.grad.float().abs().max().item())
        n += 1
    return {"grad_params": diffs, "scale": scale, "num_param_grads": n}


# ----------------------------------------------------------------------------- no host sync, checked
class HostSyncError(AssertionError):
    """A host read of device data inside a region that must have none (not a RuntimeError: code that
    catches those, e.g. a grouped_mm fallback, must not swallow it)."""


DISPATCHER_HOOKS = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "combine_preprocess",
                    "token_combine", "combine_postprocess")
# what reads a tensor's values on the host (a device sync on CUDA)
_TENSOR_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class _Guard(threading.local):
    def __init__(self):
        self.active = 0   # inside a guarded call
        self.exempt = 0   # inside an EPBuffer call that may read (exempt_buffer)


@contextlib.contextmanager
def forbid_host_sync(layer, exempt_buffer: bool, cuda_sync_debug: bool = False):
    """While `layer`'s dispatcher hooks and experts' forward run (`layer` a MoELayer, or the experts
    alone): a host read of tensor values
    (Tensor.tolist/item/cpu/numpy, bool/int/float/index of a tensor) or torch.cuda.synchronize (and a
    stream's or event's) raises HostSyncError, and, with cuda_sync_debug, torch.cuda's sync debug mode
    is "error" (CUDA catches what Python cannot see: a blocking copy, nonzero, ...). exempt_buffer:
    EPBuffer.dispatch / combine run unguarded (the torch backend exchanges its counts on the host by
    design; the kernel backends must not need this). Yields the list of what was caught (the calls
    raise as well, so code that swallows errors cannot hide one)."""
    from ep_plugin.buffer import EPBuffer

    state, caught = _Guard(), []

    def guarded(name, fn):
        def call(*a, **k):
            if state.active and not state.exempt:
                caught.append(f"{name}\n" + "".join(traceback.format_stack(limit=8)[:-1]))
                raise HostSyncError(f"host read inside the layer's dispatcher/experts: {name}")
            return fn(*a, **k)
        return call

    def scoped(fn, counter):
        def call(*a, **k):
            setattr(state, counter, getattr(state, counter) + 1)
            debug = None
            if cuda_sync_debug and counter == "active" and state.active == 1:
                debug = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*a, **k)
            finally:
                if debug is not None:
                    torch.cuda.set_sync_debug_mode(debug)
                setattr(state, counter, getattr(state, counter) - 1)
        return call

    def unguarded(fn):  # the exempt EPBuffer calls run with sync debug mode off as well
        def call(*a, **k):
            state.exempt += 1
            debug = torch.cuda.get_sync_debug_mode() if cuda_sync_debug else None
            if debug is not None:
                torch.cuda.set_sync_debug_mode(0)
            try:
                return fn(*a, **k)
            finally:
                if debug is not None:
                    torch.cuda.set_sync_debug_mode(debug)
                state.exempt -= 1
        return call

    undo = []

    def patch(owner, attr, value):
        had = attr in vars(owner) if isinstance(owner, type) else True
        undo.append((owner, attr, getattr(owner, attr), had))
        setattr(owner, attr, value)

    for attr in _TENSOR_READS:
        patch(torch.Tensor, attr, guarded(f"Tensor.{attr}", getattr(torch.Tensor, attr)))
    patch(torch.cuda, "synchronize", guarded("torch.cuda.synchronize", torch.cuda.synchronize))
    for cls in (torch.cuda.Stream, torch.cuda.Event):
        if isinstance(cls, type):
            patch(cls, "synchronize", guarded(f"{cls.__name__}.synchronize", cls.synchronize))
    if exempt_buffer:
        for attr in ("dispatch", "combine"):
            patch(EPBuffer, attr, unguarded(getattr(EPBuffer, attr)))
    disp = getattr(layer, "token_dispatcher", None)
    experts = layer.experts if disp is not None else layer
    for hook in DISPATCHER_HOOKS if disp is not None else ():
        patch(disp, hook, scoped(getattr(disp, hook), "active"))
    patch(experts, "forward", scoped(experts.forward, "active"))
    try:
        yield caught
    finally:
        for owner, attr, original, had in reversed(undo):
            if had or not isinstance(owner, type):
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)
        for hook in DISPATCHER_HOOKS if disp is not None else ():  # the class's methods again
            disp.__dict__.pop(hook, None)
        experts.__dict__.pop("forward", None)
