"""EPGroupedMLP: megatron's TEGroupedMLP whose forward reads no count on the host.

It imports megatron-core, so ep_plugin.megatron loads it on first use (as the dispatcher).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.activations import squared_relu
from megatron.core.fusions.fused_bias_geglu import quick_gelu, weighted_bias_quick_geglu_impl
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.fusions.fused_weighted_squared_relu import weighted_squared_relu_impl
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

from .dispatcher import take_device_counts
from .experts import GroupedMMLinear, bounded_weighted_swiglu, group_ends, zero_tail_rows_


def scaled(h, probs):
    return (h * probs).to(h.dtype)


class EPGroupedMLP(TEGroupedMLP):
    """megatron's TEGroupedMLP (same submodules, state dict and sharded state dict as
    grouped_mm_experts(): fc1/fc2 are GroupedMMLinear, weights [G, out, in]) whose forward reads no
    count on the host. Builder for MoESubmodules(experts=EPGroupedMLP).

    forward(rows [N, H], tokens_per_expert [G] (a tensor, any device), probs [N]) -> (out [N, H], None):
    expert g's rows are the g-th run of tokens_per_expert[g] rows from row 0; the rows after them
    (a worst-case-sized dispatch: unwritten, maybe NaN) give zero output rows. Offsets are an int32
    cumsum on the device; fc1 and fc2 run as torch grouped_mm on GPU (BF16), a per-expert loop
    elsewhere. The math is TEGroupedMLP's non-fused forward: probs on the input
    (moe_apply_probs_on_input, top-1) or after the activation (gated or not, clamp, GLU offset and
    interleave, megatron's fused weighted SwiGLU / quick-GEGLU / squared ReLU where the config asks
    for them), selective recompute of "moe_act".

    Built inside MoELayer right after ep_plugin's dispatcher, it tells that dispatcher
    (dispatcher.take_device_counts), which then hands it the device counts and worst-case rows of
    comm.host_sync: false instead of host-sized input. With any other dispatcher it takes their
    (exact-size) output as it is.
    """

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None, name=None):
        # each of these needs host counts (quantization padding) or TransformerEngine's own ops
        if config.fp8 or config.fp4:
            raise ValueError("EPGroupedMLP does not run FP8/FP4 (TransformerEngine's padding reads host "
                             "counts): use megatron's TEGroupedMLP")
        if config.use_transformer_engine_op_fuser:
            raise ValueError("EPGroupedMLP has no fused TransformerEngine path "
                             "(use_transformer_engine_op_fuser): use megatron's TEGroupedMLP")
        offloaded = set(getattr(config, "offload_modules", None) or ()) & {"expert_fc1", "moe_act",
                                                                            "fused_group_mlp"}
        if config.fine_grained_activation_offloading and offloaded:
            raise ValueError(f"EPGroupedMLP does not offload activations ({sorted(offloaded)} in "
                             "offload_modules)")
        if submodules is None:
            submodules = GroupedMLPSubmodules(linear_fc1=GroupedMMLinear, linear_fc2=GroupedMMLinear)
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, name=name)
        for lin in (self.linear_fc1, self.linear_fc2):
            if not isinstance(lin, GroupedMMLinear):
                raise TypeError(f"EPGroupedMLP runs GroupedMMLinear fc1/fc2, got {type(lin).__name__}")
        self.fed_device_counts = take_device_counts(config, pg_collection) is not None

    # The weighted SwiGLU over the rows in use only (experts.bounded_weighted_swiglu: one kernel each way that stops
    # at the last expert's end, where megatron's torch form runs a dozen passes over the worst-case rows). On by
    # default since session 16: its tests passed on 4 GPUs and the DeepSeek-like layer at EP4 (fwd+bwd) took 24.27 ms
    # against 34.14 ms without it (megatron's alltoall 31.73; 4x H100, benchmarks/megatron_layer.py).
    # It applies to BF16 rows with float32 probs (megatron's moe_router_dtype="fp32"; with BF16 probs the torch form
    # runs). It reproduces megatron's fused weighted SwiGLU run eagerly bit for bit; against the unfused form's
    # autograd (BF16 intermediates in the backward) or a torch.compile'd fusion, its gradients differ by ~1 BF16 step.
    bounded_activation = True
    bounded_runs = 0  # activations the kernels computed (tests, benches)

    def _bounded(self, h, probs, ends):
        """bounded_weighted_swiglu's output where it applies to this config and these tensors, else None."""
        cfg = self.config
        if not (self.bounded_activation and ends is not None and cfg.gated_linear_unit
                and self.activation_func is F.silu and not cfg.use_te_activation_func
                and cfg.moe_mlp_glu_interleave_size is None and cfg.activation_func_clamp_value is None
                and not cfg.glu_linear_offset and not cfg.activation_func_fp8_input_store):
            return None
        if not cfg.bias_activation_fusion and cfg.activation_func is not F.silu:
            return None  # the unfused form calls cfg.activation_func on the gate
        y = bounded_weighted_swiglu(h, probs, ends)
        if y is not None:
            self.bounded_runs += 1
        return y

    def _activation(self, h, probs, ends=None):
        cfg = self.config
        y = self._bounded(h, probs, ends)
        if y is not None:
            return y
        interleave = cfg.moe_mlp_glu_interleave_size if cfg.gated_linear_unit else None
        if cfg.use_te_activation_func:
            if interleave is not None:
                h = self._remove_glu_interleaving(h, interleave)
            return scaled(self.activation_func(h), probs)
        if cfg.bias_activation_fusion and interleave is None:
            if cfg.gated_linear_unit and self.activation_func is F.silu:
                return weighted_bias_swiglu_impl(h, None, probs, cfg.activation_func_fp8_input_store)
            if cfg.gated_linear_unit and self.activation_func is quick_gelu:
                return weighted_bias_quick_geglu_impl(h, None, probs, cfg.activation_func_fp8_input_store,
                                                      cfg.glu_linear_offset, cfg.activation_func_clamp_value)
            raise ValueError("bias_activation_fusion: only gated SiLU (SwiGLU) and quick-GELU fuse "
                             "(as in TEGroupedMLP)")
        if self.activation_func is squared_relu and cfg.use_fused_weighted_squared_relu:
            return weighted_squared_relu_impl(h, probs)
        if not cfg.gated_linear_unit:
            return scaled(self.activation_func(h), probs)
        if interleave is not None:
            h = self._remove_glu_interleaving(h, interleave)
        gate, linear = torch.chunk(h, 2, dim=-1)
        clamp = cfg.activation_func_clamp_value
        if clamp is not None:
            gate = gate.clamp(max=clamp)
            linear = linear.clamp(min=-clamp, max=clamp)
        return scaled(cfg.activation_func(gate) * (linear + cfg.glu_linear_offset), probs)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs,
                output_buffer=None, grad_input_buffer=None):
        if output_buffer is not None or grad_input_buffer is not None:
            raise ValueError("EPGroupedMLP writes no zero-copy buffers")
        x = permuted_local_hidden_states
        if not torch.is_tensor(tokens_per_expert):
            tokens_per_expert = torch.tensor(list(tokens_per_expert), dtype=torch.int64)
        ends = group_ends(tokens_per_expert, x.device)
        probs = permuted_probs.unsqueeze(-1)
        if self.config.moe_apply_probs_on_input:
            if self.config.moe_router_topk != 1:
                raise ValueError("moe_apply_probs_on_input needs moe_router_topk=1")
            x = scaled(x, probs)
            probs = torch.ones_like(probs)
        h = self.linear_fc1.forward_grouped(x, ends)
        if self.activation_recompute:
            # fp8=None: no FP8 state to save (CheckpointWithoutOutput reads any other value,
            # False included, as FP8 on, which needs TransformerEngine)
            self.activation_checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=None)
            h = self.activation_checkpoint.checkpoint(self._activation, h, probs, ends)
        else:
            h = self._activation(h, probs, ends)
        out = self.linear_fc2.forward_grouped(h, ends)
        # grouped_mm leaves the rows past the last end unwritten (any bits, NaN included): zero
        # them, before the recompute hook goes on the output that backward reaches first
        out = zero_tail_rows_(out, ends)
        if self.activation_recompute:
            self.activation_checkpoint.discard_output_and_register_recompute(out)
        return out, None
